//! Tensor parallelism between a prefill and a decode deployment: which KV heads each rank
//! holds, and which of the producer ranks' heads each consumer rank reads into which of its
//! own. Pure arithmetic, no I/O.
//!
//! The rule is vLLM's (and SGLang's): a rank of a deployment of tensor-parallel size `tp` over
//! a model with `kv_heads` KV heads holds `kv_heads / tp` consecutive heads when `tp` divides
//! them, else (grouped-query attention with fewer KV heads than ranks) one head, replicated on
//! `tp / kv_heads` consecutive ranks. Each consumer rank reads each of its heads from exactly
//! one producer rank (replicas spread over the consumer ranks), and every producer rank,
//! read or not, gets at least one reader, so that every rank's published blocks are freed by
//! acknowledgement rather than by lease expiry.

use std::ops::Range;

use crate::error::{Error, Result};

/// The largest tensor-parallel size a plan takes (a shape from a handoff is checked against it
/// before anything is sized from it).
pub const MAX_TP: u64 = 4096;

/// The most KV heads (of the whole model) a plan takes.
pub const MAX_KV_HEADS: u64 = 65_536;

/// One side of a disaggregated deployment, as far as its KV heads go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TpSide {
    /// Tensor-parallel size (ranks).
    pub tp: u64,
    /// KV heads of the whole model (not per rank).
    pub kv_heads: u64,
}

impl std::fmt::Display for TpSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TP {} over {} KV heads ({} per rank)",
            self.tp,
            self.kv_heads,
            self.heads_per_rank()
        )
    }
}

impl TpSide {
    /// A side of `tp` ranks over `kv_heads` KV heads.
    pub fn new(tp: u64, kv_heads: u64) -> TpSide {
        TpSide { tp, kv_heads }
    }

    /// Heads each rank holds: `kv_heads / tp`, at least one.
    pub fn heads_per_rank(&self) -> u64 {
        (self.kv_heads / self.tp.max(1)).max(1)
    }

    /// Ranks holding each head (1 unless heads are replicated).
    pub fn replicas(&self) -> u64 {
        if self.tp > self.kv_heads && self.kv_heads > 0 {
            self.tp / self.kv_heads
        } else {
            1
        }
    }

    /// Whether the shape is within [`MAX_TP`] and [`MAX_KV_HEADS`] and the heads split over
    /// the ranks: `tp` divides `kv_heads`, or `kv_heads` divides `tp` (replicated heads).
    /// Checked before anything is sized from the shape: a handoff names it.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.tp == 0 || self.kv_heads == 0 {
            return Err(format!("{}: zero ranks or zero KV heads", self.describe()));
        }
        if self.tp > MAX_TP || self.kv_heads > MAX_KV_HEADS {
            return Err(format!(
                "{}: beyond the limits of TP {MAX_TP} and {MAX_KV_HEADS} KV heads",
                self.describe()
            ));
        }
        if !self.kv_heads.is_multiple_of(self.tp) && !self.tp.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "{} KV heads do not split over TP {} (the heads must be a multiple of the \
                 ranks, or the ranks a multiple of the heads)",
                self.kv_heads, self.tp
            ));
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("TP {} over {} KV heads", self.tp, self.kv_heads)
    }

    /// The model's heads that rank `rank` holds (global head indices).
    pub fn heads_of(&self, rank: u64) -> Range<u64> {
        let n = self.heads_per_rank();
        let first = rank / self.replicas() * n;
        first..first + n
    }
}

/// Which heads a load reads from the producer rank's cache (`remote`, that rank's own head
/// indices) and where they go in the consumer rank's cache (`local`). Equal widths.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HeadMap {
    /// Heads of the producer rank's cache.
    pub remote: Range<u64>,
    /// Heads of the consumer rank's cache.
    pub local: Range<u64>,
}

impl HeadMap {
    /// Every head of a cache of `heads` heads into the same heads.
    pub fn all(heads: u64) -> HeadMap {
        HeadMap {
            remote: 0..heads,
            local: 0..heads,
        }
    }

    /// Heads moved.
    pub fn width(&self) -> u64 {
        self.remote.end.saturating_sub(self.remote.start)
    }
}

/// One producer rank a consumer rank loads from, and how.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TpRead {
    /// The producer rank.
    pub producer_rank: u64,
    /// The heads to move; `None`: nothing moves, the consumer rank only acknowledges (a
    /// replica no consumer rank reads from, so that its blocks are freed).
    pub heads: Option<HeadMap>,
    /// How many consumer ranks load from this producer rank: every one of them declares it
    /// to the producer, which frees the blocks after that many acknowledgements.
    pub readers: u64,
}

/// What consumer rank `rank` of `decode` loads from `prefill`'s ranks, in producer rank
/// order. Both sides hold the same model (equal KV heads in all); each side's heads split over
/// its ranks ([`TpSide::check`]). The error names both sides' shapes.
pub fn plan(prefill: TpSide, decode: TpSide, rank: u64) -> Result<Vec<TpRead>> {
    let both = || format!("prefill {prefill}, decode {decode}");
    let bad = |why: String| Error::InvalidArgument(format!("tensor parallelism: {why}"));
    if prefill.kv_heads != decode.kv_heads {
        return Err(bad(format!(
            "{}: the two sides hold different models ({} KV heads against {})",
            both(),
            prefill.kv_heads,
            decode.kv_heads
        )));
    }
    for (side, s) in [("prefill", prefill), ("decode", decode)] {
        s.check()
            .map_err(|why| bad(format!("{}: the {side} side's {why}", both())))?;
    }
    if rank >= decode.tp {
        return Err(bad(format!("decode rank {rank} of TP {}", decode.tp)));
    }
    // One pass over every consumer rank's heads: which producer ranks each reads from (its
    // heads' sources come in rank order, so a rank's reads of one producer are adjacent), and
    // so how many consumer ranks read each producer rank. Memory: one counter per producer
    // rank; time: the heads of all consumer ranks.
    let mut readers = vec![0u64; prefill.tp as usize];
    for c in 0..decode.tp {
        let mut last = None;
        for g in decode.heads_of(c) {
            let p = source(prefill, g, c);
            if last != Some(p) {
                readers[p as usize] += 1;
                last = Some(p);
            }
        }
    }
    let mut out: Vec<TpRead> = Vec::new();
    let mine = decode.heads_of(rank);
    for g in mine.clone() {
        let p = source(prefill, g, rank);
        let theirs = prefill.heads_of(p);
        match out.last_mut() {
            Some(TpRead {
                producer_rank,
                heads: Some(m),
                ..
            }) if *producer_rank == p => {
                m.remote.end += 1;
                m.local.end += 1;
            }
            _ => out.push(TpRead {
                producer_rank: p,
                heads: Some(HeadMap {
                    remote: g - theirs.start..g - theirs.start + 1,
                    local: g - mine.start..g - mine.start + 1,
                }),
                readers: readers[p as usize],
            }),
        }
    }
    // A producer rank no consumer rank reads from (a replica) is acknowledged by consumer rank
    // `p % decode.tp`, so that its blocks are freed: one reader.
    for p in (rank..prefill.tp).step_by(decode.tp as usize) {
        if readers[p as usize] == 0 {
            out.push(TpRead {
                producer_rank: p,
                heads: None,
                readers: 1,
            });
        }
    }
    out.sort_by_key(|r| r.producer_rank);
    Ok(out)
}

/// The producer rank consumer rank `c` reads global head `g` from (replicas chosen by `c`).
fn source(prefill: TpSide, g: u64, c: u64) -> u64 {
    let per = prefill.heads_per_rank();
    let rep = prefill.replicas();
    (g / per) * rep + c % rep
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn heads(r: &TpRead) -> Option<(Range<u64>, Range<u64>)> {
        r.heads
            .as_ref()
            .map(|m| (m.remote.clone(), m.local.clone()))
    }

    /// The plan as it was computed before the one-pass counting: every consumer rank's reads
    /// built in full, readers counted by scanning them (quadratic; kept as the reference).
    fn reference(prefill: TpSide, decode: TpSide, rank: u64) -> Vec<TpRead> {
        let reads = |c: u64| {
            let mut out: Vec<(u64, Option<HeadMap>)> = Vec::new();
            let mine = decode.heads_of(c);
            for g in mine.clone() {
                let p = source(prefill, g, c);
                let theirs = prefill.heads_of(p);
                match out.last_mut() {
                    Some((q, Some(m))) if *q == p => {
                        m.remote.end += 1;
                        m.local.end += 1;
                    }
                    _ => out.push((
                        p,
                        Some(HeadMap {
                            remote: g - theirs.start..g - theirs.start + 1,
                            local: g - mine.start..g - mine.start + 1,
                        }),
                    )),
                }
            }
            for p in 0..prefill.tp {
                if p % decode.tp != c {
                    continue;
                }
                let read =
                    (0..decode.tp).any(|d| decode.heads_of(d).any(|g| source(prefill, g, d) == p));
                if !read {
                    out.push((p, None));
                }
            }
            out.sort_by_key(|(p, _)| *p);
            out
        };
        let all: Vec<_> = (0..decode.tp).map(reads).collect();
        all[rank as usize]
            .iter()
            .map(|(p, h)| TpRead {
                producer_rank: *p,
                heads: h.clone(),
                readers: all.iter().filter(|r| r.iter().any(|(q, _)| q == p)).count() as u64,
            })
            .collect()
    }

    proptest! {
        /// The one-pass plan is the reference plan, for every shape that splits.
        #[test]
        fn one_pass_counting_is_the_reference(
            ptp in 1u64..=16, dtp in 1u64..=16, heads_pow in 0u32..=4, rank_seed in 0u64..16,
        ) {
            let kv = 1u64 << heads_pow;
            let (pre, dec) = (TpSide::new(ptp, kv), TpSide::new(dtp, kv));
            prop_assume!(pre.check().is_ok() && dec.check().is_ok());
            let rank = rank_seed % dtp;
            prop_assert_eq!(plan(pre, dec, rank).unwrap(), reference(pre, dec, rank));
        }
    }

    #[test]
    // Timed, and sized for native speed: Miri would take minutes and miss the bound.
    #[cfg_attr(miri, ignore)]
    fn hostile_shapes_are_refused_at_once_naming_the_limit() {
        let t0 = std::time::Instant::now();
        for (p, d) in [
            (TpSide::new(1 << 31, 8), TpSide::new(1, 8)),
            (TpSide::new(1 << 20, 8), TpSide::new(1, 8)),
            (TpSide::new(1, 1 << 31), TpSide::new(1, 1 << 31)),
            (
                TpSide::new(8, u64::from(u32::MAX)),
                TpSide::new(1, u64::from(u32::MAX)),
            ),
            (TpSide::new(8, 8), TpSide::new(1 << 31, 8)),
        ] {
            let e = plan(p, d, 0).unwrap_err().to_string();
            assert!(e.contains("4096") && e.contains("65536"), "{e}");
        }
        // The largest shapes allowed plan quickly too (one pass, no table per consumer rank).
        let big = TpSide::new(MAX_TP, MAX_KV_HEADS);
        let p = plan(big, big, MAX_TP - 1).unwrap();
        assert_eq!(p.len(), 1);
        let p = plan(TpSide::new(MAX_TP, 64), TpSide::new(1, 64), 0).unwrap();
        assert_eq!(p.len(), MAX_TP as usize);
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            t0.elapsed()
        );
    }

    #[test]
    fn equal_tp_reads_rank_to_rank() {
        let s = TpSide::new(2, 8);
        for c in 0..2 {
            let p = plan(s, s, c).unwrap();
            assert_eq!(p.len(), 1);
            assert_eq!(p[0].producer_rank, c);
            assert_eq!(heads(&p[0]), Some((0..4, 0..4)));
            assert_eq!(p[0].readers, 1);
        }
    }

    #[test]
    fn two_to_one_reads_both_halves_into_place() {
        let p = plan(TpSide::new(2, 8), TpSide::new(1, 8), 0).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].producer_rank, heads(&p[0])), (0, Some((0..4, 0..4))));
        assert_eq!((p[1].producer_rank, heads(&p[1])), (1, Some((0..4, 4..8))));
        assert!(p.iter().all(|r| r.readers == 1));
    }

    #[test]
    fn one_to_two_reads_half_each_two_readers() {
        for c in 0..2 {
            let p = plan(TpSide::new(1, 8), TpSide::new(2, 8), c).unwrap();
            assert_eq!(p.len(), 1);
            assert_eq!(heads(&p[0]), Some((c * 4..c * 4 + 4, 0..4)));
            assert_eq!(p[0].readers, 2);
        }
    }

    #[test]
    fn gqa_replicas_spread_and_every_replica_is_acknowledged() {
        // 2 KV heads, prefill TP 4: ranks 0,1 hold head 0, ranks 2,3 head 1.
        let pre = TpSide::new(4, 2);
        assert_eq!(pre.heads_of(1), 0..1);
        assert_eq!(pre.heads_of(2), 1..2);
        let p = plan(pre, TpSide::new(1, 2), 0).unwrap();
        let by: Vec<_> = p.iter().map(|r| (r.producer_rank, heads(r))).collect();
        assert_eq!(
            by,
            vec![
                (0, Some((0..1, 0..1))),
                (1, None),
                (2, Some((0..1, 1..2))),
                (3, None)
            ]
        );
        // Decode TP 4 over 2 heads: ranks 0,1 read head 0 from ranks 0,1 of a TP 4 prefill.
        let d = TpSide::new(4, 2);
        for c in 0..4 {
            let p = plan(pre, d, c).unwrap();
            assert_eq!(p.len(), 1);
            assert_eq!(p[0].producer_rank, c);
            assert_eq!(p[0].readers, 1);
        }
        // Prefill TP 1 to decode TP 4 over 2 heads: every decode rank reads one head.
        let p: Vec<_> = (0..4)
            .map(|c| plan(TpSide::new(1, 2), d, c).unwrap())
            .collect();
        assert_eq!(heads(&p[1][0]), Some((0..1, 0..1)));
        assert_eq!(heads(&p[2][0]), Some((1..2, 0..1)));
        assert!(p.iter().all(|r| r[0].readers == 4));
    }

    #[test]
    fn geometries_that_cannot_work_name_both_sides() {
        let e = plan(TpSide::new(2, 6), TpSide::new(4, 6), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("prefill TP 2 over 6 KV heads"), "{e}");
        assert!(e.contains("decode TP 4 over 6 KV heads"), "{e}");
        assert!(e.contains("do not split over TP 4"), "{e}");
        let e = plan(TpSide::new(1, 8), TpSide::new(1, 4), 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("different models (8 KV heads against 4)"), "{e}");
        assert!(plan(TpSide::new(1, 8), TpSide::new(2, 8), 2).is_err());
        assert!(plan(TpSide::new(0, 8), TpSide::new(2, 8), 0).is_err());
    }

    proptest! {
        /// Every head of every consumer rank comes from exactly one producer rank that holds
        /// it, into the right place; every producer rank has readers, and its count is the
        /// number of consumer ranks that name it.
        #[test]
        fn every_head_once_every_rank_freed(
            h in 1u64..5, pe in 0u32..4, de in 0u32..4, hm in 1u64..4,
        ) {
            let kv = h * hm;
            let sides = [kv, kv * 2, kv * 4, (kv / 2).max(1)];
            let pre = TpSide::new(sides[pe as usize], kv);
            let dec = TpSide::new(sides[de as usize], kv);
            if pre.check().is_err() || dec.check().is_err() {
                prop_assert!(plan(pre, dec, 0).is_err());
                return Ok(());
            }
            let mut named = vec![0u64; pre.tp as usize];
            let mut declared = vec![None; pre.tp as usize];
            for c in 0..dec.tp {
                let reads = plan(pre, dec, c).unwrap();
                let mine = dec.heads_of(c);
                let mut got = vec![0u32; (mine.end - mine.start) as usize];
                for r in &reads {
                    named[r.producer_rank as usize] += 1;
                    let d = declared[r.producer_rank as usize].get_or_insert(r.readers);
                    prop_assert_eq!(*d, r.readers);
                    if let Some(m) = &r.heads {
                        prop_assert_eq!(m.width(), m.local.end - m.local.start);
                        let theirs = pre.heads_of(r.producer_rank);
                        for (a, b) in m.remote.clone().zip(m.local.clone()) {
                            prop_assert_eq!(theirs.start + a, mine.start + b);
                            prop_assert!(theirs.start + a < theirs.end);
                            got[b as usize] += 1;
                        }
                    }
                }
                prop_assert!(got.iter().all(|&n| n == 1), "{:?}", got);
            }
            for p in 0..pre.tp as usize {
                prop_assert!(named[p] >= 1);
                prop_assert_eq!(Some(named[p]), declared[p]);
            }
        }
    }
}
