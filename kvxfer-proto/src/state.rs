//! Per-request recurrent state as a cache group: the conv and SSM state of Mamba, Mamba2 and
//! gated-delta-net layers (vLLM's `MambaSpec` groups). A request's state is one page per layer
//! (a "block" holding no tokens), moved whole; vLLM lays each page out as its state tensors back
//! to back, padded to the attention page in a hybrid model.
//!
//! Tensor parallelism splits each tensor by channel: the conv state's sub-projections (Mamba2's
//! x, B and C, GDN's Q, K and V) each over the ranks, the SSM state by head. A page is described
//! in **split units**, what the ranks divide: a rank holds `units` of them, and each segment of
//! each part holds `per_unit` channels per unit. A decode rank of another TP size reads its
//! units of every segment from the prefill ranks that hold them: one piece per part, row and
//! segment (NixlConnector's "3-read Mamba conv transfer" is this with three segments).
//!
//! Pure arithmetic, every figure checked before anything is sized from it.

use std::ops::Range;

use crate::error::{Error, Result};

/// The most parts (state tensors) a page describes.
pub const MAX_PARTS: usize = 8;
/// The most segments (sub-projections) a part describes.
pub const MAX_SEGMENTS: usize = 8;

/// One state tensor of a page: `rows` rows, each the rank's channels of every segment in turn.
/// vLLM's DS conv layout (`(dim, state_len)`) is one row of channels of `state_len` elements;
/// the SSM state `(heads, head_dim, d_state)` one row of one segment.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StatePart {
    /// Rows (1 unless the channels are the inner dimension).
    pub rows: u64,
    /// Per segment: channels per split unit (the same on every TP size).
    pub per_unit: Vec<u64>,
    /// Bytes of one channel in one row.
    pub channel_bytes: u64,
}

/// A state page: its parts back to back from offset 0, then `padding` bytes per split unit
/// that are never data (vLLM pads a hybrid model's state page to its attention page, which
/// shrinks with the TP size as the state does: so the padding is counted per unit, and a
/// page's size on any TP size follows from its units).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StateShape {
    /// The state tensors, in page order.
    pub parts: Vec<StatePart>,
    /// Bytes after the parts, per split unit.
    pub padding: u64,
}

impl StateShape {
    /// A page of `page_bytes` that does not split: one part of one segment, one unit per rank.
    /// Moves whole between equal TP sizes; another TP size is refused.
    pub fn opaque(page_bytes: u64) -> StateShape {
        StateShape {
            parts: vec![StatePart {
                rows: 1,
                per_unit: vec![1],
                channel_bytes: page_bytes,
            }],
            padding: 0,
        }
    }

    /// Whether the figures are in range: 1 to [`MAX_PARTS`] parts of 1 to [`MAX_SEGMENTS`]
    /// non-empty segments, and a page of `units` units within `u64`.
    pub fn check(&self, units: u64) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("state page: {why}")));
        if self.parts.is_empty() || self.parts.len() > MAX_PARTS {
            return bad(format!("{} parts: 1 to {MAX_PARTS}", self.parts.len()));
        }
        if units == 0 {
            return bad("no split units".into());
        }
        for (i, p) in self.parts.iter().enumerate() {
            if p.rows == 0 || p.channel_bytes == 0 {
                return bad(format!("part {i}: no rows or empty channels"));
            }
            if p.per_unit.is_empty() || p.per_unit.len() > MAX_SEGMENTS || p.per_unit.contains(&0) {
                return bad(format!(
                    "part {i}: segments {:?}: 1 to {MAX_SEGMENTS} of at least one channel",
                    p.per_unit
                ));
            }
        }
        if self.try_page_bytes(units).is_none() {
            return bad(format!("{units} units overflow a page"));
        }
        Ok(())
    }

    fn try_row_bytes(p: &StatePart, units: u64) -> Option<u64> {
        p.per_unit.iter().try_fold(0u64, |acc, &c| {
            acc.checked_add(c.checked_mul(units)?.checked_mul(p.channel_bytes)?)
        })
    }

    fn try_page_bytes(&self, units: u64) -> Option<u64> {
        let pad = self.padding.checked_mul(units)?;
        self.parts.iter().try_fold(pad, |acc, p| {
            acc.checked_add(Self::try_row_bytes(p, units)?.checked_mul(p.rows)?)
        })
    }

    /// Bytes of a page of a rank holding `units` units (0 where it overflows: refused by
    /// [`StateShape::check`]).
    pub fn page_bytes(&self, units: u64) -> u64 {
        self.try_page_bytes(units).unwrap_or(0)
    }

    /// The pieces of units `range` of a page of a rank holding `units`, as (offset in the page,
    /// bytes), in part, row and segment order: the same count and sizes for an equally wide
    /// range of another rank's page, so two lists pair index by index.
    pub fn pieces(&self, units: u64, range: Range<u64>, out: &mut Vec<(u64, u64)>) {
        self.each_piece(units, range, |o, n| out.push((o, n)));
    }

    /// [`StateShape::pieces`], each handed to `f` (no list in between: this runs per block
    /// and layer of a load).
    fn each_piece(&self, units: u64, range: Range<u64>, mut f: impl FnMut(u64, u64)) {
        let mut base = 0;
        for p in &self.parts {
            let row = Self::try_row_bytes(p, units).unwrap_or(0);
            for r in 0..p.rows {
                let mut seg = base + r * row;
                for &c in &p.per_unit {
                    let unit = c * p.channel_bytes;
                    f(seg + range.start * unit, (range.end - range.start) * unit);
                    seg += units * unit;
                }
            }
            base += row * p.rows;
        }
    }

    /// Descriptors of units `units` of the page at `start` of `region` of a rank holding
    /// `held`: one for the whole page (its padding too), else its pieces; pieces always when
    /// `split` (the other end's list is pieces, and the two pair index by index).
    pub(crate) fn block_descs(
        &self,
        held: u64,
        region: crate::types::RegionId,
        start: u64,
        units: Range<u64>,
        split: bool,
        out: &mut Vec<crate::descriptor::Desc>,
    ) {
        if units.start == 0 && units.end == held && !split {
            out.push(crate::descriptor::Desc::new(
                region,
                start,
                self.page_bytes(held),
            ));
            return;
        }
        self.each_piece(held, units, |o, n| {
            out.push(crate::descriptor::Desc::new(region, start + o, n))
        });
    }

    /// Feeds what two ends must agree on (not the units: a TP size's) to `feed`.
    pub fn hash_into(&self, mut feed: impl FnMut(u64)) {
        feed(self.parts.len() as u64);
        for p in &self.parts {
            feed(p.rows);
            feed(p.channel_bytes);
            feed(p.per_unit.len() as u64);
            p.per_unit.iter().for_each(|&c| feed(c));
        }
        feed(self.padding);
    }
}

/// The units of a state group a load moves, from the heads the TP plan gave in the request's
/// reference group (`heads` of `remote_heads` on the producer rank into `local_heads` here):
/// the same fraction of each rank's units. `None` where a fraction is not whole units (the
/// two TP sizes cannot split this page: an opaque page between different sizes).
pub fn units_of(
    heads: &crate::tp::HeadMap,
    remote_heads: u64,
    local_heads: u64,
    remote_units: u64,
    local_units: u64,
) -> Option<crate::tp::HeadMap> {
    let scale = |r: &Range<u64>, heads: u64, units: u64| -> Option<Range<u64>> {
        let (s, e) = (r.start.checked_mul(units)?, r.end.checked_mul(units)?);
        if heads == 0 || !s.is_multiple_of(heads) || !e.is_multiple_of(heads) {
            return None;
        }
        Some(s / heads..e / heads)
    };
    Some(crate::tp::HeadMap {
        remote: scale(&heads.remote, remote_heads, remote_units)?,
        local: scale(&heads.local, local_heads, local_units)?,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::tp::HeadMap;
    use proptest::prelude::*;

    /// Mamba2-like: conv (x, B, C) of 3-element channels in DS layout, then SSM by head.
    pub(crate) fn mamba2() -> StateShape {
        StateShape {
            parts: vec![
                StatePart {
                    rows: 1,
                    per_unit: vec![8, 2, 2],
                    channel_bytes: 3 * 2,
                },
                StatePart {
                    rows: 1,
                    per_unit: vec![1],
                    channel_bytes: 4 * 16 * 4,
                },
            ],
            padding: 40,
        }
    }

    #[test]
    fn a_page_is_its_parts_then_its_padding() {
        let s = mamba2();
        s.check(4).unwrap();
        assert_eq!(s.page_bytes(4), 4 * 12 * 6 + 4 * 256 + 4 * 40);
        let mut p = Vec::new();
        s.pieces(4, 1..3, &mut p);
        // x: units 1..3 of 4 (48 bytes a unit), B and C (12 a unit), then the SSM heads.
        assert_eq!(
            p,
            vec![(48, 96), (192 + 12, 24), (240 + 12, 24), (288 + 256, 512)]
        );
    }

    #[test]
    fn bad_figures_are_refused() {
        let mut s = mamba2();
        assert!(s.check(0).is_err());
        s.parts[0].per_unit.push(0);
        assert!(s.check(1).is_err());
        let huge = StateShape::opaque(u64::MAX / 2);
        assert!(huge.check(4).is_err());
        assert!(StateShape {
            parts: vec![],
            padding: 0
        }
        .check(1)
        .is_err());
    }

    #[test]
    fn units_follow_the_heads_fraction_or_refuse() {
        // Prefill TP 1 (8 heads, 4 units), decode TP 2 rank 1: heads 4..8 into 0..4.
        let m = HeadMap {
            remote: 4..8,
            local: 0..4,
        };
        assert_eq!(
            units_of(&m, 8, 4, 4, 2),
            Some(HeadMap {
                remote: 2..4,
                local: 0..2
            })
        );
        // An opaque page (one unit a rank) does not split.
        assert_eq!(units_of(&m, 8, 4, 1, 1), None);
        assert_eq!(
            units_of(&HeadMap::all(4), 4, 4, 1, 1),
            Some(HeadMap::all(1))
        );
    }

    proptest! {
        /// Every byte of a rank's units lands in the page once, and a range's pieces are
        /// exactly the bytes of its units (checked against a per-channel walk).
        #[test]
        fn pieces_are_exactly_the_units_bytes(
            units in 1u64..5, a in 0u64..5, b in 0u64..5,
            x in 1u64..4, bc in 1u64..3, rows in 1u64..3, cb in 1u64..5,
        ) {
            let (lo, hi) = (a.min(b) % units, (a.max(b) % units) + 1);
            prop_assume!(lo < hi);
            let s = StateShape {
                parts: vec![
                    StatePart { rows, per_unit: vec![x, bc, bc], channel_bytes: cb },
                    StatePart { rows: 1, per_unit: vec![1], channel_bytes: 3 },
                ],
                padding: 5,
            };
            // Naive: walk every channel of every row and segment in page order.
            let mut owner = Vec::new();
            for (pi, p) in s.parts.iter().enumerate() {
                for _ in 0..p.rows {
                    for &c in &p.per_unit {
                        for u in 0..units {
                            for _ in 0..c * p.channel_bytes {
                                owner.push(Some((pi, u)));
                            }
                        }
                    }
                }
            }
            owner.extend(std::iter::repeat_n(None, 5 * units as usize));
            prop_assert_eq!(owner.len() as u64, s.page_bytes(units));
            let mut pieces = Vec::new();
            s.pieces(units, lo..hi, &mut pieces);
            let mut got = vec![false; owner.len()];
            for (off, len) in pieces {
                for i in off..off + len {
                    prop_assert!(!got[i as usize]);
                    got[i as usize] = true;
                }
            }
            for (i, o) in owner.iter().enumerate() {
                let want = matches!(o, Some((_, u)) if (lo..hi).contains(u));
                prop_assert_eq!(got[i], want, "byte {}", i);
            }
        }
    }
}
