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
