//! Cache groups (vLLM's KV cache groups under its hybrid allocator): a request's KV in
//! several groups, each with its own layout and block ids, layers numbered across groups.
//! Bytes are checked per group; a group's slots that hold no block
//! ([`NO_BLOCK`]: a sliding window's blocks before it) move nothing; refusals and failures
//! name the group.

use super::cache::{TestCache, HEADS, LAYERS};
use super::harness::{
    cfg, figures, freed_as, ok, Connectors, Harness, Verdict, ALL, LAYERS_ALL, T,
};
use crate::connector::api::{KvCaches, KvConsumer, KvProducer};
use crate::connector::config::ConnectorConfig;
use kvxfer_proto::groups::NO_BLOCK;
use kvxfer_proto::layout::KvPacking;
use kvxfer_proto::lifecycle::FreeReason;
use kvxfer_proto::wire::connector::Mode;

const N: u32 = NO_BLOCK;

/// A producer and a consumer over two groups each; fields drop in order.
pub(super) struct Two {
    pub(super) producer: Box<dyn KvProducer>,
    pub(super) consumer: Box<dyn KvConsumer>,
    _connectors: Connectors,
    pub(super) src: [TestCache; 2],
    pub(super) dst: [TestCache; 2],
}

/// Group 0: full attention (HEADS heads of 8); group 1: `heads` heads of `dim` (a sliding
/// window of the same shape, or a group of another).
fn two(h: &dyn Harness, mode: Mode, heads: u64, dim: u64) -> std::result::Result<Two, String> {
    let shaped = |hd, d, seed| ok(TestCache::shaped(KvPacking::Separate, hd, d, seed), "cache");
    let src = [shaped(HEADS, 8, Some(51))?, shaped(heads, dim, Some(52))?];
    let dst = [shaped(HEADS, 8, None)?, shaped(heads, dim, None)?];
    two_of(h, mode, src, dst)
}

/// A producer over `src`'s two groups and a consumer over `dst`'s.
pub(super) fn two_of(
    h: &dyn Harness,
    mode: Mode,
    src: [TestCache; 2],
    dst: [TestCache; 2],
) -> std::result::Result<Two, String> {
    let conns = ok(h.connectors(1, 1), "connectors")?;
    let c = ConnectorConfig { mode, ..cfg() };
    let groups =
        |t: &[TestCache; 2]| -> Vec<KvCaches> { t.iter().map(|c| c.caches().clone()).collect() };
    let producer = ok(
        conns.producers[0].producer_groups(&groups(&src), &c),
        "producer",
    )?;
    let consumer = ok(
        conns.consumers[0].consumer_groups(&groups(&dst), &c),
        "consumer",
    )?;
    Ok(Two {
        producer,
        consumer,
        _connectors: conns,
        src,
        dst,
    })
}

/// Full attention beside a sliding window of the same shape, pulled: each group's blocks land
/// where its own list says; the window's slots that hold no block move nothing, on either
/// side; the cached prefix of the full group stays; the figures add both groups up.
pub fn groups_window_beside_full(h: &dyn Harness) -> Verdict {
    groups_case(h, Mode::Pull, HEADS, 8)
}

/// Two groups of different shapes (2 heads of 16 beside 4 of 8), pushed by the producer.
pub fn groups_of_two_shapes_pushed(h: &dyn Harness) -> Verdict {
    groups_case(h, Mode::Push, 2, 16)
}

fn groups_case(h: &dyn Harness, mode: Mode, heads: u64, dim: u64) -> Verdict {
    let s = two(h, mode, heads, dim)?;
    // Full: 4 blocks published, the first cached here. Window: the producer no longer holds
    // the first two; the consumer holds nothing for the third either.
    let full = [2, 4, 6, 8];
    let window = [N, N, 10, 12];
    let (full_local, window_local) = ([9, 1, 30], [N, N, 5, 7]);
    let hd = ok(
        s.producer
            .publish_groups("g", &[&full, &window], 16, 2 * LAYERS as usize, None),
        "publish_groups",
    )?;
    ensure!(
        hd.group_count() == 2,
        "a handoff of {} groups",
        hd.group_count()
    );
    ok(
        s.consumer
            .start_load_groups(&hd, &[&full_local, &window_local], &Default::default()),
        "start_load_groups",
    )?;
    ok(s.consumer.wait("g", T), "wait")?;
    s.dst[0]
        .holds(&full_local, &s.src[0], &full[1..], ALL, LAYERS_ALL)
        .map_err(|e| format!("group 0: {e}"))?;
    s.dst[1]
        .holds(&[5, 7], &s.src[1], &[10, 12], 0..heads, LAYERS_ALL)
        .map_err(|e| format!("group 1: {e}"))?;
    // Nothing else of either group was written: not the window's empty slots, not group 0's
    // blocks in group 1's tensors.
    ensure!(
        s.dst[1].zeroed(&[0, 1, 2, 3, 4, 6, 8, 9, 30], LAYERS_ALL),
        "group 1: blocks outside its pairs were written"
    );
    ensure!(
        s.dst[0].zeroed(&[0, 5, 7, 10, 12], LAYERS_ALL),
        "group 0: blocks outside its list were written"
    );
    let (b0, b1) = (
        s.src[0].request_block_bytes(),
        s.src[1].request_block_bytes(),
    );
    let st = s
        .consumer
        .next_finished()
        .ok_or("the load is not reported")?;
    figures(&st, 3 * b0 + 2 * b1, b0, "the load")?;
    freed_as(&*s.producer, "g", FreeReason::Acked, T)
}

/// Layer by layer across groups: group 1's layers follow group 0's in the numbering; each
/// is loadable once the producer says it is done, and not before.
pub fn groups_layer_wise(h: &dyn Harness) -> Verdict {
    let s = two(h, Mode::Pull, HEADS, 8)?;
    let (a, b) = ([3, 4], [N, 6]);
    let hd = ok(
        s.producer.publish_groups("lw", &[&a, &b], 8, 0, None),
        "publish",
    )?;
    ok(
        s.consumer
            .start_load_groups(&hd, &[&[20, 21], &[N, 22]], &Default::default()),
        "start_load_groups",
    )?;
    let nl = 2 * LAYERS as usize;
    for layer in 0..nl {
        let early = s
            .consumer
            .wait_layer("lw", layer, std::time::Duration::from_millis(30));
        ensure!(early.is_err(), "layer {layer} loaded before it was done");
        ok(s.producer.layer_done("lw", layer), "layer_done")?;
        ok(
            s.consumer.wait_layer("lw", layer, T),
            &format!("layer {layer}"),
        )?;
    }
    ok(s.consumer.wait("lw", T), "wait")?;
    s.dst[0].holds(&[20, 21], &s.src[0], &a, ALL, LAYERS_ALL)?;
    s.dst[1].holds(&[22], &s.src[1], &[6], ALL, LAYERS_ALL)?;
    let bad = s.producer.layer_done("lw2", nl);
    ensure!(
        bad.is_err(),
        "layer_done of a request never published: {bad:?}"
    );
    freed_as(&*s.producer, "lw", FreeReason::Acked, T)
}

/// What does not fit is refused before anything moves, naming the group: another number of
/// groups, more local blocks than a group published, a local block paired with a slot the
/// producer does not hold, a block outside a group's cache; and a failed load reports its
/// invalid blocks per group.
pub fn groups_refused_and_failed(h: &dyn Harness) -> Verdict {
    let s = two(h, Mode::Pull, HEADS, 8)?;
    let all = 2 * LAYERS as usize;
    let one = s.producer.publish("single", &[1, 2], 8, LAYERS as usize);
    ensure!(
        one.as_ref()
            .is_err_and(|e| e.to_string().contains("1 cache groups for a cache of 2")),
        "a one-group publish on a cache of two: {one:?}"
    );
    let outside = s.producer.publish_groups("out", &[&[1], &[40]], 4, 0, None);
    ensure!(
        outside
            .as_ref()
            .is_err_and(|e| e.to_string().contains("group 1 block 40 of 32")),
        "a block outside group 1's cache: {outside:?}"
    );
    let hd = ok(
        s.producer
            .publish_groups("r", &[&[1, 2], &[N, 4]], 8, all, None),
        "publish_groups",
    )?;
    let refused = |local: &[&[u32]], words: &[&str], what: &str| -> Verdict {
        let e = s
            .consumer
            .start_load_groups(&hd, local, &Default::default());
        let text = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
        ensure!(
            words.iter().all(|w| text.contains(w)),
            "{what}: {e:?}, not an error naming {words:?}"
        );
        Ok(())
    };
    refused(
        &[&[7, 8]],
        &["2 group(s), this consumer's 2, and block lists of 1"],
        "one block list for two groups",
    )?;
    refused(
        &[&[7, 8], &[5, 6, 9]],
        &["group 1:", "3 local blocks for 2 published"],
        "more local blocks than group 1 published",
    )?;
    refused(
        &[&[7, 8], &[5, 6]],
        &["group 1:", "local block 5 pairs with slot 0"],
        "a local block paired with a slot outside the producer's window",
    )?;
    // A handoff that dropped a group (an edited one, or a producer of one group) is refused.
    let mut cut = hd.clone();
    cut.groups.clear();
    let e = s
        .consumer
        .start_load_groups(&cut, &[&[7, 8], &[N, 6]], &Default::default());
    ensure!(e.is_err(), "a handoff of one group loaded into two: {e:?}");
    ensure!(
        s.dst[0].zeroed(&[5, 6, 7, 8, 9], LAYERS_ALL)
            && s.dst[1].zeroed(&[5, 6, 7, 8, 9], LAYERS_ALL),
        "a refused load wrote blocks"
    );
    s.producer.abort("r");
    // The producer gives a request up: the load fails with each group's blocks invalid.
    let gone = ok(
        s.producer
            .publish_groups("gone", &[&[1, 2], &[3, 4]], 8, all, None),
        "publish_groups",
    )?;
    s.producer.abort("gone");
    ok(
        s.consumer
            .start_load_groups(&gone, &[&[7, 8], &[N, 6]], &Default::default()),
        "start_load_groups",
    )?;
    ensure!(
        s.consumer.wait("gone", T).is_err(),
        "a load of an aborted request succeeded"
    );
    let f = s
        .consumer
        .next_failed()
        .ok_or("the failed load is not reported")?;
    ensure!(
        f.invalid_groups == [vec![7, 8], vec![6]] && f.invalid_blocks == [7, 8, 6],
        "invalid blocks {:?} by group {:?}",
        f.invalid_blocks,
        f.invalid_groups
    );
    Ok(())
}
