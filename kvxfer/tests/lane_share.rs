//! Each peer's share of a TCP lane target (issue 34): a peer that announces tables as large
//! as the budget allows and then stalls holds at most half the budget, so a good peer's
//! request still finds memory at once; and one peer's connections are capped, while another
//! peer's still open.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

#[path = "support/lane_client.rs"]
mod lane_client;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, MemoryBudget, RegionId, Transport, XferOp};
use kvxfer_proto::wire::lane::{RequestHeader, K_WRITE, SEG_LEN};

const BUDGET: u64 = 64 << 20;

fn target(tag: &str) -> (Agent, std::net::SocketAddr) {
    let b = Agent::new(
        AgentConfig::new(format!("share-{tag}"))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .budget(MemoryBudget::new(BUDGET)),
    )
    .unwrap();
    b.register(HostBuffer::new(16 << 20).unwrap()).unwrap();
    let side = b.listen("127.0.0.1:0").unwrap();
    (b, side)
}

/// A WRITE header announcing `nsegs` segments, whose table never comes.
fn stalled_header(id: u64, nsegs: usize) -> Vec<u8> {
    let mut b = Vec::new();
    RequestHeader {
        kind: K_WRITE,
        id,
        nsegs,
        notif_len: 0,
        frames: None,
        paged: false,
    }
    .encode(&mut b);
    b
}

/// A good peer writes 40,000 scattered 256-byte pieces (a 1.4 MB table at the target):
/// whether it finished, and how long it took.
fn good_write(side: std::net::SocketAddr, tag: &str) -> (Result<(), kvxfer::Error>, Duration) {
    let a = Agent::new(
        AgentConfig::new(format!("good-{tag}"))
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap();
    let peer = a.connect(side).unwrap();
    let src = a.register(HostBuffer::new(16 << 20).unwrap()).unwrap();
    let n = 40_000u64;
    let ld: Vec<Desc> = (0..n).map(|i| Desc::new(src.id(), i * 256, 256)).collect();
    let rd: Vec<Desc> = (0..n)
        .map(|i| Desc::new(RegionId(0), i * 400, 256))
        .collect();
    let l = a.prep_local(&ld).unwrap();
    let r = a.prep_remote(&peer, &rd).unwrap();
    let t = Instant::now();
    let res = a
        .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(60)))
        .unwrap()
        .wait();
    (res.map(drop), t.elapsed())
}

#[test]
fn a_peer_that_stalls_on_large_tables_leaves_half_the_budget() {
    let (b, side) = target("tables");
    // Two requests of 916,666 segments: 33.0 MB charged each, 66.0 MB of 67.1 MB together.
    let mut hostile = Vec::new();
    for id in 1..=2 {
        let mut c = lane_client::connect(&b);
        c.write_all(&stalled_header(id, 916_666)).unwrap();
        hostile.push(c);
    }
    std::thread::sleep(Duration::from_millis(300));
    let held = b.budget().used();
    let (res, took) = good_write(side, "tables");
    eprintln!(
        "a peer stalled on two 33 MB tables: the target's budget holds {held} of {BUDGET}; \
         the good peer's 40,000-piece WRITE: {res:?} in {took:?}"
    );
    assert!(held <= BUDGET / 2, "the stalled peer holds {held} bytes");
    res.unwrap();
    assert!(took < Duration::from_secs(5), "{took:?}");
    // One of the two requests (whichever the target admitted second: their connections race)
    // was refused, typed, with the share named: its reply comes once its table has streamed
    // by (the stream stays in step).
    let table = vec![0u8; 916_666 * SEG_LEN];
    let replies: Vec<(u8, String)> = hostile
        .iter_mut()
        .zip(1..)
        .map(|(c, id)| lane_client::write(c, id, &table))
        .collect();
    assert!(
        replies
            .iter()
            .any(|(status, msg)| *status != 0 && msg.contains("half the budget")),
        "{replies:?}"
    );
}

#[test]
fn one_peer_gets_at_most_128_connections() {
    let (b, side) = target("conns");
    let mut conns = Vec::new();
    for i in 0..128 {
        let c = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lane_client::connect(&b)));
        assert!(c.is_ok(), "connection {i} of 128 was refused");
        conns.push(c.unwrap());
    }
    // The 129th is closed at admission, before its welcome.
    let extra = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lane_client::connect(&b)));
    assert!(
        extra.is_err(),
        "a 129th connection of one peer was welcomed"
    );
    let mut byte = [0u8; 1];
    // Another peer is served meanwhile.
    let (res, _) = good_write(side, "conns");
    res.unwrap();
    // One closed makes room for one more.
    drop(conns.pop());
    std::thread::sleep(Duration::from_millis(200));
    let mut again = lane_client::connect(&b);
    again
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    match again.read(&mut byte) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
        r => panic!("the connection after one closed: {r:?}"),
    }
}
