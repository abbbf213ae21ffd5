//! Paged descriptors: a layer's blocks described once as (region, offset of block 0, block
//! length, block stride, block indices), NIXL 1.5's strided descriptor lists and pplx-garden's
//! paged writes, instead of one [`Desc`](crate::descriptor::Desc) per block and layer.
//!
//! Pure, like [`descriptor`](crate::descriptor): [`resolve_paged`] checks every block of a list
//! against a region table without expanding it (one pass over the indices for the largest),
//! and [`plan_paged`] pairs two resolved lists into a [`PagedPlan`] of runs that keeps the
//! indices as they are (4 bytes per block and side, where the flat form holds a 24-byte
//! descriptor, a 24-byte resolved descriptor and a 32-byte operation; and the indices are
//! shared by all the layers of a request). Operations come out of
//! [`PagedPlan::ops`] one at a time, contiguous neighbours merged, or all at once from
//! [`PagedPlan::expand`] for a path that wants the flat form.

use crate::descriptor::{push_split, region_slot, Op, Plan};
use crate::error::{Error, Result, Side};
use crate::types::{RegionId, RegionSpan};
use std::sync::Arc;

/// Blocks of one tensor of one layer: block `b` is the `block_len` bytes at
/// `offset + b * stride` in `region`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paged {
    /// The region.
    pub region: RegionId,
    /// Byte offset of block 0 in the region.
    pub offset: u64,
    /// Bytes moved per block.
    pub block_len: u64,
    /// Bytes from one block to the next.
    pub stride: u64,
    /// The blocks, in transfer order: shared by every layer's entries of one request (an
    /// `Arc`, so a request's lists hold its block indices once, not once per layer).
    pub blocks: Arc<[u32]>,
}

impl Paged {
    /// Bytes of all its blocks.
    pub fn bytes(&self) -> u64 {
        self.block_len * self.blocks.len() as u64
    }
}

/// A [`Paged`] list entry resolved against a region table: the absolute address of block 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedPaged {
    /// Absolute address of block 0.
    pub base: u64,
    /// Bytes per block.
    pub block_len: u64,
    /// Bytes from one block to the next.
    pub stride: u64,
    /// Index of the region in the table.
    pub slot: u32,
    /// The blocks, in transfer order (shared with the [`Paged`] entry).
    pub blocks: Arc<[u32]>,
}

impl ResolvedPaged {
    fn addr(&self, block: u32) -> u64 {
        self.base + u64::from(block) * self.stride
    }
}

/// Resolves `list` against `table`, checking that every block of every entry lies inside its
/// region (the largest index decides) and that no block is empty. The first bad entry is
/// reported with its index in `list`.
pub fn resolve_paged(
    side: Side,
    list: &[Paged],
    table: &[RegionSpan],
) -> Result<Vec<ResolvedPaged>> {
    let mut out = Vec::with_capacity(list.len());
    for (index, p) in list.iter().enumerate() {
        let slot = region_slot(side, index, p.region, table)?;
        let r = &table[slot];
        if p.block_len == 0 {
            return Err(Error::ZeroLength {
                side,
                index,
                region: p.region.0,
            });
        }
        if let Some(&max) = p.blocks.iter().max() {
            let start = u64::from(max)
                .checked_mul(p.stride)
                .and_then(|o| o.checked_add(p.offset));
            let end = start.and_then(|s| s.checked_add(p.block_len));
            if end.is_none_or(|e| e > r.len) {
                return Err(Error::OutOfBounds {
                    side,
                    index,
                    region: p.region.0,
                    offset: start.unwrap_or(u64::MAX),
                    len: p.block_len,
                    region_len: r.len,
                });
            }
        }
        out.push(ResolvedPaged {
            base: r.base + p.offset,
            block_len: p.block_len,
            stride: p.stride,
            slot: slot as u32,
            blocks: p.blocks.clone(),
        });
    }
    Ok(out)
}

/// Most blocks in one window of a paged transfer's data ([`Windows`]).
pub const WINDOW_BLOCKS: usize = 4096;
/// Most bytes in one window, unless its single block is larger.
pub const WINDOW_BYTES: u64 = 64 << 20;

/// A walk through the blocks of a resolved list, one window at a time: up to
/// [`WINDOW_BLOCKS`] blocks and [`WINDOW_BYTES`] bytes (at least one block), expanded into
/// pieces only for the window, so that a path moving a paged transfer holds one window's
/// pieces, never the whole request's. Block k has the same length on both sides of a
/// [`PagedPlan`], so both ends cut the same windows from their own lists: each window's bytes
/// move as a request of their own would.
#[derive(Clone, Debug, Default)]
pub struct Windows {
    entry: usize,
    k: usize,
}

impl Windows {
    /// Appends the next window of `list` to `pieces` as (address, length) and the region slot
    /// of each piece to `slots`, blocks contiguous in memory and in the same entry merged.
    /// Returns the window's bytes: 0 once the list is done.
    pub fn next(
        &mut self,
        list: &[ResolvedPaged],
        pieces: &mut Vec<(u64, u64)>,
        slots: &mut Vec<u32>,
    ) -> u64 {
        let mut blocks = 0usize;
        let mut bytes = 0u64;
        while let Some(e) = list.get(self.entry) {
            if self.k >= e.blocks.len() {
                self.entry += 1;
                self.k = 0;
                continue;
            }
            if blocks > 0 && (blocks >= WINDOW_BLOCKS || bytes + e.block_len > WINDOW_BYTES) {
                break;
            }
            let a = e.addr(e.blocks[self.k]);
            match pieces.last_mut() {
                Some(p) if blocks > 0 && self.k > 0 && p.0 + p.1 == a => p.1 += e.block_len,
                _ => {
                    pieces.push((a, e.block_len));
                    slots.push(e.slot);
                }
            }
            self.k += 1;
            blocks += 1;
            bytes += e.block_len;
        }
        bytes
    }
}

/// One pair of paged entries: block `local.blocks[k]` moves to (or from) `remote.blocks[k]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// The local side.
    pub local: ResolvedPaged,
    /// The remote side.
    pub remote: ResolvedPaged,
}

/// The runs of one transfer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PagedPlan {
    /// Runs in posting order.
    pub runs: Vec<Run>,
    /// Total bytes.
    pub bytes: u64,
    /// Block pairs in all runs.
    pub blocks: usize,
}

/// Pairs `local[i]` with `remote[i]`: both lists must have as many entries, each pair as many
/// blocks of the same length.
pub fn plan_paged(local: Vec<ResolvedPaged>, remote: Vec<ResolvedPaged>) -> Result<PagedPlan> {
    if local.len() != remote.len() {
        return Err(Error::LengthMismatch {
            index: usize::MAX,
            local_len: local.len() as u64,
            remote_len: remote.len() as u64,
        });
    }
    let mut bytes = 0u64;
    let mut blocks = 0usize;
    let mut runs = Vec::with_capacity(local.len());
    for (i, (l, r)) in local.into_iter().zip(remote).enumerate() {
        if l.block_len != r.block_len || l.blocks.len() != r.blocks.len() {
            return Err(Error::LengthMismatch {
                index: i,
                local_len: l.block_len * l.blocks.len() as u64,
                remote_len: r.block_len * r.blocks.len() as u64,
            });
        }
        bytes += l.block_len * l.blocks.len() as u64;
        blocks += l.blocks.len();
        runs.push(Run {
            local: l,
            remote: r,
        });
    }
    Ok(PagedPlan {
        runs,
        bytes,
        blocks,
    })
}

impl PagedPlan {
    /// The operations, in order, blocks that are contiguous on both sides merged (as
    /// [`plan`](crate::descriptor::plan) merges them), without building a list.
    pub fn ops(&self) -> impl Iterator<Item = Op> + '_ {
        self.runs.iter().flat_map(|run| {
            let (l, r) = (&run.local, &run.remote);
            let n = l.blocks.len();
            let mut k = 0;
            std::iter::from_fn(move || {
                if k >= n {
                    return None;
                }
                let mut op = Op {
                    local: l.addr(l.blocks[k]),
                    remote: r.addr(r.blocks[k]),
                    len: l.block_len,
                    lslot: l.slot,
                    rslot: r.slot,
                };
                k += 1;
                while k < n
                    && l.addr(l.blocks[k]) == op.local + op.len
                    && r.addr(r.blocks[k]) == op.remote + op.len
                {
                    op.len += l.block_len;
                    k += 1;
                }
                Some(op)
            })
        })
    }

    /// The flat form: every operation in a list, operations longer than `max_op` split
    /// (0: never), for a path that posts from a list.
    pub fn expand(&self, max_op: u64) -> Plan {
        let mut ops: Vec<Op> = Vec::new();
        for o in self.ops() {
            push_split(o, max_op, &mut ops);
        }
        Plan {
            ops,
            bytes: self.bytes,
            descs: self.blocks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::descriptor::{plan, resolve, Desc};
    use crate::types::MemKind;

    fn table() -> Vec<RegionSpan> {
        vec![
            RegionSpan {
                id: RegionId(3),
                base: 0x1000_0000,
                len: 1 << 20,
                kind: MemKind::Host,
            },
            RegionSpan {
                id: RegionId(9),
                base: 0x9000_0000,
                len: 1 << 20,
                kind: MemKind::Host,
            },
        ]
    }

    fn flat(p: &[Paged]) -> Vec<Desc> {
        p.iter()
            .flat_map(|p| {
                p.blocks.iter().map(move |&b| {
                    Desc::new(p.region, p.offset + u64::from(b) * p.stride, p.block_len)
                })
            })
            .collect()
    }

    /// The paged plan moves exactly what the flat plan of the same blocks moves, in the same
    /// order, with the same merging.
    #[test]
    fn paged_plan_equals_the_flat_plan() {
        let mut x = 7u64;
        let mut next = |m: u32| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u32 % m
        };
        // Miri runs this crate's tests ~1000x slower: fewer cases there.
        let cases = if cfg!(miri) { 6 } else { 50 };
        for case in 0..cases {
            let layers = 1 + next(4) as usize;
            let (mut lp, mut rp) = (Vec::new(), Vec::new());
            for layer in 0..layers {
                let n = next(40) as usize;
                let mut lb: Vec<u32> = (0..n as u32).collect();
                let mut rb = lb.clone();
                if case % 3 != 0 {
                    for i in (1..n).rev() {
                        lb.swap(i, next(i as u32 + 1) as usize);
                        rb.swap(i, next(i as u32 + 1) as usize);
                    }
                }
                let len = 64 * (1 + u64::from(next(4)));
                lp.push(Paged {
                    region: RegionId(3),
                    offset: layer as u64 * 65536,
                    block_len: len,
                    stride: 256,
                    blocks: lb.into(),
                });
                rp.push(Paged {
                    region: RegionId(9),
                    offset: layer as u64 * 65536 + 8,
                    block_len: len,
                    stride: if case % 2 == 0 { len } else { 256 },
                    blocks: rb.into(),
                });
            }
            let t = table();
            let pp = plan_paged(
                resolve_paged(Side::Local, &lp, &t).unwrap(),
                resolve_paged(Side::Remote, &rp, &t).unwrap(),
            )
            .unwrap();
            let (lf, rf) = (flat(&lp), flat(&rp));
            let idx: Vec<usize> = (0..lf.len()).collect();
            for max_op in [0, 100] {
                let want = plan(
                    &resolve(Side::Local, &lf, &t).unwrap(),
                    &idx,
                    &resolve(Side::Remote, &rf, &t).unwrap(),
                    &idx,
                    max_op,
                )
                .unwrap();
                // The flat planner merges across layers too; the paged one within a run.
                let got = pp.expand(max_op);
                assert_eq!(got.bytes, want.bytes, "case {case}");
                assert_eq!(got.descs, want.descs, "case {case}");
                let total = |p: &Plan| p.ops.iter().map(|o| o.len).sum::<u64>();
                assert_eq!(total(&got), total(&want));
                let bytes_of = |p: &Plan| {
                    let mut v: Vec<(u64, u64)> = p
                        .ops
                        .iter()
                        .flat_map(|o| {
                            (0..o.len)
                                .step_by(64)
                                .map(move |d| (o.local + d, o.remote + d))
                        })
                        .collect();
                    v.sort_unstable();
                    v
                };
                assert_eq!(bytes_of(&got), bytes_of(&want), "case {case}");
                assert!(got.ops.len() >= want.ops.len());
            }
        }
    }

    /// The windows of both sides of a plan cut the same bytes, hold at most their bounds, and
    /// together move what the flat form moves, in order.
    #[test]
    fn windows_cut_both_sides_alike_and_cover_the_plan() {
        let t = table();
        let lb: Arc<[u32]> = (0..5000u32).map(|b| (b * 7919) % 5000).collect();
        let rb: Arc<[u32]> = (0..5000u32).collect();
        let lp = vec![
            Paged {
                region: RegionId(3),
                offset: 0,
                block_len: 128,
                stride: 128,
                blocks: lb.clone(),
            },
            Paged {
                region: RegionId(3),
                offset: 640_000,
                block_len: 64,
                stride: 64,
                blocks: (0..3u32).collect(),
            },
        ];
        let rp = vec![
            Paged {
                region: RegionId(9),
                offset: 0,
                block_len: 128,
                stride: 128,
                blocks: rb,
            },
            Paged {
                region: RegionId(9),
                offset: 700_000,
                block_len: 64,
                stride: 64,
                blocks: (0..3u32).collect(),
            },
        ];
        let plan = plan_paged(
            resolve_paged(Side::Local, &lp, &t).unwrap(),
            resolve_paged(Side::Remote, &rp, &t).unwrap(),
        )
        .unwrap();
        let side = |remote: bool| -> Vec<ResolvedPaged> {
            plan.runs
                .iter()
                .map(|r| {
                    if remote {
                        r.remote.clone()
                    } else {
                        r.local.clone()
                    }
                })
                .collect()
        };
        let (l, r) = (side(false), side(true));
        let (mut wl, mut wr) = (Windows::default(), Windows::default());
        let (mut all_l, mut all_r) = (Vec::new(), Vec::new());
        let mut windows = 0;
        loop {
            let (mut pl, mut sl, mut pr, mut sr) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let (bl, br) = (wl.next(&l, &mut pl, &mut sl), wr.next(&r, &mut pr, &mut sr));
            assert_eq!(bl, br, "window {windows}");
            if bl == 0 {
                break;
            }
            assert!(bl <= WINDOW_BYTES);
            assert!(pl.len() <= WINDOW_BLOCKS && pr.len() <= WINDOW_BLOCKS);
            assert_eq!(pl.iter().map(|p| p.1).sum::<u64>(), bl);
            assert_eq!(pr.iter().map(|p| p.1).sum::<u64>(), br);
            assert_eq!(sl.len(), pl.len());
            assert!(sr.iter().all(|&s| s == 1));
            all_l.extend(pl);
            all_r.extend(pr);
            windows += 1;
        }
        assert_eq!(windows, 2, "5003 blocks: a full window and the rest");
        // The remote side is contiguous within an entry: merged, but never across windows.
        assert_eq!(all_r.len(), 3);
        // Byte by byte, the windows pair the same addresses as the flat plan.
        let stream = |v: &[(u64, u64)]| -> Vec<u64> {
            v.iter()
                .flat_map(|&(a, n)| (a..a + n).step_by(64))
                .collect()
        };
        let flat = plan.expand(0);
        let want_l: Vec<u64> = flat
            .ops
            .iter()
            .flat_map(|o| (o.local..o.local + o.len).step_by(64))
            .collect();
        let want_r: Vec<u64> = flat
            .ops
            .iter()
            .flat_map(|o| (o.remote..o.remote + o.len).step_by(64))
            .collect();
        assert_eq!(stream(&all_l), want_l);
        assert_eq!(stream(&all_r), want_r);
    }

    #[test]
    fn bad_entries_are_typed_errors_with_their_index() {
        let t = table();
        let ok = Paged {
            region: RegionId(3),
            offset: 0,
            block_len: 4096,
            stride: 4096,
            blocks: vec![0, 255].into(),
        };
        assert!(resolve_paged(Side::Local, std::slice::from_ref(&ok), &t).is_ok());
        let past = Paged {
            blocks: vec![3, 256].into(),
            ..ok.clone()
        };
        assert!(matches!(
            resolve_paged(Side::Remote, &[ok.clone(), past], &t),
            Err(Error::OutOfBounds { side: Side::Remote, index: 1, offset, .. }) if offset == 256 * 4096
        ));
        let overflow = Paged {
            stride: u64::MAX / 2,
            ..ok.clone()
        };
        assert!(matches!(
            resolve_paged(Side::Local, &[overflow], &t),
            Err(Error::OutOfBounds { index: 0, .. })
        ));
        let empty = Paged {
            block_len: 0,
            ..ok.clone()
        };
        assert!(matches!(
            resolve_paged(Side::Local, &[empty], &t),
            Err(Error::ZeroLength { index: 0, .. })
        ));
        let foreign = Paged {
            region: RegionId(77),
            ..ok.clone()
        };
        assert!(matches!(
            resolve_paged(Side::Local, &[foreign], &t),
            Err(Error::UnknownRegion { region: 77, .. })
        ));
        let l = resolve_paged(Side::Local, std::slice::from_ref(&ok), &t).unwrap();
        let short = Paged {
            blocks: vec![0].into(),
            ..ok.clone()
        };
        let r = resolve_paged(Side::Remote, &[short], &t).unwrap();
        assert!(matches!(
            plan_paged(l.clone(), r),
            Err(Error::LengthMismatch { index: 0, .. })
        ));
        assert!(matches!(
            plan_paged(l, Vec::new()),
            Err(Error::LengthMismatch { .. })
        ));
    }
}
