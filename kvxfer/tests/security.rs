//! Authenticated side channel (shared secret, mutual), garbage on the side channel, and strict
//! transport mode.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::io::Write;
use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Transport, XferOp};

#[path = "support/kv.rs"]
mod kv;
use kv::kv_layout;

fn agent(name: &str, secret: Option<&str>) -> Agent {
    let mut c = AgentConfig::new(format!("{name}-{}", std::process::id()))
        .transport(Transport::Tcp)
        .net_devices("lo");
    if let Some(s) = secret {
        c = c.secret(s.as_bytes().to_vec());
    }
    Agent::new(c).unwrap()
}

#[test]
fn shared_secret_is_proven_both_ways_before_metadata_moves() {
    let b = agent("auth-b", Some("open sesame"));
    b.register(HostBuffer::new(4096).unwrap()).unwrap();
    let addr = b.listen("127.0.0.1:0").unwrap();

    // Same secret: works, and data moves.
    let a = agent("auth-a", Some("open sesame"));
    let ra = a.register(HostBuffer::new(4096).unwrap()).unwrap();
    let peer = a.connect(addr).unwrap();
    let l = a.prep_local(&[Desc::new(ra.id(), 0, 4096)]).unwrap();
    let rid = kvxfer::RegionId(0);
    let r = a.prep_remote(&peer, &[Desc::new(rid, 0, 4096)]).unwrap();
    a.transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();

    // No secret, a wrong one: refused with a typed error; neither side learns the other.
    for (name, secret) in [("auth-none", None), ("auth-wrong", Some("guess"))] {
        let c = agent(name, secret);
        let e = c.connect(addr).unwrap_err();
        assert!(matches!(e, Error::Auth { .. }), "{name}: {e}");
        assert!(matches!(
            c.prep_remote(b.name(), &[]),
            Err(Error::UnknownPeer { .. })
        ));
        assert!(
            b.peer_info(c.name()).is_err(),
            "{name} got into the listener's table"
        );
    }

    // A client with a secret refuses a listener that has none (it would learn nothing).
    let open = agent("auth-open", None);
    let oaddr = open.listen("127.0.0.1:0").unwrap();
    let c = agent("auth-c", Some("open sesame"));
    let e = c.connect(oaddr).unwrap_err();
    assert!(matches!(e, Error::Auth { .. }), "{e}");
    assert!(open.peer_info(c.name()).is_err());
    // The listener kept working through all of it.
    assert_eq!(a.connect(addr).unwrap(), peer);
}

#[test]
fn garbage_on_the_side_channel_is_refused_and_the_listener_keeps_working() {
    let b = agent("junk-b", None);
    let addr = b.listen("127.0.0.1:0").unwrap();
    let junk: [&[u8]; 5] = [
        b"GET / HTTP/1.1\r\n\r\n",
        &[0xff; 64],
        &[5, 0, 0, 0, 1, 1, 2, 3, 4], // HELLO with 4 bytes of "metadata"
        &[0, 0, 0, 0, 1],             // empty frame
        &[0xff, 0xff, 0xff, 0x7f, 1], // 2 GiB frame
    ];
    for j in junk {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let _ = s.write_all(j);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut sink);
    }
    let a = agent("junk-a", None);
    assert_eq!(a.connect(addr).unwrap(), b.name());
}

#[test]
fn strict_mode_refuses_a_silent_fallback_to_tcp() {
    // With UCX peer-failure detection on, UCX 1.13-1.22 will not use its mapped shared-memory
    // transports (posix, sysv: no peer-failure handler), and asking for "posix,sysv,tcp"
    // silently runs over TCP: strict mode makes that an error naming it. (`cma` does handle
    // peer failure: on UCX 1.22 with kvxfer's RNDV_THRESH=inf, "sm,tcp" gets cma for RMA, which
    // strict mode rightly lets through.)
    let mk = |name: &str, peer_failure: bool| {
        let c = AgentConfig::new(format!("{name}-{}", std::process::id()))
            .transport(Transport::Custom("posix,sysv,tcp".into()))
            .net_devices("lo")
            .ucx_tcp(true)
            .strict(true)
            .peer_failure(Some(peer_failure));
        Agent::new(c).unwrap()
    };
    for (peer_failure, want_ok) in [(true, false), (false, true)] {
        let b = mk("strict-b", peer_failure);
        let rb = b.register(HostBuffer::new(4096).unwrap()).unwrap();
        let addr = b.listen("127.0.0.1:0").unwrap();
        let a = mk("strict-a", peer_failure);
        let ra = a.register(HostBuffer::new(4096).unwrap()).unwrap();
        let peer = a.connect(addr).unwrap();
        let l = a.prep_local(&[Desc::new(ra.id(), 0, 4096)]).unwrap();
        let r = a
            .prep_remote(&peer, &[Desc::new(rb.id(), 0, 4096)])
            .unwrap();
        let res = a
            .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
            .and_then(|x| x.wait());
        if want_ok {
            res.unwrap();
        } else {
            match res {
                Err(Error::TransportMismatch { got, .. }) => assert!(got.contains("tcp"), "{got}"),
                other => panic!("peer_failure {peer_failure}: {other:?}"),
            }
        }
    }
}

/// A TCP relay between a client and `to` that records both directions and, if `flip` is
/// set, flips the byte at that offset of what the client sends. Serves one connection; the
/// bytes it saw (client to server, server to client) come back from the handle.
/// What a relay saw: client to server, server to client.
type Seen = std::thread::JoinHandle<(Vec<u8>, Vec<u8>)>;

fn relay(to: std::net::SocketAddr, flip: Option<usize>) -> (std::net::SocketAddr, Seen) {
    use std::io::Read;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (c, _) = l.accept().unwrap();
        let s = std::net::TcpStream::connect(to).unwrap();
        let pump =
            |mut from: std::net::TcpStream, mut to: std::net::TcpStream, flip: Option<usize>| {
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 65536];
                    loop {
                        let n = match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let at = seen.len();
                        seen.extend_from_slice(&buf[..n]);
                        if let Some(f) = flip {
                            if (at..at + n).contains(&f) {
                                buf[f - at] ^= 0x01;
                            }
                        }
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    seen
                })
            };
        let up = pump(c.try_clone().unwrap(), s.try_clone().unwrap(), flip);
        let down = pump(s, c, None);
        (up.join().unwrap(), down.join().unwrap())
    });
    (addr, h)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn lane_secret(a: &Agent) -> [u8; 16] {
    use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};
    let meta = Metadata::decode(&a.metadata().unwrap(), DEFAULT_COMPAT).unwrap();
    meta.tcp_lane().unwrap().secret
}

#[test]
fn a_relay_without_the_secret_reads_and_changes_nothing() {
    let b = agent("relay-b", Some("open sesame"));
    let rb = b.register(HostBuffer::new(4096).unwrap()).unwrap();
    let addr = b.listen("127.0.0.1:0").unwrap();
    let a = agent("relay-a", Some("open sesame"));
    let ra = a.register(HostBuffer::new(4096).unwrap()).unwrap();

    // A relay that passes everything through: the handshake completes, the connection is
    // kept for updates, and the relay saw neither agent's name nor either lane credential,
    // in the handshake or in an update sent after it.
    let (via, seen) = relay(addr, None);
    let peer = a.connect(via).unwrap();
    // The session the relay passed works: data moves.
    let l = a.prep_local(&[Desc::new(ra.id(), 0, 4096)]).unwrap();
    let r = a
        .prep_remote(&peer, &[Desc::new(rb.id(), 0, 4096)])
        .unwrap();
    a.transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    // An update through the relay: b registers another region, a learns it.
    let later = b.register(HostBuffer::new(4096).unwrap()).unwrap();
    let t = std::time::Instant::now();
    while !a
        .peer_regions(&peer)
        .unwrap()
        .iter()
        .any(|s| s.id == later.id())
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no update through the relay"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (a_name, a_lane) = (a.name().to_string(), lane_secret(&a));
    drop((l, r, ra));
    drop(a); // closes the kept connection: the relay ends.
    let (up, down) = seen.join().unwrap();
    assert!(
        up.len() > 100 && down.len() > 100,
        "metadata went through the relay"
    );
    for (what, secret) in [
        (a_name.as_bytes().to_vec(), "a's name"),
        (b.name().as_bytes().to_vec(), "b's name"),
        (a_lane.to_vec(), "a's lane credential"),
        (lane_secret(&b).to_vec(), "b's lane credential"),
    ] {
        assert!(
            !contains(&up, &what) && !contains(&down, &what),
            "the relay read {secret} ({:?}) off the wire",
            String::from_utf8_lossy(&what)
        );
    }

    // A relay that changes one byte of the sealed HELLO (after the preamble, the handshake
    // frame and the HELLO's header): the connect fails typed, and the listener loaded nothing.
    let c = agent("relay-c", Some("open sesame"));
    // (The handshake message is an ephemeral X25519 key and a tag: 48 bytes.)
    let hello_at = 8 + 5 + 48 + 5;
    let (via, seen) = relay(addr, Some(hello_at + 10));
    let e = c.connect(via).unwrap_err();
    assert!(matches!(e, Error::Auth { .. }), "{e}");
    assert!(b.peer_info(c.name()).is_err(), "a changed HELLO was loaded");
    drop(seen.join());
    // The listener still serves.
    assert_eq!(c.connect(addr).unwrap(), peer);
}

/// Two agents with a secret (`sealed_data`: lane_encryption on both), `b`'s lane reached
/// through a relay: `b`'s metadata is loaded into `a` with its lane address pointing at it.
fn lane_via_relay(
    tag: &str,
    sealed_data: bool,
    flip: Option<&dyn Fn(&Agent) -> usize>,
) -> (Agent, Agent, kvxfer::Region, kvxfer::Region, String, Seen) {
    use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};
    let mk = |n: &str| {
        let c = AgentConfig::new(format!("{n}-{tag}-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .secret(b"open sesame".to_vec())
            .lane_encryption(sealed_data);
        Agent::new(c).unwrap()
    };
    let (a, b) = (mk("lrelay-a"), mk("lrelay-b"));
    let ra = a.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
    let rb = b.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
    ra.write(0, &[0xA7; 1 << 16]).unwrap();
    rb.write(0, &[0x5B; 1 << 16]).unwrap();
    let mut meta = Metadata::decode(&b.metadata().unwrap(), DEFAULT_COMPAT).unwrap();
    let mut lane = meta.tcp_lane().unwrap();
    let (via, seen) = relay(lane.addr, flip.map(|f| f(&a)));
    lane.addr = via;
    meta.set_tcp_lane(Some(lane));
    let peer = a.load_remote_metadata(&meta.encode()).unwrap();
    // A sealed lane serves only peers its target loaded (their keys prove their names).
    b.load_remote_metadata(&a.metadata().unwrap()).unwrap();
    (a, b, ra, rb, peer, seen)
}

fn write_all_of(
    a: &Agent,
    ra: &kvxfer::Region,
    rb: &kvxfer::Region,
    peer: &str,
) -> kvxfer::Result<()> {
    let l = a.prep_local(&[Desc::new(ra.id(), 0, 1 << 16)])?;
    let r = a.prep_remote(peer, &[Desc::new(rb.id(), 0, 1 << 16)])?;
    a.transfer_all(
        XferOp::Write,
        &l,
        &r,
        Some(b"landed"),
        Some(Duration::from_secs(10)),
    )?
    .wait()
    .map(|_| ())
}

/// With a secret, a relay on the TCP lane sees no lane credential, no name and no
/// notification (control is sealed; with lane_encryption not the data either).
#[test]
fn a_relay_on_the_tcp_lane_learns_no_credential() {
    for sealed_data in [false, true] {
        let (a, b, ra, rb, peer, seen) = lane_via_relay("pass", sealed_data, None);
        write_all_of(&a, &ra, &rb, &peer).unwrap();
        let mut got = vec![0u8; 1 << 16];
        rb.read(0, &mut got).unwrap();
        assert!(got.iter().all(|&x| x == 0xA7), "the write landed whole");
        let (bl, an) = (lane_secret(&b), a.name().as_bytes().to_vec());
        drop(a);
        let (up, down) = seen.join().unwrap();
        assert!(up.len() > 1 << 16, "the data went through the relay");
        for (what, secret) in [
            (&bl[..], "b's lane credential"),
            (&an[..], "a's name"),
            (&b"landed"[..], "the notification"),
        ] {
            assert!(
                !contains(&up, what) && !contains(&down, what),
                "the relay read {secret} off the lane (sealed data {sealed_data})"
            );
        }
        assert_eq!(
            contains(&up, &[0xA7; 64]),
            !sealed_data,
            "the data is in the clear exactly when lane_encryption is off"
        );
    }
}

/// A byte a relay changes on the TCP lane: in the first request's record (control), and with
/// lane_encryption in the data. The write fails typed; b's memory keeps its bytes.
#[test]
fn a_relay_on_the_tcp_lane_changes_nothing() {
    // (Opening: 4 + 48 bytes; the hello record: its name + 59 bytes.)
    let in_request: &dyn Fn(&Agent) -> usize = &|a| 52 + a.name().len() + 59 + 10;
    let in_data: &dyn Fn(&Agent) -> usize = &|_| 30_000;
    for (sealed_data, at) in [(false, in_request), (true, in_request), (true, in_data)] {
        let (a, _b, ra, rb, peer, seen) = lane_via_relay("flip", sealed_data, Some(at));
        let e = write_all_of(&a, &ra, &rb, &peer).unwrap_err();
        let mut got = vec![0u8; 1 << 16];
        rb.read(0, &mut got).unwrap();
        assert!(
            got.iter().all(|&x| x == 0x5B),
            "a changed lane stream wrote into b (sealed data {sealed_data}): {e}"
        );
        drop(a);
        drop(seen.join());
    }
}

/// A process without the secret that holds b's lane credential (say, read from a registry)
/// and speaks the open lane's hello and a READ: refused before any request, no byte of b's
/// memory read, and b still serves.
#[test]
fn a_lane_credential_without_the_secret_reads_nothing() {
    use kvxfer_proto::wire::lane::{Hello, RequestHeader, Segment, K_READ};
    use std::io::Read;
    let (a, b, _ra, rb, _peer, _seen) = lane_via_relay("cred", false, None);
    let real = {
        use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};
        Metadata::decode(&b.metadata().unwrap(), DEFAULT_COMPAT)
            .unwrap()
            .tcp_lane()
            .unwrap()
    };
    let mut s = std::net::TcpStream::connect(real.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut m = Hello {
        name: a.name(),
        secret: real.secret,
        epoch: 0,
    }
    .encode();
    RequestHeader {
        kind: K_READ,
        id: 1,
        nsegs: 1,
        notif_len: 0,
        frames: None,
        paged: false,
    }
    .encode(&mut m);
    Segment {
        region: rb.id().0,
        offset: 0,
        len: 1 << 16,
    }
    .encode(&mut m);
    let _ = s.write_all(&m);
    let mut back = Vec::new();
    let _ = s.read_to_end(&mut back);
    assert!(
        !contains(&back, &[0x5B; 64]),
        "b served {} bytes of its memory to a client without the secret",
        back.len()
    );
    // b still serves its real peer (directly, not through the relay).
    drop(a);
    let c = AgentConfig::new(format!("lrelay-c-{}", std::process::id()))
        .transport(Transport::Tcp)
        .net_devices("lo")
        .secret(b"open sesame".to_vec());
    let c = Agent::new(c).unwrap();
    let rc = c.register(HostBuffer::new(1 << 16).unwrap()).unwrap();
    let peer = c.load_remote_metadata(&b.metadata().unwrap()).unwrap();
    b.load_remote_metadata(&c.metadata().unwrap()).unwrap();
    let l = c.prep_local(&[Desc::new(rc.id(), 0, 1 << 16)]).unwrap();
    let r = c
        .prep_remote(&peer, &[Desc::new(rb.id(), 0, 1 << 16)])
        .unwrap();
    c.transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    let mut got = vec![0u8; 1 << 16];
    rc.read(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0x5B));
}

/// A sealed lane's record buffers are charged to the agent's budget, on both ends: a target
/// whose budget cannot hold them refuses the sealed data (nothing lands), one that can shows
/// them in its peak and gives them back when the connection goes.
#[test]
fn a_sealed_lane_charges_its_record_buffers_to_the_budget() {
    use kvxfer::MemoryBudget;
    let mk = |n: &str, budget: MemoryBudget| {
        let c = AgentConfig::new(format!("{n}-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .secret(b"open sesame".to_vec())
            .lane_encryption(true)
            .budget(budget);
        Agent::new(c).unwrap()
    };
    for (limit, lands) in [(2u64 << 20, false), (64 << 20, true)] {
        let budget = MemoryBudget::new(limit);
        let b = mk(&format!("charged-b{limit}"), budget.clone());
        let a = mk(&format!("charged-a{limit}"), MemoryBudget::unlimited());
        let ra = a.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        let rb = b.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        ra.write(0, &[0x3C; 1 << 20]).unwrap();
        let peer = a.connect(b.listen("127.0.0.1:0").unwrap()).unwrap();
        let l = a.prep_local(&[Desc::new(ra.id(), 0, 1 << 20)]).unwrap();
        let r = a
            .prep_remote(&peer, &[Desc::new(rb.id(), 0, 1 << 20)])
            .unwrap();
        let done = a
            .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
            .unwrap()
            .wait();
        let mut got = vec![0u8; 1 << 20];
        rb.read(0, &mut got).unwrap();
        assert_eq!(done.is_ok(), lands, "limit {limit}: {done:?}");
        assert_eq!(got.iter().all(|&x| x == 0x3C), lands, "limit {limit}");
        assert!(got.iter().all(|&x| x == 0x3C) || got.iter().all(|&x| x == 0));
        if lands {
            assert!(budget.peak() >= 3 << 20, "peak {}", budget.peak());
        }
        drop(a);
        let t0 = std::time::Instant::now();
        while budget.used() > 0 && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(budget.used(), 0, "the connection's charge outlived it");
    }
}

/// An agent with a secret whose UCX worker a same-host process without the secret reaches:
/// over UCX's shared memory (a secret keeps UCX off TCP; `Auto` keeps posix, sysv and cma).
fn ucx_reachable(name: &str) -> Agent {
    let c = AgentConfig::new(format!("{name}-{}", std::process::id()))
        .transport(Transport::Auto)
        .net_devices("lo")
        .secret(b"open sesame".to_vec());
    Agent::new(c).unwrap()
}

/// With a secret, notifications and connector messages are believed only from the sealed TCP
/// lane, whose sender the session gives: a process without the secret that reaches the
/// agents' UCX workers (over shared memory: with a secret UCX never takes TCP) and sends over
/// UCX active messages an acknowledgement naming the consumer, a refusal naming the producer,
/// and a user notification, changes nothing. The
/// producer still holds the request, the consumer's load completes with the producer's bytes,
/// no forged notification is delivered, and the real ones arrive with their sender.
#[test]
fn forged_senders_over_ucx_are_not_believed() {
    use kvxfer::connector::{ConnectorConfig, Consumer, Producer};
    use kvxfer_proto::wire::connector::{ToConsumer, ToProducer};
    use std::sync::Arc;
    let layout = kv_layout;
    let p = Arc::new(ucx_reachable("forge-p"));
    let (_pr, pl) = layout(&p, 0x5a);
    let paddr = p.listen("127.0.0.1:0").unwrap();
    let c = Arc::new(ucx_reachable("forge-c"));
    let (cr, cl) = layout(&c, 0);
    let producer = Producer::new(p.clone(), pl, ConnectorConfig::default(), Some(paddr)).unwrap();
    let consumer = Consumer::new(c.clone(), cl.clone(), ConnectorConfig::default()).unwrap();
    let h = producer.publish("req", &[3, 4], 32, 2).unwrap();
    assert_eq!(producer.held(), 1);

    // Forgers: no secret, UCX only (lanes off), named like the consumer and the producer,
    // each holding its target's metadata (so its UCX worker address).
    let forger = |name: &str, target: &Agent| {
        let cfg = AgentConfig::new(name.to_string())
            .transport(Transport::Shm)
            .net_devices("lo")
            .lanes(false)
            .ucx_emulated_shm(true);
        let f = Agent::new(cfg).unwrap();
        let to = f.load_remote_metadata(&target.metadata().unwrap()).unwrap();
        (f, to)
    };
    let (fc, to_p) = forger(c.name(), &p);
    let ack = ToProducer::Ack {
        request: "req".into(),
        readers: None,
        grant: None,
    };
    fc.notify(&to_p, &ack.encode()).unwrap().wait().unwrap();
    let (fp, to_c) = forger(p.name(), &c);
    fp.notify(&to_c, b"forged").unwrap().wait().unwrap();
    consumer.start_load(&h, &[1, 2]).unwrap();
    let refused = ToConsumer::Refused {
        request: "req".into(),
        kind: None,
        why: "forged".into(),
    };
    fp.notify(&to_c, &refused.encode()).unwrap().wait().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    consumer.wait("req", Duration::from_secs(20)).unwrap();
    for d in cl.descs(&[1, 2], 0..2, 0..2).unwrap() {
        let mut b = vec![0u8; d.len as usize];
        cr.read(d.offset, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a), "the load's bytes landed");
    }
    assert!(
        c.try_notification().is_none(),
        "a forged user notification was delivered"
    );
    // The real ones arrive, over the sealed lane, with their sender.
    p.notify(c.name(), b"real").unwrap().wait().unwrap();
    let n = c.wait_notification(Duration::from_secs(5)).unwrap();
    assert_eq!((n.from.as_str(), &n.payload[..]), (p.name(), &b"real"[..]));
}

/// Before the load, a forged acknowledgement naming the only reader would free the request.
#[test]
fn a_forged_acknowledgement_frees_nothing() {
    use kvxfer::connector::{ConnectorConfig, Producer};
    use kvxfer_proto::wire::connector::ToProducer;
    use std::sync::Arc;
    let p = Arc::new(ucx_reachable("ack-p"));
    let (_r, pl) = kv_layout(&p, 0x5a);
    let producer = Producer::new(p.clone(), pl, ConnectorConfig::default(), None).unwrap();
    producer.publish("req", &[3, 4], 32, 2).unwrap();
    let f = Agent::new(
        AgentConfig::new(format!("ack-reader-{}", std::process::id()))
            .transport(Transport::Shm)
            .net_devices("lo")
            .lanes(false)
            .ucx_emulated_shm(true),
    )
    .unwrap();
    let to = f.load_remote_metadata(&p.metadata().unwrap()).unwrap();
    for _ in 0..3 {
        let ack = ToProducer::Ack {
            request: "req".into(),
            readers: Some(1),
            grant: None,
        };
        f.notify(&to, &ack.encode()).unwrap().wait().unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        producer.held(),
        1,
        "a forged acknowledgement freed the request"
    );
}

/// With a secret, a notification that follows data the shm lane or UCX moved arrives (over the
/// sealed TCP lane), after the data, with its sender; the transfer reports the lane that moved
/// the data. (UCX moves host memory here over its shared-memory transports: with a secret it
/// never takes TCP.)
#[test]
fn with_a_secret_notifications_follow_shm_and_ucx_data() {
    for (transport, lane) in [
        (Transport::Shm, kvxfer::Lane::Shm),
        (Transport::Custom("sm".into()), kvxfer::Lane::Ucx),
    ] {
        let mk = |n: &str| {
            let c = AgentConfig::new(format!("note-{n}-{lane:?}-{}", std::process::id()))
                .transport(transport.clone())
                .net_devices("lo")
                .secret(b"open sesame".to_vec())
                .peer_failure(Some(false));
            Agent::new(c).unwrap()
        };
        let (a, b) = (mk("a"), mk("b"));
        let ra = a.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        let rb = b.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        ra.write(0, &[0x11; 1 << 20]).unwrap();
        let peer = a.connect(b.listen("127.0.0.1:0").unwrap()).unwrap();
        let l = a.prep_local(&[Desc::new(ra.id(), 0, 1 << 20)]).unwrap();
        let r = a
            .prep_remote(&peer, &[Desc::new(rb.id(), 0, 1 << 20)])
            .unwrap();
        let stats = a
            .transfer_all(
                XferOp::Write,
                &l,
                &r,
                Some(b"done"),
                Some(Duration::from_secs(10)),
            )
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(stats.lane, lane, "{transport:?}");
        assert_eq!(stats.bytes, 1 << 20);
        let n = b.wait_notification(Duration::from_secs(5)).unwrap();
        assert_eq!((n.from.as_str(), &n.payload[..]), (a.name(), &b"done"[..]));
        let mut got = vec![0u8; 1 << 20];
        rb.read(0, &mut got).unwrap();
        assert!(
            got.iter().all(|&x| x == 0x11),
            "{transport:?}: the data landed first"
        );
    }
}

/// A small KV cache registered on `a` (2 layers, 2 heads of 32, 16 blocks of 16 tokens),
/// filled with `fill`: its region and layout.
/// With lane_encryption the data is compressed first, then sealed: a compressible write and
/// read move fewer bytes than they carry, and every byte arrives.
#[test]
fn sealed_data_composes_with_compression() {
    use kvxfer::Compression;
    let mk = |n: &str| {
        let c = AgentConfig::new(format!("zseal-{n}-{}", std::process::id()))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .secret(b"open sesame".to_vec())
            .lane_encryption(true)
            .compression(Compression::On);
        Agent::new(c).unwrap()
    };
    let (a, b) = (mk("a"), mk("b"));
    const LEN: usize = 4 << 20;
    let ra = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let rb = b.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| ((i / 64) % 7) as u8).collect();
    ra.write(0, &data).unwrap();
    let peer = a.connect(b.listen("127.0.0.1:0").unwrap()).unwrap();
    let l = a.prep_local(&[Desc::new(ra.id(), 0, LEN as u64)]).unwrap();
    let r = a
        .prep_remote(&peer, &[Desc::new(rb.id(), 0, LEN as u64)])
        .unwrap();
    for op in [XferOp::Write, XferOp::Read] {
        if op == XferOp::Read {
            ra.write(0, &vec![0u8; LEN]).unwrap();
        }
        let st = a
            .transfer_all(op, &l, &r, None, Some(Duration::from_secs(20)))
            .unwrap()
            .wait()
            .unwrap();
        assert!(
            st.wire_bytes < st.bytes / 2,
            "{op:?}: {} of {} bytes on the wire",
            st.wire_bytes,
            st.bytes
        );
        let mut got = vec![0u8; LEN];
        (if op == XferOp::Write { &rb } else { &ra })
            .read(0, &mut got)
            .unwrap();
        assert!(got == data, "{op:?}: the bytes arrived");
    }
}
