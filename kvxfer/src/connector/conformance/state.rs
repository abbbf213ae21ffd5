//! Recurrent-state groups (Mamba, Mamba2, GDN: [`kvxfer_proto::state`]): a request's state
//! page moves whole beside its attention blocks, pulled or pushed; between TP sizes each
//! decode rank reads its split units of every part and segment; what cannot split (a padded
//! page, or one of a single unit a rank) is refused before anything moves, naming the group.

use super::cache::{TestCache, HEADS, LAYERS};
use super::groups::two_of;
use super::harness::{freed_as, ok, Harness, Verdict, ALL, LAYERS_ALL, T};
use crate::connector::api::LoadSpec;
use kvxfer_proto::groups::NO_BLOCK;
use kvxfer_proto::layout::{KvPacking, StateShape};
use kvxfer_proto::lifecycle::FreeReason;
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::wire::connector::Mode;

const N: u32 = NO_BLOCK;
/// Split units of a state page at TP 1.
const UNITS: u64 = 4;

/// Attention beside a padded state page (a hybrid model's), pulled.
pub fn state_beside_attention(h: &dyn Harness) -> Verdict {
    state_case(h, Mode::Pull)
}

/// The same, pushed by the producer.
pub fn state_beside_attention_pushed(h: &dyn Harness) -> Verdict {
    state_case(h, Mode::Push)
}

fn state_case(h: &dyn Harness, mode: Mode) -> Verdict {
    let attn = |seed| {
        ok(
            TestCache::shaped(KvPacking::Separate, HEADS, 8, seed),
            "cache",
        )
    };
    let state = |seed| ok(TestCache::state(UNITS, 40, seed), "state cache");
    let s = two_of(
        h,
        mode,
        [attn(Some(61))?, state(Some(62))?],
        [attn(None)?, state(None)?],
    )?;
    // The state group holds one page, for the whole prompt (vLLM's last block); the consumer
    // holds the attention prefix, never a state prefix.
    let (full, pages) = ([2, 4, 6, 8], [N, N, N, 3]);
    let hd = ok(
        s.producer
            .publish_groups("st", &[&full, &pages], 16, 2 * LAYERS as usize, None),
        "publish_groups",
    )?;
    ok(
        s.consumer
            .start_load_groups(&hd, &[&[9, 1, 30], &[7]], &Default::default()),
        "start_load_groups",
    )?;
    ok(s.consumer.wait("st", T), "wait")?;
    s.dst[0]
        .holds(&[9, 1, 30], &s.src[0], &full[1..], ALL, LAYERS_ALL)
        .map_err(|e| format!("attention: {e}"))?;
    s.dst[1]
        .holds(&[7], &s.src[1], &[3], 0..UNITS, LAYERS_ALL)
        .map_err(|e| format!("state: {e}"))?;
    let others: Vec<u32> = (0..32).filter(|&b| b != 7).collect();
    ensure!(
        s.dst[1].zeroed(&others, LAYERS_ALL),
        "state pages other than the request's were written"
    );
    let (b0, page) = (
        s.src[0].request_block_bytes(),
        s.src[1].request_block_bytes(),
    );
    let st = s
        .consumer
        .next_finished()
        .ok_or("the load is not reported")?;
    let (moved, skipped) = (3 * b0 + page, b0);
    ensure!(
        st.bytes_moved == moved && st.bytes_skipped == skipped,
        "moved {} skipped {}, want {moved} and {skipped}",
        st.bytes_moved,
        st.bytes_skipped
    );
    freed_as(&*s.producer, "st", FreeReason::Acked, T)
}

/// Between TP sizes a page that cannot split is refused, naming the group, before a byte
/// moves: a padded page read by a rank of other units, and a hybrid model's page of one unit
/// a rank read by a decode rank that takes half the heads.
pub fn state_that_cannot_split_is_refused(h: &dyn Harness) -> Verdict {
    let attn = |heads, seed| {
        ok(
            TestCache::shaped(KvPacking::Separate, heads, 8, seed),
            "cache",
        )
    };
    // Prefill TP 1 (4 heads, 4 units), decode TP 2 rank 0 (2 heads, 2 units), padded pages.
    let padded = two_of(
        h,
        Mode::Pull,
        [
            attn(HEADS, Some(71))?,
            ok(TestCache::state(UNITS, 40, Some(72)), "state")?,
        ],
        [attn(2, None)?, ok(TestCache::state(2, 40, None), "state")?],
    )?;
    let half = LoadSpec {
        heads: Some(HeadMap {
            remote: 0..2,
            local: 0..2,
        }),
        readers: Some(2),
    };
    refused(&padded, &half, &["group 1", "padded pages"])?;
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
