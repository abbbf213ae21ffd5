//! A request's KV as several cache groups (vLLM's KV cache groups under its hybrid cache
//! manager): each group a set of layers with its own layout and its own block ids. A model with
//! sliding-window and full-attention layers has two groups of one geometry whose block lists
//! differ (the window's blocks outside it are not held); a hybrid model adds a group of another
//! shape. Layers are numbered across groups, group 0's first: the index the connector's
//! layer-wise calls and messages use.
//!
//! A block list may hold [`NO_BLOCK`] where a group keeps nothing (a sliding window's blocks
//! before it, vLLM's null block): a pair with it on either side moves nothing.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::layout::KvLayout;

/// "No block here": a slot a group does not hold (vLLM's null block, a sliding window's
/// evicted blocks). Never moved, never granted, never checked against a cache's size.
pub const NO_BLOCK: u32 = u32::MAX;

/// The most groups a cache or a handoff carries (vLLM makes a handful; a handoff from a
/// client is checked against it before anything is sized from it).
pub const MAX_GROUPS: usize = 64;

/// Where each group's layers sit in the numbering across groups.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupLayers {
    starts: Vec<usize>,
    total: usize,
}

impl GroupLayers {
    /// The numbering of groups of `layers[g]` layers each.
    pub fn new(layers: impl IntoIterator<Item = usize>) -> GroupLayers {
        let mut starts = Vec::new();
        let mut total = 0;
        for n in layers {
            starts.push(total);
            total += n;
        }
        GroupLayers { starts, total }
    }

    /// The numbering of `groups`' layouts.
    pub fn of(groups: &[KvLayout]) -> GroupLayers {
        GroupLayers::new(groups.iter().map(|l| l.layers.len()))
    }

    /// Layers of every group.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Groups.
    pub fn groups(&self) -> usize {
        self.starts.len()
    }

    /// The group of layer `layer` and its index inside the group.
    pub fn locate(&self, layer: usize) -> Option<(usize, usize)> {
        if layer >= self.total {
            return None;
        }
        let g = self.starts.partition_point(|&s| s <= layer) - 1;
        Some((g, layer - self.starts[g]))
    }

    /// The layers of group `g` in the numbering across groups.
    pub fn range(&self, g: usize) -> Range<usize> {
        let start = self.starts.get(g).copied().unwrap_or(self.total);
        let end = self.starts.get(g + 1).copied().unwrap_or(self.total);
        start..end
    }
}

/// An end's cache as groups: each group's layout and the layer numbering across them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheGroups {
    layouts: Vec<KvLayout>,
    layers: GroupLayers,
}

impl CacheGroups {
    /// `layouts` as groups, in order: 1 to [`MAX_GROUPS`] of them, each of at least one layer
    /// and a geometry its packing allows.
    pub fn new(layouts: Vec<KvLayout>) -> Result<CacheGroups> {
        if layouts.is_empty() || layouts.len() > MAX_GROUPS {
            return Err(Error::InvalidArgument(format!(
                "{} cache groups: 1 to {MAX_GROUPS}",
                layouts.len()
            )));
        }
        for (g, l) in layouts.iter().enumerate() {
            l.check_packing()
                .map_err(|e| Error::InvalidArgument(format!("cache group {g}: {e}")))?;
            if l.layers.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "cache group {g}: no layers"
                )));
            }
        }
        let layers = GroupLayers::of(&layouts);
        Ok(CacheGroups { layouts, layers })
    }

    /// Every group's layout.
    pub fn layouts(&self) -> &[KvLayout] {
        &self.layouts
    }

    /// Groups.
    pub fn len(&self) -> usize {
        self.layouts.len()
    }

    /// Never: a cache has at least one group.
    pub fn is_empty(&self) -> bool {
        self.layouts.is_empty()
    }

    /// Layers of every group.
    pub fn total_layers(&self) -> usize {
        self.layers.total()
    }

    /// The group of layer `layer` (numbered across groups), its layout and its index there.
    pub fn locate(&self, layer: usize) -> Option<(usize, &KvLayout, usize)> {
        let (g, l) = self.layers.locate(layer)?;
        Some((g, &self.layouts[g], l))
    }

    /// Bytes one block id of group `g` stands for: its tensors in every layer of the group.
    pub fn block_bytes_all_layers(&self, g: usize) -> u64 {
        self.layouts
            .get(g)
            .map_or(0, KvLayout::block_bytes_all_layers)
    }

    /// Descriptors `blocks[g]` blocks of each group make in every layer (whole blocks).
    pub fn descs<T: AsRef<[u32]>>(&self, blocks: &[T]) -> u64 {
        self.layouts
            .iter()
            .zip(blocks)
            .map(|(l, b)| (b.as_ref().len() * l.layers.len() * l.tensors_per_layer()) as u64)
            .sum()
    }
}

/// The blocks one group's load moves: `local` pairs with the last `local.len()` of `remote`
/// (the consumer holds the ones before: a cached prefix), and a pair whose local side is
/// [`NO_BLOCK`] is dropped (nothing is to land there). A local block paired with a slot the
/// producer does not hold is refused: it would stay unfilled and be taken as loaded. Why, when
/// the lists do not pair.
pub fn pair_blocks(local: &[u32], remote: &[u32]) -> Result<(Vec<u32>, Vec<u32>), String> {
    let skip = remote.len().checked_sub(local.len()).ok_or_else(|| {
        format!(
            "{} local blocks for {} published",
            local.len(),
            remote.len()
        )
    })?;
    let mut out = (
        Vec::with_capacity(local.len()),
        Vec::with_capacity(local.len()),
    );
    for (i, (&l, &r)) in local.iter().zip(&remote[skip..]).enumerate() {
        match (l, r) {
            (NO_BLOCK, _) => {}
            (l, NO_BLOCK) => {
                return Err(format!(
                    "local block {l} pairs with slot {} of the producer's, which it does not \
                     hold",
                    skip + i
                ))
            }
            (l, r) => {
                out.0.push(l);
                out.1.push(r);
            }
        }
    }
    Ok(out)
}

/// `blocks` without [`NO_BLOCK`]: what a group actually holds.
pub fn held(blocks: &[u32]) -> impl Iterator<Item = u32> + '_ {
    blocks.iter().copied().filter(|&b| b != NO_BLOCK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn layers_are_numbered_across_groups() {
        let g = GroupLayers::new([3, 0, 2]);
        assert_eq!((g.total(), g.groups()), (5, 3));
        let at: Vec<_> = (0..6).map(|l| g.locate(l)).collect();
        assert_eq!(
            at,
            [
                Some((0, 0)),
                Some((0, 1)),
                Some((0, 2)),
                Some((2, 0)),
                Some((2, 1)),
                None
            ]
        );
        assert_eq!((g.range(0), g.range(1), g.range(2)), (0..3, 3..3, 3..5));
        assert_eq!(g.range(7), 5..5);
    }

    #[test]
    fn pairs_skip_the_cached_prefix_and_the_slots_nobody_holds() {
        let n = NO_BLOCK;
        // A sliding window: the producer no longer holds its first two blocks; the consumer
        // caches the first one and holds nothing for the second.
        let (l, r) = pair_blocks(&[n, 7, 8], &[n, n, 4, 5]).unwrap();
        assert_eq!((l, r), (vec![7, 8], vec![4, 5]));
        let (l, r) = pair_blocks(&[1, n, 3], &[9, 8, 7]).unwrap();
        assert_eq!((l, r), (vec![1, 3], vec![9, 7]));
        assert_eq!(
            pair_blocks(&[1, 2], &[3]).unwrap_err(),
            "2 local blocks for 1 published"
        );
        // A block to fill from a slot the producer no longer holds: refused, never left empty.
        let e = pair_blocks(&[6, 7], &[n, 4]).unwrap_err();
        assert!(e.contains("local block 6 pairs with slot 0"), "{e}");
        assert_eq!(held(&[n, 2, n, 5]).collect::<Vec<_>>(), [2, 5]);
    }

    proptest! {
        #[test]
        fn every_layer_has_one_place(sizes in proptest::collection::vec(0usize..5, 0..6)) {
            let g = GroupLayers::new(sizes.clone());
            let mut seen = Vec::new();
            for (i, n) in sizes.iter().enumerate() {
                prop_assert_eq!(g.range(i).len(), *n);
                for l in g.range(i) {
                    prop_assert_eq!(g.locate(l), Some((i, l - g.range(i).start)));
                    seen.push(l);
                }
            }
            prop_assert_eq!(seen, (0..g.total()).collect::<Vec<_>>());
            prop_assert_eq!(g.locate(g.total()), None);
        }
    }
}
