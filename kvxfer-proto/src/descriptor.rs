//! Descriptor lists: `(region, offset, length)` triples, bounds checking against a region
//! table, and coalescing of pairs that are contiguous on both sides.
//!
//! Pure: no I/O, no UCX. The agent resolves a list once against its own (or a peer's) region
//! table into a [`Resolved`] list of absolute addresses, and builds transfers from index
//! selections of two resolved lists with [`plan`], NIXL's `prepXferDlist` / `makeXferReq` model.

use crate::error::{Error, Result, Side};
pub use crate::types::{RegionId, RegionSpan};

/// One contiguous piece of registered memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// The region.
    pub region: RegionId,
    /// Byte offset in the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Desc {
    /// A descriptor.
    pub fn new(region: RegionId, offset: u64, len: u64) -> Self {
        Desc {
            region,
            offset,
            len,
        }
    }
}

/// A descriptor resolved to an absolute address, with the index of its region in the table it
/// was resolved against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// Absolute address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Index of the region in the table.
    pub slot: u32,
}

/// Resolves `descs` against `table` (sorted or not), checking every descriptor lies inside its
/// region. The first bad descriptor is reported with its index.
pub fn resolve(side: Side, descs: &[Desc], table: &[RegionSpan]) -> Result<Vec<Resolved>> {
    // Region tables are small (one entry per KV tensor); a short linear probe with a one-entry
    // cache beats hashing for the usual runs of descriptors in the same region.
    let mut out = Vec::with_capacity(descs.len());
    let mut last: Option<usize> = None;
    for (index, d) in descs.iter().enumerate() {
        let slot = match last {
            Some(s) if table[s].id == d.region => s,
            _ => region_slot(side, index, d.region, table)?,
        };
        last = Some(slot);
        let r = &table[slot];
        if d.len == 0 {
            return Err(Error::ZeroLength {
                side,
                index,
                region: d.region.0,
            });
        }
        let end = d.offset.checked_add(d.len);
        if end.is_none_or(|e| e > r.len) {
            return Err(Error::OutOfBounds {
                side,
                index,
                region: d.region.0,
                offset: d.offset,
                len: d.len,
                region_len: r.len,
            });
        }
        out.push(Resolved {
            addr: r.base + d.offset,
            len: d.len,
            slot: slot as u32,
        });
    }
    Ok(out)
}

/// The slot of `region` in `table`; unknown: an error naming entry `index` of the list.
pub(crate) fn region_slot(
    side: Side,
    index: usize,
    region: RegionId,
    table: &[RegionSpan],
) -> Result<usize> {
    table
        .iter()
        .position(|r| r.id == region)
        .ok_or(Error::UnknownRegion {
            side,
            index,
            region: region.0,
        })
}

/// One operation to post: `len` bytes between a local and a remote address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// Local address.
    pub local: u64,
    /// Remote address.
    pub remote: u64,
    /// Bytes.
    pub len: u64,
    /// Local region slot.
    pub lslot: u32,
    /// Remote region slot.
    pub rslot: u32,
}

/// The operations of one transfer, and what they add up to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Operations in posting order.
    pub ops: Vec<Op>,
    /// Total bytes.
    pub bytes: u64,
    /// Descriptor pairs before coalescing.
    pub descs: usize,
}

/// Builds the operations for descriptor pairs `(local[li[k]], remote[ri[k]])`.
///
/// Pairs adjacent in the selection that are contiguous on both sides (and in the same regions)
/// are merged into one operation; operations longer than `max_op` are split (`max_op == 0`:
/// never split). Fails on a bad index or on a pair whose lengths differ.
pub fn plan(
    local: &[Resolved],
    li: &[usize],
    remote: &[Resolved],
    ri: &[usize],
    max_op: u64,
) -> Result<Plan> {
    if li.len() != ri.len() {
        return Err(Error::LengthMismatch {
            index: usize::MAX,
            local_len: li.len() as u64,
            remote_len: ri.len() as u64,
        });
    }
    let mut ops: Vec<Op> = Vec::with_capacity(li.len());
    let mut bytes = 0u64;
    for (k, (&a, &b)) in li.iter().zip(ri).enumerate() {
        let l = local.get(a).ok_or(Error::BadIndex {
            side: Side::Local,
            index: a,
            len: local.len(),
        })?;
        let r = remote.get(b).ok_or(Error::BadIndex {
            side: Side::Remote,
            index: b,
            len: remote.len(),
        })?;
        if l.len != r.len {
            return Err(Error::LengthMismatch {
                index: k,
                local_len: l.len,
                remote_len: r.len,
            });
        }
        bytes += l.len;
        if let Some(prev) = ops.last_mut() {
            if prev.lslot == l.slot
                && prev.rslot == r.slot
                && prev.local + prev.len == l.addr
                && prev.remote + prev.len == r.addr
            {
                prev.len += l.len;
                continue;
            }
        }
        ops.push(Op {
            local: l.addr,
            remote: r.addr,
            len: l.len,
            lslot: l.slot,
            rslot: r.slot,
        });
    }
    if max_op > 0 && ops.iter().any(|o| o.len > max_op) {
        ops = split(&ops, max_op);
    }
    Ok(Plan {
        ops,
        bytes,
        descs: li.len(),
    })
}

fn split(ops: &[Op], max_op: u64) -> Vec<Op> {
    let mut out = Vec::with_capacity(ops.len());
    for o in ops {
        push_split(*o, max_op, &mut out);
    }
    out
}

/// Appends `o` to `out` cut into operations of at most `max_op` bytes (0: whole).
pub(crate) fn push_split(o: Op, max_op: u64, out: &mut Vec<Op>) {
    if max_op == 0 || o.len <= max_op {
        out.push(o);
        return;
    }
    let mut done = 0;
    while done < o.len {
        let n = (o.len - done).min(max_op);
        out.push(Op {
            local: o.local + done,
            remote: o.remote + done,
            len: n,
            ..o
        });
        done += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::MemKind;
    use proptest::prelude::*;

    fn table() -> Vec<RegionSpan> {
        vec![
            RegionSpan {
                id: RegionId(7),
                base: 0x1000,
                len: 4096,
                kind: MemKind::Host,
            },
            RegionSpan {
                id: RegionId(9),
                base: 0x10_0000,
                len: 1 << 20,
                kind: MemKind::Host,
            },
        ]
    }

    #[test]
    fn resolve_checks_bounds_and_regions() {
        let t = table();
        let ok = resolve(
            Side::Remote,
            &[
                Desc::new(RegionId(7), 0, 4096),
                Desc::new(RegionId(9), 10, 5),
            ],
            &t,
        )
        .unwrap();
        assert_eq!(
            ok[0],
            Resolved {
                addr: 0x1000,
                len: 4096,
                slot: 0
            }
        );
        assert_eq!(
            ok[1],
            Resolved {
                addr: 0x10_000a,
                len: 5,
                slot: 1
            }
        );

        let e = resolve(Side::Remote, &[Desc::new(RegionId(7), 1, 4096)], &t).unwrap_err();
        assert!(matches!(
            e,
            Error::OutOfBounds {
                side: Side::Remote,
                index: 0,
                region: 7,
                offset: 1,
                len: 4096,
                region_len: 4096
            }
        ));
        let e = resolve(
            Side::Local,
            &[Desc::new(RegionId(7), 0, 1), Desc::new(RegionId(8), 0, 1)],
            &t,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            Error::UnknownRegion {
                side: Side::Local,
                index: 1,
                region: 8
            }
        ));
        // Overflowing offset + len must not wrap into bounds.
        let e = resolve(Side::Remote, &[Desc::new(RegionId(9), u64::MAX, 2)], &t).unwrap_err();
        assert!(matches!(e, Error::OutOfBounds { .. }));
        let e = resolve(Side::Remote, &[Desc::new(RegionId(9), 0, 0)], &t).unwrap_err();
        assert!(matches!(e, Error::ZeroLength { .. }));
        let text = e.to_string();
        assert!(
            text.contains("zero length") && !text.contains("outside"),
            "{text}"
        );
    }

    #[test]
    fn contiguous_blocks_make_one_op() {
        let t = table();
        let d: Vec<_> = (0..16)
            .map(|i| Desc::new(RegionId(9), i * 1024, 1024))
            .collect();
        let l = resolve(Side::Local, &d, &t).unwrap();
        let r = resolve(Side::Remote, &d, &t).unwrap();
        let idx: Vec<usize> = (0..16).collect();
        let p = plan(&l, &idx, &r, &idx, 0).unwrap();
        assert_eq!(p.ops.len(), 1);
        assert_eq!(p.ops[0].len, 16 * 1024);
        assert_eq!(p.bytes, 16 * 1024);
        assert_eq!(p.descs, 16);
        // Split at 5000 bytes: 4 ops of 5000 and one of 384.
        let p = plan(&l, &idx, &r, &idx, 5000).unwrap();
        assert_eq!(
            p.ops.iter().map(|o| o.len).collect::<Vec<_>>(),
            vec![5000, 5000, 5000, 1384]
        );
        assert_eq!(p.ops[1].local, p.ops[0].local + 5000);
        assert_eq!(p.ops[1].remote, p.ops[0].remote + 5000);
    }

    #[test]
    fn plan_rejects_bad_pairs() {
        let t = table();
        let l = resolve(Side::Local, &[Desc::new(RegionId(9), 0, 8)], &t).unwrap();
        let r = resolve(Side::Remote, &[Desc::new(RegionId(9), 0, 9)], &t).unwrap();
        assert!(matches!(
            plan(&l, &[0], &r, &[0], 0),
            Err(Error::LengthMismatch { index: 0, .. })
        ));
        assert!(matches!(
            plan(&l, &[1], &r, &[0], 0),
            Err(Error::BadIndex {
                side: Side::Local,
                ..
            })
        ));
        assert!(matches!(
            plan(&l, &[0], &r, &[0, 0], 0),
            Err(Error::LengthMismatch { .. })
        ));
    }

    proptest! {
        /// Coalescing never changes which bytes go where: expanding the plan byte by byte gives
        /// the same (local, remote) address pairs as the naive per-descriptor expansion.
        #[test]
        fn coalescing_preserves_byte_mapping(
            blocks in proptest::collection::vec((0u64..64, 0u64..64), 1..40),
            max_op in prop_oneof![Just(0u64), 1u64..200],
        ) {
            let t = vec![RegionSpan { id: RegionId(1), base: 0, len: 64 * 16, kind: MemKind::Host }];
            let ld: Vec<_> = blocks.iter().map(|&(a, _)| Desc::new(RegionId(1), a * 16, 16)).collect();
            let rd: Vec<_> = blocks.iter().map(|&(_, b)| Desc::new(RegionId(1), b * 16, 16)).collect();
            let l = resolve(Side::Local, &ld, &t).unwrap();
            let r = resolve(Side::Remote, &rd, &t).unwrap();
            let idx: Vec<usize> = (0..blocks.len()).collect();
            let p = plan(&l, &idx, &r, &idx, max_op).unwrap();
            let naive: Vec<(u64, u64)> = blocks.iter()
                .flat_map(|&(a, b)| (0..16).map(move |i| (a * 16 + i, b * 16 + i))).collect();
            let got: Vec<(u64, u64)> = p.ops.iter()
                .flat_map(|o| (0..o.len).map(move |i| (o.local + i, o.remote + i))).collect();
            prop_assert_eq!(got, naive);
            prop_assert_eq!(p.bytes, 16 * blocks.len() as u64);
            if max_op > 0 { prop_assert!(p.ops.iter().all(|o| o.len <= max_op)); }
            // Adjacent ops are never mergeable (coalescing is maximal) when not split.
            if max_op == 0 {
                for w in p.ops.windows(2) {
                    prop_assert!(!(w[0].local + w[0].len == w[1].local && w[0].remote + w[0].len == w[1].remote));
                }
            }
        }
    }
}
