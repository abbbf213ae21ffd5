//! Handoffs are untrusted input (issue 33, part 4): with a secret, a consumer loads only a
//! handoff its producer sealed, and checks the seal before it connects anywhere; a producer
//! answers only lease calls that carry the request's grant, so a peer that was not given the
//! handoff frees, renews and declares nothing.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvxfer::connector::{ConnectorConfig, Consumer, FreeReason, Producer};
use kvxfer::{Agent, AgentConfig, Error, Transport};

#[path = "support/kv.rs"]
mod kv;
use kv::kv_layout;

const SECRET: &[u8] = b"open sesame";
const T: Duration = Duration::from_secs(20);

fn agent(name: &str) -> Arc<Agent> {
    let c = AgentConfig::new(format!("{name}-{}", std::process::id()))
        .transport(Transport::Tcp)
        .net_devices("lo")
        .secret(SECRET.to_vec());
    Arc::new(Agent::new(c).unwrap())
}

/// Every byte of `blocks` (both layers) in `r` is `fill`.
fn blocks_are(r: &kvxfer::Region, l: &kvxfer::layout::KvLayout, blocks: &[u32], fill: u8) -> bool {
    l.descs(blocks, 0..2, 0..2).unwrap().iter().all(|d| {
        let mut b = vec![0u8; d.len as usize];
        r.read(d.offset, &mut b).unwrap();
        b.iter().all(|&x| x == fill)
    })
}

/// A listener the client runs: counts the connections it gets until dropped.
struct Foreign {
    addr: std::net::SocketAddr,
    accepted: Arc<AtomicUsize>,
    stop: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Foreign {
    fn start() -> Foreign {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicUsize::new(0));
        let (a, s) = (accepted.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while s.load(Ordering::SeqCst) == 0 {
                match l.accept() {
                    Ok((c, _)) => {
                        a.fetch_add(1, Ordering::SeqCst);
                        held.push(c);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Foreign {
            addr,
            accepted,
            stop,
            thread: Some(thread),
        }
    }

    /// Connections made to it so far, after a pause for any in flight.
    fn connections(&self) -> usize {
        std::thread::sleep(Duration::from_millis(200));
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        self.stop.store(1, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A client edits a sealed handoff: another producer at an address it runs, another side
/// channel, another request's blocks, another epoch, another request's grant, no seal. Each
/// load fails typed (`Error::Auth`) at once: no connection to the client's listener, nothing
/// written into the consumer's blocks. The request whose blocks the edit named is unaffected,
/// and a real load beside them completes.
#[test]
fn edited_handoffs_fail_alone_before_any_connection() {
    let p = agent("edit-p");
    let (_pr, pl) = kv_layout(&p, 0x5a);
    let paddr = p.listen("127.0.0.1:0").unwrap();
    let c = agent("edit-c");
    let (cr, cl) = kv_layout(&c, 0);
    let producer = Producer::new(p.clone(), pl, ConnectorConfig::default(), Some(paddr)).unwrap();
    let consumer = Consumer::new(c.clone(), cl.clone(), ConnectorConfig::default()).unwrap();
    let foreign = Foreign::start();

    let real = producer.publish("real", &[3, 4], 32, 2).unwrap();
    let other = producer.publish("other", &[5, 6], 32, 2).unwrap();
    let mine = producer.publish("mine", &[9, 10], 32, 2).unwrap();
    assert!(mine.seal.is_some() && mine.grant.is_some());
    type Edit = Box<dyn Fn(&mut kvxfer::connector::Handoff)>;
    let fa = foreign.addr;
    let og = other.grant;
    let edits: Vec<(&str, Edit)> = vec![
        (
            "another producer at the client's listener",
            Box::new(move |h| {
                h.producer = format!("mallory-{}", std::process::id());
                h.side_channel = Some(fa);
            }),
        ),
        (
            "the client's listener as side channel",
            Box::new(move |h| h.side_channel = Some(fa)),
        ),
        (
            "another request's blocks",
            Box::new(|h| h.blocks = vec![5, 6]),
        ),
        ("another epoch", Box::new(|h| h.epoch ^= 1)),
        ("another request's grant", Box::new(move |h| h.grant = og)),
        ("no seal", Box::new(|h| h.seal = None)),
    ];
    for (what, edit) in &edits {
        let mut h = mine.clone();
        edit(&mut h);
        let e = consumer.start_load(&h, &[1, 2]).unwrap_err();
        assert!(matches!(e, Error::Auth { .. }), "{what}: {e}");
        println!("{what}: {e}");
    }
    assert_eq!(
        foreign.connections(),
        0,
        "an edited handoff made the consumer dial the client's listener"
    );
    assert!(
        blocks_are(&cr, &cl, &[1, 2], 0),
        "an edited load wrote into the consumer's blocks"
    );
    assert_eq!(consumer.in_progress(), 0);
    // The request the edit pointed at is still held and loads with its own handoff; the real
    // one loads too.
    assert_eq!(producer.held(), 3);
    consumer.start_load(&other, &[11, 12]).unwrap();
    consumer.start_load(&real, &[7, 8]).unwrap();
    consumer.wait("other", T).unwrap();
    consumer.wait("real", T).unwrap();
    assert!(blocks_are(&cr, &cl, &[7, 8, 11, 12], 0x5a));
    assert!(blocks_are(&cr, &cl, &[1, 2], 0));
}

/// A peer that holds the secret and is connected to the producer, but was never given the
/// handoff: its acknowledgements (no grant, a guessed one) free nothing, and its heartbeat
/// declaring four readers is not taken (the producer refuses each, naming the grant). The reader with the handoff then loads, and its
/// acknowledgement alone frees the request.
#[test]
fn a_peer_without_the_handoff_frees_and_declares_nothing() {
    use kvxfer::connector::{Grant, GRANT_LEN};
    use kvxfer_proto::wire::connector::ToProducer;
    let p = agent("grant-p");
    let (_pr, pl) = kv_layout(&p, 0x5a);
    let paddr = p.listen("127.0.0.1:0").unwrap();
    let producer = Producer::new(p.clone(), pl, ConnectorConfig::default(), Some(paddr)).unwrap();
    let h = producer.publish("req", &[3, 4], 32, 2).unwrap();

    let mallory = agent("grant-m");
    let to = mallory.connect(paddr).unwrap();
    let calls = [
        ToProducer::Ack {
            request: "req".into(),
            readers: Some(1),
            grant: None,
        },
        ToProducer::Ack {
            request: "req".into(),
            readers: Some(1),
            grant: Some(Grant([0; GRANT_LEN])),
        },
        ToProducer::Heartbeat {
            request: "req".into(),
            readers: Some(4),
            grant: Some(Grant([0x5a; GRANT_LEN])),
        },
    ];
    for m in &calls {
        mallory.notify(&to, &m.encode()).unwrap().wait().unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        producer.held(),
        1,
        "a peer without the handoff freed the request"
    );

    let c = agent("grant-c");
    let (cr, cl) = kv_layout(&c, 0);
    let consumer = Consumer::new(c.clone(), cl.clone(), ConnectorConfig::default()).unwrap();
    consumer.start_load(&h, &[1, 2]).unwrap();
    consumer.wait("req", T).unwrap();
    assert!(blocks_are(&cr, &cl, &[1, 2], 0x5a));
    let f = producer.wait_freed("req", T).unwrap();
    assert_eq!(f.reason, FreeReason::Acked);
}

/// Grant-scoped lane access: a peer that holds the secret and is connected to both ends reads
/// no block of the producer's cache that was not granted to it (another request's blocks, a
/// request granted to another reader, blocks never published), writes none, and writes none
/// of the consumer's cache. Nothing moves: its buffer keeps its bytes, both caches theirs. A
/// plain region of the producer stays open to it (an agent-level transfer), and the real
/// reader, granted by its lease, loads.
#[test]
fn a_peer_reads_and_writes_only_the_blocks_granted_to_it() {
    use kvxfer::{Desc, HostBuffer, XferOp};
    let p = agent("scope-p");
    let (pr, pl) = kv_layout(&p, 0x5a);
    let plain = p.register(HostBuffer::new(4096).unwrap()).unwrap();
    plain.write(0, &[0x77; 4096]).unwrap();
    let paddr = p.listen("127.0.0.1:0").unwrap();
    let producer = Producer::new(
        p.clone(),
        pl.clone(),
        ConnectorConfig::default(),
        Some(paddr),
    )
    .unwrap();
    let c = agent("scope-c");
    let (cr, cl) = kv_layout(&c, 0);
    let caddr = c.listen("127.0.0.1:0").unwrap();
    let consumer = Consumer::new(c.clone(), cl.clone(), ConnectorConfig::default()).unwrap();
    let h = producer.publish("req", &[3, 4], 32, 2).unwrap();
    producer.publish("other", &[5, 6], 32, 2).unwrap();
    consumer.start_load(&h, &[1, 2]).unwrap();
    consumer.wait("req", T).unwrap();
    assert!(blocks_are(&cr, &cl, &[1, 2], 0x5a));

    let m = agent("scope-m");
    let buf = m.register(HostBuffer::new(1 << 17).unwrap()).unwrap();
    buf.write(0, &vec![0x11; 1 << 17]).unwrap();
    let to_p = m.connect(paddr).unwrap();
    let to_c = m.connect(caddr).unwrap();
    let moved = |op: XferOp, to: &str, remote: Desc| {
        let l = m.prep_local(&[Desc::new(buf.id(), 0, remote.len)]).unwrap();
        let r = m.prep_remote(to, &[remote]).unwrap();
        m.transfer_all(op, &l, &r, None, Some(Duration::from_secs(10)))
            .and_then(|t| t.wait())
    };
    let block = |l: &kvxfer::layout::KvLayout, b: u32| l.descs(&[b], 1..2, 0..2).unwrap()[0];
    let cases = [
        (
            "read another request's block",
            XferOp::Read,
            &to_p,
            block(&pl, 5),
        ),
        (
            "read a block granted to another reader",
            XferOp::Read,
            &to_p,
            block(&pl, 3),
        ),
        (
            "read a block never published",
            XferOp::Read,
            &to_p,
            block(&pl, 12),
        ),
        (
            "read the whole cache",
            XferOp::Read,
            &to_p,
            Desc::new(pr.id(), 0, pr.len()),
        ),
        (
            "write a published block",
            XferOp::Write,
            &to_p,
            block(&pl, 4),
        ),
        (
            "write the consumer's loaded block",
            XferOp::Write,
            &to_c,
            block(&cl, 1),
        ),
    ];
    for (what, op, to, d) in cases {
        let e = moved(op, to, d).unwrap_err();
        println!("{what}: {e}");
        assert!(
            matches!(e, Error::LaneFailed { .. }) && e.to_string().contains("holds no grant"),
            "{what}: {e:?}"
        );
    }
    // The paged form (one entry per tensor, as the connector reads): another request's
    // blocks, read and written.
    for op in [XferOp::Read, XferOp::Write] {
        let remote = pl.paged(&[5, 6], 1..2, 0..2).unwrap();
        let local: Vec<kvxfer::paged::Paged> = remote
            .iter()
            .enumerate()
            .map(|(i, r)| kvxfer::paged::Paged {
                region: buf.id(),
                offset: i as u64 * 2 * r.block_len,
                block_len: r.block_len,
                stride: r.block_len,
                blocks: std::sync::Arc::from(&[0u32, 1][..]),
            })
            .collect();
        let e = m
            .transfer_paged(op, &to_p, &local, &remote, None, Some(T))
            .and_then(|t| t.wait())
            .unwrap_err();
        println!("paged {op:?} of another request's blocks: {e}");
        assert!(
            e.to_string().contains("holds no grant"),
            "paged {op:?}: {e:?}"
        );
    }
    // Nothing moved either way.
    let mut mine = vec![0u8; 1 << 17];
    buf.read(0, &mut mine).unwrap();
    assert!(
        mine.iter().all(|&x| x == 0x11),
        "the peer's buffer received bytes"
    );
    assert!(
        blocks_are(&pr, &pl, &[3, 4, 5, 6, 12], 0x5a),
        "the producer's cache changed"
    );
    assert!(
        blocks_are(&cr, &cl, &[1, 2], 0x5a),
        "the consumer's cache changed"
    );
    // A plain region stays open to an authenticated peer.
    moved(XferOp::Read, &to_p, Desc::new(plain.id(), 0, 4096)).unwrap();
    buf.read(0, &mut mine[..4096]).unwrap();
    assert!(mine[..4096].iter().all(|&x| x == 0x77));
    // The other request is still served to a reader with its handoff.
    assert_eq!(producer.held(), 1);
}

/// Lane identity among holders of the secret (issue 33, part 2): a process that holds the
/// secret and calls itself the reader (an agent configured with the reader's name, given the
/// producer's metadata) reads none of the blocks granted to that reader, and one that calls
/// itself the producer sends the consumer nothing. Each lane handshake proves the initiator's
/// static key; the target takes the hello's name only with the key that name's metadata
/// carried. The reader's grant stays whole: the request is still held for its second reader.
#[test]
fn a_peer_with_the_secret_cannot_act_under_another_agents_name() {
    use kvxfer::{Desc, HostBuffer, XferOp};
    let p = agent("ident-p");
    let (pr, pl) = kv_layout(&p, 0x5a);
    let paddr = p.listen("127.0.0.1:0").unwrap();
    let two = ConnectorConfig::default().readers(2);
    let producer = Producer::new(p.clone(), pl.clone(), two, Some(paddr)).unwrap();
    let c = agent("ident-c");
    let (cr, cl) = kv_layout(&c, 0);
    let consumer = Consumer::new(c.clone(), cl.clone(), ConnectorConfig::default()).unwrap();
    let h = producer.publish("req", &[3, 4], 32, 2).unwrap();
    consumer.start_load(&h, &[1, 2]).unwrap();
    consumer.wait("req", T).unwrap();
    assert!(blocks_are(&cr, &cl, &[1, 2], 0x5a));
    assert_eq!(producer.held(), 1, "held for its second reader");

    // The impostor reader: the reader's name, its own key.
    let m = agent("ident-c");
    assert_eq!(m.name(), c.name());
    let buf = m.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
    buf.write(0, &vec![0x11; 1 << 16]).unwrap();
    let to_p = m.load_remote_metadata(&p.metadata().unwrap()).unwrap();
    let granted = pl.descs(&[3], 1..2, 0..2).unwrap()[0];
    let l = m
        .prep_local(&[Desc::new(buf.id(), 0, granted.len)])
        .unwrap();
    let r = m.prep_remote(&to_p, &[granted]).unwrap();
    let e = m
        .transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(10)))
        .and_then(|t| t.wait())
        .unwrap_err();
    println!("the impostor reader's read: {e}");
    assert!(
        matches!(e, Error::LaneFailed { .. }) && e.to_string().contains("another agent's key"),
        "the impostor read a block granted to the reader it named: {e:?}"
    );
    let mut mine = vec![0u8; 1 << 16];
    buf.read(0, &mut mine).unwrap();
    assert!(
        mine.iter().all(|&x| x == 0x11),
        "bytes reached the impostor"
    );

    // The impostor producer: a notification under the producer's name.
    let mp = agent("ident-p");
    let to_c = mp.load_remote_metadata(&c.metadata().unwrap()).unwrap();
    let sent = mp.notify(&to_c, b"forged").and_then(|t| t.wait());
    println!("the impostor producer's notification: {sent:?}");
    assert!(
        sent.is_err(),
        "the consumer took a lane under the producer's name"
    );
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !c.notifications().iter().any(|n| n.payload == b"forged"),
        "a notification under the producer's name was delivered"
    );
    // The request, its reader's grant and both caches are as they were.
    assert_eq!(producer.held(), 1);
    assert!(blocks_are(&pr, &pl, &[3, 4], 0x5a));
    assert!(blocks_are(&cr, &cl, &[1, 2], 0x5a));
}
