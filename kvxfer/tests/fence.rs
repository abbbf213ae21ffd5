//! Fencing a peer's writes (`Agent::fence_inbound`): once it returns, nothing the peer sent
//! through the TCP lane before it (queued in a socket, or mid-stream) lands in this agent's
//! memory; the peer's transfer cut short fails typed, and its next one reconnects and lands.
//! A transfer queued before the writer learned of a fence is refused however late its
//! connection opens (the fence epochs of the lane's hello), and the writer learns the fence
//! before it reports the failure, so that what it queues next lands. What makes a failed push
//! load safe to reuse (a late write of the failed request cannot land in blocks the engine
//! gave to the next one).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Transport};

const LEN: usize = 64 << 20;

#[test]
fn nothing_a_fenced_peer_sent_lands_after_the_fence() {
    fenced_mid_stream(1);
}

#[test]
fn a_striped_transfer_is_fenced_whole() {
    // Four connections per transfer: every one is closed.
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
    // The connections are open (a transfer before): the fence finds them mid-stream.
    src.write(0, &vec![0xFF; LEN]).unwrap();
    w.write(&l, &r).start().unwrap().wait().unwrap();
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
            Ok(_) => {
                // The fence came after the transfer, and the writer did not see it: its next
                // transfer, queued before it learned, is not written; the one after lands.
                src.write(0, &vec![0xEE; LEN]).unwrap();
                let e = w.write(&l, &r).start().unwrap().wait().unwrap_err();
                std::thread::sleep(Duration::from_millis(100));
                assert!(
                    at_fence == snapshot(),
                    "a transfer queued before the writer learned of the fence landed ({e})"
                );
                w.write(&l, &r).start().unwrap().wait().unwrap();
                assert!(snapshot().iter().all(|&b| b == 0xEE));
                continue;
            }
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
fn a_transfer_queued_before_the_writer_learned_of_a_fence_is_refused_however_late_it_connects() {
    late_writer(None);
}

/// The same through the sealed lane: the fenced welcome travels in a sealed record.
#[test]
fn a_fence_is_told_through_the_sealed_lane_too() {
    late_writer(Some("fence-secret"));
}

fn late_writer(secret: Option<&str>) {
    let tag = if secret.is_some() { "s" } else { "o" };
    let mk = |n: &str| {
        let mut c = AgentConfig::new(format!("{n}-{tag}-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo");
        if let Some(s) = secret {
            c = c.secret(s.as_bytes().to_vec());
        }
        Agent::new(c).unwrap()
    };
    let (w, t) = (mk("late-writer"), mk("late-target"));
    let src = w.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
    let dst = t.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
    let peer = w.connect(t.listen("127.0.0.1:0").unwrap()).unwrap();
    let l = w.prep_local(&[Desc::new(src.id(), 0, 1 << 20)]).unwrap();
    let r = w
        .prep_remote(&peer, &[Desc::new(dst.id(), 0, 1 << 20)])
        .unwrap();
    src.write(0, &[7u8; 1 << 20]).unwrap();
    let landed = |fill: u8| {
        let mut v = vec![0u8; 1 << 20];
        dst.read(0, &mut v).unwrap();
        v.iter().all(|&b| b == fill)
    };
    // The writer has no lane connection yet: the fence closes none, and the writer's next
    // transfer (queued before it could learn) opens its connection after the fence.
    assert_eq!(t.fence_inbound(w.name()), 0);
    match w.write(&l, &r).start().unwrap().wait() {
        Err(Error::Fenced { epoch, .. }) => assert_eq!(epoch, 1),
        other => panic!("expected a fenced refusal, got {other:?}"),
    }
    assert!(landed(0), "a refused transfer wrote");
    // Learned: what the writer queues now lands, and its connection stays open.
    w.write(&l, &r).start().unwrap().wait().unwrap();
    assert!(landed(7));
    dst.write(0, &[0u8; 1 << 20]).unwrap();
    // Fenced again (twice): the open connection is closed; the next transfer fails on it
    // without writing, and the writer learns the count before it reports that failure.
    assert_eq!(t.fence_inbound(w.name()), 1);
    assert_eq!(t.fence_inbound(w.name()), 0);
    assert!(w.write(&l, &r).start().unwrap().wait().is_err());
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        landed(0),
        "a transfer queued before the writer learned of the fence wrote"
    );
    w.write(&l, &r).start().unwrap().wait().unwrap();
    assert!(landed(7));
}

#[test]
fn a_connection_still_at_the_gate_when_its_peer_is_fenced_is_not_served() {
    use kvxfer_proto::wire::lane::{parse_welcome, Hello, WELCOME_FIXED_LEN, W_FENCED, W_OK};
    use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};
    use std::io::{Read, Write};
    let t = Agent::new(
        AgentConfig::new(format!("gate-target-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap();
    let lane = Metadata::decode(&t.metadata().unwrap(), DEFAULT_COMPAT)
        .unwrap()
        .tcp_lane()
        .unwrap();
    let hello = |epoch| {
        Hello {
            name: "gate-writer",
            secret: lane.secret,
            epoch,
        }
        .encode()
    };
    let connect = || {
        let c = std::net::TcpStream::connect(lane.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c
    };
    // Accepted, its hello not finished: then its peer is fenced, then the hello completes.
    let h0 = hello(0);
    let mut c = connect();
    c.write_all(&h0[..h0.len() - 1]).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    t.fence_inbound("gate-writer");
    c.write_all(&h0[h0.len() - 1..]).unwrap();
    // Refused with the target's count, and closed: nothing it sends is taken.
    let mut w = [0u8; WELCOME_FIXED_LEN];
    c.read_exact(&mut w).unwrap();
    let (status, epoch, _) = parse_welcome(&w);
    assert_eq!(
        (status, epoch),
        (W_FENCED, 1),
        "a connection opened before the fence"
    );
    let mut rest = Vec::new();
    let _ = c.read_to_end(&mut rest);
    // A connection that names the count it was told is served; one that names the old count
    // (a transfer queued before the writer learned) is refused, however late it connects.
    for (epoch, want) in [(1, W_OK), (0, W_FENCED), (2, W_OK)] {
        let mut c = connect();
        c.write_all(&hello(epoch)).unwrap();
        c.read_exact(&mut w).unwrap();
        assert_eq!(parse_welcome(&w).0, want, "a hello naming epoch {epoch}");
    }
}
