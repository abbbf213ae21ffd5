//! Recurrent-state groups (Mamba, Mamba2, GDN: [`kvxfer_proto::state`]): a request's state
//! page moves whole beside its attention blocks, pulled or pushed; between TP sizes each
//! decode rank reads its split units of every part and segment; what cannot split (a page of
//! a single unit a rank) or does not match (another page) is refused before anything moves,
//! naming the group. Quantized KV whose scales are a buffer of their own moves them as a group
//! beside it, with the same block ids.

use super::cache::{TestCache, HEADS, LAYERS};
use super::groups::two_of;
use super::harness::{figures, freed_as, ok, Harness, Verdict, ALL, LAYERS_ALL, T};
use crate::connector::api::LoadSpec;
use kvxfer_proto::groups::NO_BLOCK;
use kvxfer_proto::layout::{KvPacking, StateShape};
use kvxfer_proto::lifecycle::FreeReason;
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::wire::connector::Mode;

const N: u32 = NO_BLOCK;
/// Split units of a state page at TP 1.
const UNITS: u64 = 4;

/// An attention cache of `heads` heads of 8, zeroed or filled from `seed`.
fn attn(heads: u64, seed: Option<u64>) -> std::result::Result<TestCache, String> {
    ok(
        TestCache::shaped(KvPacking::Separate, heads, 8, seed),
        "cache",
    )
}

/// Attention beside a padded state page (a hybrid model's), pulled.
pub fn state_beside_attention(h: &dyn Harness) -> Verdict {
    state_case(h, Mode::Pull, false)
}

/// The same with the state group first (vLLM orders groups by their layers), pushed by the
/// producer: the state's units follow the attention group's heads wherever it sits.
pub fn state_beside_attention_pushed(h: &dyn Harness) -> Verdict {
    state_case(h, Mode::Push, true)
}

fn state_case(h: &dyn Harness, mode: Mode, state_first: bool) -> Verdict {
    let state = |seed| ok(TestCache::state(UNITS, 40, seed), "state cache");
    let (a, st) = if state_first { (1, 0) } else { (0, 1) };
    let order = |x: TestCache, y: TestCache| if state_first { [y, x] } else { [x, y] };
    let s = two_of(
        h,
        mode,
        order(attn(HEADS, Some(61))?, state(Some(62))?),
        order(attn(HEADS, None)?, state(None)?),
    )?;
    // The state group holds one page, for the whole prompt (vLLM's last block); the consumer
    // holds the attention prefix, never a state prefix.
    let (full, pages) = ([2, 4, 6, 8], [N, N, N, 3]);
    let (full_local, page_local): (&[u32], &[u32]) = (&[9, 1, 30], &[7]);
    fn lists<'a>(state_first: bool, x: &'a [u32], y: &'a [u32]) -> [&'a [u32]; 2] {
        if state_first {
            [y, x]
        } else {
            [x, y]
        }
    }
    let hd = ok(
        s.producer.publish_groups(
            "st",
            &lists(state_first, &full, &pages),
            16,
            2 * LAYERS as usize,
            None,
        ),
        "publish_groups",
    )?;
    ok(
        s.consumer.start_load_groups(
            &hd,
            &lists(state_first, full_local, page_local),
            &Default::default(),
        ),
        "start_load_groups",
    )?;
    ok(s.consumer.wait("st", T), "wait")?;
    s.dst[a]
        .holds(full_local, &s.src[a], &full[1..], ALL, LAYERS_ALL)
        .map_err(|e| format!("attention: {e}"))?;
    s.dst[st]
        .holds(page_local, &s.src[st], &[3], 0..UNITS, LAYERS_ALL)
        .map_err(|e| format!("state: {e}"))?;
    let others: Vec<u32> = (0..32).filter(|&b| b != 7).collect();
    ensure!(
        s.dst[st].zeroed(&others, LAYERS_ALL),
        "state pages other than the request's were written"
    );
    let (b0, page) = (
        s.src[a].request_block_bytes(),
        s.src[st].request_block_bytes(),
    );
    let st = s
        .consumer
        .next_finished()
        .ok_or("the load is not reported")?;
    figures(&st, 3 * b0 + page, b0, "the load")?;
    freed_as(&*s.producer, "st", FreeReason::Acked, T)
}

/// Between TP sizes a page that cannot split is refused, naming the group, before a byte
/// moves: a page of another padding (another shape), and a hybrid model's page of one unit
/// a rank read by a decode rank that takes half the heads.
pub fn state_that_cannot_split_is_refused(h: &dyn Harness) -> Verdict {
    // Prefill TP 1 (4 heads, 4 units), decode TP 2 rank 0 (2 heads, 2 units), pages padded
    // by 40 and 30 bytes a unit.
    let padded = two_of(
        h,
        Mode::Pull,
        [
            attn(HEADS, Some(71))?,
            ok(TestCache::state(UNITS, 40, Some(72)), "state")?,
        ],
        [attn(2, None)?, ok(TestCache::state(2, 30, None), "state")?],
    )?;
    let half = reading(0..2, 0..2, 2);
    refused(&padded, &half, &["group 1", "differs from this consumer's"])?;
    // One opaque unit a rank: half the heads is not a whole unit.
    let opaque = |seed| {
        ok(
            TestCache::state_shaped(1, StateShape::opaque(96), seed),
            "opaque state",
        )
    };
    let single = two_of(
        h,
        Mode::Pull,
        [attn(HEADS, Some(73))?, opaque(Some(74))?],
        [attn(2, None)?, opaque(None)?],
    )?;
    refused(&single, &half, &["group 1", "do not split"])
}

/// A load of the producer's heads `remote` into `local`, declaring `readers` readers.
fn reading(remote: std::ops::Range<u64>, local: std::ops::Range<u64>, readers: u32) -> LoadSpec {
    LoadSpec {
        heads: Some(HeadMap { remote, local }),
        readers: Some(readers),
    }
}

fn refused(s: &super::groups::Two, spec: &LoadSpec, words: &[&str]) -> Verdict {
    let hd = ok(
        s.producer
            .publish_groups("split", &[&[1, 2], &[N, 3]], 8, 2 * LAYERS as usize, None),
        "publish_groups",
    )?;
    let e = s.consumer.start_load_groups(&hd, &[&[5, 6], &[9]], spec);
    let text = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(
        words.iter().all(|w| text.contains(w)),
        "{e:?}, not an error naming {words:?}"
    );
    ensure!(
        s.dst[0].zeroed(&[5, 6], LAYERS_ALL) && s.dst[1].zeroed(&[9], LAYERS_ALL),
        "a refused load wrote blocks"
    );
    s.producer.abort("split");
    Ok(())
}

/// A decode rank of half the prefill's heads (TP 1 to TP 2, rank 1) over a model whose state
/// group comes first (2 split units at TP 1, one at TP 2): it reads heads 2..4 of the
/// attention group and, in the same fraction, unit 1 of every part and segment of the state
/// page, into its unit 0.
pub fn state_follows_the_heads(h: &dyn Harness) -> Verdict {
    let s = two_of(
        h,
        Mode::Pull,
        [
            ok(TestCache::state(2, 0, Some(81)), "state")?,
            attn(HEADS, Some(82))?,
        ],
        [ok(TestCache::state(1, 0, None), "state")?, attn(2, None)?],
    )?;
    let hd = ok(
        s.producer
            .publish_groups("half", &[&[N, 3], &[1, 2]], 8, 2 * LAYERS as usize, None),
        "publish_groups",
    )?;
    let spec = reading(2..4, 0..2, 1);
    ok(
        s.consumer.start_load_groups(&hd, &[&[9], &[5, 6]], &spec),
        "start_load_groups",
    )?;
    ok(s.consumer.wait("half", T), "wait")?;
    s.dst[1]
        .holds_in(&[5, 6], 0..2, &s.src[1], &[1, 2], 2..4, LAYERS_ALL)
        .map_err(|e| format!("attention: {e}"))?;
    s.dst[0]
        .holds_in(&[9], 0..1, &s.src[0], &[3], 1..2, LAYERS_ALL)
        .map_err(|e| format!("state: {e}"))?;
    freed_as(&*s.producer, "half", FreeReason::Acked, T)
}

/// Quantized KV with its scales in a buffer of their own (FP8 values, one float32 scale per
/// token and head for K and for V), the scales a group beside the KV with the same block ids:
/// a decode rank of half the heads reads both groups' heads 2..4, so each block's scales land
/// with its values, and the blocks' other heads and scales stay untouched.
pub fn scales_travel_with_their_kv(h: &dyn Harness) -> Verdict {
    use kvxfer_proto::layout::{KvDtype, KvOrder};
    let of = |heads, dim, dtype, seed| {
        ok(
            TestCache::typed(
                KvPacking::Separate,
                KvOrder::Hnd,
                heads,
                dim,
                dtype,
                4,
                seed,
            ),
            "cache",
        )
    };
    let s = two_of(
        h,
        Mode::Pull,
        [
            of(HEADS, 16, KvDtype::Fp8, Some(91))?,
            of(HEADS, 1, KvDtype::F32, Some(92))?,
        ],
        [
            of(2, 16, KvDtype::Fp8, None)?,
            of(2, 1, KvDtype::F32, None)?,
        ],
    )?;
    let blocks = [4, 5, 6];
    let hd = ok(
        s.producer
            .publish_groups("q8", &[&blocks, &blocks], 12, 2 * LAYERS as usize, None),
        "publish_groups",
    )?;
    let spec = reading(2..4, 0..2, 1);
    let local = [20, 21, 22];
    ok(
        s.consumer.start_load_groups(&hd, &[&local, &local], &spec),
        "start_load_groups",
    )?;
    ok(s.consumer.wait("q8", T), "wait")?;
    for (g, what) in [(0, "values"), (1, "scales")] {
        s.dst[g]
            .holds_in(&local, 0..2, &s.src[g], &blocks, 2..4, LAYERS_ALL)
            .map_err(|e| format!("{what}: {e}"))?;
        let others: Vec<u32> = (0..32).filter(|b| !local.contains(b)).collect();
        ensure!(
            s.dst[g].zeroed(&others, LAYERS_ALL),
            "{what}: blocks outside the load were written"
        );
    }
    freed_as(&*s.producer, "q8", FreeReason::Acked, T)
}
