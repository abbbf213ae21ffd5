//! A push producer's writes (`Mode::Push`): a consumer's "want" made into a target (its
//! blocks paired with the request's, split where the block sizes differ), and each ready
//! layer written to it as the producer's thread runs. The producer's shell is in
//! `producer.rs`.
#![forbid(unsafe_code)]

use super::carrier::LayerMove;
use super::producer_state::{ProducerShared, ProducerState, PushTarget};
use super::shell::{lock, state_charge, Figures};
use crate::telemetry::RequestStats;
use kvxfer_proto::block_size::split;
use kvxfer_proto::connector::ProducerAction;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::groups::{held, pair_blocks};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::wire::connector::{PushWant, ToConsumer};
use std::time::Duration;

/// Builds a push target from a consumer's "want" (one per cache group), against the blocks
/// `published` of each group for a request of `tokens`. A consumer of another block size
/// names its blocks in the smaller one; this side's are split to match.
pub(super) fn push_target(
    sh: &ProducerShared,
    reader: String,
    want: PushWant,
    published: &[Vec<u32>],
    tokens: u64,
) -> Result<PushTarget> {
    let bad = |w: &str| Error::InvalidArgument(format!("push request: {w}"));
    let PushWant {
        blocks,
        num_blocks,
        layers,
        block_tokens,
        more,
    } = want;
    let first = PushWant {
        blocks,
        num_blocks,
        layers,
        block_tokens,
        more: Vec::new(),
    };
    let wants: Vec<PushWant> = std::iter::once(first).chain(more).collect();
    if wants.len() != sh.groups.len() {
        return Err(bad(&format!(
            "blocks of {} cache groups for a cache of {}",
            wants.len(),
            sh.groups.len()
        )));
    }
    let (mut local, mut pairs, mut views, mut skipped) = (Vec::new(), Vec::new(), Vec::new(), 0u64);
    for (g, (w, mine)) in wants.into_iter().zip(published).enumerate() {
        let ours = &sh.groups.layouts()[g];
        if w.layers.len() != ours.layers.len() {
            return Err(bad("another layer count"));
        }
        let group = |why: String| match sh.groups.len() {
            1 => bad(&why),
            _ => bad(&format!("group {g}: {why}")),
        };
        let (view, mine) = match w.block_tokens {
            Some(bt) => {
                let (v, m) = split(ours, bt, tokens, mine).map_err(group)?;
                (Some(v), m)
            }
            None => (None, mine.clone()),
        };
        let (theirs, from) = pair_blocks(&w.blocks, &mine).map_err(group)?;
        let cached = held(&mine[..mine.len() - w.blocks.len()]).count() as u64;
        skipped += cached * view.as_ref().unwrap_or(ours).block_bytes_all_layers();
        local.push(KvLayout {
            num_blocks: w.num_blocks,
            layers: w.layers,
            block_tokens: view.as_ref().unwrap_or(ours).block_tokens,
            ..ours.clone()
        });
        pairs.push((from, theirs));
        views.push(view);
    }
    let descs = sh
        .groups
        .descs(&pairs.iter().map(|p| &p.0[..]).collect::<Vec<_>>());
    // The producer's thread must not block: no room now is a refusal.
    let charge = state_charge(&sh.cfg.budget, descs, "push state", Duration::ZERO)?;
    Ok(PushTarget {
        reader,
        local,
        pairs,
        views,
        skipped,
        posted: 0,
        inflight: Vec::new(),
        landed: 0,
        figures: Figures::default(),
        failed: false,
        _charge: charge,
    })
}

/// Posts the ready layers of every push target and collects finished ones.
pub(super) fn producer_pushes(sh: &ProducerShared) {
    let mut st = lock(&sh.st);
    let mut acks: Vec<(String, String)> = Vec::new();
    // A push that failed is the consumer's to hear at once (else it waits out its lease).
    let mut notes: Vec<(String, Vec<u8>)> = Vec::new();
    let refusal = |req: &str, e: &Error| ToConsumer::Refused {
        request: req.to_string(),
        kind: None,
        why: format!("the push failed: {e}"),
    };
    let groups = &sh.groups;
    let nl = groups.total_layers();
    let ProducerState { core, requests, .. } = &mut *st;
    for (req, r) in requests.iter_mut() {
        let ready = core.ready_layers(req);
        for p in r.pushes.iter_mut() {
            while !p.failed && p.posted < ready {
                let l = p.posted;
                let note = ToConsumer::Layer {
                    request: req.clone(),
                    layer: l,
                }
                .encode();
                let Some((g, layout, layer)) = groups.locate(l) else {
                    break;
                };
                if p.pairs[g].0.is_empty() {
                    // Nothing of this group moves: the layer is the consumer's at once.
                    sh.carrier.send(&p.reader, &note);
                    p.posted += 1;
                    p.landed += 1;
                    continue;
                }
                // Whole blocks: the consumer's blocks as its push request named them.
                let heads = HeadMap::all(layout.geometry.kv_heads);
                let m = LayerMove {
                    local: p.views[g].as_ref().unwrap_or(layout),
                    local_blocks: &p.pairs[g].0,
                    remote: &p.local[g],
                    remote_blocks: &p.pairs[g].1,
                    heads: &heads,
                    layer,
                };
                match sh.carrier.write(&p.reader, &m, &note, sh.cfg.lease) {
                    Ok(t) => {
                        p.figures.posted();
                        p.inflight.push((l, t));
                    }
                    Err(e) => {
                        log::warn!("kvxfer producer: push of {req:?} layer {l}: {e}");
                        notes.push((p.reader.clone(), refusal(req, &e).encode()));
                        p.failed = true;
                    }
                }
                p.posted += 1;
            }
            let mut i = 0;
            while i < p.inflight.len() {
                if !p.inflight[i].1.is_done() {
                    i += 1;
                    continue;
                }
                let (_, t) = p.inflight.swap_remove(i);
                let r = t.wait();
                p.figures.finished(r.as_ref().ok(), p.inflight.is_empty());
                match r {
                    Ok(_) => p.landed += 1,
                    Err(e) => {
                        log::warn!("kvxfer producer: push of {req:?}: {e}");
                        if !p.failed {
                            notes.push((p.reader.clone(), refusal(req, &e).encode()));
                        }
                        p.failed = true;
                    }
                }
            }
            if p.landed == nl && !p.failed {
                acks.push((req.clone(), p.reader.clone()));
                let f = &p.figures;
                sh.tel.record(&RequestStats {
                    request: req.clone(),
                    bytes_moved: f.bytes,
                    bytes_skipped: p.skipped,
                    descriptors: f.descs,
                    post_time: f.post,
                    transfer_time: f.busy,
                    handoff_time: r.published.elapsed(),
                });
                p.failed = true; // done: forgotten below
            }
        }
        // A target is forgotten once done or failed with nothing of it in flight.
        r.pushes.retain(|p| !(p.failed && p.inflight.is_empty()));
    }
    drop(st);
    // The consumer hears of its failures before anything is freed.
    for (reader, m) in notes {
        sh.carrier.send(&reader, &m);
    }
    // The producer saw its writes land: that reader is done with the blocks. (The lock is
    // taken again only then: this runs every millisecond while pushes are in progress.)
    if acks.is_empty() {
        return;
    }
    let now = sh.t0.elapsed();
    let mut st = lock(&sh.st);
    for (req, reader) in acks {
        for a in st.core.push_landed(&reader, &req, now) {
            if let ProducerAction::Freed(f) = a {
                st.record_freed(f, &sh.tel, sh.cfg.mode, &*sh.carrier);
            }
        }
    }
    drop(st);
    sh.cv.notify_all();
}
