//! The device lane, with [`SimulatedDevice`] standing in for a GPU (its allocations are sealed
//! memory files, exported and opened as CUDA virtual-memory allocations are): a same-host
//! peer's device memory opened once through the lane's hand-over socket, a scattered paged
//! request moved in one submission, bytes intact both ways, the notification after the data,
//! and everything the lane must refuse.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvxfer::staging::{SimulatedDevice, StagingShape};
use kvxfer::{
    Agent, AgentConfig, Desc, DeviceAlloc, Error, GpuPath, HostBuffer, Lane, MemKind, Region,
    Share, Transport, XferOp,
};
use rand::{RngCore, SeedableRng};

static SEQ: AtomicU64 = AtomicU64::new(0);

fn name(p: &str) -> String {
    format!(
        "{p}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

fn cfg(p: &str, dev: &SimulatedDevice) -> AgentConfig {
    AgentConfig::new(name(p))
        .transport(Transport::Shm)
        .lane_addr(std::net::Ipv4Addr::LOCALHOST.into())
        .copy_engine(dev.engine())
        .staging(StagingShape::new(4, 64 << 10).unwrap())
}

/// Blocks of 32 KiB (a Qwen3-0.6B block), scattered: slot `i` of the request at `perm[i]`.
const BS: u64 = 32 << 10;
const NB: u64 = 64;

fn perm(seed: u64) -> Vec<u64> {
    let mut p: Vec<u64> = (0..NB).collect();
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    for i in (1..p.len()).rev() {
        let j = (r.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

fn descs(r: &Region, slots: &[u64]) -> Vec<Desc> {
    slots
        .iter()
        .map(|&s| Desc::new(r.id(), s * BS, BS))
        .collect()
}

fn random(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// `len` bytes of simulated device memory registered as CUDA device 0.
fn device_region(a: &Agent, dev: &SimulatedDevice, len: usize) -> (Region, u64) {
    let addr = dev.alloc(len).unwrap();
    // SAFETY: the simulated allocation lives as long as `dev`, which every test keeps alive
    // past the agents; nothing else frees it.
    let r = unsafe { a.register_raw(addr as *mut u8, len, MemKind::Cuda(0)) }.unwrap();
    (r, addr)
}

struct Pair {
    a: Agent,
    da: SimulatedDevice,
    b: Agent,
    db: SimulatedDevice,
}

fn pair(b_cfg: impl FnOnce(AgentConfig) -> AgentConfig) -> Pair {
    let (da, db) = (SimulatedDevice::new(), SimulatedDevice::new());
    let a = Agent::new(cfg("dl-a", &da)).unwrap();
    let b = Agent::new(b_cfg(cfg("dl-b", &db))).unwrap();
    Pair { a, da, b, db }
}

fn connect(a: &Agent, b: &Agent) -> String {
    let addr = b.listen("127.0.0.1:0").unwrap();
    a.connect(addr).unwrap()
}

#[test]
fn a_scattered_request_moves_in_one_submission_both_ways() {
    let p = pair(|c| c);
    let len = (NB * BS) as usize;
    let (ra, xa) = device_region(&p.a, &p.da, len);
    let (rb, xb) = device_region(&p.b, &p.db, len);
    let peer = connect(&p.a, &p.b);
    assert_eq!(
        p.a.peer_info(&peer).unwrap().lanes,
        vec![Lane::Device, Lane::Tcp],
        "the lanes towards a same-host peer with device memory only, in the order they are \
         tried (the shm lane opens where the peer has host memory to map)"
    );
    assert_eq!(ra.device_alloc(), Some(DeviceAlloc::Plain));
    let data = random(1, len);
    p.da.write(xa, &data).unwrap();
    let (src, dst) = (perm(2), perm(3));
    let l = p.a.prep_local(&descs(&ra, &src)).unwrap();
    let r = p.a.prep_remote(&peer, &descs(&rb, &dst)).unwrap();

    // WRITE with a notification: one submission on the initiator's device, none on the
    // target's, and the notification finds the bytes in place.
    let (sa, sb) = (p.da.submissions(), p.db.submissions());
    let s =
        p.a.transfer_all(XferOp::Write, &l, &r, Some(b"landed"), None)
            .unwrap()
            .wait()
            .unwrap();
    assert_eq!(s.lane, Lane::Device, "{s:?}");
    assert_eq!(s.bytes, NB * BS);
    assert_eq!(p.da.submissions() - sa, 1, "one submission for {NB} blocks");
    assert_eq!(
        p.db.submissions() - sb,
        0,
        "the target's device is not asked"
    );
    let n = p.b.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(n.payload, b"landed");
    let mut got = vec![0u8; len];
    p.db.read(xb, &mut got).unwrap();
    for (i, (&s, &d)) in src.iter().zip(&dst).enumerate() {
        let (s, d) = ((s * BS) as usize, (d * BS) as usize);
        assert!(
            got[d..d + BS as usize] == data[s..s + BS as usize],
            "block {i} differs"
        );
    }

    // READ it back into a cleared region, at the source slots.
    p.da.write(xa, &vec![0u8; len]).unwrap();
    let s =
        p.a.transfer_all(XferOp::Read, &l, &r, None, None)
            .unwrap()
            .wait()
            .unwrap();
    assert_eq!(s.lane, Lane::Device);
    let mut back = vec![0u8; len];
    p.da.read(xa, &mut back).unwrap();
    assert!(back == data, "READ back differs");
    // The peer's allocation was opened once, and stays open for the next transfer.
    assert_eq!(p.da.allocations(), 2, "own and the peer's, opened once");
}

#[test]
fn host_memory_on_either_side_is_not_the_device_lanes() {
    let p = pair(|c| c);
    let len = (NB * BS) as usize;
    let (ra, xa) = device_region(&p.a, &p.da, len);
    let hb = p.b.register(HostBuffer::new(len).unwrap()).unwrap();
    let peer = connect(&p.a, &p.b);
    let data = random(4, len);
    p.da.write(xa, &data).unwrap();
    let slots: Vec<u64> = (0..NB).collect();
    let l = p.a.prep_local(&descs(&ra, &slots)).unwrap();
    let r = p.a.prep_remote(&peer, &descs(&hb, &slots)).unwrap();
    let s =
        p.a.transfer_all(XferOp::Write, &l, &r, None, None)
            .unwrap()
            .wait()
            .unwrap();
    assert_eq!(s.lane, Lane::Tcp, "device to host goes staged: {s:?}");
    let mut h = vec![0u8; len];
    hb.read(0, &mut h).unwrap();
    assert!(h == data);
}

#[test]
fn with_the_lane_off_device_memory_goes_staged() {
    let (da, db) = (SimulatedDevice::new(), SimulatedDevice::new());
    let a = Agent::new(cfg("dl-off-a", &da).device_lane(false)).unwrap();
    let b = Agent::new(cfg("dl-off-b", &db)).unwrap();
    let len = (NB * BS) as usize;
    let (ra, _) = device_region(&a, &da, len);
    let (rb, _) = device_region(&b, &db, len);
    let peer = connect(&a, &b);
    let slots: Vec<u64> = (0..NB).collect();
    let l = a.prep_local(&descs(&ra, &slots)).unwrap();
    let r = a.prep_remote(&peer, &descs(&rb, &slots)).unwrap();
    let s = a
        .transfer_all(XferOp::Write, &l, &r, None, None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(s.lane, Lane::Tcp);
}

/// A peer the owner cannot tell: loaded by hand (no side channel kept), and the owner's
/// device memory staged (not mapped by UCX, so the UCX fence does not reach it). The lane
/// itself reads the owner's registration page and refuses a region its owner gave up, typed,
/// before any byte moves; a fresh registration moves again. (With the memory mapped by UCX,
/// the peer announced itself to the owner's UCX engine when it loaded the metadata, and is
/// told of the deregistration, unless its announcement arrives after it: which refusal comes
/// first then depends on that race.)
#[test]
fn a_region_its_owner_deregistered_is_refused() {
    let p = pair(|c| c.gpu_path(GpuPath::Staged));
    let len = (NB * BS) as usize;
    let (ra, xa) = device_region(&p.a, &p.da, len);
    let (rb, xb) = device_region(&p.b, &p.db, len);
    let peer = p.a.load_remote_metadata(&p.b.metadata().unwrap()).unwrap();
    let slots: Vec<u64> = (0..NB).collect();
    let l = p.a.prep_local(&descs(&ra, &slots)).unwrap();
    let r = p.a.prep_remote(&peer, &descs(&rb, &slots)).unwrap();
    let s =
        p.a.transfer_all(XferOp::Write, &l, &r, None, None)
            .unwrap()
            .wait()
            .unwrap();
    assert_eq!(s.lane, Lane::Device);
    p.b.deregister(&rb).unwrap();
    p.db.write(xb, &vec![7u8; len]).unwrap();
    p.da.write(xa, &vec![1u8; len]).unwrap();
    for op in [XferOp::Write, XferOp::Read] {
        let e =
            p.a.transfer_all(op, &l, &r, None, None)
                .and_then(|t| t.wait())
                .unwrap_err();
        assert!(
            matches!(e, Error::LaneFailed { lane: "device", ref why, .. } if why.contains("deregistered")),
            "{op:?}: {e}"
        );
    }
    let (mut got_b, mut got_a) = (vec![0u8; len], vec![0u8; len]);
    p.db.read(xb, &mut got_b).unwrap();
    p.da.read(xa, &mut got_a).unwrap();
    assert!(
        got_b.iter().all(|&x| x == 7),
        "a byte was written after deregistration"
    );
    assert!(
        got_a.iter().all(|&x| x == 1),
        "a byte was read after deregistration"
    );
}

/// The peer in its own process (run by the test below; ignored otherwise): a simulated
/// device region of `BIG` bytes, a listener whose address it prints, then it waits to be
/// killed.
#[test]
#[ignore = "a peer's own process, started by the tests here"]
fn device_owner_child() {
    if std::env::var("KVX_DEVICE_OWNER").is_err() {
        return;
    }
    let db = SimulatedDevice::new();
    let b = Agent::new(cfg("dl-owner", &db)).unwrap();
    let (_rb, _) = device_region(&b, &db, BIG);
    println!("SIDE {}", b.listen("127.0.0.1:0").unwrap());
    std::thread::sleep(Duration::from_secs(120));
}

const BIG: usize = 1 << 30;

/// A peer process SIGKILLed while the device lane copies 1 GiB into its memory: the
/// transfer (no notification: nothing else would notice) ends typed (the peer's process
/// exited, before or during), within seconds, never reported as delivered; the agent then serves a live peer as before. The copy lands in the
/// dead peer's memory file, which this process's mapping keeps valid (no fault, no write
/// into anything else).
#[test]
fn a_peer_killed_mid_copy_fails_the_transfer_typed() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "device_owner_child", "--ignored", "--nocapture"])
        .env("KVX_DEVICE_OWNER", "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut from = std::io::BufReader::new(child.stdout.take().unwrap());
    let side: std::net::SocketAddr = loop {
        let mut l = String::new();
        assert!(from.read_line(&mut l).unwrap() > 0, "the peer said nothing");
        if let Some(i) = l.find("SIDE ") {
            break l[i + 5..].trim().parse().unwrap();
        }
    };
    let da = SimulatedDevice::new();
    let a = Agent::new(cfg("dl-killer", &da)).unwrap();
    let (ra, _) = device_region(&a, &da, BIG);
    let peer = a.connect(side).unwrap();
    let whole = |r: kvxfer::RegionId| [Desc::new(r, 0, BIG as u64)];
    let l = a.prep_local(&whole(ra.id())).unwrap();
    // The peer's region is its first (id 0).
    let r = a.prep_remote(&peer, &whole(kvxfer::RegionId(0))).unwrap();
    // A first WRITE opens the peer's allocation and shows the lane carries it.
    let s = a
        .transfer_all(XferOp::Write, &l, &r, None, None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(s.lane, Lane::Device);
    let first_ms = s.duration.as_millis();
    // Again, pages in place: the time the copy takes, to aim the kill into it.
    let s = a
        .transfer_all(XferOp::Write, &l, &r, None, None)
        .unwrap()
        .wait()
        .unwrap();
    let copy_ms = s.duration.as_millis() as u64;
    let t0 = std::time::Instant::now();
    let killed = std::thread::scope(|sc| {
        let t = sc.spawn(|| {
            a.transfer_all(XferOp::Write, &l, &r, None, None)
                .and_then(|t| t.wait())
        });
        // A tenth of the way into the copy.
        std::thread::sleep(Duration::from_millis((copy_ms / 10).max(1)));
        child.kill().unwrap();
        t.join().unwrap()
    });
    let _ = child.wait();
    eprintln!(
        "copies of 1 GiB: {first_ms} ms, then {copy_ms} ms; after the kill: {killed:?} in {:?}",
        t0.elapsed()
    );
    match killed {
        Err(Error::LaneFailed {
            lane: "device",
            ref why,
            ..
        }) if why.contains("exited") => {}
        other => panic!("a WRITE into a killed peer: {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // The same agent goes on serving a live peer.
    let db2 = SimulatedDevice::new();
    let b2 = Agent::new(cfg("dl-live", &db2)).unwrap();
    let len = (NB * BS) as usize;
    let (ra2, _) = device_region(&a, &da, len);
    let (rb2, _) = device_region(&b2, &db2, len);
    let peer2 = connect(&a, &b2);
    let slots: Vec<u64> = (0..NB).collect();
    let l2 = a.prep_local(&descs(&ra2, &slots)).unwrap();
    let r2 = a.prep_remote(&peer2, &descs(&rb2, &slots)).unwrap();
    let s = a
        .transfer_all(XferOp::Write, &l2, &r2, None, None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(s.lane, Lane::Device);
}

/// Memory kinds told apart at registration: a virtual-memory allocation moves on the device
/// lane; pool memory, which no other process can open, is not exported and moves staged over
/// the TCP lane, its kind visible on the region and its lane in the transfer's figures.
#[test]
fn each_allocation_kind_takes_the_path_that_reaches_it() {
    let p = pair(|c| c);
    let len = (NB * BS) as usize;
    let (ra, xa) = device_region(&p.a, &p.da, len);
    let reg = |dev: &SimulatedDevice, kind| {
        let addr = dev.alloc_as(len, kind).unwrap();
        // SAFETY: the simulated allocation lives as long as `dev`, past the agents.
        let r = unsafe { p.b.register_raw(addr as *mut u8, len, MemKind::Cuda(0)) }.unwrap();
        (r, addr)
    };
    let (rv, xv) = reg(&p.db, DeviceAlloc::Virtual);
    let (rp, xp) = reg(&p.db, DeviceAlloc::Pool);
    assert_eq!(rv.device_alloc(), Some(DeviceAlloc::Virtual));
    assert_eq!(rp.device_alloc(), Some(DeviceAlloc::Pool));
    let peer = connect(&p.a, &p.b);
    let data = random(9, len);
    p.da.write(xa, &data).unwrap();
    let slots = perm(10);
    let l = p.a.prep_local(&descs(&ra, &slots)).unwrap();
    for (r, x, lane) in [(&rv, xv, Lane::Device), (&rp, xp, Lane::Tcp)] {
        let rd = p.a.prep_remote(&peer, &descs(r, &slots)).unwrap();
        let s =
            p.a.transfer_all(XferOp::Write, &l, &rd, None, None)
                .unwrap()
                .wait()
                .unwrap();
        assert_eq!(s.lane, lane, "{:?}", r.device_alloc());
        let mut got = vec![0u8; len];
        p.db.read(x, &mut got).unwrap();
        assert!(got == data, "{:?}: bytes differ", r.device_alloc());
    }
}

/// The lane's working set (the copy list and its table, 48 bytes a block) is charged to the
/// memory budget: with no room left after the staging pools, a transfer waits the lane's
/// stall limit and fails typed rather than allocate past the budget.
#[test]
fn the_lanes_copy_tables_are_charged_to_the_budget() {
    // Staging: 4 chunks of 64 KiB, charged at the first device registration.
    let staging = 4 * (64 << 10);
    let (da, db) = (SimulatedDevice::new(), SimulatedDevice::new());
    let tight = cfg("dl-budget-a", &da)
        .budget(kvxfer::MemoryBudget::new(staging + 1024))
        .lane_stall(Duration::from_millis(200));
    let a = Agent::new(tight).unwrap();
    let b = Agent::new(cfg("dl-budget-b", &db)).unwrap();
    let len = (NB * BS) as usize;
    let (ra, _) = device_region(&a, &da, len);
    let (rb, _) = device_region(&b, &db, len);
    let peer = connect(&a, &b);
    let slots = perm(11);
    let l = a.prep_local(&descs(&ra, &slots)).unwrap();
    let r = a.prep_remote(&peer, &descs(&rb, &slots)).unwrap();
    let e = a
        .transfer_all(XferOp::Write, &l, &r, None, None)
        .and_then(|t| t.wait())
        .unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert!(e.to_string().contains("device lane"), "{e}");
    assert_eq!(a.budget().used(), staging, "the charge is released");
}

/// Three agents with a secret, each with its own simulated device, all connected to the first.
fn trio() -> (Vec<std::sync::Arc<Agent>>, Vec<SimulatedDevice>) {
    let devs: Vec<SimulatedDevice> = (0..3).map(|_| SimulatedDevice::new()).collect();
    let agents = ["dl-own", "dl-named", "dl-other"]
        .iter()
        .zip(&devs)
        .map(|(p, d)| {
            std::sync::Arc::new(Agent::new(cfg(p, d).secret(b"open sesame".to_vec())).unwrap())
        })
        .collect();
    (agents, devs)
}

/// `a`'s `op` of `peer`'s region `rid` at `slots` with its device region `mine` at the same
/// slots: the lane it took.
fn move_blocks(
    a: &Agent,
    peer: &str,
    mine: &Region,
    rid: kvxfer::RegionId,
    op: XferOp,
) -> kvxfer::Result<Lane> {
    let slots: Vec<u64> = (0..NB).collect();
    let l = a.prep_local(&descs(mine, &slots)).unwrap();
    let r = a
        .prep_remote(
            peer,
            &slots
                .iter()
                .map(|&s| Desc::new(rid, s * BS, BS))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    a.transfer_all(op, &l, &r, None, Some(Duration::from_secs(10)))
        .and_then(|t| t.wait())
        .map(|s| s.lane)
}

#[test]
fn device_memory_shared_with_one_peer_opens_to_it_alone() {
    let (ag, dev) = trio();
    let len = (NB * BS) as usize;
    let addr = dev[0].alloc(len).unwrap();
    // SAFETY: the simulated allocation lives as long as `dev`, which outlives the agents.
    let only = unsafe {
        ag[0].register_raw_shared(
            addr as *mut u8,
            len,
            MemKind::Cuda(0),
            Share::Only(vec![ag[1].name().to_string()]),
        )
    }
    .unwrap();
    let (open, open_at) = device_region(&ag[0], &dev[0], len);
    let data = random(21, len);
    dev[0].write(addr, &data).unwrap();
    dev[0].write(open_at, &data).unwrap();
    let peers: Vec<String> = ag[1..].iter().map(|x| connect(x, &ag[0])).collect();
    let mine: Vec<(Region, u64)> = (1..3)
        .map(|i| device_region(&ag[i], &dev[i], len))
        .collect();

    // The named peer reads it, over the TCP lane (staged at both ends): the only path whose
    // target sees the request.
    let got = move_blocks(&ag[1], &peers[0], &mine[0].0, only.id(), XferOp::Read);
    assert_eq!(got.unwrap(), Lane::Tcp);
    let mut b = vec![0u8; len];
    dev[1].read(mine[0].1, &mut b).unwrap();
    assert!(b == data, "the named peer's read differs");

    // Another peer with the secret, on the same host with a device lane open to the owner:
    // refused both ways, nothing moved.
    let got = move_blocks(&ag[2], &peers[1], &mine[1].0, only.id(), XferOp::Read);
    assert!(
        matches!(&got, Err(Error::LaneFailed { why, .. })
            if why.contains(&format!("is not among the peers region {} is shared with", only.id().0))),
        "{got:?}"
    );
    let mut c = vec![0u8; len];
    dev[2].read(mine[1].1, &mut c).unwrap();
    assert!(c.iter().all(|&x| x == 0), "bytes reached the other peer");
    dev[2].write(mine[1].1, &vec![0xee; len]).unwrap();
    let got = move_blocks(&ag[2], &peers[1], &mine[1].0, only.id(), XferOp::Write);
    assert!(matches!(got, Err(Error::LaneFailed { .. })), "{got:?}");
    dev[0].read(addr, &mut c).unwrap();
    assert!(c == data, "the other peer's write landed");

    // What a region registered for all peers allows the same peer: its device lane.
    let got = move_blocks(&ag[2], &peers[1], &mine[1].0, open.id(), XferOp::Read);
    assert_eq!(got.unwrap(), Lane::Device);
    dev[2].read(mine[1].1, &mut c).unwrap();
    assert!(c == data);
}

#[test]
fn a_device_cache_shared_with_no_peer_opens_only_through_grants() {
    use kvxfer::connector::{ConnectorConfig, Consumer, Producer};
    use kvxfer::layout::{KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking};
    let (ag, dev) = trio();
    let g = KvGeometry {
        name: "sec".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 32,
        dtype: KvDtype::Bf16,
    };
    let layout = |r: kvxfer::RegionId| {
        KvLayout::contiguous(g.clone(), 16, 16, KvPacking::Separate, KvOrder::Nhd, r)
    };
    let len = layout(kvxfer::RegionId(0)).region_bytes() as usize;
    let cache = |i: usize, fill: u8| {
        let at = dev[i].alloc(len).unwrap();
        dev[i].write(at, &vec![fill; len]).unwrap();
        // SAFETY: the simulated allocation lives as long as `dev`, which outlives the agents.
        let r = unsafe {
            ag[i].register_raw_shared(at as *mut u8, len, MemKind::Cuda(0), Share::Only(vec![]))
        }
        .unwrap();
        (r.id(), at, layout(r.id()))
    };
    let (pid, _, pl) = cache(0, 0x5a);
    let (_, cat, cl) = cache(1, 0);
    let side = ag[0].listen("127.0.0.1:0").unwrap();
    let producer = Producer::new(
        ag[0].clone(),
        pl.clone(),
        ConnectorConfig::default(),
        Some(side),
    )
    .unwrap();
    let consumer = Consumer::new(ag[1].clone(), cl.clone(), ConnectorConfig::default()).unwrap();
    let h = producer.publish("req", &[3, 4], 32, 2).unwrap();
    consumer.start_load(&h, &[1, 2]).unwrap();
    consumer.wait("req", Duration::from_secs(20)).unwrap();
    for d in cl.descs(&[1, 2], 0..2, 0..2).unwrap() {
        let mut b = vec![0u8; d.len as usize];
        dev[1].read(cat + d.offset, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0x5a), "the load's bytes landed");
    }
    // A third agent with the secret reads block 5 of the producer's cache, which nobody
    // granted it.
    let to_p = ag[2].connect(side).unwrap();
    let d = pl.descs(&[5], 0..1, 0..1).unwrap()[0];
    let (mine, at) = device_region(&ag[2], &dev[2], d.len as usize);
    let l = ag[2].prep_local(&[Desc::new(mine.id(), 0, d.len)]).unwrap();
    let r = ag[2]
        .prep_remote(&to_p, &[Desc::new(pid, d.offset, d.len)])
        .unwrap();
    let got = ag[2]
        .transfer_all(XferOp::Read, &l, &r, None, Some(Duration::from_secs(10)))
        .and_then(|t| t.wait())
        .map(|s| s.lane);
    assert!(
        matches!(&got, Err(Error::LaneFailed { why, .. }) if why.contains("holds no grant")),
        "{got:?}"
    );
    let mut b = vec![0u8; d.len as usize];
    dev[2].read(at, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "bytes reached the rogue");
    drop(consumer);
    drop(producer);
}

#[path = "support/fds.rs"]
mod fds;

/// A hostile hand-over: a socket of this process (the pid the owner's metadata names) that
/// relays the owner's real answer to one asker with each device entry passed through `edit`,
/// and, with `swap`, each entry's descriptor replaced by that file.
fn relay(
    real: kvxfer_proto::wire::lane_entries::ShmLaneInfo,
    edit: fn(&mut kvxfer_proto::wire::shm_fds::DeviceEntry),
    swap: Option<std::fs::File>,
) -> (
    kvxfer_proto::wire::lane_entries::ShmLaneInfo,
    std::thread::JoinHandle<()>,
) {
    use kvxfer_proto::wire::shm_fds::{FdAsk, FdFrame};
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
    let mut info = real;
    info.socket = *b"kvx-test-devrel\0";
    info.token = [9; 32];
    let at = |i: &kvxfer_proto::wire::lane_entries::ShmLaneInfo| {
        SocketAddr::from_abstract_name(i.socket_name().as_bytes()).unwrap()
    };
    let l = UnixListener::bind_addr(&at(&info)).unwrap();
    let t = std::thread::spawn(move || {
        let (asker, _) = l.accept().unwrap();
        let mut ask = [0u8; kvxfer_proto::wire::shm_fds::ASK_LEN];
        (&asker).read_exact(&mut ask).unwrap();
        let mut owner = UnixStream::connect_addr(&at(&real)).unwrap();
        owner
            .write_all(&FdAsk { token: real.token }.encode())
            .unwrap();
        loop {
            let (mut frame, fds) = fds::recv_frame(&mut owner);
            let last = matches!(frame, FdFrame::End | FdFrame::Refused(_));
            let raw: Vec<i32> = match (&mut frame, &swap) {
                (FdFrame::Devices(entries), _) => {
                    entries.iter_mut().for_each(edit);
                    match &swap {
                        Some(f) => fds.iter().map(|_| f.as_raw_fd()).collect(),
                        None => fds.iter().map(|f| f.as_raw_fd()).collect(),
                    }
                }
                _ => fds.iter().map(|f| f.as_raw_fd()).collect(),
            };
            fds::send_fds(&asker, &frame.encode(), &raw);
            if last {
                break;
            }
        }
        let _ = (&asker).read(&mut [0u8; 1]);
    });
    (info, t)
}

/// A WRITE of `0x22` from a fresh device region of `p.a` into all of `rb` of `p.b`, whose
/// device lane entry is `lane`: the lane it took, or its error.
fn write_through(
    p: &Pair,
    rb: &Region,
    lane: kvxfer_proto::wire::lane_entries::ShmLaneInfo,
) -> kvxfer::Result<Lane> {
    use kvxfer_proto::wire::lane_entries::{LaneEntry, LANE_DEVICE};
    use kvxfer_proto::wire::metadata::Metadata;
    let len = (NB * BS) as usize;
    let mut meta = Metadata::decode(&p.b.metadata().unwrap(), p.b.compat()).unwrap();
    meta.lanes.retain(|e| e.lane != LANE_DEVICE);
    meta.lanes.push(LaneEntry::device(&lane));
    let peer = p.a.load_remote_metadata(&meta.encode()).unwrap();
    let (ra, xa) = device_region(&p.a, &p.da, len);
    p.da.write(xa, &vec![0x22; len]).unwrap();
    let slots: Vec<u64> = (0..NB).collect();
    let l = p.a.prep_local(&descs(&ra, &slots)).unwrap();
    let r = p.a.prep_remote(&peer, &descs(rb, &slots)).unwrap();
    p.a.transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(10)))
        .and_then(|t| t.wait())
        .map(|s| s.lane)
}

/// The checks on what a same-host peer's device lane hands over, against a socket of the
/// right process that lies: an export shorter than the region is not used (the WRITE goes
/// by another lane), an allocation claimed larger than its memory file, or a file that is
/// not a sealed memory file of this user, is not opened (the WRITE fails typed), and
/// nothing lands outside the region either way. The honest relay goes on the device lane.
#[test]
fn a_lying_device_hand_over_opens_nothing() {
    use kvxfer_proto::wire::lane_entries::device_of;
    use kvxfer_proto::wire::metadata::Metadata;
    let len = (NB * BS) as usize;
    let dir = std::env::temp_dir().join(format!("kvx-dev-handover-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let on_disk = dir.join("precious");
    type Case = (
        &'static str,
        fn(&mut kvxfer_proto::wire::shm_fds::DeviceEntry),
        bool,
    );
    let cases: [Case; 4] = [
        ("honest", |_| {}, false),
        ("an export shorter than the region", |e| e.len -= 1, false),
        ("an allocation larger than its file", |e| e.size *= 2, false),
        ("a file on disk", |_| {}, true),
    ];
    for (what, edit, swap) in cases {
        let p = pair(|c| c);
        let (rb, xb) = device_region(&p.b, &p.db, len);
        let real = device_of(
            &Metadata::decode(&p.b.metadata().unwrap(), p.b.compat())
                .unwrap()
                .lanes,
        )
        .unwrap();
        std::fs::write(&on_disk, vec![0x11u8; 2 * len]).unwrap();
        let file = swap.then(|| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&on_disk)
                .unwrap()
        });
        let (info, server) = relay(real, edit, file);
        let got = write_through(&p, &rb, info);
        server.join().unwrap();
        eprintln!("{what}: WRITE {got:?}");
        let mut b = vec![0u8; len];
        p.db.read(xb, &mut b).unwrap();
        match what {
            "honest" => {
                assert_eq!(got.unwrap(), Lane::Device);
                assert!(b.iter().all(|&x| x == 0x22));
            }
            "an export shorter than the region" => {
                // Not opened on the device lane; the TCP lane, whose target checks the
                // request, carries it.
                assert_eq!(got.unwrap(), Lane::Tcp, "{what}");
                assert!(b.iter().all(|&x| x == 0x22));
            }
            _ => {
                assert!(
                    matches!(&got, Err(Error::LaneFailed { lane: "device", why, .. })
                        if why.contains("does not open here")),
                    "{what}: {got:?}"
                );
                assert!(b.iter().all(|&x| x == 0), "{what}: bytes landed");
            }
        }
        let disk = std::fs::read(&on_disk).unwrap();
        assert!(
            disk.iter().all(|&x| x == 0x11),
            "{what}: the WRITE reached the file"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
