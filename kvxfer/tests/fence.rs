//! Fencing a peer's writes (`Agent::fence_inbound`): once it returns, nothing the peer sent
//! through the TCP lane before it (queued in a socket, or mid-stream) lands in this agent's
//! memory; the peer's transfer cut short fails typed, and its next one reconnects and lands.
//! What makes a failed push load safe to reuse (a late write of the failed request cannot
//! land in blocks the engine gave to the next one).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport};

const LEN: usize = 64 << 20;

#[test]
fn nothing_a_fenced_peer_sent_lands_after_the_fence() {
    fenced_mid_stream(1);
}

#[test]
fn a_striped_transfer_is_fenced_whole() {
    // Four connections per transfer, opened by the stripes' threads as the transfer starts:
    // one still at the gate when the fence comes is closed when its hello is proven.
    fenced_mid_stream(4);
}

fn fenced_mid_stream(stripes: usize) {
    let mk = |n: &str| {
        Agent::new(
            AgentConfig::new(format!("{n}-{stripes}-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo")
                .stripes(stripes),
        )
        .unwrap()
    };
    let (w, t) = (mk("fence-writer"), mk("fence-target"));
    let src = w.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let dst = t.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let addr = t.listen("127.0.0.1:0").unwrap();
    let peer = w.connect(addr).unwrap();
    let l = w.prep_local(&[Desc::new(src.id(), 0, LEN as u64)]).unwrap();
    let r = w
        .prep_remote(&peer, &[Desc::new(dst.id(), 0, LEN as u64)])
        .unwrap();
    let snapshot = || {
        let mut v = vec![0u8; LEN];
        dst.read(0, &mut v).unwrap();
        v
    };
    // Cut short mid-stream (tried until the fence lands inside a transfer).
    let mut cut = None;
    for fill in 1..=20u8 {
        src.write(0, &vec![fill; LEN]).unwrap();
        let x = w.write(&l, &r).start().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let closed = t.fence_inbound(w.name());
        let at_fence = snapshot();
        // Whatever was in flight stays out: the memory does not change after the fence.
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            at_fence == snapshot(),
            "bytes landed after the fence (try {fill})"
        );
        match x.wait() {
            Ok(_) => continue,
            Err(e) => {
                let landed = at_fence.iter().filter(|&&b| b == fill).count();
                cut = Some((fill, closed, landed, e));
                break;
            }
        }
    }
    let (fill, closed, landed, e) = cut.expect("no transfer was in flight at a fence");
    println!("fenced {closed} connection(s) mid-stream: {landed} of {LEN} bytes had landed; the writer got: {e}");
    assert!(closed >= 1 && landed < LEN, "{closed} {landed}");
    // The next write reconnects and lands whole.
    src.write(0, &vec![fill + 1; LEN]).unwrap();
    w.write(&l, &r).start().unwrap().wait().unwrap();
    assert!(snapshot().iter().all(|&b| b == fill + 1));
}

#[test]
fn a_connection_still_at_the_gate_when_its_peer_is_fenced_is_not_served() {
    use kvxfer::wire::lane::{Hello, WELCOME_FIXED_LEN};
    use kvxfer::wire::metadata::{Metadata, DEFAULT_COMPAT};
    use std::io::{Read, Write};
    let t = Agent::new(
        AgentConfig::new(format!("gate-target-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap();
    let lane = Metadata::decode(&t.metadata().unwrap(), DEFAULT_COMPAT)
        .unwrap()
        .lane
        .unwrap();
    let hello = Hello {
        name: "gate-writer",
        secret: lane.secret,
    }
    .encode();
    let connect = || {
        let c = std::net::TcpStream::connect(lane.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c
    };
    // Accepted, its hello not finished: then its peer is fenced, then the hello completes.
    let mut c = connect();
    c.write_all(&hello[..hello.len() - 1]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    t.fence_inbound("gate-writer");
    c.write_all(&hello[hello.len() - 1..]).unwrap();
    let mut w = [0u8; WELCOME_FIXED_LEN];
    match c.read(&mut w) {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("a connection opened before the fence was served ({n} bytes of welcome)"),
    }
    // A connection opened after the fence is served.
    let mut c = connect();
    c.write_all(&hello).unwrap();
    c.read_exact(&mut w).unwrap();
    assert_eq!(w[0], 0, "a reconnect after the fence was refused");
}
