//! Agent incarnations (issue 17, epochs without a registry): every agent draws a random epoch
//! that its metadata carries. A second live agent that offers a name already loaded is refused
//! (typed, on both sides), and the first keeps being the one transfers reach; a restarted agent
//! (the one before it gone) replaces it, transfers prepared for the old one fail as stale, and
//! nothing of the old one is used again.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Transport, XferOp};

const LEN: usize = 64 << 10;

fn agent(name: &str) -> Agent {
    Agent::new(
        AgentConfig::new(name)
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap()
}

/// A "prefill" agent whose one region is filled with `fill`.
fn prefill(name: &str, fill: u8) -> (Agent, kvxfer::Region) {
    let a = agent(name);
    let r = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    r.write(0, &vec![fill; LEN]).unwrap();
    (a, r)
}

/// What `d` reads from the peer `name`'s region 0.
fn read_from(d: &Agent, local: &kvxfer::Region, name: &str) -> kvxfer::Result<Vec<u8>> {
    let l = d.prep_local(&[Desc::new(local.id(), 0, LEN as u64)])?;
    let r = d.prep_remote(name, &[Desc::new(kvxfer::RegionId(0), 0, LEN as u64)])?;
    d.transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(10)))?
        .wait()?;
    let mut out = vec![0u8; LEN];
    local.read(0, &mut out)?;
    Ok(out)
}

#[test]
fn a_second_live_agent_with_a_taken_name_is_refused_and_a_restart_is_not() {
    let name = format!("ep-prefill-{}", std::process::id());
    let d = agent(&format!("ep-decode-{}", std::process::id()));
    let dl = d.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let side = d.listen("127.0.0.1:0").unwrap();

    let (p1, _r1) = prefill(&name, 0x11);
    assert_eq!(p1.connect(side).unwrap(), d.name());
    assert!(read_from(&d, &dl, &name)
        .unwrap()
        .iter()
        .all(|&b| b == 0x11));

    // Two ranks given one name: the second is refused on both sides, typed, naming the name.
    let (p2, _r2) = prefill(&name, 0x22);
    let e = p2.connect(side).unwrap_err();
    assert!(
        matches!(&e, Error::NameConflict { name: n, .. } if *n == name),
        "{e}"
    );
    println!("the second agent is told: {e}");
    let e = d.load_remote_metadata(&p2.metadata().unwrap()).unwrap_err();
    assert!(matches!(e, Error::NameConflict { .. }), "{e}");
    println!("the listener says: {e}");
    // And the first one is still the one a READ reaches.
    assert!(read_from(&d, &dl, &name)
        .unwrap()
        .iter()
        .all(|&b| b == 0x11));
    drop(p2);

    // A transfer prepared for the first incarnation, kept across its restart.
    let l = d.prep_local(&[Desc::new(dl.id(), 0, LEN as u64)]).unwrap();
    let stale = d
        .prep_remote(&name, &[Desc::new(kvxfer::RegionId(0), 0, LEN as u64)])
        .unwrap();

    // The first one goes away and comes back under the same name: accepted, new epoch.
    drop(p1);
    let (p3, _r3) = prefill(&name, 0x33);
    assert_eq!(p3.connect(side).unwrap(), d.name());
    assert!(read_from(&d, &dl, &name)
        .unwrap()
        .iter()
        .all(|&b| b == 0x33));
    let e = d
        .transfer_all(XferOp::Read, &l, &stale, None, Some(Duration::from_secs(5)))
        .and_then(|t| t.wait())
        .unwrap_err();
    assert!(matches!(e, Error::StalePeer { .. }), "{e}");
    println!("a transfer prepared for the old incarnation: {e}");
}

/// The server-less discovery: an agent published at its side channel is resolved by name; a
/// name whose address is another agent's is refused, and an unknown name is `UnknownPeer`.
#[test]
fn side_channel_discovery_resolves_names_it_was_given() {
    use kvxfer::registry::{Discovery, SideChannelDiscovery};
    use std::sync::Arc;
    let pid = std::process::id();
    let (p, _r) = prefill(&format!("sc-prefill-{pid}"), 0x44);
    let p = Arc::new(p);
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = probe.local_addr().unwrap();
    drop(probe);
    SideChannelDiscovery::new(addr).publish(&p).unwrap();
    let d = agent(&format!("sc-decode-{pid}"));
    let dl = d.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let disc = SideChannelDiscovery::new("127.0.0.1:0".parse().unwrap())
        .with_peer(p.name(), addr)
        .with_peer("someone-else", addr);
    disc.resolve(&d, p.name()).unwrap();
    assert!(read_from(&d, &dl, p.name())
        .unwrap()
        .iter()
        .all(|&b| b == 0x44));
    let e = disc.resolve(&d, "someone-else").unwrap_err();
    assert!(e.to_string().contains("not \"someone-else\""), "{e}");
    let e = disc.resolve(&d, "nobody").unwrap_err();
    assert!(matches!(e, Error::UnknownPeer { .. }), "{e}");
}

/// Metadata is a claim: an impostor that copies the loaded agent's epoch (every HELLO answer
/// shows it) or names no epoch is refused as a conflict, and the real agent stays the one a
/// READ reaches.
#[test]
fn an_impostor_with_the_real_epoch_or_epoch_zero_is_refused() {
    use kvxfer_proto::wire::metadata::{Metadata, DEFAULT_COMPAT};
    let name = format!("imp-prefill-{}", std::process::id());
    let d = agent(&format!("imp-decode-{}", std::process::id()));
    let dl = d.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let side = d.listen("127.0.0.1:0").unwrap();
    let (real, _r) = prefill(&name, 0x11);
    real.connect(side).unwrap();
    // The same incarnation's metadata again (a second handshake) is fine.
    d.load_remote_metadata(&real.metadata().unwrap()).unwrap();

    let (impostor, _ri) = prefill(&name, 0x66);
    let own = Metadata::decode(&impostor.metadata().unwrap(), DEFAULT_COMPAT).unwrap();
    let copied = Metadata::decode(&real.metadata().unwrap(), DEFAULT_COMPAT).unwrap();
    // Its own metadata with the real epoch; the same with the real lane address and process
    // copied too (only its UCX worker, where traffic would go, is its own); epoch 0.
    let mut look_alike = own.clone();
    (look_alike.lanes, look_alike.host) = (copied.lanes.clone(), copied.host);
    for (what, base, epoch) in [
        ("the real epoch", &own, real.epoch()),
        (
            "the real epoch, lane and process",
            &look_alike,
            real.epoch(),
        ),
        ("epoch 0", &own, 0),
    ] {
        let mut forged = base.clone();
        forged.epoch = epoch;
        let e = d.load_remote_metadata(&forged.encode()).unwrap_err();
        assert!(
            matches!(&e, Error::NameConflict { name: n, .. } if *n == name),
            "{what}: {e}"
        );
        println!("an impostor with {what}: {e}");
        assert_eq!(d.peer_epoch(&name), Some(real.epoch()), "{what}");
        assert!(
            read_from(&d, &dl, &name)
                .unwrap()
                .iter()
                .all(|&b| b == 0x11),
            "{what}: the impostor's bytes were read"
        );
    }
}

/// Without a secret, an old incarnation counts as alive only if its lane welcomes a hello with
/// the credential its metadata carries: another socket listening where its lane listened (a
/// port reused by the next process, here a bare listener) does not hold the name, so the
/// restart is accepted. (With the check back to "a connection is accepted", the restart was
/// refused: `NameConflict`, "still answers at".)
#[test]
fn a_reused_lane_port_does_not_keep_a_dead_incarnation_alive() {
    use kvxfer_proto::wire::metadata::Metadata;
    let name = format!("ep-reuse-{}", std::process::id());
    let d = agent(&format!("ep-reuse-d-{}", std::process::id()));
    let dl = d.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let side = d.listen("127.0.0.1:0").unwrap();
    let (p1, _r1) = prefill(&name, 0x11);
    let old = Metadata::decode(&p1.metadata().unwrap(), kvxfer::DEFAULT_COMPAT)
        .unwrap()
        .tcp_lane()
        .unwrap()
        .addr;
    assert_eq!(p1.connect(side).unwrap(), d.name());
    drop(p1);
    // Something else takes the old lane's port and accepts connections (into its backlog).
    let squat = std::net::TcpListener::bind(old).unwrap();
    let (p3, _r3) = prefill(&name, 0x33);
    assert_eq!(p3.connect(side).unwrap(), d.name());
    assert!(read_from(&d, &dl, &name)
        .unwrap()
        .iter()
        .all(|&b| b == 0x33));
    drop(squat);
}
