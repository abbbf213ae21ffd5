//! Two processes: the decode side registers a buffer and listens; the prefill side (a child
//! process) connects, learns the decode side's regions with `Agent::peer_regions` (ids are
//! the decode side's to give, not guessed), WRITEs into the first one and notifies.
//!
//! ```text
//! cargo run --example two_process
//! ```

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport};

fn main() -> kvxfer::Result<()> {
    if let Some(addr) = std::env::args().nth(1) {
        return prefill(&addr);
    }
    // Decode: a 1 MiB buffer, a listener, and a child process that writes into it.
    let decode = Agent::new(
        AgentConfig::new("decode")
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )?;
    let dst = decode.register(HostBuffer::new(1 << 20)?)?;
    let addr = decode.listen("127.0.0.1:0")?;
    let mut child = Command::new(std::env::current_exe().expect("this program"))
        .arg(addr.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|e| kvxfer::Error::io("starting the prefill process", e))?;
    let note = decode.wait_notification(Duration::from_secs(20))?;
    let mut got = vec![0u8; 64 * 1024];
    dst.read(0, &mut got)?;
    let ok = got.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8);
    let out = BufReader::new(child.stdout.take().expect("piped"));
    for line in out.lines().map_while(Result::ok) {
        println!("prefill process: {line}");
    }
    let status = child
        .wait()
        .map_err(|e| kvxfer::Error::io("waiting for prefill", e))?;
    println!(
        "decode process: notification {:?} from {:?}; 65536 bytes {}; prefill exited {status}",
        String::from_utf8_lossy(&note.payload),
        note.from,
        if ok { "verified" } else { "WRONG" }
    );
    if !ok || !status.success() {
        std::process::exit(1);
    }
    Ok(())
}

fn prefill(addr: &str) -> kvxfer::Result<()> {
    let a = Agent::new(
        AgentConfig::new("prefill")
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )?;
    let src = a.register(HostBuffer::new(1 << 20)?)?;
    let data: Vec<u8> = (0..64 * 1024).map(|i| (i % 251) as u8).collect();
    src.write(0, &data)?;
    let peer = a.connect(addr)?;
    // The peer's regions as its metadata lists them: the id to write into, and its size.
    let regions = a.peer_regions(&peer)?;
    let target = regions.first().ok_or_else(|| kvxfer::Error::UnknownPeer {
        agent: peer.clone(),
    })?;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{peer:?} has {} region(s); region {} holds {} bytes",
        regions.len(),
        target.id.0,
        target.len
    );
    let local = a.prep_local(&[Desc::new(src.id(), 0, data.len() as u64)])?;
    let remote = a.prep_remote(&peer, &[Desc::new(target.id, 0, data.len() as u64)])?;
    let st = a
        .write(&local, &remote)
        .notify(b"written")
        .deadline(Duration::from_secs(10))
        .start()?
        .wait()?;
    let _ = writeln!(
        out,
        "wrote {} bytes into region {} in {:?}",
        st.bytes, target.id.0, st.duration
    );
    Ok(())
}
