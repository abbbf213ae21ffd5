//! A region shared with named peers only (`Agent::register_shared`, `Share::Only`): it is
//! published with no UCX key, no shm handle and no address, moves only on the TCP lane (in-host
//! too), and the lane's target serves it only to the peers named, by the name each one's lane
//! session proved. Another authenticated peer is refused, typed, and nothing moves either way.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::time::{Duration, Instant};

use kvxfer::{
    Agent, AgentConfig, Desc, Error, HostBuffer, Lane, Region, RegionId, Share, Transport, XferOp,
    DEFAULT_COMPAT,
};
use kvxfer_proto::wire::metadata::Metadata;

#[path = "support/kv.rs"]
mod kv;

const LEN: usize = 1 << 20;

fn agent(name: &str, secret: bool) -> Agent {
    let mut c = AgentConfig::new(format!("{name}-{}", std::process::id()))
        .transport(Transport::Auto)
        .net_devices("lo");
    if secret {
        c = c.secret(b"open sesame".to_vec());
    }
    Agent::new(c).unwrap()
}

/// `a`'s `op` of the whole of `peer`'s region `id` with a buffer of its own, and that buffer.
fn go(a: &Agent, peer: &str, id: u32, op: XferOp, fill: u8) -> (kvxfer::Result<Lane>, Region) {
    let mine = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    mine.write(0, &vec![fill; LEN]).unwrap();
    let l = a
        .prep_local(&[Desc::new(mine.id(), 0, LEN as u64)])
        .unwrap();
    let t0 = Instant::now();
    let r = loop {
        match a.prep_remote(peer, &[Desc::new(RegionId(id), 0, LEN as u64)]) {
            Ok(r) => break r,
            Err(e) if t0.elapsed() > Duration::from_secs(5) => panic!("region {id}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let done = a
        .transfer_all(op, &l, &r, None, Some(Duration::from_secs(10)))
        .and_then(|t| t.wait())
        .map(|s| s.lane);
    (done, mine)
}

fn all(r: &Region, b: u8) -> bool {
    let mut got = vec![0u8; LEN];
    r.read(0, &mut got).unwrap();
    got.iter().all(|&x| x == b)
}

fn not_among(r: &kvxfer::Result<Lane>, id: u32) -> bool {
    matches!(r, Err(Error::LaneFailed { .. }))
        && r.as_ref().unwrap_err().to_string().contains(&format!(
            "is not among the peers region {id} is shared with"
        ))
}

#[test]
fn a_region_shared_with_one_peer_serves_it_alone() {
    let o = agent("share-o", true);
    let side = o.listen("127.0.0.1:0").unwrap();
    let (a, b) = (agent("share-a", true), agent("share-b", true));
    let only = o
        .register_shared(
            HostBuffer::new(LEN).unwrap(),
            Share::Only(vec![a.name().to_string()]),
        )
        .unwrap();
    only.write(0, &vec![0x5a; LEN]).unwrap();
    let plain = o.register(HostBuffer::new(LEN).unwrap()).unwrap();
    plain.write(0, &vec![0x3c; LEN]).unwrap();
    let nobody = o
        .register_shared(HostBuffer::new(LEN).unwrap(), Share::Only(Vec::new()))
        .unwrap();
    let (id, pid, nid) = (only.id().0, plain.id().0, nobody.id().0);

    // Published with no key, no handle, no address.
    let meta = Metadata::decode(&o.metadata().unwrap(), DEFAULT_COMPAT).unwrap();
    for r in meta
        .regions
        .iter()
        .filter(|r| r.id.0 == id || r.id.0 == nid)
    {
        assert!(r.rkey.is_empty() && r.shm.is_none() && r.base == 0, "{r:?}");
    }
    let p = meta.regions.iter().find(|r| r.id.0 == pid).unwrap();
    assert!(!p.rkey.is_empty() && p.base != 0);

    let pa = a.connect(side).unwrap();
    let pb = b.connect(side).unwrap();

    // The peer named reads and writes it, over the TCP lane (in-host too).
    let (got, mine) = go(&a, &pa, id, XferOp::Read, 0);
    assert_eq!(got.unwrap(), Lane::Tcp);
    assert!(all(&mine, 0x5a), "a's read landed");
    let (got, _) = go(&a, &pa, id, XferOp::Write, 0x77);
    assert_eq!(got.unwrap(), Lane::Tcp);
    assert!(all(&only, 0x77), "a's write landed");

    // Another authenticated peer: refused both ways, nothing moved.
    let (got, mine) = go(&b, &pb, id, XferOp::Read, 0);
    assert!(
        not_among(&got, id),
        "b read a region shared with a only: {got:?}"
    );
    assert!(all(&mine, 0), "bytes reached b");
    let (got, _) = go(&b, &pb, id, XferOp::Write, 0x99);
    assert!(
        not_among(&got, id),
        "b wrote a region shared with a only: {got:?}"
    );
    assert!(all(&only, 0x77), "b's bytes landed");
    // The paged form (block tables, as the connector reads): the same answers.
    let paged = |who: &Agent, peer: &str, op: XferOp| {
        let mine = who.register(HostBuffer::new(LEN).unwrap()).unwrap();
        let p = |region, blocks: &[u32]| kvxfer::paged::Paged {
            region,
            offset: 0,
            block_len: 4096,
            stride: 4096,
            blocks: std::sync::Arc::from(blocks),
        };
        let r = who
            .transfer_paged(
                op,
                peer,
                &[p(mine.id(), &[0, 1])],
                &[p(RegionId(id), &[7, 9])],
                None,
                Some(Duration::from_secs(10)),
            )
            .and_then(|t| t.wait())
            .map(|s| s.lane);
        (r, mine)
    };
    let (got, mine) = paged(&a, &pa, XferOp::Read);
    assert_eq!(got.unwrap(), Lane::Tcp);
    let mut head = vec![0u8; 8192];
    mine.read(0, &mut head).unwrap();
    assert!(head.iter().all(|&x| x == 0x77), "a's paged read landed");
    for op in [XferOp::Read, XferOp::Write] {
        let (got, mine) = paged(&b, &pb, op);
        assert!(not_among(&got, id), "b's paged {op:?}: {got:?}");
        assert!(all(&mine, 0));
    }
    assert!(all(&only, 0x77), "b's paged write landed");
    // Shared with nobody: a is refused too.
    let (got, _) = go(&a, &pa, nid, XferOp::Read, 0);
    assert!(not_among(&got, nid), "{got:?}");

    // b is not cut off: the plain region serves it (over the shm lane), and so does o.
    let (got, mine) = go(&b, &pb, pid, XferOp::Read, 0);
    assert_eq!(got.unwrap(), Lane::Shm);
    assert!(all(&mine, 0x3c));
    // The owner's own transfers out of the region go (by the TCP lane: it has no UCX key).
    let to_a = a.register(HostBuffer::new(LEN).unwrap()).unwrap();
    let peer_a = o.peer_info(a.name()).map(|i| i.name).unwrap();
    let l = o
        .prep_local(&[Desc::new(only.id(), 0, LEN as u64)])
        .unwrap();
    let t0 = Instant::now();
    let r = loop {
        match o.prep_remote(&peer_a, &[Desc::new(to_a.id(), 0, LEN as u64)]) {
            Ok(r) => break r,
            Err(e) if t0.elapsed() > Duration::from_secs(5) => panic!("{e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    let st = o
        .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(st.lane, Lane::Tcp);
    assert!(all(&to_a, 0x77));

    // Deregistered, its share set goes with it.
    o.deregister(&only).unwrap();
    let (got, _) = go(&a, &pa, id, XferOp::Read, 0);
    assert!(got.is_err());
}

#[test]
fn naming_peers_needs_a_secret_and_the_lanes() {
    let open = agent("share-open", false);
    let e = open
        .register_shared(
            HostBuffer::new(4096).unwrap(),
            Share::Only(vec!["x".into()]),
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_)) && e.to_string().contains("needs a secret"),
        "{e}"
    );
    // Nobody at all needs no proof of names.
    open.register_shared(HostBuffer::new(4096).unwrap(), Share::Only(Vec::new()))
        .unwrap();
    let no_lanes = Agent::new(
        AgentConfig::new(format!("share-nl-{}", std::process::id()))
            .transport(Transport::Shm)
            .lanes(false)
            .ucx_emulated_shm(true)
            .secret(b"open sesame".to_vec()),
    )
    .unwrap();
    let e = no_lanes
        .register_shared(
            HostBuffer::new(4096).unwrap(),
            Share::Only(vec!["x".into()]),
        )
        .unwrap_err();
    assert!(e.to_string().contains("lanes are off"), "{e}");
}

/// A connector cache registered shared with no peer (`Share::Only(vec![])`) opens only
/// through grants, on every path: a handoff loads (over the TCP lane), while another
/// authenticated peer's read of a block nobody granted it is refused. With the cache registered
/// as usual, that same read succeeds over the shm lane: the hole this closes.
#[test]
fn a_cache_shared_with_no_peer_opens_only_through_grants() {
    use kvxfer::connector::{ConnectorConfig, Consumer, Producer};
    use std::sync::Arc;
    let cache = |a: &Agent, fill: u8, lane_only: bool| {
        let with = if lane_only {
            Share::Only(Vec::new())
        } else {
            Share::AllPeers
        };
        kv::kv_layout_shared(a, fill, with)
    };
    for lane_only in [true, false] {
        let tag = if lane_only { "lo" } else { "open" };
        let p = Arc::new(agent(&format!("share-p-{tag}"), true));
        let (pr, pl) = cache(&p, 0x5a, lane_only);
        let side = p.listen("127.0.0.1:0").unwrap();
        let c = Arc::new(agent(&format!("share-c-{tag}"), true));
        let (cr, cl) = cache(&c, 0, lane_only);
        let producer = Producer::new(
            p.clone(),
            pl.clone(),
            ConnectorConfig::default(),
            Some(side),
        )
        .unwrap();
        let consumer = Consumer::new(c.clone(), cl.clone(), ConnectorConfig::default()).unwrap();
        let h = producer.publish("req", &[3, 4], 32, 2).unwrap();
        consumer.start_load(&h, &[1, 2]).unwrap();
        consumer.wait("req", Duration::from_secs(20)).unwrap();
        for d in cl.descs(&[1, 2], 0..2, 0..2).unwrap() {
            let mut b = vec![0u8; d.len as usize];
            cr.read(d.offset, &mut b).unwrap();
            assert!(
                b.iter().all(|&x| x == 0x5a),
                "{tag}: the load's bytes landed"
            );
        }
        // Another agent with the secret reads block 5 of the producer's cache, which nobody
        // granted it.
        let rogue = agent(&format!("share-r-{tag}"), true);
        let to_p = rogue.connect(side).unwrap();
        let d = pl.descs(&[5], 0..1, 0..1).unwrap()[0];
        let mine = rogue
            .register(HostBuffer::new(d.len as usize).unwrap())
            .unwrap();
        let l = rogue.prep_local(&[Desc::new(mine.id(), 0, d.len)]).unwrap();
        let r = rogue
            .prep_remote(&to_p, &[Desc::new(pr.id(), d.offset, d.len)])
            .unwrap();
        let got = rogue
            .transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(10)))
            .and_then(|t| t.wait())
            .map(|s| s.lane);
        let mut b = vec![0u8; d.len as usize];
        mine.read(0, &mut b).unwrap();
        if lane_only {
            assert!(
                matches!(&got, Err(Error::LaneFailed { why, .. }) if why.contains("holds no grant")),
                "{tag}: {got:?}"
            );
            assert!(b.iter().all(|&x| x == 0), "{tag}: bytes reached the rogue");
        } else {
            // What a cache registered as usual allows a same-host peer with the secret.
            assert_eq!(got.unwrap(), Lane::Shm, "{tag}");
            assert!(b.iter().all(|&x| x == 0x5a));
        }
        drop(consumer);
        drop(producer);
    }
}
