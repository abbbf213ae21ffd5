//! The connector end to end in one process: pull and push, full and partial (cached prefix)
//! loads, layer-wise handoff, lease expiry, two readers of half the heads each, and memory
//! budget backpressure. Every byte is compared with the producer's.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvxfer::connector::{ConnectorConfig, Consumer, Mode, Producer};
use kvxfer::layout::{KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking};
use kvxfer::{Agent, AgentConfig, Error, HostBuffer, MemoryBudget, Region, Transport};
use kvxfer_proto::lifecycle::FreeReason;
use rand::{RngCore, SeedableRng};

const T: Duration = Duration::from_secs(20);

fn geometry(heads: u64) -> KvGeometry {
    KvGeometry {
        name: "test".into(),
        layers: 4,
        kv_heads: heads,
        head_dim: 32,
        dtype: KvDtype::Bf16,
    }
}

struct Side {
    agent: Arc<Agent>,
    region: Region,
    layout: KvLayout,
}

fn side(
    name: &str,
    t: &Transport,
    heads: u64,
    blocks: u64,
    order: KvOrder,
    packing: KvPacking,
) -> (Side, Option<std::net::SocketAddr>) {
    let g = geometry(heads);
    // Agents of a layout family share the compat hash of its common part.
    let probe = KvLayout::contiguous(g.clone(), 16, blocks, packing, order, kvxfer::RegionId(0));
    let agent = Agent::new(
        AgentConfig::new(format!("{name}-{}", std::process::id()))
            .transport(t.clone())
            .net_devices("lo"),
    )
    .unwrap();
    let region = agent
        .register(HostBuffer::new(probe.region_bytes() as usize).unwrap())
        .unwrap();
    let layout = KvLayout::contiguous(g, 16, blocks, packing, order, region.id());
    let addr = agent.listen("127.0.0.1:0").unwrap();
    (
        Side {
            agent: Arc::new(agent),
            region,
            layout,
        },
        Some(addr),
    )
}

fn randomize(r: &Region, seed: u64) {
    let mut v = vec![0u8; r.len() as usize];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    r.write(0, &v).unwrap();
}

fn bytes(r: &Region, d: &kvxfer::Desc) -> Vec<u8> {
    let mut v = vec![0u8; d.len as usize];
    r.read(d.offset, &mut v).unwrap();
    v
}

/// Checks that the consumer's `local` blocks hold the producer's `remote` blocks (heads
/// `heads` of them) in every layer.
fn check(p: &Side, c: &Side, remote: &[u32], local: &[u32], heads: std::ops::Range<u64>) {
    let nl = p.layout.layers.len();
    let rd = p.layout.descs(remote, 0..nl, heads).unwrap();
    let ld = c
        .layout
        .descs(local, 0..nl, 0..c.layout.geometry.kv_heads)
        .unwrap();
    assert_eq!(rd.len(), ld.len());
    for (a, b) in rd.iter().zip(&ld) {
        assert!(
            bytes(&p.region, a) == bytes(&c.region, b),
            "{a:?} -> {b:?} differ"
        );
    }
}

fn cfg(mode: Mode) -> ConnectorConfig {
    ConnectorConfig::default()
        .mode(mode)
        .heartbeat(Duration::from_millis(50))
}

fn full_and_partial(t: Transport, mode: Mode) {
    let (p, paddr) = side("prod", &t, 2, 64, KvOrder::Nhd, KvPacking::Separate);
    let (c, _) = side("cons", &t, 2, 48, KvOrder::Nhd, KvPacking::Separate);
    randomize(&p.region, 1);
    let producer = Producer::new(p.agent.clone(), p.layout.clone(), cfg(mode), paddr).unwrap();
    let consumer = Consumer::new(c.agent.clone(), c.layout.clone(), cfg(mode)).unwrap();

    // Full load of 7 scattered blocks.
    let remote = [40, 3, 17, 18, 19, 60, 2];
    let h = producer.publish("full", &remote, 7 * 16, 4).unwrap();
    let h = kvxfer::connector::Handoff::decode(&h.encode()).unwrap();
    let local = [5, 6, 7, 30, 31, 1, 47];
    consumer.start_load(&h, &local).unwrap();
    consumer.wait("full", T).unwrap();
    check(&p, &c, &remote, &local, 0..2);
    let f = producer.wait_freed("full", T).unwrap();
    assert_eq!((f.blocks, f.reason), (remote.to_vec(), FreeReason::Acked));
    let s = consumer.take_finished().pop().unwrap();
    let per_block = c.layout.block_bytes() * 4 * 2;
    assert_eq!(s.bytes_moved, 7 * per_block);
    assert_eq!(s.bytes_skipped, 0);

    // Partial: the consumer holds the first 5 of 8 blocks; exactly 3 blocks' bytes move.
    let remote = [10, 11, 12, 13, 14, 50, 51, 52];
    let before = {
        let mut v = vec![0u8; c.region.len() as usize];
        c.region.read(0, &mut v).unwrap();
        v
    };
    let h = producer.publish("part", &remote, 8 * 16 - 3, 4).unwrap();
    consumer.start_load(&h, &[20, 21, 22]).unwrap();
    consumer.wait("part", T).unwrap();
    check(&p, &c, &remote[5..], &[20, 21, 22], 0..2);
    let s = consumer.take_finished().pop().unwrap();
    assert_eq!(s.bytes_moved, 3 * per_block, "only the missing blocks move");
    assert_eq!(s.bytes_skipped, 5 * per_block);
    // Nothing else in the consumer's cache changed.
    let mut after = vec![0u8; c.region.len() as usize];
    c.region.read(0, &mut after).unwrap();
    let touched: Vec<(u64, u64)> = c
        .layout
        .descs(&[20, 21, 22], 0..4, 0..2)
        .unwrap()
        .iter()
        .map(|d| (d.offset, d.offset + d.len))
        .collect();
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        let i = i as u64;
        if !touched.iter().any(|&(s, e)| i >= s && i < e) {
            assert_eq!(a, b, "byte {i} outside the loaded blocks changed");
        }
    }
    assert_eq!(
        producer.wait_freed("part", T).unwrap().reason,
        FreeReason::Acked
    );

    // Everything cached: nothing moves, the producer still frees.
    let h = producer.publish("hit", &[1, 2], 32, 4).unwrap();
    consumer.start_load(&h, &[]).unwrap();
    consumer.wait("hit", T).unwrap();
    assert_eq!(consumer.take_finished().pop().unwrap().bytes_moved, 0);
    assert_eq!(
        producer.wait_freed("hit", T).unwrap().reason,
        FreeReason::Acked
    );
    let prom = consumer.telemetry().prometheus();
    assert!(
        prom.contains("kvxfer_requests_total{role=\"consumer\",result=\"ok\"} 3"),
        "{prom}"
    );
}

#[test]
fn pull_full_partial_and_cached_over_shm() {
    full_and_partial(Transport::Shm, Mode::Pull);
}

#[test]
fn pull_full_partial_and_cached_over_tcp() {
    full_and_partial(Transport::Tcp, Mode::Pull);
}

#[test]
fn push_full_partial_and_cached() {
    full_and_partial(Transport::Tcp, Mode::Push);
}

fn layer_wise(mode: Mode) {
    let t = Transport::Shm;
    let (p, paddr) = side("lwp", &t, 2, 32, KvOrder::Nhd, KvPacking::Fused);
    let (c, _) = side("lwc", &t, 2, 32, KvOrder::Nhd, KvPacking::Fused);
    randomize(&p.region, 2);
    let producer = Producer::new(p.agent.clone(), p.layout.clone(), cfg(mode), paddr).unwrap();
    let consumer = Consumer::new(c.agent.clone(), c.layout.clone(), cfg(mode)).unwrap();
    let remote = [4, 9, 1];
    let h = producer.publish("lw", &remote, 48, 0).unwrap();
    consumer.start_load(&h, &[0, 1, 2]).unwrap();
    producer.layer_done("lw", 0).unwrap();
    // The consumer has layer 0 while the producer has not finished the last layer.
    consumer.wait_layer("lw", 0, T).unwrap();
    assert!(matches!(
        consumer.wait_layer("lw", 3, Duration::from_millis(100)),
        Err(Error::WaitTimeout(_))
    ));
    let d0 = p.layout.descs(&remote, 0..1, 0..2).unwrap();
    let l0 = c.layout.descs(&[0, 1, 2], 0..1, 0..2).unwrap();
    for (a, b) in d0.iter().zip(&l0) {
        assert!(bytes(&p.region, a) == bytes(&c.region, b));
    }
    for l in 1..4 {
        producer.layer_done("lw", l).unwrap();
    }
    consumer.wait("lw", T).unwrap();
    check(&p, &c, &remote, &[0, 1, 2], 0..2);
    assert_eq!(
        producer.wait_freed("lw", T).unwrap().reason,
        FreeReason::Acked
    );
}

#[test]
fn layer_wise_pull() {
    layer_wise(Mode::Pull);
}

#[test]
fn layer_wise_push() {
    layer_wise(Mode::Push);
}

#[test]
fn expired_handoff_fails_cleanly_and_frees() {
    let t = Transport::Shm;
    let (p, paddr) = side("exp", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
    let (c, _) = side("exc", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
    let pc = cfg(Mode::Pull).lease(Duration::from_millis(300));
    let producer = Producer::new(p.agent.clone(), p.layout.clone(), pc, paddr).unwrap();
    let consumer = Consumer::new(c.agent.clone(), c.layout.clone(), cfg(Mode::Pull)).unwrap();
    let h = producer.publish("late", &[1, 2, 3], 48, 4).unwrap();
    let f = producer.wait_freed("late", T).unwrap();
    assert_eq!(f.reason, FreeReason::Expired);
    consumer.start_load(&h, &[4, 5, 6]).unwrap();
    let e = consumer.wait("late", T).unwrap_err();
    assert!(
        matches!(&e, Error::Handoff { why, .. } if why.contains("expired")),
        "{e}"
    );
    let fl = consumer.take_failed().pop().unwrap();
    assert_eq!(fl.invalid_blocks, vec![4, 5, 6]);
    // Aborted requests are refused the same way.
    let h = producer.publish("gone", &[7], 16, 4).unwrap();
    producer.abort("gone");
    consumer.start_load(&h, &[9]).unwrap();
    let e = consumer.wait("gone", T).unwrap_err();
    assert!(
        matches!(&e, Error::Handoff { why, .. } if why.contains("aborted")),
        "{e}"
    );
}

#[test]
fn two_readers_each_read_half_the_heads() {
    let t = Transport::Shm;
    let (p, paddr) = side("tp", &t, 4, 16, KvOrder::Hnd, KvPacking::Separate);
    let (c0, _) = side("tp0", &t, 2, 16, KvOrder::Hnd, KvPacking::Separate);
    let (c1, _) = side("tp1", &t, 2, 16, KvOrder::Hnd, KvPacking::Separate);
    randomize(&p.region, 3);
    let pc = cfg(Mode::Pull).readers(2);
    let producer = Producer::new(p.agent.clone(), p.layout.clone(), pc, paddr).unwrap();
    let k0 = Consumer::new(
        c0.agent.clone(),
        c0.layout.clone(),
        cfg(Mode::Pull).heads(0..2),
    )
    .unwrap();
    let k1 = Consumer::new(
        c1.agent.clone(),
        c1.layout.clone(),
        cfg(Mode::Pull).heads(2..4),
    )
    .unwrap();
    let remote = [3, 8, 15];
    let h = producer.publish("tp", &remote, 48, 4).unwrap();
    k0.start_load(&h, &[0, 1, 2]).unwrap();
    k0.wait("tp", T).unwrap();
    // One reader done: the blocks stay held for the other.
    assert!(matches!(
        producer.wait_freed("tp", Duration::from_millis(200)),
        Err(Error::WaitTimeout(_))
    ));
    assert_eq!(producer.held(), 1);
    k1.start_load(&h, &[5, 6, 7]).unwrap();
    k1.wait("tp", T).unwrap();
    check(&p, &c0, &remote, &[0, 1, 2], 0..2);
    check(&p, &c1, &remote, &[5, 6, 7], 2..4);
    assert_eq!(
        producer.wait_freed("tp", T).unwrap().reason,
        FreeReason::Acked
    );
    // A consumer whose head count does not match its range is refused up front.
    let bad = Consumer::new(
        c0.agent.clone(),
        c0.layout.clone(),
        cfg(Mode::Pull).heads(0..3),
    )
    .unwrap();
    drop(k0);
    let h = producer.publish("tp2", &remote, 48, 4).unwrap();
    assert!(matches!(
        bad.start_load(&h, &[0, 1, 2]),
        Err(Error::Handoff { .. })
    ));
}

#[test]
fn budget_backpressure_completes_and_never_exceeds() {
    let t = Transport::Shm;
    let (p, paddr) = side("bp", &t, 2, 64, KvOrder::Nhd, KvPacking::Separate);
    let (c, _) = side("bc", &t, 2, 64, KvOrder::Nhd, KvPacking::Separate);
    randomize(&p.region, 4);
    // Room for the state of two 8-block loads at a time, not three.
    let one = 4096 + 8 * 4 * 2 * 160;
    let budget = MemoryBudget::new(2 * one + one / 2);
    let producer =
        Producer::new(p.agent.clone(), p.layout.clone(), cfg(Mode::Pull), paddr).unwrap();
    let consumer = Arc::new(
        Consumer::new(
            c.agent.clone(),
            c.layout.clone(),
            cfg(Mode::Pull).budget(budget.clone()),
        )
        .unwrap(),
    );
    let hs: Vec<_> = (0..6u32)
        .map(|i| {
            let remote: Vec<u32> = (i * 8..i * 8 + 8).collect();
            let local: Vec<u32> = (i * 8..i * 8 + 8).rev().collect();
            let h = producer.publish(&format!("b{i}"), &remote, 128, 4).unwrap();
            let k = consumer.clone();
            std::thread::spawn(move || {
                k.start_load(&h, &local).unwrap();
                k.wait(&h.request, T).unwrap();
                (remote, local)
            })
        })
        .collect();
    for h in hs {
        let (remote, local) = h.join().unwrap();
        check(&p, &c, &remote, &local, 0..2);
    }
    assert!(
        budget.peak() <= budget.limit(),
        "{} > {}",
        budget.peak(),
        budget.limit()
    );
    assert!(
        budget.waits() > 0,
        "concurrency above the budget had to wait"
    );
    assert_eq!(budget.used(), 0);
    // A load bigger than the whole budget fails with a typed error, not growth.
    let h = producer
        .publish("huge", &(0..64).collect::<Vec<_>>(), 1024, 4)
        .unwrap();
    let e = consumer
        .start_load(&h, &(0..64).collect::<Vec<_>>())
        .unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
}

#[test]
fn one_agent_in_both_roles_and_a_handoff_before_publish() {
    // kv_both: each worker runs a producer and a consumer on one agent; the user's own
    // notifications are untouched by either.
    let t = Transport::Shm;
    let (x, xaddr) = side("bx", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
    let (y, yaddr) = side("by", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
    randomize(&x.region, 5);
    randomize(&y.region, 6);
    let xp = Producer::new(x.agent.clone(), x.layout.clone(), cfg(Mode::Pull), xaddr).unwrap();
    let xc = Consumer::new(x.agent.clone(), x.layout.clone(), cfg(Mode::Pull)).unwrap();
    let yp = Producer::new(y.agent.clone(), y.layout.clone(), cfg(Mode::Pull), yaddr).unwrap();
    let yc = Consumer::new(y.agent.clone(), y.layout.clone(), cfg(Mode::Pull)).unwrap();
    let peer_of_x = x.agent.connect(yaddr.unwrap()).unwrap();
    let hx = xp.publish("x1", &[1, 2], 32, 4).unwrap();
    let hy = yp.publish("y1", &[3, 4], 32, 4).unwrap();
    yc.start_load(&hx, &[10, 11]).unwrap();
    xc.start_load(&hy, &[12, 13]).unwrap();
    x.agent
        .notify(&peer_of_x, b"user note")
        .unwrap()
        .wait()
        .unwrap();
    yc.wait("x1", T).unwrap();
    xc.wait("y1", T).unwrap();
    check(&x, &y, &[1, 2], &[10, 11], 0..2);
    check(&y, &x, &[3, 4], &[12, 13], 0..2);
    assert_eq!(y.agent.wait_notification(T).unwrap().payload, b"user note");
    assert!(
        y.agent.try_notification().is_none(),
        "control messages leaked to the user"
    );
    // A handoff can reach the consumer before its producer published: it waits, then loads.
    let blocks = [5u32, 6];
    let early = kvxfer::connector::Handoff {
        request: "late-publish".into(),
        ..xp.publish("template", &blocks, 32, 4).unwrap()
    };
    yc.start_load(&early, &[14, 15]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The handoff's grant is the one it is published under (an engine's scheduler that writes
    // the handoff first chooses it).
    let grant = early.grant.unwrap();
    xp.publish_granted("late-publish", &blocks, 32, 4, grant)
        .unwrap();
    yc.wait("late-publish", T).unwrap();
    check(&x, &y, &blocks, &[14, 15], 0..2);
}

#[test]
fn a_consumer_that_dies_mid_load_leaves_no_stranded_blocks() {
    let t = Transport::Tcp;
    let (p, paddr) = side("dp", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
    let pc = cfg(Mode::Pull).lease(Duration::from_millis(500));
    let producer = Producer::new(p.agent.clone(), p.layout.clone(), pc, paddr).unwrap();
    let h = producer.publish("orphan", &[1, 2, 3], 48, 1).unwrap();
    {
        let (c, _) = side("dc", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
        let consumer = Consumer::new(c.agent.clone(), c.layout.clone(), cfg(Mode::Pull)).unwrap();
        consumer.start_load(&h, &[4, 5, 6]).unwrap();
        consumer.wait_layer("orphan", 0, T).unwrap();
        // The decode worker goes away with layers 1..3 outstanding: no more heartbeats, no ack.
        drop(consumer);
        drop(c);
    }
    let f = producer.wait_freed("orphan", T).unwrap();
    assert_eq!((f.blocks, f.reason), (vec![1, 2, 3], FreeReason::Expired));
    assert_eq!(producer.held(), 0);
    // Later layers reported done for it are refused cleanly, not stranded.
    assert!(matches!(
        producer.layer_done("orphan", 1),
        Err(Error::Handoff { .. })
    ));
}

#[test]
fn a_restarted_producer_fails_its_old_handoffs_at_once() {
    let t = Transport::Tcp;
    let (p, paddr) = side("rs", &t, 2, 16, KvOrder::Hnd, KvPacking::Fused);
    let (c, _) = side("rc", &t, 2, 16, KvOrder::Hnd, KvPacking::Fused);
    let consumer = Consumer::new(c.agent.clone(), c.layout.clone(), cfg(Mode::Pull)).unwrap();
    let producer =
        Producer::new(p.agent.clone(), p.layout.clone(), cfg(Mode::Pull), paddr).unwrap();
    // Published before any layer is computed: the load holds a lease and waits for layers.
    let old = producer.publish("before", &[1, 2], 32, 0).unwrap();
    assert_eq!(old.epoch, p.agent.epoch());
    consumer.start_load(&old, &[3, 4]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(consumer.in_progress(), 1);
    // The prefill worker restarts: same name, a new incarnation, its blocks gone.
    drop(producer);
    drop(p);
    let (p2, paddr2) = side("rs", &t, 2, 16, KvOrder::Hnd, KvPacking::Fused);
    randomize(&p2.region, 9);
    let producer2 =
        Producer::new(p2.agent.clone(), p2.layout.clone(), cfg(Mode::Pull), paddr2).unwrap();
    let new = producer2.publish("after", &[5, 6], 32, 4).unwrap();
    assert_eq!(new.producer, old.producer);
    assert_ne!(new.epoch, old.epoch);
    // The new incarnation's handoff loads it (another epoch than the one loaded) and loads.
    consumer.start_load(&new, &[7, 8]).unwrap();
    consumer.wait("after", T).unwrap();
    check(&p2, &c, &[5, 6], &[7, 8], 0..2);
    // The old load ends as a restart, not after a lease or a grace for "not held".
    let e = consumer.wait("before", T).unwrap_err();
    assert!(
        matches!(&e, Error::Handoff { why, .. } if why.contains("restarted")),
        "{e}"
    );
    let f = consumer.take_failed().pop().unwrap();
    assert_eq!(
        (f.request.as_str(), f.invalid_blocks),
        ("before", vec![3, 4])
    );
    // An old handoff offered again is refused at its start.
    let e = consumer.start_load(&old, &[3, 4]).unwrap_err();
    assert!(
        matches!(&e, Error::Handoff { why, .. } if why.contains("restarted")),
        "{e}"
    );
    assert_eq!(consumer.in_progress(), 0);
}

#[test]
fn a_cancelled_load_ends_with_its_blocks_untouched_and_frees_the_producer() {
    let t = Transport::Tcp;
    let (p, paddr) = side("cp", &t, 2, 16, KvOrder::Hnd, KvPacking::Fused);
    let (c, _) = side("cc", &t, 2, 16, KvOrder::Hnd, KvPacking::Fused);
    randomize(&p.region, 3);
    let producer =
        Producer::new(p.agent.clone(), p.layout.clone(), cfg(Mode::Pull), paddr).unwrap();
    let consumer = Consumer::new(c.agent.clone(), c.layout.clone(), cfg(Mode::Pull)).unwrap();
    // Published before its layers are computed: the load waits for them.
    let h = producer.publish("gone-client", &[1, 2], 32, 0).unwrap();
    consumer.start_load(&h, &[3, 4]).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    consumer.cancel("gone-client").unwrap();
    let e = consumer.wait("gone-client", T).unwrap_err();
    assert!(
        matches!(&e, Error::Handoff { why, .. } if why == "cancelled"),
        "{e}"
    );
    let f = consumer.take_failed().pop().unwrap();
    assert_eq!(f.invalid_blocks, vec![3, 4]);
    // The producer hears this reader is done and frees (not at the lease's end).
    let freed = producer.wait_freed("gone-client", T).unwrap();
    assert_eq!(freed.reason, FreeReason::Acked, "{freed:?}");
    // Layers computed after the cancel never reach the cancelled blocks.
    for layer in 0..4 {
        let _ = producer.layer_done("gone-client", layer);
    }
    std::thread::sleep(Duration::from_millis(200));
    let nl = c.layout.layers.len();
    for d in c.layout.descs(&[3, 4], 0..nl, 0..2).unwrap() {
        assert!(
            bytes(&c.region, &d).iter().all(|&b| b == 0),
            "{d:?} was written"
        );
    }
    // Cancelling what already ended, or was never started, changes nothing.
    consumer.cancel("gone-client").unwrap();
    consumer.cancel("never").unwrap();
    assert_eq!(consumer.in_progress(), 0);
}

/// A producer that never answers (its connector gone, its agent still up: the consumer's
/// messages arrive and nothing comes back, as behind a connection that did not come back
/// after a cut link): the load fails typed at the grace, naming its blocks, and does not
/// wait for good. Before, a load that never got a lease had no end.
#[test]
fn a_load_its_producer_never_answers_fails_at_the_grace() {
    for mode in [Mode::Pull, Mode::Push] {
        let t = Transport::Tcp;
        let (p, paddr) = side("na", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
        let (c, _) = side("nc", &t, 2, 16, KvOrder::Nhd, KvPacking::Separate);
        let producer = Producer::new(p.agent.clone(), p.layout.clone(), cfg(mode), paddr).unwrap();
        let h = producer.publish("silent", &[1, 2], 32, 4).unwrap();
        drop(producer);
        let consumer = Consumer::new(c.agent.clone(), c.layout.clone(), cfg(mode)).unwrap();
        let t0 = Instant::now();
        consumer.start_load(&h, &[3, 4]).unwrap();
        let e = consumer
            .wait("silent", kvxfer_proto::connector::UNKNOWN_GRACE * 3)
            .unwrap_err();
        let took = t0.elapsed();
        eprintln!("{mode:?}: failed after {took:?}: {e}");
        assert!(
            matches!(&e, Error::Handoff { why, .. } if why.contains("has not answered")),
            "{mode:?}: {e}"
        );
        assert!(took >= kvxfer_proto::connector::UNKNOWN_GRACE, "{took:?}");
        let f = consumer.take_failed().pop().unwrap();
        assert_eq!(
            (f.request.as_str(), f.invalid_blocks),
            ("silent", vec![3, 4])
        );
        assert_eq!(consumer.in_progress(), 0);
    }
}
