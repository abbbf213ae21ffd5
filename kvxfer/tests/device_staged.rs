//! Device memory on the staged path, with [`SimulatedDevice`] standing in for a GPU: device
//! addresses that the host cannot dereference, reached only through the copy engine. Bytes
//! move intact in every direction (device↔device, host↔device, WRITE and READ, scattered
//! blocks that straddle staging chunks), notifications come after the data, the path is
//! visible per peer, concurrency above the pools waits for chunks instead of allocating, and
//! every misconfiguration is a typed error at registration.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvxfer::staging::{CopyEngine, CopyQueue, SimulatedDevice, StagingShape};
use kvxfer::{
    Agent, AgentConfig, Desc, Error, GpuPath, HostBuffer, Lane, MemKind, MemoryBudget, Region,
    Transport, XferOp,
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

/// Staging of 8 chunks of 64 KiB: two pairs per side.
const CHUNK: usize = 64 << 10;

fn cfg(p: &str, t: Transport, dev: &SimulatedDevice) -> AgentConfig {
    AgentConfig::new(name(p))
        .transport(t)
        .net_devices("lo")
        .lane_addr(std::net::Ipv4Addr::LOCALHOST.into())
        .copy_engine(dev.engine())
        .staging(StagingShape::new(8, CHUNK).unwrap())
        // The staged path itself; in-host device memory otherwise takes the device lane
        // (tests/device_lane.rs).
        .device_lane(false)
}

/// `len` bytes of simulated device memory registered as CUDA device 0.
fn device_region(a: &Agent, dev: &SimulatedDevice, len: usize) -> (Region, u64) {
    let addr = dev.alloc(len).unwrap();
    // SAFETY: the simulated allocation lives as long as `dev`, which every test keeps alive
    // past the agents; nothing else frees it.
    let r = unsafe { a.register_raw(addr as *mut u8, len, MemKind::Cuda(0)) }.unwrap();
    (r, addr)
}

fn random(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Blocks of 48 KiB (they straddle the 64 KiB chunks), at reversed slots on the peer.
const BS: u64 = 48 << 10;
const NB: u64 = 40;

fn descs(r: &Region, reversed: bool) -> Vec<Desc> {
    (0..NB)
        .map(|i| {
            let slot = if reversed { NB - 1 - i } else { i };
            Desc::new(r.id(), slot * BS, BS)
        })
        .collect()
}

/// `got` holds the blocks of `data` (of `bs` bytes) in reverse order.
fn assert_reversed(got: &[u8], data: &[u8], bs: usize) {
    let n = data.len() / bs;
    for i in 0..n {
        let j = n - 1 - i;
        assert!(
            got[j * bs..(j + 1) * bs] == data[i * bs..(i + 1) * bs],
            "block {i} differs at slot {j}"
        );
    }
}

fn pair(t: Transport) -> (Agent, SimulatedDevice, Agent, SimulatedDevice) {
    let (da, db) = (SimulatedDevice::new(), SimulatedDevice::new());
    let a = Agent::new(cfg("dev-a", t.clone(), &da)).unwrap();
    let b = Agent::new(cfg("dev-b", t, &db)).unwrap();
    (a, da, b, db)
}

fn connect(a: &Agent, b: &Agent) -> String {
    let addr = b.listen("127.0.0.1:0").unwrap();
    a.connect(addr).unwrap()
}

fn both_ways(t: Transport) {
    let (a, da, b, db) = pair(t);
    let len = (NB * BS) as usize;
    let (ra, xa) = device_region(&a, &da, len);
    let (rb, xb) = device_region(&b, &db, len);
    let hb = b.register(HostBuffer::new(len).unwrap()).unwrap();
    let peer = connect(&a, &b);
    let info = a.peer_info(&peer).unwrap();
    assert_eq!(info.gpu_path, Some(GpuPath::Staged), "{info:?}");

    let data = random(1, len);
    da.write(xa, &data).unwrap();
    let copies0 = da.copies();
    let (sub_a, sub_b) = (da.submissions(), db.submissions());

    // Device → device WRITE, scattered and reversed on the peer, with a notification.
    let l = a.prep_local(&descs(&ra, false)).unwrap();
    let r = a.prep_remote(&peer, &descs(&rb, true)).unwrap();
    let s = a
        .transfer_all(XferOp::Write, &l, &r, Some(b"d2d"), None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(s.lane, Lane::Tcp);
    assert_eq!(s.bytes, NB * BS);
    let n = b.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(n.payload, b"d2d");
    let mut got = vec![0u8; len];
    db.read(xb, &mut got).unwrap();
    assert_reversed(&got, &data, BS as usize);
    assert!(
        da.copies() > copies0,
        "the initiator's copy engine was not used"
    );
    // One submission per staging chunk on each side (a gather into the chunk, a scatter out
    // of it), not one per block slice: 40 blocks of 48 KiB fill 30 chunks of 64 KiB, cut
    // into 60 slices (every 192 KiB, 4 blocks in 3 chunks make 6).
    let chunks = NB * BS / CHUNK as u64;
    assert_eq!(da.copies() - copies0, 60, "slices gathered");
    assert_eq!(da.submissions() - sub_a, chunks, "the sender's submissions");
    assert_eq!(
        db.submissions() - sub_b,
        chunks,
        "the receiver's submissions"
    );

    // Device → host WRITE (the peer's host region), then host → device READ back into a
    // cleared device region.
    let r_host = a.prep_remote(&peer, &descs(&hb, false)).unwrap();
    a.transfer_all(XferOp::Write, &l, &r_host, None, None)
        .unwrap()
        .wait()
        .unwrap();
    let mut h = vec![0u8; len];
    hb.read(0, &mut h).unwrap();
    assert!(h == data, "device → host bytes differ");
    da.write(xa, &vec![0u8; len]).unwrap();
    a.transfer_all(XferOp::Read, &l, &r_host, Some(b"read"), None)
        .unwrap()
        .wait()
        .unwrap();
    let mut back = vec![0u8; len];
    da.read(xa, &mut back).unwrap();
    assert!(back == data, "host → device READ bytes differ");
    let n = b.wait_notification(Duration::from_secs(10)).unwrap();
    assert_eq!(n.payload, b"read");

    // Device → device READ (the peer's device, staged by the peer), into a cleared region.
    da.write(xa, &vec![0u8; len]).unwrap();
    a.transfer_all(XferOp::Read, &l, &r, None, None)
        .unwrap()
        .wait()
        .unwrap();
    da.read(xa, &mut back).unwrap();
    assert!(back == data, "device ← device READ bytes differ");

    // Host memory on the initiator into the peer's device.
    let ha = a.register(HostBuffer::new(len).unwrap()).unwrap();
    let other = random(2, len);
    ha.write(0, &other).unwrap();
    let lh = a.prep_local(&descs(&ha, false)).unwrap();
    a.transfer_all(XferOp::Write, &lh, &r, None, None)
        .unwrap()
        .wait()
        .unwrap();
    db.read(xb, &mut got).unwrap();
    assert_eq!(got[(NB - 1) as usize * BS as usize..][..16], other[..16]);

    let st = a.staging_stats().unwrap();
    assert_eq!(st.bytes, 8 * CHUNK as u64);
    assert!(st.peak_initiator <= st.chunks_per_pool);
    assert_eq!(st.in_use, 0, "chunks left held after the transfers");
    assert_eq!(b.staging_stats().unwrap().in_use, 0);
}

#[test]
fn staged_device_memory_moves_every_way_over_tcp() {
    both_ways(Transport::Tcp);
}

#[test]
fn staged_device_memory_in_host_takes_the_tcp_lane_not_shm() {
    // With the shared-memory transport the host regions map directly; device memory, with
    // the device lane off, goes staged over the TCP lane.
    both_ways(Transport::Shm);
}

#[test]
fn concurrency_above_the_pools_waits_instead_of_allocating() {
    // One target, six initiators writing device memory to its device at once: the target's
    // pool has two pairs of chunks, so four transfers must wait; the budget never grows. The
    // target's copies are slowed (1 ms each) so that transfers overlap whatever the machine.
    let dt = SimulatedDevice::new();
    let budget = MemoryBudget::new(8 * CHUNK as u64 + (1 << 20));
    let slow = Arc::new(Wrapped {
        dev: dt.clone(),
        left: Arc::new(AtomicU64::new(u64::MAX / 2)),
        delay: Duration::from_millis(1),
    });
    let t = Agent::new(
        cfg("dev-t", Transport::Tcp, &dt)
            .copy_engine(slow)
            .budget(budget.clone()),
    )
    .unwrap();
    let go = Arc::new(std::sync::Barrier::new(N));
    const PER: usize = 4 << 20;
    const N: usize = 6;
    let (rt, xt) = device_region(&t, &dt, PER * N);
    assert_eq!(
        budget.used(),
        8 * CHUNK as u64,
        "pools charged at registration"
    );
    let addr = t.listen("127.0.0.1:0").unwrap();
    let hs: Vec<_> = (0..N)
        .map(|k| {
            let (rid, go) = (rt.id(), go.clone());
            std::thread::spawn(move || {
                let d = SimulatedDevice::new();
                let a = Agent::new(cfg("dev-i", Transport::Tcp, &d)).unwrap();
                let (ra, xa) = device_region(&a, &d, PER);
                let data = random(10 + k as u64, PER);
                d.write(xa, &data).unwrap();
                let peer = a.connect(addr).unwrap();
                let l = a.prep_local(&[Desc::new(ra.id(), 0, PER as u64)]).unwrap();
                let r = a
                    .prep_remote(&peer, &[Desc::new(rid, (k * PER) as u64, PER as u64)])
                    .unwrap();
                go.wait();
                a.transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(60)))
                    .unwrap()
                    .wait()
                    .unwrap();
                (k, data, d)
            })
        })
        .collect();
    for h in hs {
        let (k, data, _d) = h.join().unwrap();
        let mut got = vec![0u8; PER];
        dt.read(xt + (k * PER) as u64, &mut got).unwrap();
        assert!(got == data, "initiator {k}: bytes differ");
    }
    let st = t.staging_stats().unwrap();
    assert!(
        st.peak_target <= st.chunks_per_pool,
        "{} chunks in use at once, the pool has {}",
        st.peak_target,
        st.chunks_per_pool
    );
    assert!(st.waits > 0, "six concurrent writers never waited: {st:?}");
    assert!(budget.peak() <= budget.limit());
    assert_eq!(st.in_use, 0);
    // The same figures, as an operator's scrape sees them.
    let m = t.prometheus();
    let n = t.name();
    for want in [
        format!("kvxfer_staging_bytes{{agent=\"{n}\"}} {}", 8 * CHUNK),
        format!("kvxfer_staging_chunks_in_use{{agent=\"{n}\"}} 0"),
        format!("kvxfer_staging_waits_total{{agent=\"{n}\"}} {}", st.waits),
        format!(
            "kvxfer_budget_limit_bytes{{agent=\"{n}\"}} {}",
            budget.limit()
        ),
        format!(
            "kvxfer_budget_peak_bytes{{agent=\"{n}\"}} {}",
            budget.peak()
        ),
    ] {
        assert!(m.contains(&want), "{want:?} not in:\n{m}");
    }
}

#[test]
fn one_initiator_to_many_peers_shares_its_pool() {
    let d = SimulatedDevice::new();
    let a = Agent::new(cfg("dev-m", Transport::Tcp, &d)).unwrap();
    const PER: usize = 2 << 20;
    let (ra, xa) = device_region(&a, &d, PER);
    let data = random(7, PER);
    d.write(xa, &data).unwrap();
    let peers: Vec<(Agent, SimulatedDevice, Region, u64, String)> = (0..4)
        .map(|_| {
            let dp = SimulatedDevice::new();
            let p = Agent::new(cfg("dev-p", Transport::Tcp, &dp)).unwrap();
            let (rp, xp) = device_region(&p, &dp, PER);
            let name = connect(&a, &p);
            (p, dp, rp, xp, name)
        })
        .collect();
    let l = a.prep_local(&[Desc::new(ra.id(), 0, PER as u64)]).unwrap();
    // Four transfers in flight at once (one lane thread per peer) on two pairs of chunks.
    let ts: Vec<_> = peers
        .iter()
        .map(|(_, _, rp, _, name)| {
            let r = a
                .prep_remote(name, &[Desc::new(rp.id(), 0, PER as u64)])
                .unwrap();
            a.transfer_all(XferOp::Write, &l, &r, None, None).unwrap()
        })
        .collect();
    for t in ts {
        t.wait().unwrap();
    }
    for (_, dp, _, xp, _) in &peers {
        let mut got = vec![0u8; PER];
        dp.read(*xp, &mut got).unwrap();
        assert!(got == data);
    }
    let st = a.staging_stats().unwrap();
    assert!(st.peak_initiator <= st.chunks_per_pool, "{st:?}");
}

#[test]
fn registration_errors_are_typed() {
    let dev = SimulatedDevice::new();
    let addr = dev.alloc(1 << 20).unwrap() as *mut u8;
    // No copy engine: without the `cuda` feature nothing can move device memory; with it and
    // no GPU, the driver probe fails. Either way a typed error, at registration.
    let plain = Agent::new(
        AgentConfig::new(name("dev-none"))
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap();
    // SAFETY: refused before anything touches the address.
    let e = unsafe { plain.register_raw(addr, 1 << 20, MemKind::Cuda(0)) };
    match e {
        Err(Error::Cuda { why, .. }) => eprintln!("no engine: {why}"),
        // A machine with a GPU and the `cuda` feature: the simulated address is not device
        // memory, but the CUDA engine only learns that at copy time.
        Ok(r) if cfg!(feature = "cuda") => drop(r),
        other => panic!("expected Error::Cuda, got {other:?}"),
    }
    // Direct forced with memory UCX cannot reach.
    let a = Agent::new(cfg("dev-direct", Transport::Tcp, &dev).gpu_path(GpuPath::Direct)).unwrap();
    // SAFETY: refused before anything touches the address.
    let e = unsafe { a.register_raw(addr, 1 << 20, MemKind::Cuda(0)) }.unwrap_err();
    assert!(
        matches!(&e, Error::Cuda { why, .. } if why.contains("direct")),
        "{e}"
    );
    // Staged with kvxfer's lanes off.
    let a = Agent::new(
        cfg("dev-nolanes", Transport::Tcp, &dev)
            .lanes(false)
            .ucx_tcp(true),
    )
    .unwrap();
    // SAFETY: as above.
    let e = unsafe { a.register_raw(addr, 1 << 20, MemKind::Cuda(0)) }.unwrap_err();
    assert!(
        matches!(&e, Error::Cuda { why, .. } if why.contains("lane")),
        "{e}"
    );
    // Staging chunks that do not fit the budget: refused, nothing allocated.
    let small = MemoryBudget::new(CHUNK as u64);
    let a = Agent::new(cfg("dev-budget", Transport::Tcp, &dev).budget(small.clone())).unwrap();
    // SAFETY: as above.
    let e = unsafe { a.register_raw(addr, 1 << 20, MemKind::Cuda(0)) }.unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
    assert_eq!(small.used(), 0);
    // Staging too small to double-buffer: refused where the shape is made, before any agent.
    let e = StagingShape::new(2, CHUNK).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// A simulated device whose copies to the host fail once `left` runs out, and whose copies
/// to the device take `delay` each.
#[derive(Debug)]
struct Wrapped {
    dev: SimulatedDevice,
    left: Arc<AtomicU64>,
    delay: Duration,
}

struct FailingQueue(Box<dyn CopyQueue>, Arc<AtomicU64>, Duration);

impl CopyQueue for FailingQueue {
    unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> kvxfer::Result<()> {
        if self.1.fetch_sub(1, Ordering::SeqCst) == 0 {
            self.1.store(0, Ordering::SeqCst);
            return Err(Error::Cuda {
                device: 0,
                why: "injected copy failure".into(),
            });
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.to_host(src, dst, len) }
    }
    unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> kvxfer::Result<()> {
        std::thread::sleep(self.2);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.to_device(src, dst, len) }
    }
    fn sync(&mut self) -> kvxfer::Result<()> {
        self.0.sync()
    }
}

impl CopyEngine for Wrapped {
    fn name(&self) -> &'static str {
        "failing"
    }
    fn check_device(&self, _: u32) -> kvxfer::Result<()> {
        Ok(())
    }
    fn queue(&self, d: u32) -> kvxfer::Result<Box<dyn CopyQueue>> {
        Ok(Box::new(FailingQueue(
            self.dev.queue(d)?,
            self.left.clone(),
            self.delay,
        )))
    }
}

#[test]
fn a_failing_device_copy_fails_the_transfer_and_the_lane_recovers() {
    let da = SimulatedDevice::new();
    let left = Arc::new(AtomicU64::new(3));
    let a = Agent::new(
        cfg("dev-f", Transport::Tcp, &da).copy_engine(Arc::new(Wrapped {
            dev: da.clone(),
            left: left.clone(),
            delay: Duration::ZERO,
        })),
    )
    .unwrap();
    let db = SimulatedDevice::new();
    let b = Agent::new(cfg("dev-g", Transport::Tcp, &db)).unwrap();
    let len = (NB * BS) as usize;
    let (ra, xa) = device_region(&a, &da, len);
    let (rb, xb) = device_region(&b, &db, len);
    let peer = connect(&a, &b);
    let data = random(3, len);
    da.write(xa, &data).unwrap();
    let l = a.prep_local(&descs(&ra, false)).unwrap();
    let r = a.prep_remote(&peer, &descs(&rb, false)).unwrap();
    let e = a
        .transfer_all(
            XferOp::Write,
            &l,
            &r,
            Some(b"never"),
            Some(Duration::from_secs(20)),
        )
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(&e, Error::Cuda { why, .. } if why.contains("injected")),
        "{e}"
    );
    assert!(
        b.wait_notification(Duration::from_millis(500)).is_err(),
        "a notification arrived for a failed transfer"
    );
    assert_eq!(
        a.staging_stats().unwrap().in_use,
        0,
        "chunks leaked by the failure"
    );
    // The next transfer works (a new connection; the engine no longer fails).
    left.store(u64::MAX / 2, Ordering::SeqCst);
    a.transfer_all(
        XferOp::Write,
        &l,
        &r,
        Some(b"ok"),
        Some(Duration::from_secs(20)),
    )
    .unwrap()
    .wait()
    .unwrap();
    assert_eq!(
        b.wait_notification(Duration::from_secs(10))
            .unwrap()
            .payload,
        b"ok"
    );
    let mut got = vec![0u8; len];
    db.read(xb, &mut got).unwrap();
    assert!(got == data);
    // The region is free again: deregistering succeeds.
    a.deregister(&ra).unwrap();
}

/// On a machine with a GPU (feature `cuda`): GPU→GPU between two agents, on the staged path and,
/// where the loaded UCX has CUDA transports, the direct path; bytes compared after copying
/// back. Without a GPU: a skip with the reason.
#[cfg(feature = "cuda")]
#[test]
fn cuda_gpu_to_gpu_both_paths_or_skip() {
    use kvxfer::cuda::cudarc::driver::CudaContext;
    use kvxfer::cuda::CudaCopyEngine;
    if let Err(e) = kvxfer::cuda::probe(0) {
        // Run by the fake-driver test below, a skip would hide a failure.
        assert!(
            std::env::var_os("KVXFER_REQUIRE_GPU").is_none(),
            "a GPU (or the fake driver) was required: {e}"
        );
        eprintln!("SKIP (no GPU here): {e}");
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let len = 16 << 20;
    let data = random(5, len);
    let engine: Arc<dyn CopyEngine> = Arc::new(CudaCopyEngine::new());
    for path in [GpuPath::Staged, GpuPath::Direct] {
        let mk = |p: &str| {
            Agent::new(
                AgentConfig::new(name(p))
                    .transport(if path == GpuPath::Direct {
                        Transport::Auto
                    } else {
                        Transport::Tcp
                    })
                    .net_devices("lo")
                    .lane_addr(std::net::Ipv4Addr::LOCALHOST.into())
                    .gpu_path(path)
                    .copy_engine(engine.clone()),
            )
            .unwrap()
        };
        let (a, b) = (mk("gpu-a"), mk("gpu-b"));
        let ra = match a.register(stream.memcpy_stod(&data).unwrap()) {
            Err(Error::Cuda { why, .. }) if path == GpuPath::Direct => {
                eprintln!("SKIP direct path: {why}");
                continue;
            }
            r => r.unwrap(),
        };
        let rb = b.register(stream.alloc_zeros::<u8>(len).unwrap()).unwrap();
        stream.synchronize().unwrap();
        let peer = connect(&a, &b);
        assert_eq!(a.peer_info(&peer).unwrap().gpu_path, Some(path));
        // Scattered: 64 KiB blocks reversed.
        let bs = 64u64 << 10;
        let n = len as u64 / bs;
        let ld: Vec<Desc> = (0..n).map(|i| Desc::new(ra.id(), i * bs, bs)).collect();
        let rd: Vec<Desc> = (0..n)
            .map(|i| Desc::new(rb.id(), (n - 1 - i) * bs, bs))
            .collect();
        let l = a.prep_local(&ld).unwrap();
        let r = a.prep_remote(&peer, &rd).unwrap();
        let t0 = std::time::Instant::now();
        a.transfer_all(
            XferOp::Write,
            &l,
            &r,
            Some(b"gpu"),
            Some(Duration::from_secs(60)),
        )
        .unwrap()
        .wait()
        .unwrap();
        eprintln!("{path}: {len} bytes GPU->GPU in {:?}", t0.elapsed());
        assert_eq!(
            b.wait_notification(Duration::from_secs(10))
                .unwrap()
                .payload,
            b"gpu"
        );
        let mut got = vec![0u8; len];
        let mut q = engine.queue(0).unwrap();
        // SAFETY: rb is a registered device region of len bytes; `got` lives past the sync.
        unsafe { q.to_host(rb.addr(), got.as_mut_ptr(), len) }.unwrap();
        q.sync().unwrap();
        assert_reversed(&got, &data, bs as usize);
    }
}

/// The connector over device-resident KV caches (both sides), pull and push, layer-wise: the
/// staged path is transparent to it. In-host (the shared-memory transport): device memory
/// still takes the TCP lane.
fn connector_on_device_kv(mode: kvxfer::connector::Mode) {
    use kvxfer::connector::{ConnectorConfig, Consumer, Producer};
    use kvxfer::layout::{KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking};
    let g = KvGeometry {
        name: "dev".into(),
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        dtype: KvDtype::Bf16,
    };
    let blocks = 32;
    let side = |p: &str| {
        let dev = SimulatedDevice::new();
        let a = Arc::new(Agent::new(cfg(p, Transport::Shm, &dev)).unwrap());
        let probe = KvLayout::contiguous(
            g.clone(),
            16,
            blocks,
            KvPacking::Separate,
            KvOrder::Nhd,
            kvxfer::RegionId(0),
        );
        let (r, x) = device_region(&a, &dev, probe.region_bytes() as usize);
        let layout = KvLayout::contiguous(
            g.clone(),
            16,
            blocks,
            KvPacking::Separate,
            KvOrder::Nhd,
            r.id(),
        );
        (a, dev, r, x, layout)
    };
    let (pa, pd, pr, px, pl) = side("kvp");
    let (ca, cd, _cr, cx, cl) = side("kvc");
    let data = random(9, pr.len() as usize);
    pd.write(px, &data).unwrap();
    let paddr = pa.listen("127.0.0.1:0").unwrap();
    let cc = ConnectorConfig::default()
        .mode(mode)
        .heartbeat(Duration::from_millis(50));
    let producer = Producer::new(pa.clone(), pl.clone(), cc.clone(), Some(paddr)).unwrap();
    let consumer = Consumer::new(ca.clone(), cl.clone(), cc).unwrap();
    let remote = [7u32, 30, 2, 3, 19];
    let local = [0u32, 1, 2, 20, 31];
    let h = producer.publish("dev-req", &remote, 5 * 16, 0).unwrap();
    consumer.start_load(&h, &local).unwrap();
    for l in 0..4 {
        producer.layer_done("dev-req", l).unwrap();
    }
    consumer.wait("dev-req", Duration::from_secs(20)).unwrap();
    let rd = pl.descs(&remote, 0..4, 0..2).unwrap();
    let ld = cl.descs(&local, 0..4, 0..2).unwrap();
    assert_eq!(rd.len(), ld.len());
    for (a, b) in rd.iter().zip(&ld) {
        let mut got = vec![0u8; b.len as usize];
        cd.read(cx + b.offset, &mut got).unwrap();
        assert!(
            got[..] == data[a.offset as usize..(a.offset + a.len) as usize],
            "{a:?} -> {b:?} differ"
        );
    }
    let peer = ca.peer_info(pa.name()).unwrap();
    assert_eq!(peer.gpu_path, Some(GpuPath::Staged));
    let s = consumer.take_finished().pop().unwrap();
    assert_eq!(s.bytes_moved, 5 * cl.block_bytes() * 4 * 2);
}

#[test]
fn connector_pull_of_device_kv() {
    connector_on_device_kv(kvxfer::connector::Mode::Pull);
}

#[test]
fn connector_push_of_device_kv() {
    connector_on_device_kv(kvxfer::connector::Mode::Push);
}

/// Deregistering device memory in flight is refused, and allowed once the transfer is done. (A
/// peer killed mid-transfer: `tests/peer_death.rs`, with device memory in both processes.)
#[test]
fn device_memory_in_flight_cannot_be_deregistered() {
    let (a, da, b, db) = pair(Transport::Tcp);
    const LEN: usize = 4 << 20;
    let (ra, _) = device_region(&a, &da, LEN);
    let (rb, _) = device_region(&b, &db, LEN);
    let peer = connect(&a, &b);
    let l = a.prep_local(&[Desc::new(ra.id(), 0, LEN as u64)]).unwrap();
    let r = a
        .prep_remote(&peer, &[Desc::new(rb.id(), 0, LEN as u64)])
        .unwrap();
    let t = a
        .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(20)))
        .unwrap();
    // The transfer holds the region from the moment it is posted.
    assert!(
        matches!(a.deregister(&ra), Err(Error::Busy { .. })),
        "device memory deregistered under a transfer"
    );
    t.wait().unwrap();
    a.deregister(&ra).unwrap();
    assert_eq!(a.staging_stats().unwrap().in_use, 0);
}

/// A GPU worker (staged) and a CPU-only one without a copy engine, over the shared-memory
/// transport: device memory moves into and out of the CPU worker's host memory (its TCP lane
/// serves it; it stages nothing itself).
#[test]
fn staged_device_memory_to_a_cpu_only_peer() {
    let d = SimulatedDevice::new();
    let g = Agent::new(cfg("dev-gpu", Transport::Shm, &d)).unwrap();
    let c = Agent::new(
        AgentConfig::new(name("cpu-only"))
            .transport(Transport::Shm)
            .net_devices("lo"),
    )
    .unwrap();
    let len = (NB * BS) as usize;
    let (rg, xg) = device_region(&g, &d, len);
    let hc = c.register(HostBuffer::new(len).unwrap()).unwrap();
    let peer = connect(&g, &c);
    let data = random(11, len);
    d.write(xg, &data).unwrap();
    let l = g.prep_local(&descs(&rg, false)).unwrap();
    let r = g.prep_remote(&peer, &descs(&hc, true)).unwrap();
    let s = g
        .transfer_all(XferOp::Write, &l, &r, Some(b"to-cpu"), None)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(s.lane, Lane::Tcp);
    assert_eq!(
        c.wait_notification(Duration::from_secs(10))
            .unwrap()
            .payload,
        b"to-cpu"
    );
    let mut h = vec![0u8; len];
    hc.read(0, &mut h).unwrap();
    assert_reversed(&h, &data, BS as usize);
    d.write(xg, &vec![0u8; len]).unwrap();
    g.transfer_all(XferOp::Read, &l, &r, None, None)
        .unwrap()
        .wait()
        .unwrap();
    let mut back = vec![0u8; len];
    d.read(xg, &mut back).unwrap();
    assert!(back == data);
    assert!(
        c.staging_stats().is_none(),
        "the CPU-only peer allocated staging"
    );
}

/// The GPU test above, run in a child process against the fake CUDA driver
/// (`tests/fake_cuda/libcuda.c`: device memory the host cannot dereference, copies deferred
/// until their stream is synchronized). It exercises the CUDA copy engine, cudarc buffers
/// registered as device memory and the pinned staging chunks where no GPU exists.
#[cfg(feature = "cuda")]
#[test]
fn cuda_test_against_the_fake_driver() {
    use std::path::Path;
    use std::process::Command;
    if std::env::var_os("KVXFER_REQUIRE_GPU").is_some() {
        return; // the child itself
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake_cuda_kvxfer");
    let ok = Command::new(root.join("tests/fake_cuda/build.sh"))
        .arg(&dir)
        .status()
        .unwrap();
    assert!(ok.success(), "building the fake libcuda failed");
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cuda_gpu_to_gpu_both_paths_or_skip",
            "--nocapture",
        ])
        .env("LD_LIBRARY_PATH", &dir)
        .env("KVXFER_REQUIRE_GPU", "1")
        .env("UCX_LOG_LEVEL", "error")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
    assert!(text.contains("staged: 16777216 bytes GPU->GPU"), "{text}");
    assert!(!text.contains("not modelled"), "{text}");
}

#[test]
fn staged_device_memory_moves_compressed() {
    // Compression on: staging chunks travel as frames both ways (the initiator's for a WRITE,
    // the target's for a READ), every byte checked, fewer bytes on the wire for bf16 data.
    let (da, db) = (SimulatedDevice::new(), SimulatedDevice::new());
    let on = |p: &str, d: &SimulatedDevice| {
        cfg(p, Transport::Tcp, d).compression(kvxfer::Compression::On)
    };
    let a = Agent::new(on("zdev-a", &da)).unwrap();
    let b = Agent::new(on("zdev-b", &db)).unwrap();
    const N: u64 = 120; // 5.6 MiB: above compression's 4 MiB floor
    let len = (N * BS) as usize;
    let (ra, xa) = device_region(&a, &da, len);
    let (rb, xb) = device_region(&b, &db, len);
    let peer = connect(&a, &b);
    // bf16 values at a few scales.
    let data: Vec<u8> = random(3, len)
        .chunks_exact(2)
        .enumerate()
        .flat_map(|(i, w)| {
            let x = (f32::from(w[0]) - 127.5) / 64.0 * [0.05f32, 1.0, 8.0][i % 3];
            ((x.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect();
    da.write(xa, &data).unwrap();
    let d = |r: &Region, reversed: bool| -> Vec<Desc> {
        (0..N)
            .map(|i| Desc::new(r.id(), if reversed { N - 1 - i } else { i } * BS, BS))
            .collect()
    };
    let l = a.prep_local(&d(&ra, false)).unwrap();
    let r = a.prep_remote(&peer, &d(&rb, true)).unwrap();
    let s = a
        .transfer_all(XferOp::Write, &l, &r, Some(b"z"), None)
        .unwrap()
        .wait()
        .unwrap();
    assert!(s.wire_bytes < s.bytes, "{s:?}");
    assert_eq!(
        b.wait_notification(Duration::from_secs(10))
            .unwrap()
            .payload,
        b"z"
    );
    let mut got = vec![0u8; len];
    db.read(xb, &mut got).unwrap();
    assert_reversed(&got, &data, BS as usize);
    da.write(xa, &vec![0u8; len]).unwrap();
    let s = a
        .transfer_all(XferOp::Read, &l, &r, None, None)
        .unwrap()
        .wait()
        .unwrap();
    assert!(s.wire_bytes < s.bytes, "{s:?}");
    let mut back = vec![0u8; len];
    da.read(xa, &mut back).unwrap();
    assert!(back == data, "device ← device compressed READ bytes differ");
    assert!(b.codec_totals().decoded.frames > 0 && b.codec_totals().encoded.frames > 0);
}
