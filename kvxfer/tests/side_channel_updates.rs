//! A region registered after `connect` reaches the peer without a reconnect, both ways, with
//! and without a secret; the lists prepared before stay valid (the peer only grew). An update
//! is taken only as the agent its connection's handshake loaded.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvxfer::{
    Agent, AgentConfig, Desc, HostBuffer, MemoryBudget, Region, RegionId, Transport, XferOp,
};
use kvxfer_proto::wire::metadata::{Metadata, RegionMeta};
use kvxfer_proto::wire::side_channel::{encode_frame, read_frame, HELLO, META, PREAMBLE, UPDATE};

const LEN: usize = 64 << 10;

fn agent(name: &str, secret: Option<&[u8]>) -> Agent {
    let mut c = AgentConfig::new(format!("{name}-{}", std::process::id()))
        .transport(Transport::Tcp)
        .net_devices("lo");
    if let Some(s) = secret {
        c = c.secret(s.to_vec());
    }
    Agent::new(c).unwrap()
}

fn filled(a: &Agent, byte: u8) -> Region {
    let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    r.write(0, &vec![byte; LEN]).unwrap();
    r
}

/// Waits up to 5 s for `peer`'s metadata in `a` to list `id`.
fn sees(a: &Agent, peer: &str, id: RegionId) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if a.peer_regions(peer).unwrap().iter().any(|s| s.id == id) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// `a` reads `peer`'s region `id` through `prepared` (or a list prepared now) into a fresh
/// region: the bytes it got.
fn read(a: &Agent, peer: &str, id: RegionId, prepared: Option<&kvxfer::PreparedRemote>) -> u8 {
    let local = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let l = a
        .prep_local(&[Desc::new(local.id(), 0, LEN as u64)])
        .unwrap();
    let fresh;
    let r = match prepared {
        Some(p) => p,
        None => {
            fresh = a
                .prep_remote(peer, &[Desc::new(id, 0, LEN as u64)])
                .unwrap();
            &fresh
        }
    };
    a.transfer_all(XferOp::Read, &l, r, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    let mut got = vec![0u8; LEN];
    local.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == got[0]), "one byte throughout");
    a.deregister(&local).unwrap();
    got[0]
}

#[test]
fn a_region_registered_after_connect_reaches_the_peer_both_ways() {
    for secret in [None, Some(&b"updates"[..])] {
        let a = agent("upd-a", secret);
        let b = agent("upd-b", secret);
        let first = filled(&a, 1);
        let side = a.listen("127.0.0.1:0").unwrap();
        let name = b.connect(side).unwrap();
        assert_eq!(name, a.name());
        let before = b
            .prep_remote(&name, &[Desc::new(first.id(), 0, LEN as u64)])
            .unwrap();

        // The listening side registers: the connecting side sees it, and its list prepared
        // before still works (same incarnation, only grown).
        let second = filled(&a, 2);
        assert!(
            sees(&b, &name, second.id()),
            "secret {secret:?}: b never saw a's region registered after connect"
        );
        assert_eq!(read(&b, &name, first.id(), Some(&before)), 1);
        assert_eq!(read(&b, &name, second.id(), None), 2);

        // The connecting side registers: the listening side sees it.
        let theirs = filled(&b, 3);
        assert!(
            sees(&a, b.name(), theirs.id()),
            "secret {secret:?}: a never saw b's region registered after connect"
        );
        assert_eq!(read(&a, b.name(), theirs.id(), None), 3);
    }
}

/// A client without a secret completes a real handshake as agent `c` (its metadata), then
/// sends updates over the kept connection: one naming another agent is refused and ends the
/// connection; before it, one that only grows `c` is loaded.
#[test]
fn an_update_is_taken_only_as_the_agent_the_handshake_loaded() {
    let a = agent("upd-target", None);
    let c = agent("upd-client", None);
    let side = a.listen("127.0.0.1:0").unwrap();
    let mut s = TcpStream::connect(side).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = PREAMBLE.to_vec();
    hello.extend_from_slice(&encode_frame(HELLO, &c.metadata().unwrap()));
    s.write_all(&hello).unwrap();
    let mut pre = [0u8; PREAMBLE.len()];
    s.read_exact(&mut pre).unwrap();
    let (kind, _) = read_frame(&mut s, "a").unwrap();
    assert_eq!(kind, META);
    assert!(a.peer_regions(c.name()).unwrap().is_empty());

    // Grown: taken.
    let mut m = Metadata::decode(&c.metadata().unwrap(), kvxfer::DEFAULT_COMPAT).unwrap();
    m.regions.push(RegionMeta {
        id: RegionId(77),
        kind: kvxfer::MemKind::Host,
        base: 0x10_0000,
        len: 4096,
        rkey: vec![1; 8],
        shm: None,
    });
    s.write_all(&encode_frame(UPDATE, &m.encode())).unwrap();
    assert!(
        sees(&a, c.name(), RegionId(77)),
        "the grown metadata was not loaded"
    );

    // Another name on this connection: refused, nothing loaded, the connection closed.
    let victim = format!("victim-{}", std::process::id());
    m.name = victim.clone();
    s.write_all(&encode_frame(UPDATE, &m.encode())).unwrap();
    let mut b = [0u8; 1];
    let closed = matches!(s.read(&mut b), Ok(0));
    assert!(
        a.peer_regions(&victim).is_err(),
        "an update loaded another agent's name"
    );
    assert!(closed, "the connection stays open after a foreign update");
}

/// An update is charged to the agent's budget while it is read and loaded: one larger than
/// the budget is refused, nothing of it loaded, the connection closed.
#[test]
fn an_update_past_the_budget_is_refused_and_loads_nothing() {
    let budget = MemoryBudget::new(16 << 10);
    let a = Agent::new(
        AgentConfig::new(format!("upd-budget-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .budget(budget.clone()),
    )
    .unwrap();
    let c = agent("upd-budget-client", None);
    let side = a.listen("127.0.0.1:0").unwrap();
    let mut s = TcpStream::connect(side).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut hello = PREAMBLE.to_vec();
    hello.extend_from_slice(&encode_frame(HELLO, &c.metadata().unwrap()));
    s.write_all(&hello).unwrap();
    let mut pre = [0u8; PREAMBLE.len()];
    s.read_exact(&mut pre).unwrap();
    assert_eq!(read_frame(&mut s, "a").unwrap().0, META);
    // Grown by 8 regions with 4 KiB keys: about 33 KiB, twice the budget.
    let mut m = Metadata::decode(&c.metadata().unwrap(), kvxfer::DEFAULT_COMPAT).unwrap();
    for i in 0..8u32 {
        m.regions.push(RegionMeta {
            id: RegionId(100 + i),
            kind: kvxfer::MemKind::Host,
            base: 0x10_0000 * u64::from(i + 1),
            len: 4096,
            rkey: vec![1; 4096],
            shm: None,
        });
    }
    let frame = encode_frame(UPDATE, &m.encode());
    assert!(frame.len() as u64 > budget.limit());
    s.write_all(&frame).unwrap();
    // Closed: an end of stream, or a reset (the agent closed with the update's body unread).
    let mut b = [0u8; 1];
    let got = s.read(&mut b);
    let closed = matches!(&got, Ok(0))
        || matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset);
    assert!(
        a.peer_regions(c.name()).unwrap().is_empty(),
        "an update past the budget was loaded"
    );
    assert!(closed, "the connection stays open past the budget: {got:?}");
    assert_eq!(budget.used(), 0, "the refused update still holds budget");
}
