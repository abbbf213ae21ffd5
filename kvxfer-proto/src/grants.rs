//! Grant-scoped access to a KV cache, checked by the target of every TCP-lane request: a
//! region the connector registers for its cache is *restricted*, and a peer reads (or writes)
//! bytes of it only inside the blocks a lease granted to that peer. A pull producer grants a
//! reader the published blocks (every layer) once the reader presented the request's grant;
//! a push consumer grants its producer write access to the blocks it opened. A plain region
//! its owner shared with named peers only opens, whole, to those peers; regions nobody
//! restricted or shared stay open to every authenticated peer (plain agent-level transfers).
//!
//! What a peer may touch is the cache's geometry and a counted block set, not a list of byte
//! ranges: a grant holds a few bytes a block, whatever the layer count, and a check is one
//! binary search and a lookup per block, whatever the number of grants.

use std::collections::HashMap;

use crate::layout::KvLayout;
use crate::wire::connector::Grant;

/// One cache's geometry as one peer may touch it (read, or write), and the blocks its grants
/// open there, counted (two requests may share a block, a cached prefix).
#[derive(Clone, Debug)]
struct Opened {
    write: bool,
    /// Each layer tensor's region and first byte, sorted.
    tensors: Vec<(u32, u64)>,
    /// From one block to the next (a block and its padding).
    block_bytes: u64,
    /// A block's data: a grant never opens the padding after it.
    block_len: u64,
    num_blocks: u64,
    blocks: HashMap<u32, u32>,
}

impl Opened {
    /// Whether `[off, off + len)` of `region` lies inside opened blocks (a run of adjacent
    /// opened blocks included): one binary search for the tensor, a lookup per block.
    fn covers(&self, region: u32, off: u64, len: u64) -> bool {
        let bb = self.block_bytes;
        if bb == 0 {
            return false;
        }
        // The last tensor that starts at or before `off` in `region`.
        let i = self.tensors.partition_point(|&t| t <= (region, off));
        let Some(&(r, base)) = i.checked_sub(1).and_then(|i| self.tensors.get(i)) else {
            return false;
        };
        if r != region {
            return false;
        }
        let rel = off - base;
        let Some(end) = rel.checked_add(len.max(1)) else {
            return false;
        };
        if end > bb.saturating_mul(self.num_blocks) {
            return false;
        }
        if self.block_len < bb {
            // Padded blocks: no run spans two, and nothing past a block's data is opened.
            return rel % bb + (end - rel) <= self.block_len
                && u32::try_from(rel / bb).is_ok_and(|b| self.blocks.contains_key(&b));
        }
        (rel / bb..=(end - 1) / bb)
            .all(|b| u32::try_from(b).is_ok_and(|b| self.blocks.contains_key(&b)))
    }

    fn add(&mut self, blocks: &[u32]) {
        for &b in blocks {
            *self.blocks.entry(b).or_default() += 1;
        }
    }

    fn remove(&mut self, blocks: &[u32]) {
        for b in blocks {
            if let Some(n) = self.blocks.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.blocks.remove(b);
                }
            }
        }
    }
}

/// What one peer was granted: per cache (and direction), the blocks opened; per grant, what
/// it opened, to take back.
#[derive(Debug, Default)]
struct PeerGrants {
    opened: Vec<Opened>,
    by_grant: HashMap<Grant, (usize, Vec<u32>)>,
}

impl PeerGrants {
    fn take_back(&mut self, grant: &Grant) {
        if let Some((i, blocks)) = self.by_grant.remove(grant) {
            if let Some(o) = self.opened.get_mut(i) {
                o.remove(&blocks);
            }
        }
    }
}

/// The grants an agent gave, and the regions only grants open.
#[derive(Debug, Default)]
pub struct GrantTable {
    restricted: HashMap<u32, usize>,
    /// Plain regions their owner shared with these peers only (read and write, whole).
    only: HashMap<u32, Vec<String>>,
    by_peer: HashMap<String, PeerGrants>,
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

    /// Only `peers` may read or write `region` (none: no peer); replaces an earlier set.
    pub fn share_only(&mut self, region: u32, peers: Vec<String>) {
        self.only.insert(region, peers);
    }

    /// Forgets `region`'s share set (it was deregistered).
    pub fn forget(&mut self, region: u32) {
        self.only.remove(&region);
    }

    /// `peer` may read (`write`: write) `blocks` of every layer of the cache `layout`
    /// describes, under `grant` (granting again replaces what it opened).
    pub fn grant(
        &mut self,
        grant: Grant,
        peer: &str,
        write: bool,
        layout: &KvLayout,
        blocks: &[u32],
    ) {
        let mut tensors: Vec<(u32, u64)> = layout
            .layers
            .iter()
            .flat_map(|l| std::iter::once(l.k).chain(l.v))
            .map(|(r, off)| (r.0, off))
            .collect();
        tensors.sort_unstable();
        let (block_bytes, block_len, num_blocks) = (
            layout.block_stride(),
            layout.block_bytes(),
            layout.num_blocks,
        );
        let p = self.by_peer.entry(peer.to_string()).or_default();
        p.take_back(&grant);
        let i = match p.opened.iter().position(|o| {
            o.write == write
                && o.block_bytes == block_bytes
                && o.block_len == block_len
                && o.num_blocks == num_blocks
                && o.tensors == tensors
        }) {
            Some(i) => i,
            None => {
                p.opened.push(Opened {
                    write,
                    tensors,
                    block_bytes,
                    block_len,
                    num_blocks,
                    blocks: HashMap::new(),
                });
                p.opened.len() - 1
            }
        };
        p.opened[i].add(blocks);
        p.by_grant.insert(grant, (i, blocks.to_vec()));
    }

    /// Bytes the table holds for one grant of `blocks` of `layout`'s cache to `peer`,
    /// rounded up: its block list (4 bytes a block), the counts it adds to the peer's block
    /// set (a hash entry, 16 bytes with its share of empty slots), the tensor list of a new
    /// scope and the peer's name. What a memory budget is charged for it.
    pub fn cost(peer: &str, layout: &KvLayout, blocks: &[u32]) -> u64 {
        let tensors = layout.layers.len() * 2;
        (blocks.len() * (4 + 16) + tensors * 16 + peer.len() + 256) as u64
    }

    /// Ends what `grant` opened, for every peer.
    pub fn revoke(&mut self, grant: &Grant) {
        self.by_peer.retain(|_, p| {
            p.take_back(grant);
            !p.by_grant.is_empty()
        });
    }

    /// Grants in force (all peers).
    pub fn scopes(&self) -> usize {
        self.by_peer.values().map(|p| p.by_grant.len()).sum()
    }

    /// What `peer` may read (`write`: write), looked up once for a whole request's table.
    pub fn access<'a>(&'a self, peer: &'a str, write: bool) -> PeerAccess<'a> {
        PeerAccess {
            table: self,
            peer,
            write,
            grants: self.by_peer.get(peer),
        }
    }

    /// Whether `peer` may read (`write`: write) `[off, off + len)` of `region`; `Err` says
    /// why not. ([`GrantTable::access`] once, then its checks, for many pieces.)
    pub fn check(
        &self,
        peer: &str,
        write: bool,
        region: u32,
        off: u64,
        len: u64,
    ) -> Result<(), String> {
        self.access(peer, write).check(region, off, len)
    }
}

/// One peer's grants in one direction ([`GrantTable::access`]).
#[derive(Debug)]
pub struct PeerAccess<'a> {
    table: &'a GrantTable,
    peer: &'a str,
    write: bool,
    grants: Option<&'a PeerGrants>,
}

impl PeerAccess<'_> {
    /// Whether the region's share set, if its owner gave one, names the peer; `Err` says why
    /// not. (A region only grants open has no share set: see [`PeerAccess::check`].)
    pub fn check_share(&self, region: u32) -> Result<(), String> {
        match self.table.only.get(&region) {
            Some(peers) if !peers.iter().any(|p| p == self.peer) => Err(format!(
                "{:?} is not among the peers region {region} is shared with",
                self.peer
            )),
            _ => Ok(()),
        }
    }

    /// Whether the peer may touch `[off, off + len)` of `region`; `Err` says why not.
    pub fn check(&self, region: u32, off: u64, len: u64) -> Result<(), String> {
        if !self.table.is_restricted(region) {
            return self.check_share(region);
        }
        let granted = self.grants.is_some_and(|p| {
            p.opened
                .iter()
                .any(|o| o.write == self.write && o.covers(region, off, len))
        });
        if granted {
            Ok(())
        } else {
            Err(format!(
                "{:?} holds no grant to {} [{off}, +{len}) of region {region}",
                self.peer,
                if self.write { "write" } else { "read" }
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

    #[test]
    fn a_block_two_grants_share_stays_open_until_both_end() {
        let l = layout();
        let bb = l.block_bytes();
        let mut t = GrantTable::new();
        t.restrict([7]);
        let (a, b) = (Grant([3; 16]), Grant([4; 16]));
        t.grant(a, "d", false, &l, &[1, 2]);
        t.grant(b, "d", false, &l, &[2, 3]);
        t.revoke(&a);
        assert!(
            t.check("d", false, 7, bb, bb).is_err(),
            "block 1 was only a's"
        );
        assert!(
            t.check("d", false, 7, 2 * bb, 2 * bb).is_ok(),
            "b still opens 2 and 3"
        );
        t.revoke(&b);
        assert!(t.check("d", false, 7, 2 * bb, bb).is_err());
        assert_eq!(t.scopes(), 0);
    }

    #[test]
    fn a_shared_region_opens_whole_to_its_peers_only() {
        let mut t = GrantTable::new();
        t.share_only(3, vec!["a".into(), "b".into()]);
        t.share_only(4, Vec::new());
        for write in [false, true] {
            assert!(t.check("a", write, 3, 0, u64::MAX / 2).is_ok());
            assert!(t.check("b", write, 3, 100, 1).is_ok());
            let e = t.check("c", write, 3, 0, 1).unwrap_err();
            assert!(e.contains("\"c\" is not among the peers region 3"), "{e}");
            assert!(t.check("a", write, 4, 0, 1).is_err());
            // Regions without a set stay open.
            assert!(t.check("c", write, 5, 0, 1).is_ok());
        }
        assert!(t.access("c", false).check_share(3).is_err());
        t.forget(3);
        assert!(t.check("c", false, 3, 0, 1).is_ok());
    }

    #[test]
    fn a_grant_of_padded_blocks_opens_their_data_only() {
        let mut l = layout();
        l.pad_per_head = 16;
        let (bb, stride) = (l.block_bytes(), l.block_stride());
        let mut t = GrantTable::new();
        t.restrict([7]);
        t.grant(Grant([5; 16]), "d", true, &l, &[3, 4]);
        for d in l.descs(&[3, 4], 0..2, 0..2).unwrap() {
            assert_eq!(t.check("d", true, 7, d.offset, d.len), Ok(()));
        }
        let base = l.layers[0].k.1;
        // The padding after a granted block, a run into it, and two blocks as one run.
        assert!(t.check("d", true, 7, base + 3 * stride + bb, 1).is_err());
        assert!(t.check("d", true, 7, base + 3 * stride, bb + 1).is_err());
        assert!(t
            .check("d", true, 7, base + 3 * stride, 2 * stride)
            .is_err());
        assert!(t.check("d", true, 7, base + 5 * stride, bb).is_err());
    }
}
