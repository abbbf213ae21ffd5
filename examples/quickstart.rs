//! The README's quick start: two agents in one process, a WRITE with a notification that
//! arrives after the data, and what happened, printed.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport};

fn main() -> kvxfer::Result<()> {
    let decode = Agent::new(AgentConfig::new("decode").transport(Transport::Shm))?;
    let prefill = Agent::new(AgentConfig::new("prefill").transport(Transport::Shm))?;
    let dst = decode.register(HostBuffer::new(1 << 20)?)?;
    let src = prefill.register(HostBuffer::new(1 << 20)?)?;
    src.write(0, b"kv bytes")?;
    let addr = decode.listen("127.0.0.1:0")?;
    let peer = prefill.connect(addr)?; // both sides now know each other
    let local = prefill.prep_local(&[Desc::new(src.id(), 0, 4096)])?;
    let remote = prefill.prep_remote(&peer, &[Desc::new(dst.id(), 0, 4096)])?;
    let stats = prefill
        .write(&local, &remote)
        .notify(b"req-1")
        .start()?
        .wait()?;
    let note = decode.wait_notification(Duration::from_secs(5))?; // the data has landed
    let mut got = [0u8; 8];
    dst.read(0, &mut got)?;
    println!(
        "wrote {} bytes from {:?} to {peer:?} in {:?}; notification {:?} from {:?} arrived \
         after the data; the first bytes there: {:?}",
        stats.bytes,
        prefill.name(),
        stats.duration,
        String::from_utf8_lossy(&note.payload),
        note.from,
        String::from_utf8_lossy(&got)
    );
    Ok(())
}
