//! Two agents in one process over UCX loopback: READ and WRITE with random data verified byte
//! for byte, over TCP and over shared memory; notifications; bounds errors; Busy; cancel-safety.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, Lane, Region, Transport, XferOp};
use rand::{Rng, RngCore, SeedableRng};

const BLOCK: u64 = 32 * 1024;
const SLOTS: u64 = 256;

struct Pair {
    a: Agent,
    b: Agent,
    ra: Region,
    rb: Region,
    peer_of_a: String,
}

fn pair(t: Transport, tag: &str) -> Pair {
    pair_cfg(t, true, tag)
}

fn pair_cfg(t: Transport, lanes: bool, tag: &str) -> Pair {
    pair_striped(t, lanes, tag, 1, SLOTS)
}

/// `lanes`: kvxfer's own lanes (shared-memory mapping, TCP stream) on, or UCX only; TCP-lane
/// transfers striped over `stripes` connections; regions of `slots` blocks.
fn pair_striped(t: Transport, lanes: bool, tag: &str, stripes: usize, slots: u64) -> Pair {
    let _ = env_logger::builder().is_test(true).try_init();
    let cfg = |n: &str| {
        let c = AgentConfig::new(format!("{n}-{tag}-{}", std::process::id()))
            .transport(t.clone())
            .lanes(lanes)
            .ucx_emulated_shm(!lanes)
            // UCX only: its own TCP transport too, opted in.
            .ucx_tcp(!lanes)
            .stripes(stripes);
        c.net_devices("lo")
    };
    let b = Agent::new(cfg("b")).expect("agent b");
    let a = Agent::new(cfg("a")).expect("agent a");
    let ra = a
        .register(HostBuffer::new((BLOCK * slots) as usize).unwrap())
        .unwrap();
    let rb = b
        .register(HostBuffer::new((BLOCK * slots) as usize).unwrap())
        .unwrap();
    let addr = b.listen("127.0.0.1:0").unwrap();
    let peer_of_a = a.connect(addr).expect("metadata exchange");
    assert_eq!(peer_of_a, b.name());
    Pair {
        a,
        b,
        ra,
        rb,
        peer_of_a,
    }
}

fn fill(r: &Region, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; r.len() as usize];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    r.write(0, &v).unwrap();
    v
}

fn snapshot(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.len() as usize];
    r.read(0, &mut v).unwrap();
    v
}

/// Random, distinct block slots on both sides; checks every byte landed where it should and
/// nothing else changed.
fn roundtrip(t: Transport, lanes: bool, want: Lane, tag: &str) {
    roundtrip_of(pair_cfg(t, lanes, tag), want, 100, SLOTS);
}

/// [`roundtrip`] of `n` blocks on a pair with regions of `slots` blocks.
fn roundtrip_of(p: Pair, want: Lane, n: usize, slots: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut la: Vec<u64> = (0..slots).collect();
    let mut lb: Vec<u64> = (0..slots).collect();
    use rand::seq::SliceRandom;
    la.shuffle(&mut rng);
    lb.shuffle(&mut rng);
    let ld: Vec<Desc> = la[..n]
        .iter()
        .map(|&s| Desc::new(p.ra.id(), s * BLOCK, BLOCK))
        .collect();
    let rd: Vec<Desc> = lb[..n]
        .iter()
        .map(|&s| Desc::new(p.rb.id(), s * BLOCK, BLOCK))
        .collect();
    let local = p.a.prep_local(&ld).unwrap();
    let remote = p.a.prep_remote(&p.peer_of_a, &rd).unwrap();

    for op in [XferOp::Write, XferOp::Read] {
        let va = fill(&p.ra, rng.gen());
        let vb = fill(&p.rb, rng.gen());
        let payload = format!("{op}-done");
        let x =
            p.a.transfer_all(
                op,
                &local,
                &remote,
                Some(payload.as_bytes()),
                Some(Duration::from_secs(30)),
            )
            .unwrap();
        let expect = |src: &[u8], dst_before: &[u8], src_slots: &[u64], dst_slots: &[u64]| {
            let mut e = dst_before.to_vec();
            for k in 0..n {
                let (s, d) = (
                    (src_slots[k] * BLOCK) as usize,
                    (dst_slots[k] * BLOCK) as usize,
                );
                e[d..d + BLOCK as usize].copy_from_slice(&src[s..s + BLOCK as usize]);
            }
            e
        };
        if op == XferOp::Write {
            // The target sees the notification only once every byte has landed: check its
            // memory at that moment, before the initiator's completion is even looked at.
            let note = p.b.wait_notification(Duration::from_secs(30)).unwrap();
            assert!(
                snapshot(&p.rb) == expect(&va, &vb, &la, &lb),
                "notification arrived before the data"
            );
            assert_eq!(note.payload, payload.as_bytes());
            assert_eq!(note.from, p.a.name());
        }
        let stats = x.wait().unwrap();
        assert_eq!(stats.bytes, n as u64 * BLOCK);
        assert_eq!(stats.descs, n);
        assert_eq!(stats.ops, n, "random slots do not coalesce");
        assert_eq!(stats.lane, want, "lane");
        if op == XferOp::Read {
            assert!(
                snapshot(&p.ra) == expect(&vb, &va, &lb, &la),
                "read: destination bytes differ"
            );
            // The target is told its blocks were read (it may free them).
            let note = p.b.wait_notification(Duration::from_secs(10)).unwrap();
            assert_eq!(note.from, p.a.name());
            assert_eq!(note.payload, payload.as_bytes());
        }
        // The source side is unchanged.
        match op {
            XferOp::Write => assert!(snapshot(&p.ra) == va),
            XferOp::Read => assert!(snapshot(&p.rb) == vb),
        }
        // One notification per transfer, however many connections carried it.
        assert!(p.b.try_notification().is_none(), "a second notification");
    }
}

#[test]
fn tcp_lane_striped_over_four_connections() {
    // 801 random blocks = 26 MB, above the 16 MiB below which a transfer is not striped; the
    // cuts fall inside blocks (200.25 blocks a stripe).
    let p = pair_striped(Transport::Tcp, true, "stripe", 4, 1024);
    roundtrip_of(p, Lane::Tcp, 801, 1024);
}

#[test]
fn tcp_read_write_random_blocks() {
    roundtrip(Transport::Tcp, true, Lane::Tcp, "tcp");
}

#[test]
fn shm_read_write_random_blocks() {
    roundtrip(Transport::Shm, true, Lane::Shm, "shm");
}

#[test]
fn auto_takes_the_shared_memory_lane_in_host() {
    roundtrip(Transport::Auto, true, Lane::Shm, "auto");
}

#[test]
fn ucx_tcp_read_write_random_blocks() {
    roundtrip(Transport::Tcp, false, Lane::Ucx, "utcp");
}

#[test]
fn ucx_shm_read_write_random_blocks() {
    roundtrip(Transport::Shm, false, Lane::Ucx, "ushm");
}

#[test]
fn tcp_lane_target_refuses_unregistered_memory_and_stays_in_step() {
    let p = pair(Transport::Tcp, "refuse");
    // An initiator that loaded b's metadata by hand: no kept side-channel connection tells it
    // of a deregistration (a kept one would, and it would refuse before the target does).
    let p = Pair {
        a: Agent::new(
            AgentConfig::new(format!("a2-refuse-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo"),
        )
        .unwrap(),
        ..p
    };
    let ra =
        p.a.register(HostBuffer::new((BLOCK * SLOTS) as usize).unwrap())
            .unwrap();
    let p = Pair { ra, ..p };
    assert_eq!(
        p.a.load_remote_metadata(&p.b.metadata().unwrap()).unwrap(),
        p.peer_of_a
    );
    let ld = [Desc::new(p.ra.id(), 0, 4 * BLOCK)];
    let local = p.a.prep_local(&ld).unwrap();
    let remote =
        p.a.prep_remote(&p.peer_of_a, &[Desc::new(p.rb.id(), 0, 4 * BLOCK)])
            .unwrap();
    // The target drops the region; the initiator still has the old metadata.
    p.b.deregister(&p.rb).unwrap();
    let e =
        p.a.transfer_all(XferOp::Write, &local, &remote, Some(b"x"), None)
            .unwrap()
            .wait()
            .unwrap_err();
    match &e {
        Error::LaneFailed {
            lane: "tcp", why, ..
        } => {
            assert!(why.contains("not registered"), "{why}")
        }
        e => panic!("unexpected {e}"),
    }
    assert!(
        p.b.try_notification().is_none(),
        "notification of a refused write"
    );
    // A read of it is refused too, and the stream is still in step for the next request.
    let e =
        p.a.transfer_all(XferOp::Read, &local, &remote, None, None)
            .unwrap()
            .wait()
            .unwrap_err();
    assert!(matches!(e, Error::LaneFailed { .. }), "{e}");
    let rc =
        p.b.register(HostBuffer::new((4 * BLOCK) as usize).unwrap())
            .unwrap();
    let addr = p.b.listen("127.0.0.1:0").unwrap();
    assert_eq!(p.a.connect(addr).unwrap(), p.peer_of_a);
    let remote =
        p.a.prep_remote(&p.peer_of_a, &[Desc::new(rc.id(), 0, 4 * BLOCK)])
            .unwrap();
    let want = fill(&p.ra, 3);
    let st =
        p.a.transfer_all(XferOp::Write, &local, &remote, Some(b"ok"), None)
            .unwrap()
            .wait()
            .unwrap();
    assert_eq!(st.lane, Lane::Tcp);
    assert_eq!(
        p.b.wait_notification(Duration::from_secs(5))
            .unwrap()
            .payload,
        b"ok"
    );
    assert!(snapshot(&rc)[..] == want[..(4 * BLOCK) as usize]);
}

#[test]
fn out_of_bounds_remote_descriptor_is_refused_before_posting() {
    let p = pair(Transport::Tcp, "oob");
    let e =
        p.a.prep_remote(&p.peer_of_a, &[Desc::new(p.rb.id(), BLOCK * SLOTS - 8, 16)])
            .unwrap_err();
    assert!(
        matches!(e, Error::OutOfBounds { side: kvxfer::Side::Remote, index: 0, offset, len: 16, .. } if offset == BLOCK * SLOTS - 8),
        "{e}"
    );
    let e =
        p.a.prep_remote(&p.peer_of_a, &[Desc::new(kvxfer::RegionId(999), 0, 1)])
            .unwrap_err();
    assert!(matches!(e, Error::UnknownRegion { region: 999, .. }), "{e}");
    let e =
        p.a.prep_local(&[Desc::new(p.ra.id(), 1, BLOCK * SLOTS)])
            .unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutOfBounds {
                side: kvxfer::Side::Local,
                ..
            }
        ),
        "{e}"
    );
    let e = p.a.prep_remote("nobody", &[]).unwrap_err();
    assert!(matches!(e, Error::UnknownPeer { .. }), "{e}");
}

#[test]
fn deregister_in_flight_is_busy_then_succeeds() {
    let p = pair(Transport::Tcp, "busy");
    // A large transfer so that it is still in flight when deregister runs.
    let ld = vec![Desc::new(p.ra.id(), 0, BLOCK * SLOTS); 8];
    let rd = vec![Desc::new(p.rb.id(), 0, BLOCK * SLOTS); 8];
    let local = p.a.prep_local(&ld).unwrap();
    let remote = p.a.prep_remote(&p.peer_of_a, &rd).unwrap();
    let x =
        p.a.transfer_all(XferOp::Write, &local, &remote, None, None)
            .unwrap();
    assert!(p.ra.inflight() >= 1 || x.is_done());
    if !x.is_done() {
        match p.a.deregister(&p.ra) {
            Err(Error::Busy { region, inflight }) => {
                assert_eq!(region, p.ra.id().0);
                assert!(inflight >= 1);
            }
            Ok(()) => panic!("deregistered memory in flight"),
            Err(e) if x.is_done() => panic!("unexpected {e}"),
            Err(e) => panic!("unexpected {e}"),
        }
    }
    x.wait().unwrap();
    assert_eq!(p.ra.inflight(), 0);
    p.a.deregister(&p.ra).unwrap();
    assert!(!p.ra.is_registered());
    assert!(matches!(
        p.a.deregister(&p.ra),
        Err(Error::Deregistered { .. })
    ));
    // Prepared lists that name it now fail cleanly instead of touching unregistered memory
    // (at the call, or from the transfer).
    let e =
        p.a.transfer_all(XferOp::Write, &local, &remote, None, None)
            .and_then(|x| x.wait())
            .unwrap_err();
    assert!(matches!(e, Error::Deregistered { .. }), "{e}");
}

#[test]
fn dropped_transfer_keeps_buffers_alive() {
    let p = pair(Transport::Tcp, "drop");
    let expect = fill(&p.ra, 99);
    let local =
        p.a.prep_local(&[Desc::new(p.ra.id(), 0, BLOCK * SLOTS)])
            .unwrap();
    let remote =
        p.a.prep_remote(&p.peer_of_a, &[Desc::new(p.rb.id(), 0, BLOCK * SLOTS)])
            .unwrap();
    let x =
        p.a.transfer_all(XferOp::Write, &local, &remote, Some(b"landed"), None)
            .unwrap();
    // Drop every user handle to the source memory and the transfer future while in flight.
    let Pair { a, b, ra, rb, .. } = p;
    drop(x);
    drop(local);
    drop(ra);
    // The engine still holds the registration; the data lands intact.
    let note = b.wait_notification(Duration::from_secs(30)).unwrap();
    assert_eq!(note.payload, b"landed");
    assert!(snapshot(&rb) == expect);
    drop(a);
}

#[test]
fn futures_resolve_without_a_runtime_of_ours() {
    let p = pair(Transport::Shm, "fut");
    fill(&p.ra, 5);
    let local = p.a.prep_local(&[Desc::new(p.ra.id(), 0, 4096)]).unwrap();
    let remote =
        p.a.prep_remote(&p.peer_of_a, &[Desc::new(p.rb.id(), 0, 4096)])
            .unwrap();
    let x =
        p.a.transfer_all(XferOp::Write, &local, &remote, None, None)
            .unwrap();
    let stats = block_on(x).unwrap();
    assert_eq!(stats.bytes, 4096);
    let mut got = vec![0u8; 4096];
    p.rb.read(0, &mut got).unwrap();
    let mut want = vec![0u8; 4096];
    p.ra.read(0, &mut want).unwrap();
    assert_eq!(got, want);
}

#[test]
fn cancel_returns_after_ucx_is_done() {
    let p = pair(Transport::Tcp, "cancel");
    let ld: Vec<Desc> = (0..SLOTS)
        .map(|s| Desc::new(p.ra.id(), s * BLOCK, BLOCK))
        .collect();
    let rd: Vec<Desc> = (0..SLOTS)
        .rev()
        .map(|s| Desc::new(p.rb.id(), s * BLOCK, BLOCK))
        .collect();
    let local = p.a.prep_local(&ld).unwrap();
    let remote = p.a.prep_remote(&p.peer_of_a, &rd).unwrap();
    let x =
        p.a.transfer_all(XferOp::Write, &local, &remote, None, None)
            .unwrap();
    let r = x.cancel();
    assert!(matches!(r, Err(Error::Canceled) | Ok(_)), "{r:?}");
    // Once cancel returned, UCX holds nothing: the region can be deregistered.
    assert_eq!(p.ra.inflight(), 0);
    p.a.deregister(&p.ra).unwrap();
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct T(std::thread::Thread);
    impl Wake for T {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(T(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

#[test]
fn tcp_lane_buffers_are_charged_to_the_budgets() {
    let _ = env_logger::builder().is_test(true).try_init();
    let tag = std::process::id();
    let small = kvxfer::MemoryBudget::new(1000);
    let b = Agent::new(
        AgentConfig::new(format!("bb-{tag}"))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .budget(small.clone()),
    )
    .unwrap();
    let a = Agent::new(
        AgentConfig::new(format!("ba-{tag}"))
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap();
    let ra = a
        .register(HostBuffer::new((BLOCK * SLOTS) as usize).unwrap())
        .unwrap();
    let rb = b
        .register(HostBuffer::new((BLOCK * SLOTS) as usize).unwrap())
        .unwrap();
    let addr = b.listen("127.0.0.1:0").unwrap();
    let peer = a.connect(addr).unwrap();
    // 100 scattered blocks: 3,600 bytes of request state on the target, over its 1,000.
    let ld: Vec<Desc> = (0..100)
        .map(|i| Desc::new(ra.id(), i * 2 * BLOCK, BLOCK))
        .collect();
    let rd: Vec<Desc> = (0..100)
        .map(|i| Desc::new(rb.id(), i * 2 * BLOCK, BLOCK))
        .collect();
    let l = a.prep_local(&ld).unwrap();
    let r = a.prep_remote(&peer, &rd).unwrap();
    let e = a
        .transfer_all(XferOp::Write, &l, &r, None, Some(Duration::from_secs(60)))
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(
        matches!(&e, Error::LaneFailed { why, .. } if why.contains("out of memory")),
        "{e}"
    );
    assert_eq!(small.used(), 0);
    assert!(small.peak() <= small.limit());
    // The refused request was skipped in step: a small transfer fits, on the same stream.
    let l1 = a.prep_local(&ld[..5]).unwrap();
    let r1 = a.prep_remote(&peer, &rd[..5]).unwrap();
    a.transfer_all(XferOp::Write, &l1, &r1, None, None)
        .unwrap()
        .wait()
        .unwrap();
    // Its charge ends with the request, not when the next one comes: the connection idles
    // holding nothing (issue 34).
    let t0 = std::time::Instant::now();
    while small.used() != 0 && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        small.used(),
        0,
        "an idle lane connection holds its last request's charge"
    );
    // The initiator's own budget bounds it too.
    let c = Agent::new(
        AgentConfig::new(format!("bc-{tag}"))
            .transport(Transport::Tcp)
            .net_devices("lo")
            .budget(kvxfer::MemoryBudget::new(100)),
    )
    .unwrap();
    let rc = c
        .register(HostBuffer::new((BLOCK * SLOTS) as usize).unwrap())
        .unwrap();
    let p2 = c.connect(addr).unwrap();
    let ld: Vec<Desc> = (0..10)
        .map(|i| Desc::new(rc.id(), i * 2 * BLOCK, BLOCK))
        .collect();
    let l = c.prep_local(&ld).unwrap();
    let r = c.prep_remote(&p2, &rd[..10]).unwrap();
    let e = c
        .transfer_all(XferOp::Write, &l, &r, None, None)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
}

#[test]
fn cuda_memory_without_a_gpu_or_cuda_ucx_is_a_typed_error() {
    let a = Agent::new(AgentConfig::new(format!("cuda-{}", std::process::id())).net_devices("lo"))
        .unwrap();
    let mut fake = vec![0u8; 4096];
    // SAFETY: the pointer is valid host memory; registration is refused before any use.
    let r = unsafe { a.register_raw(fake.as_mut_ptr(), fake.len(), kvxfer::MemKind::Cuda(0)) };
    match r {
        Err(Error::Cuda { device: 0, why }) => eprintln!("as expected here: {why}"),
        // With the `cuda` feature and a GPU, the staged path accepts device registrations (the
        // CUDA engine learns at copy time that this pointer is host memory).
        Ok(r) if gpu_present() => eprintln!("GPU present: registered {r:?} on the staged path"),
        other => panic!("expected Error::Cuda, got {other:?}"),
    }
}

fn gpu_present() -> bool {
    #[cfg(feature = "cuda")]
    {
        kvxfer::cuda::probe(0).is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    false
}

#[test]
fn paged_transfers_move_the_same_bytes_and_refuse_bad_blocks() {
    use kvxfer::paged::Paged;
    for (t, lanes, tag) in [
        (Transport::Tcp, true, "paged-tcp"),
        (Transport::Shm, true, "paged-shm"),
        (Transport::Tcp, false, "paged-ucx"),
    ] {
        let p = pair_cfg(t, lanes, tag);
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        use rand::seq::SliceRandom;
        // Two "layers" of 64 slots each; 40 blocks of each, at random slots on both sides.
        let (mut la, mut lb): (Vec<u32>, Vec<u32>) = ((0..64).collect(), (0..64).collect());
        la.shuffle(&mut rng);
        lb.shuffle(&mut rng);
        let (la, lb): (Vec<u32>, Vec<u32>) = (la[..40].to_vec(), lb[..40].to_vec());
        let side = |r: &Region, blocks: &[u32]| -> Vec<Paged> {
            let shared: std::sync::Arc<[u32]> = blocks.into();
            (0..2)
                .map(|layer| Paged {
                    region: r.id(),
                    offset: layer * 64 * BLOCK,
                    block_len: BLOCK,
                    stride: BLOCK,
                    blocks: shared.clone(),
                })
                .collect()
        };
        let (lp, rp) = (side(&p.ra, &la), side(&p.rb, &lb));
        for op in [XferOp::Write, XferOp::Read] {
            let va = fill(&p.ra, rng.gen());
            let vb = fill(&p.rb, rng.gen());
            let st =
                p.a.transfer_paged(op, &p.peer_of_a, &lp, &rp, Some(b"paged"), None)
                    .unwrap()
                    .wait()
                    .unwrap();
            assert_eq!(st.bytes, 2 * 40 * BLOCK);
            let (src, mut dst, ss, ds) = match op {
                XferOp::Write => (va.clone(), vb.clone(), &la, &lb),
                XferOp::Read => (vb.clone(), va.clone(), &lb, &la),
            };
            for layer in 0..2u64 {
                for k in 0..40 {
                    let s = ((layer * 64 + u64::from(ss[k])) * BLOCK) as usize;
                    let d = ((layer * 64 + u64::from(ds[k])) * BLOCK) as usize;
                    dst[d..d + BLOCK as usize].copy_from_slice(&src[s..s + BLOCK as usize]);
                }
            }
            let got = match op {
                XferOp::Write => snapshot(&p.rb),
                XferOp::Read => snapshot(&p.ra),
            };
            assert!(got == dst, "{tag} {op}: bytes differ");
            let note = p.b.wait_notification(Duration::from_secs(10)).unwrap();
            assert_eq!(note.payload, b"paged");
        }
        // A block past the peer's region: typed, before anything moves.
        let mut bad = rp.clone();
        bad[1].blocks = vec![0, SLOTS as u32 - 64].into();
        let mut short = lp.clone();
        short[1].blocks = vec![0, 1].into();
        let r =
            p.a.transfer_paged(XferOp::Write, &p.peer_of_a, &short, &bad, None, None);
        assert!(
            matches!(r, Err(Error::OutOfBounds { index: 1, .. })),
            "{tag}: {r:?}"
        );
        // Blocks that do not pair up.
        let r =
            p.a.transfer_paged(XferOp::Write, &p.peer_of_a, &short, &rp, None, None);
        assert!(
            matches!(r, Err(Error::LengthMismatch { index: 1, .. })),
            "{tag}: {r:?}"
        );
    }
}
