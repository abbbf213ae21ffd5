//! Tensor-parallel cases: prefill and decode deployments of equal and unequal TP sizes, each
//! rank its own producer or consumer, every decode rank loading what
//! [`kvxfer_proto::tp::plan`] names with [`KvConsumer::start_load_with`], every prefill rank's
//! blocks freed on acknowledgement (readers declared by the decode ranks, not configured on
//! the prefill side).

use super::cache::{TestCache, LAYERS};
use super::harness::{cfg, figures, freed_as, ok, Connectors, Harness, Verdict, T};
use crate::connector::api::{KvConsumer, KvProducer, LoadSpec};
use kvxfer_proto::lifecycle::FreeReason;
use kvxfer_proto::tp::{plan, TpSide};

/// Prefill TP 2 to decode TP 2: rank r reads rank r's heads.
pub fn tp_two_to_two(h: &dyn Harness) -> Verdict {
    tp_case(h, 2, 2, 4)
}

/// Prefill TP 2 to decode TP 1: the decode rank reads both halves, each into its place.
pub fn tp_two_to_one(h: &dyn Harness) -> Verdict {
    tp_case(h, 2, 1, 4)
}

/// Prefill TP 1 to decode TP 2: each decode rank reads half the heads; the prefill rank frees
/// after both.
pub fn tp_one_to_two(h: &dyn Harness) -> Verdict {
    tp_case(h, 1, 2, 4)
}

/// Grouped-query attention with fewer KV heads than ranks: 2 KV heads, prefill TP 4 (each
/// head on two ranks) to decode TP 1; the replicas nobody reads are acknowledged and freed.
pub fn tp_gqa_replicas(h: &dyn Harness) -> Verdict {
    tp_case(h, 4, 1, 2)
}

/// MLA, prefill TP 2 to decode TP 1: the latent is whole on both prefill ranks; the decode
/// rank reads it once, from one of them, and only acknowledges the other.
pub fn tp_mla_two_to_one(h: &dyn Harness) -> Verdict {
    tp_case_of(h, 2, 1, 1, |_, seed| TestCache::latent(seed))
}

/// MLA, prefill TP 1 to decode TP 2: each decode rank reads the whole latent from the one
/// prefill rank, which frees its blocks after both.
pub fn tp_mla_one_to_two(h: &dyn Harness) -> Verdict {
    tp_case_of(h, 1, 2, 1, |_, seed| TestCache::latent(seed))
}

/// Recurrent state (a Mamba2-like page of 4 split units at TP 1, padded as a hybrid model's
/// is), prefill TP 1 to decode TP 2: each decode rank reads its two units of every part and
/// segment (conv x, B and C, then the SSM heads) into its page.
pub fn tp_state_one_to_two(h: &dyn Harness) -> Verdict {
    tp_case_of(h, 1, 2, 4, |units, seed| TestCache::state(units, 10, seed))
}

/// The same, prefill TP 2 to decode TP 1: the decode rank gathers both ranks' units.
pub fn tp_state_two_to_one(h: &dyn Harness) -> Verdict {
    tp_case_of(h, 2, 1, 4, |units, seed| TestCache::state(units, 10, seed))
}

/// Attention pages padded per head (a hybrid model's, vLLM's `page_size_padded`), prefill TP
/// 1 to decode TP 2: each side steps over its own padding, and none of it moves.
pub fn tp_padded_one_to_two(h: &dyn Harness) -> Verdict {
    tp_case_of(h, 1, 2, 4, |heads, seed| TestCache::padded(heads, 40, seed))
}

/// The same, prefill TP 2 to decode TP 1.
pub fn tp_padded_two_to_one(h: &dyn Harness) -> Verdict {
    tp_case_of(h, 2, 1, 4, |heads, seed| TestCache::padded(heads, 40, seed))
}

/// Ranks built over fresh caches; fields drop in order (connector objects before caches).
struct Ranks {
    producers: Vec<Box<dyn KvProducer>>,
    consumers: Vec<Box<dyn KvConsumer>>,
    _connectors: Connectors,
    src: Vec<TestCache>,
    dst: Vec<TestCache>,
}

/// A rank's cache of `heads` heads, zeroed or filled from `seed`.
type RankCache = fn(u64, Option<u64>) -> kvxfer_proto::error::Result<TestCache>;

fn tp_case(h: &dyn Harness, ptp: u64, dtp: u64, kv_heads: u64) -> Verdict {
    tp_case_of(h, ptp, dtp, kv_heads, TestCache::new)
}

fn tp_case_of(h: &dyn Harness, ptp: u64, dtp: u64, kv_heads: u64, cache: RankCache) -> Verdict {
    let (pre, dec) = (TpSide::new(ptp, kv_heads), TpSide::new(dtp, kv_heads));
    let conns = ok(h.connectors(ptp as usize, dtp as usize), "connectors")?;
    let mut r = Ranks {
        producers: Vec::new(),
        consumers: Vec::new(),
        src: Vec::new(),
        dst: Vec::new(),
        _connectors: Connectors {
            producers: Vec::new(),
            consumers: Vec::new(),
        },
    };
    for p in 0..ptp {
        r.src
            .push(ok(cache(pre.heads_per_rank(), Some(31 + p)), "cache")?);
    }
    for _ in 0..dtp {
        r.dst.push(ok(cache(dec.heads_per_rank(), None), "cache")?);
    }
    for (c, s) in conns.producers.iter().zip(&r.src) {
        r.producers
            .push(ok(c.producer(s.caches(), &cfg()), "producer")?);
    }
    for (c, d) in conns.consumers.iter().zip(&r.dst) {
        r.consumers
            .push(ok(c.consumer(d.caches(), &cfg()), "consumer")?);
    }
    r._connectors = conns;
    // Every prefill rank publishes the request under its own name (one consumer may load it
    // from several ranks), with the default of one reader: the decode ranks declare theirs.
    // Four published blocks; the decode ranks hold the first (a cached prefix): three move.
    let remote = [2, 4, 6, 8];
    let local = [9, 1, 30];
    let mut handoffs = Vec::new();
    for (p, prod) in r.producers.iter().enumerate() {
        let req = format!("tp#{p}");
        handoffs.push(ok(
            prod.publish(&req, &remote, 12, LAYERS as usize),
            "publish",
        )?);
    }
    for (c, cons) in r.consumers.iter().enumerate() {
        for read in ok(plan(pre, dec, c as u64), "plan")? {
            let blocks: &[u32] = if read.heads.is_some() { &local } else { &[] };
            let hd = &handoffs[read.producer_rank as usize];
            let what = format!(
                "decode rank {c} loading from prefill rank {}",
                read.producer_rank
            );
            ok(
                cons.start_load_with(hd, blocks, &LoadSpec::from_tp(&read)),
                &what,
            )?;
        }
    }
    for (c, cons) in r.consumers.iter().enumerate() {
        for read in ok(plan(pre, dec, c as u64), "plan")? {
            let req = format!("tp#{}", read.producer_rank);
            ok(
                cons.wait(&req, T),
                &format!("decode rank {c} waiting for {req}"),
            )?;
            let Some(m) = read.heads else { continue };
            let src = &r.src[read.producer_rank as usize];
            let layers = 0..LAYERS as usize;
            r.dst[c]
                .holds_in(
                    &local,
                    m.local.clone(),
                    src,
                    &remote[1..],
                    m.remote.clone(),
                    layers,
                )
                .map_err(|e| {
                    format!(
                        "decode rank {c}, heads {:?} from prefill rank {}: {e}",
                        m.local, read.producer_rank
                    )
                })?;
        }
        r.dst[c]
            .padding_untouched()
            .map_err(|e| format!("decode rank {c}: {e}"))?;
    }
    // Figures: each load moved and skipped its share of the heads.
    for (c, cons) in r.consumers.iter().enumerate() {
        let per_head = r.dst[c].request_block_bytes() / dec.heads_per_rank();
        let sliced = r.dst[c].slice_bytes_per_head();
        let mut done = Vec::new();
        while let Some(st) = cons.next_finished() {
            done.push(st);
        }
        for read in ok(plan(pre, dec, c as u64), "plan")? {
            let req = format!("tp#{}", read.producer_rank);
            let st = done
                .iter()
                .find(|s| s.request == req)
                .ok_or(format!("decode rank {c}: {req} not reported finished"))?;
            let w = read.heads.as_ref().map_or(0, |m| m.width());
            let whole = read.heads.as_ref().is_some_and(|m| {
                m.local == (0..dec.heads_per_rank()) && m.remote == (0..pre.heads_per_rank())
            });
            let moved = 3 * w * if whole { per_head } else { sliced };
            let skipped = per_head * w;
            figures(st, moved, skipped, &format!("decode rank {c}, {req}"))?;
        }
    }
    for (p, prod) in r.producers.iter().enumerate() {
        freed_as(&**prod, &format!("tp#{p}"), FreeReason::Acked, T)
            .map_err(|e| format!("prefill rank {p}: {e}"))?;
    }
    drop(r);
    Ok(())
}
