//! Grant-scoped access to a KV cache, checked by the target of every TCP-lane request: a
//! region the connector registers for its cache is *restricted*, and a peer reads (or writes)
//! bytes of it only inside the blocks a lease granted to that peer. A pull producer grants a
//! reader the published blocks (every layer) once the reader presented the request's grant;
//! a push consumer grants its producer write access to the blocks it opened. Regions nobody
//! restricted stay open to every authenticated peer (plain agent-level transfers).
//!
//! A scope is the cache's geometry and a block set, not a list of byte ranges: what a grant
//! holds is 4 bytes a block, whatever the layer count.

use std::collections::{HashMap, HashSet};

use crate::layout::KvLayout;
use crate::wire::connector::Grant;

/// What one grant gives one peer: these blocks of this cache, to read or to write.
#[derive(Clone, Debug)]
struct Scope {
    write: bool,
    /// Each layer tensor's region and first byte.
    tensors: Vec<(u32, u64)>,
    block_bytes: u64,
    num_blocks: u64,
    blocks: HashSet<u32>,
}

impl Scope {
    /// Whether `[off, off + len)` of `region` lies inside granted blocks (a run of adjacent
    /// granted blocks included).
    fn covers(&self, region: u32, off: u64, len: u64) -> bool {
        let bb = self.block_bytes;
        let tensor = bb.saturating_mul(self.num_blocks);
        self.tensors.iter().any(|&(r, base)| {
            if r != region || off < base || bb == 0 {
                return false;
            }
            let rel = off - base;
            let Some(end) = rel.checked_add(len.max(1)) else {
                return false;
            };
            if end > tensor {
                return false;
            }
            (rel / bb..=(end - 1) / bb)
                .all(|b| u32::try_from(b).is_ok_and(|b| self.blocks.contains(&b)))
        })
    }
}

/// The grants an agent gave, and the regions only grants open.
#[derive(Debug, Default)]
pub struct GrantTable {
    restricted: HashMap<u32, usize>,
    /// Per peer: its scopes, by the grant that made each.
    by_peer: HashMap<String, Vec<(Grant, Scope)>>,
}

impl GrantTable {
    /// An empty table: every region open.
    pub fn new() -> GrantTable {
        GrantTable::default()
    }

    /// Only grants open `regions` from now on (counted: each [`GrantTable::restrict`] needs
    /// its [`GrantTable::unrestrict`]).
    pub fn restrict(&mut self, regions: impl IntoIterator<Item = u32>) {
        for r in regions {
            *self.restricted.entry(r).or_default() += 1;
        }
    }

    /// Undoes one [`GrantTable::restrict`] of `regions`.
    pub fn unrestrict(&mut self, regions: impl IntoIterator<Item = u32>) {
        for r in regions {
            if let Some(n) = self.restricted.get_mut(&r) {
                *n -= 1;
                if *n == 0 {
                    self.restricted.remove(&r);
                }
            }
        }
    }

    /// Whether only grants open `region`.
    pub fn is_restricted(&self, region: u32) -> bool {
        self.restricted.contains_key(&region)
    }

    /// `peer` may read (`write`: write) `blocks` of every layer of the cache `layout`
    /// describes, under `grant` (granting again replaces the scope).
    pub fn grant(
        &mut self,
        grant: Grant,
        peer: &str,
        write: bool,
        layout: &KvLayout,
        blocks: &[u32],
    ) {
        let tensors = layout
            .layers
            .iter()
            .flat_map(|l| std::iter::once(l.k).chain(l.v))
            .map(|(r, off)| (r.0, off))
            .collect();
        let scope = Scope {
            write,
            tensors,
            block_bytes: layout.block_bytes(),
            num_blocks: layout.num_blocks,
            blocks: blocks.iter().copied().collect(),
        };
        let v = self.by_peer.entry(peer.to_string()).or_default();
        v.retain(|(g, _)| g != &grant);
        v.push((grant, scope));
    }

    /// Ends every scope `grant` made, for every peer.
    pub fn revoke(&mut self, grant: &Grant) {
        self.by_peer.retain(|_, v| {
            v.retain(|(g, _)| g != grant);
            !v.is_empty()
        });
    }

    /// Scopes held now (all peers).
    pub fn scopes(&self) -> usize {
        self.by_peer.values().map(Vec::len).sum()
    }

    /// Whether `peer` may read (`write`: write) `[off, off + len)` of `region`; `Err` says
    /// why not.
    pub fn check(
        &self,
        peer: &str,
        write: bool,
        region: u32,
        off: u64,
        len: u64,
    ) -> Result<(), String> {
        if !self.is_restricted(region) {
            return Ok(());
        }
        let granted = self.by_peer.get(peer).is_some_and(|v| {
            v.iter()
                .any(|(_, s)| s.write == write && s.covers(region, off, len))
        });
        if granted {
            Ok(())
        } else {
            Err(format!(
                "{peer:?} holds no grant to {} [{off}, +{len}) of region {region}",
                if write { "write" } else { "read" }
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvDtype, KvGeometry, KvOrder, KvPacking};
    use crate::types::RegionId;

    fn layout() -> KvLayout {
        let g = KvGeometry {
            name: "g".into(),
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::Bf16,
        };
        KvLayout::contiguous(g, 4, 16, KvPacking::Separate, KvOrder::Nhd, RegionId(7))
    }

    #[test]
    fn a_grant_opens_its_blocks_of_every_layer_to_its_peer_only() {
        let l = layout();
        let bb = l.block_bytes();
        let mut t = GrantTable::new();
        // Open until restricted.
        assert!(t.check("mallory", false, 7, 0, bb).is_ok());
        t.restrict([7]);
        let g = Grant([1; 16]);
        t.grant(g, "decode", false, &l, &[3, 4, 9]);
        for d in l.descs(&[3, 4, 9], 0..2, 0..2).unwrap() {
            assert_eq!(t.check("decode", false, 7, d.offset, d.len), Ok(()));
            assert!(
                t.check("decode", true, 7, d.offset, d.len).is_err(),
                "a read grant writes"
            );
            assert!(t.check("mallory", false, 7, d.offset, d.len).is_err());
        }
        // Blocks 3 and 4 as one run; 4 and 5 (not granted) refused; a byte past block 9.
        let base = l.layers[1].k.1;
        assert_eq!(t.check("decode", false, 7, base + 3 * bb, 2 * bb), Ok(()));
        assert!(t.check("decode", false, 7, base + 4 * bb, 2 * bb).is_err());
        assert!(t.check("decode", false, 7, base + 9 * bb, bb + 1).is_err());
        for d in l.descs(&[0, 5, 15], 0..2, 0..2).unwrap() {
            assert!(t.check("decode", false, 7, d.offset, d.len).is_err());
        }
        // Past the region's tensors, and overflowing lengths.
        assert!(t.check("decode", false, 7, l.region_bytes(), 1).is_err());
        assert!(t
            .check("decode", false, 7, base + 3 * bb, u64::MAX)
            .is_err());
        assert!(
            t.check("decode", false, 8, 0, 1).is_ok(),
            "another region stays open"
        );
        t.revoke(&g);
        assert!(t.check("decode", false, 7, base + 3 * bb, bb).is_err());
        assert_eq!(t.scopes(), 0);
        t.unrestrict([7]);
        assert!(t.check("mallory", false, 7, 0, bb).is_ok());
    }

    #[test]
    fn restrictions_count_and_grants_replace() {
        let l = layout();
        let bb = l.block_bytes();
        let mut t = GrantTable::new();
        t.restrict([7]);
        t.restrict([7]);
        t.unrestrict([7]);
        assert!(t.is_restricted(7));
        let g = Grant([2; 16]);
        t.grant(g, "p", true, &l, &[1]);
        t.grant(g, "p", true, &l, &[2]);
        assert!(
            t.check("p", true, 7, bb, bb).is_err(),
            "the first scope was replaced"
        );
        assert!(t.check("p", true, 7, 2 * bb, bb).is_ok());
        assert_eq!(t.scopes(), 1);
    }
}
