//! The conformance suite every implementation of the connector traits passes: kvxfer's
//! [`AgentConnector`](super::AgentConnector) and
//! [`InProcessConnector`](super::InProcessConnector) in kvxfer's CI, and a third party's
//! through the same [`Harness`].
//!
//! Each case builds small host caches with a seeded pattern, drives the traits as an engine
//! would, and checks bytes, figures and the blocks reported back; it returns the first
//! violation as text. [`connector_conformance!`](crate::connector_conformance) turns the
//! cases into one `#[test]` each:
//!
//! ```
//! use kvxfer::connector::conformance::{self, Connectors, Harness};
//! use kvxfer::connector::{InProcessConnector, KvConnector};
//!
//! struct Mine;
//! impl Harness for Mine {
//!     fn connectors(&self, producers: usize, consumers: usize) -> kvxfer::Result<Connectors> {
//!         let c = InProcessConnector::new(); // your implementation here
//!         let each = |n| (0..n).map(|_| Box::new(c.clone()) as Box<dyn KvConnector>).collect();
//!         Ok(Connectors { producers: each(producers), consumers: each(consumers) })
//!     }
//! }
//! // In a test file: `kvxfer::connector_conformance!(Mine);`. Or case by case:
//! let (name, case) = conformance::CASES[0];
//! assert!(case(&Mine).is_ok(), "{name}");
//! ```

mod cache;
mod harness;

use std::thread;
use std::time::{Duration, Instant};

pub use abuse::{peer_share, squatted_declarations};
pub use block_size::{
    block_sizes_large_to_small, block_sizes_large_to_small_pushed, block_sizes_small_to_large,
    block_sizes_small_to_large_pushed, block_sizes_that_cannot_map_are_refused,
};
pub use cache::{TestCache, BLOCKS, BLOCK_TOKENS, HEADS, LAYERS};
pub use groups::{
    groups_layer_wise, groups_of_two_shapes_pushed, groups_refused_and_failed,
    groups_window_beside_full,
};
use harness::{cfg, failed_naming, freed_as, ok, setup, Setup, ALL, LAYERS_ALL, T};
pub use harness::{Connectors, Harness, Verdict};
pub use state::{
    scales_travel_with_their_kv, state_beside_attention, state_beside_attention_pushed,
    state_follows_the_heads, state_that_cannot_split_is_refused,
};
pub use tp::{
    tp_gqa_replicas, tp_mla_one_to_two, tp_mla_two_to_one, tp_one_to_two, tp_padded_one_to_two,
    tp_padded_two_to_one, tp_state_one_to_two, tp_state_two_to_one, tp_two_to_one, tp_two_to_two,
};

use super::config::ConnectorConfig;
use kvxfer_proto::error::Error;
use kvxfer_proto::lifecycle::FreeReason;
use kvxfer_proto::wire::connector::Mode;

/// A case of the suite.
pub type Case = fn(&dyn Harness) -> Verdict;

/// Every case, by name.
pub const CASES: &[(&str, Case)] = &[
    ("full_load", full_load),
    ("partial_load", partial_load),
    ("all_cached", all_cached),
    ("layer_wise_order", layer_wise_order),
    ("push_full_and_partial", push_full_and_partial),
    ("push_while_heartbeats_cross", push_while_heartbeats_cross),
    ("abort", abort),
    ("lease_expiry", lease_expiry),
    ("hold_ceiling", hold_ceiling),
    ("two_readers_half_the_heads", two_readers_half_the_heads),
    ("failed_load_names_its_blocks", failed_load_names_its_blocks),
    ("concurrent_requests", concurrent_requests),
    ("dropped_consumer", dropped_consumer),
    ("dropped_producer", dropped_producer),
    ("tp_two_to_two", tp_two_to_two),
    ("tp_two_to_one", tp_two_to_one),
    ("tp_one_to_two", tp_one_to_two),
    ("tp_gqa_replicas", tp_gqa_replicas),
    ("tp_mla_two_to_one", tp_mla_two_to_one),
    ("tp_mla_one_to_two", tp_mla_one_to_two),
    ("tp_state_one_to_two", tp_state_one_to_two),
    ("tp_state_two_to_one", tp_state_two_to_one),
    ("tp_padded_one_to_two", tp_padded_one_to_two),
    ("tp_padded_two_to_one", tp_padded_two_to_one),
    ("state_beside_attention", state_beside_attention),
    (
        "state_beside_attention_pushed",
        state_beside_attention_pushed,
    ),
    (
        "state_that_cannot_split_is_refused",
        state_that_cannot_split_is_refused,
    ),
    ("state_follows_the_heads", state_follows_the_heads),
    ("scales_travel_with_their_kv", scales_travel_with_their_kv),
    ("groups_window_beside_full", groups_window_beside_full),
    ("groups_of_two_shapes_pushed", groups_of_two_shapes_pushed),
    ("groups_layer_wise", groups_layer_wise),
    ("groups_refused_and_failed", groups_refused_and_failed),
    ("block_sizes_small_to_large", block_sizes_small_to_large),
    ("block_sizes_large_to_small", block_sizes_large_to_small),
    (
        "block_sizes_small_to_large_pushed",
        block_sizes_small_to_large_pushed,
    ),
    (
        "block_sizes_large_to_small_pushed",
        block_sizes_large_to_small_pushed,
    ),
    (
        "block_sizes_that_cannot_map_are_refused",
        block_sizes_that_cannot_map_are_refused,
    ),
    ("squatted_declarations", squatted_declarations),
    ("peer_share", peer_share),
];

/// Runs every case; the verdicts by name.
pub fn run(h: &dyn Harness) -> Vec<(&'static str, Verdict)> {
    CASES.iter().map(|(n, c)| (*n, c(h))).collect()
}

/// One `#[test]` per conformance case for the [`Harness`] `$harness` (an expression).
#[macro_export]
macro_rules! connector_conformance {
    ($harness:expr) => {
        $crate::connector_conformance!(@cases $harness; full_load, partial_load, all_cached,
            layer_wise_order, push_full_and_partial, push_while_heartbeats_cross, abort,
            lease_expiry, hold_ceiling, two_readers_half_the_heads, failed_load_names_its_blocks,
            concurrent_requests, dropped_consumer, dropped_producer, tp_two_to_two,
            tp_two_to_one, tp_one_to_two, tp_gqa_replicas, tp_mla_two_to_one, tp_mla_one_to_two,
            tp_state_one_to_two, tp_state_two_to_one, tp_padded_one_to_two,
            tp_padded_two_to_one, state_beside_attention,
            state_beside_attention_pushed, state_that_cannot_split_is_refused,
            state_follows_the_heads, scales_travel_with_their_kv,
            groups_window_beside_full, groups_of_two_shapes_pushed, groups_layer_wise,
            groups_refused_and_failed, block_sizes_small_to_large, block_sizes_large_to_small,
            block_sizes_small_to_large_pushed, block_sizes_large_to_small_pushed,
            block_sizes_that_cannot_map_are_refused, squatted_declarations, peer_share);
    };
    (@cases $harness:expr; $($case:ident),*) => {
        $(
            #[test]
            fn $case() {
                if let Err(why) = $crate::connector::conformance::$case(&$harness) {
                    panic!("conformance case {}: {why}", stringify!($case));
                }
            }
        )*
    };
}

macro_rules! ensure {
    ($c:expr, $($t:tt)*) => {
        if !$c {
            return Err(format!($($t)*));
        }
    };
}

// After `ensure!`, which their cases use.
mod abuse;
mod block_size;
mod groups;
mod state;
mod tp;

fn one(h: &dyn Harness, mode: Mode) -> std::result::Result<Setup, String> {
    let c = ConnectorConfig { mode, ..cfg() };
    setup(h, c.clone(), vec![(HEADS, c)])
}

/// A whole request moves; every byte arrives; the figures say so; the producer frees it on
/// the acknowledgement.
pub fn full_load(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Pull)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let remote = [3, 9, 4, 20, 21, 22];
    let local = [0, 1, 2, 10, 30, 31];
    let hd = ok(p.publish("full", &remote, 24, LAYERS as usize), "publish")?;
    ok(c.start_load(&hd, &local), "start_load")?;
    ok(c.wait("full", T), "wait")?;
    s.dst[0].holds(&local, &s.src, &remote, ALL, LAYERS_ALL)?;
    let st = c
        .next_finished()
        .ok_or("a completed load is not reported by next_finished")?;
    ensure!(
        st.request == "full",
        "finished {:?}, not \"full\"",
        st.request
    );
    let want = 6 * s.src.request_block_bytes();
    ensure!(
        st.bytes_moved == want,
        "bytes_moved {} != {want}",
        st.bytes_moved
    );
    ensure!(
        st.bytes_skipped == 0,
        "bytes_skipped {} for a full load",
        st.bytes_skipped
    );
    freed_as(&**p, "full", FreeReason::Acked, T)?;
    let f = c.next_failed();
    ensure!(f.is_none(), "a good load reported as failed: {f:?}");
    ensure!(
        s.dst[0].zeroed(&[5, 6, 7], LAYERS_ALL),
        "blocks outside the load were written"
    );
    // The figures: the layers' reads overlap, so their wall time is within the handoff's (a
    // sum over layers is not); the producer that served the pull counts it.
    ensure!(
        st.transfer_time <= st.handoff_time,
        "transfer_time {:?} exceeds the handoff's {:?}",
        st.transfer_time,
        st.handoff_time
    );
    let served = p.telemetry().totals().0;
    ensure!(
        served == 1,
        "the producer counts {served} requests served, not 1"
    );
    Ok(())
}

/// A cached prefix stays: only the last blocks move, into the blocks given, and the figures
/// count the rest as skipped.
pub fn partial_load(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Pull)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let remote = [1, 2, 3, 4, 5, 6];
    let local = [11, 12, 13];
    let hd = ok(p.publish("part", &remote, 24, LAYERS as usize), "publish")?;
    ok(c.start_load(&hd, &local), "start_load")?;
    ok(c.wait("part", T), "wait")?;
    s.dst[0].holds(&local, &s.src, &remote[3..], ALL, LAYERS_ALL)?;
    ensure!(
        s.dst[0].zeroed(&[8, 9, 10, 14], LAYERS_ALL),
        "blocks around the loaded ones were written (the prefix must not move)"
    );
    let st = c
        .next_finished()
        .ok_or("the partial load is not reported")?;
    let bb = s.src.request_block_bytes();
    ensure!(
        st.bytes_moved == 3 * bb,
        "bytes_moved {} != {}",
        st.bytes_moved,
        3 * bb
    );
    ensure!(
        st.bytes_skipped == 3 * bb,
        "bytes_skipped {} != {}",
        st.bytes_skipped,
        3 * bb
    );
    freed_as(&**p, "part", FreeReason::Acked, T)
}

/// Everything cached: nothing moves, the load completes at once, the producer frees.
pub fn all_cached(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Pull)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let hd = ok(
        p.publish("cached", &[1, 2, 3], 12, LAYERS as usize),
        "publish",
    )?;
    ok(c.start_load(&hd, &[]), "start_load")?;
    ok(c.wait("cached", T), "wait")?;
    let st = c.next_finished().ok_or("the cached load is not reported")?;
    ensure!(
        st.bytes_moved == 0,
        "bytes_moved {} with nothing to load",
        st.bytes_moved
    );
    ensure!(
        s.dst[0].zeroed(&[0, 1, 2, 3], LAYERS_ALL),
        "a fully cached load wrote blocks"
    );
    freed_as(&**p, "cached", FreeReason::Acked, T)
}

/// Layer-wise: a layer is loadable only once the producer says it is computed, layers land
/// in order, and `wait_layer` returns for a layer while later ones are outstanding.
pub fn layer_wise_order(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Pull)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let remote = [5, 6, 7, 8];
    let local = [1, 2, 3, 4];
    let hd = ok(p.publish("lw", &remote, 16, 0), "publish")?;
    ok(c.start_load(&hd, &local), "start_load")?;
    let r = c.wait_layer("lw", 0, Duration::from_millis(300));
    ensure!(
        matches!(r, Err(Error::WaitTimeout(_))),
        "layer 0 loaded before it was computed: {r:?}"
    );
    ensure!(
        s.dst[0].zeroed(&local, LAYERS_ALL),
        "bytes moved before any layer was done"
    );
    for l in 0..LAYERS as usize {
        ok(p.layer_done("lw", l), "layer_done")?;
        ok(c.wait_layer("lw", l, T), &format!("wait_layer {l}"))?;
        s.dst[0].holds(&local, &s.src, &remote, ALL, 0..l + 1)?;
        if l + 1 < LAYERS as usize {
            ensure!(
                s.dst[0].zeroed(&local, l + 1..LAYERS as usize),
                "layers after {l} landed before they were computed"
            );
            let r = c.wait_layer("lw", l + 1, Duration::from_millis(100));
            ensure!(
                r.is_err(),
                "layer {} reported loaded before it was computed",
                l + 1
            );
        }
    }
    ok(c.wait("lw", T), "wait")?;
    freed_as(&**p, "lw", FreeReason::Acked, T)
}

/// Push mode: the producer writes into the consumer's blocks, full and partial.
pub fn push_full_and_partial(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Push)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let hd = ok(
        p.publish("push-a", &[1, 2, 3, 4], 16, LAYERS as usize),
        "publish",
    )?;
    ok(c.start_load(&hd, &[20, 21, 22, 23]), "start_load")?;
    ok(c.wait("push-a", T), "wait")?;
    s.dst[0].holds(&[20, 21, 22, 23], &s.src, &[1, 2, 3, 4], ALL, LAYERS_ALL)?;
    freed_as(&**p, "push-a", FreeReason::Acked, T)?;
    push_as_computed(&s, "push-b", &[9, 10, 11], &[25])?;
    ensure!(
        s.dst[0].zeroed(&[24, 26], LAYERS_ALL),
        "push wrote outside its blocks"
    );
    Ok(())
}

/// Publishes `req` (blocks `published`) before any layer is computed, loads its last
/// `local.len()` blocks into `local` of the first consumer, computes every layer, and checks
/// the bytes and the free (as acknowledged).
fn push_as_computed(s: &Setup, req: &str, published: &[u32], local: &[u32]) -> Verdict {
    let (p, c) = (&s.producer, &s.consumers[0]);
    let hd = ok(
        p.publish(req, published, BLOCK_TOKENS * published.len() as u64, 0),
        "publish",
    )?;
    ok(c.start_load(&hd, local), "start_load")?;
    for l in 0..LAYERS as usize {
        ok(p.layer_done(req, l), "layer_done")?;
    }
    ok(c.wait(req, T), &format!("wait for {req}"))?;
    let remote = &published[published.len() - local.len()..];
    s.dst[0].holds(local, &s.src, remote, ALL, LAYERS_ALL)?;
    freed_as(&**p, req, FreeReason::Acked, T)
}

/// Push with a heartbeat every millisecond: the producer counts a reader's landed writes as
/// its acknowledgement and frees the blocks, so a heartbeat may reach it after the free and
/// before the reader heard of its last layer. The load still completes, every time.
pub fn push_while_heartbeats_cross(h: &dyn Harness) -> Verdict {
    let c = ConnectorConfig {
        mode: Mode::Push,
        heartbeat: Duration::from_millis(1),
        ..cfg()
    };
    let s = setup(h, c.clone(), vec![(HEADS, c)])?;
    for i in 0..40 {
        // Every other request whole, the rest with its first two blocks cached.
        let local: &[u32] = if i % 2 == 0 { &[20, 21, 22] } else { &[25] };
        push_as_computed(&s, &format!("hb-{i}"), &[9, 10, 11], local)?;
    }
    Ok(())
}

/// An aborted request is freed at once as aborted; a later load of it fails, typed, naming
/// its blocks.
pub fn abort(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Pull)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let hd = ok(p.publish("ab", &[1, 2], 8, LAYERS as usize), "publish")?;
    ensure!(p.held() == 1, "held {} after one publish", p.held());
    p.abort("ab");
    let f = p
        .next_freed(T)
        .ok_or("an aborted request is not reported freed")?;
    ensure!(
        f.request == "ab" && f.reason == FreeReason::Aborted && f.blocks == [1, 2],
        "freed {f:?}"
    );
    ensure!(p.held() == 0, "held {} after the abort", p.held());
    if c.start_load(&hd, &[3, 4]).is_err() {
        return Ok(()); // refused up front: also typed
    }
    let r = c.wait("ab", T);
    ensure!(
        matches!(r, Err(Error::Handoff { .. })),
        "load of an aborted request: {r:?}"
    );
    failed_naming(&**c, &[3, 4])?;
    ensure!(
        s.dst[0].zeroed(&[3, 4], LAYERS_ALL),
        "an aborted request's bytes were read"
    );
    Ok(())
}

/// With no reader, a request's lease ends: it is freed as expired, and a late reader fails.
pub fn lease_expiry(h: &dyn Harness) -> Verdict {
    let c = ConnectorConfig {
        lease: Duration::from_millis(300),
        ..cfg()
    };
    let s = setup(h, c.clone(), vec![(HEADS, c)])?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let t0 = Instant::now();
    let hd = ok(p.publish("exp", &[1, 2, 3], 12, LAYERS as usize), "publish")?;
    freed_as(&**p, "exp", FreeReason::Expired, Duration::from_secs(10))?;
    let took = t0.elapsed();
    ensure!(
        took >= Duration::from_millis(250),
        "freed after {took:?}, before its 300 ms lease"
    );
    if c.start_load(&hd, &[4, 5, 6]).is_ok() {
        let r = c.wait("exp", T);
        ensure!(r.is_err(), "a load of an expired request succeeded");
        failed_naming(&**c, &[4, 5, 6])?;
    }
    Ok(())
}

/// A load that never ends (its producer never computes the layers, its consumer heartbeats
/// throughout) holds the blocks no longer than the producer's ceiling, and the load fails
/// naming its blocks. They are freed as [`FreeReason::HoldLimit`], or as `Acked` when the
/// consumer gives up first: its view of the lease ends a margin before the producer's (so that
/// no read outlives the lease), and a failed pull load releases its blocks at once.
pub fn hold_ceiling(h: &dyn Harness) -> Verdict {
    let pc = ConnectorConfig {
        lease: Duration::from_millis(400),
        max_hold: Duration::from_millis(1200),
        ..cfg()
    };
    let s = setup(h, pc, vec![(HEADS, cfg())])?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let t0 = Instant::now();
    // No layer is computed: the consumer waits, heartbeating every 50 ms.
    let hd = ok(p.publish("endless", &[1, 2], 8, 0), "publish")?;
    ok(c.start_load(&hd, &[6, 7]), "start_load")?;
    let f = ok(
        p.wait_freed("endless", Duration::from_secs(10)),
        "waiting for \"endless\" to be freed",
    )?;
    let took = t0.elapsed();
    ensure!(
        matches!(f.reason, FreeReason::HoldLimit | FreeReason::Acked),
        "\"endless\" freed as {:?}",
        f.reason
    );
    ensure!(
        took >= Duration::from_millis(1100) && took < Duration::from_secs(5),
        "freed after {took:?} with a 1.2 s ceiling and heartbeats every 50 ms"
    );
    let r = c.wait("endless", T);
    ensure!(
        r.is_err(),
        "the load of a request freed at its ceiling succeeded"
    );
    failed_naming(&**c, &[6, 7])?;
    Ok(())
}

/// Two decode ranks read half the heads each; the blocks are freed after the second.
pub fn two_readers_half_the_heads(h: &dyn Harness) -> Verdict {
    let pc = ConnectorConfig {
        readers: 2,
        ..cfg()
    };
    let lo = ConnectorConfig {
        heads: Some(0..HEADS / 2),
        ..cfg()
    };
    let hi = ConnectorConfig {
        heads: Some(HEADS / 2..HEADS),
        ..cfg()
    };
    let s = setup(h, pc, vec![(HEADS / 2, lo), (HEADS / 2, hi)])?;
    let p = &s.producer;
    let remote = [2, 4, 6];
    let hd = ok(p.publish("tp", &remote, 12, LAYERS as usize), "publish")?;
    ok(
        s.consumers[0].start_load(&hd, &[0, 1, 2]),
        "start_load (heads 0..2)",
    )?;
    ok(s.consumers[0].wait("tp", T), "wait (heads 0..2)")?;
    s.dst[0].holds(&[0, 1, 2], &s.src, &remote, 0..HEADS / 2, LAYERS_ALL)?;
    let early = p.wait_freed("tp", Duration::from_millis(300));
    ensure!(early.is_err(), "freed after one of two readers: {early:?}");
    ok(
        s.consumers[1].start_load(&hd, &[7, 8, 9]),
        "start_load (heads 2..4)",
    )?;
    ok(s.consumers[1].wait("tp", T), "wait (heads 2..4)")?;
    s.dst[1].holds(&[7, 8, 9], &s.src, &remote, HEADS / 2..HEADS, LAYERS_ALL)?;
    freed_as(&**p, "tp", FreeReason::Acked, T)
}

/// A load that cannot complete (the producer gives the request up mid-load) fails, typed,
/// reporting exactly the local blocks it was loading, and nothing else.
pub fn failed_load_names_its_blocks(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Pull)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let hd = ok(p.publish("mid", &[1, 2, 3, 4, 5], 20, 0), "publish")?;
    ok(c.start_load(&hd, &[17, 18, 19]), "start_load")?;
    ok(p.layer_done("mid", 0), "layer_done")?;
    ok(c.wait_layer("mid", 0, T), "wait_layer 0")?;
    p.abort("mid");
    let r = c.wait("mid", T);
    ensure!(
        matches!(r, Err(Error::Handoff { .. })),
        "wait after the abort: {r:?}"
    );
    let fl = c.next_failed().ok_or("the failed load is not reported")?;
    ensure!(fl.request == "mid", "failed {:?}", fl.request);
    ensure!(
        fl.invalid_blocks == [17, 18, 19],
        "invalid blocks {:?}",
        fl.invalid_blocks
    );
    ensure!(c.next_failed().is_none(), "one failure reported twice");
    ensure!(
        c.in_progress() == 0,
        "{} loads still in progress",
        c.in_progress()
    );
    Ok(())
}

/// Eight requests published and loaded at once from eight threads: each its own bytes.
pub fn concurrent_requests(h: &dyn Harness) -> Verdict {
    let s = one(h, Mode::Pull)?;
    let (p, c) = (&s.producer, &s.consumers[0]);
    let mut handoffs = Vec::new();
    for i in 0..8u32 {
        let remote = [i * 4, i * 4 + 1, i * 4 + 2];
        let hd = ok(
            p.publish(&format!("c{i}"), &remote, 12, LAYERS as usize),
            "publish",
        )?;
        handoffs.push((hd, remote, [31 - i * 3, 30 - i * 3, 29 - i * 3]));
    }
    let errs: Vec<String> = thread::scope(|sc| {
        let joins: Vec<_> = handoffs
            .iter()
            .map(|(hd, _, local)| {
                sc.spawn(move || {
                    c.start_load(hd, local)
                        .and_then(|()| c.wait(&hd.request, T))
                        .err()
                        .map(|e| format!("{}: {e}", hd.request))
                })
            })
            .collect();
        joins
            .into_iter()
            .filter_map(|j| j.join().unwrap_or(Some("a loader panicked".into())))
            .collect()
    });
    ensure!(errs.is_empty(), "{}", errs.join("; "));
    for (_, remote, local) in &handoffs {
        s.dst[0].holds(local, &s.src, remote, ALL, LAYERS_ALL)?;
    }
    let mut n = 0;
    while c.next_finished().is_some() {
        n += 1;
    }
    ensure!(n == 8, "{n} of 8 loads reported finished");
    let deadline = Instant::now() + T;
    while p.held() > 0 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    ensure!(
        p.held() == 0,
        "{} requests still held after every load",
        p.held()
    );
    Ok(())
}

/// A decode worker that goes away mid-load leaves nothing held: its lease ends.
pub fn dropped_consumer(h: &dyn Harness) -> Verdict {
    let c = ConnectorConfig {
        lease: Duration::from_millis(500),
        ..cfg()
    };
    let mut s = setup(h, c.clone(), vec![(HEADS, c)])?;
    let hd = ok(s.producer.publish("dc", &[1, 2, 3], 12, 0), "publish")?;
    ok(s.consumers[0].start_load(&hd, &[4, 5, 6]), "start_load")?;
    ok(s.producer.layer_done("dc", 0), "layer_done")?;
    ok(s.consumers[0].wait_layer("dc", 0, T), "wait_layer 0")?;
    drop(s.consumers.pop());
    freed_as(
        &*s.producer,
        "dc",
        FreeReason::Expired,
        Duration::from_secs(10),
    )?;
    ensure!(s.producer.held() == 0, "held {}", s.producer.held());
    Ok(())
}

/// A prefill worker that goes away mid-load: the load fails, typed, naming its blocks, within
/// a bounded time (no hang).
pub fn dropped_producer(h: &dyn Harness) -> Verdict {
    let c = ConnectorConfig {
        lease: Duration::from_millis(500),
        ..cfg()
    };
    let s = setup(h, c.clone(), vec![(HEADS, c)])?;
    let Setup {
        producer,
        consumers,
        _connectors,
        src,
        dst,
    } = s;
    let hd = ok(producer.publish("dp", &[1, 2, 3], 12, 0), "publish")?;
    ok(consumers[0].start_load(&hd, &[4, 5, 6]), "start_load")?;
    ok(producer.layer_done("dp", 0), "layer_done")?;
    ok(consumers[0].wait_layer("dp", 0, T), "wait_layer 0")?;
    drop(producer);
    let t0 = Instant::now();
    let r = consumers[0].wait("dp", T);
    ensure!(r.is_err(), "a load whose producer went away completed");
    ensure!(
        !matches!(r, Err(Error::WaitTimeout(_))),
        "a load whose producer went away still runs after {:?}",
        t0.elapsed()
    );
    let fl = consumers[0]
        .next_failed()
        .ok_or("the failed load is not reported")?;
    ensure!(
        fl.invalid_blocks == [4, 5, 6],
        "invalid blocks {:?}",
        fl.invalid_blocks
    );
    drop(consumers);
    drop((_connectors, src, dst));
    Ok(())
}
