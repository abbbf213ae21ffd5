//! What the connector opens of its cache to whom: regions only grants open, and the grants
//! (`kvxfer_proto::grants`), which every TCP-lane request's table is checked against.
#![forbid(unsafe_code)]

use std::sync::RwLockWriteGuard;

use super::handle::Agent;
use kvxfer_proto::grants::GrantTable;
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::wire::connector::Grant;

impl Agent {
    fn grants(&self) -> RwLockWriteGuard<'_, GrantTable> {
        self.shared
            .grants
            .write()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The regions of `layout`'s cache open only inside grants (`on`), or as before (`false`,
    /// undoing one earlier restriction).
    pub(crate) fn restrict(&self, layout: &KvLayout, on: bool) {
        let regions = layout
            .layers
            .iter()
            .flat_map(|l| std::iter::once(l.k).chain(l.v))
            .map(|(r, _)| r.0);
        if on {
            self.grants().restrict(regions);
        } else {
            self.grants().unrestrict(regions);
        }
    }

    /// `peer` may read (`write`: write) `blocks` of every layer of `layout`'s cache, under
    /// `grant`.
    pub(crate) fn grant(
        &self,
        grant: Grant,
        peer: &str,
        write: bool,
        layout: &KvLayout,
        blocks: &[u32],
    ) {
        self.grants().grant(grant, peer, write, layout, blocks);
    }

    /// Ends what `grant` opened.
    pub(crate) fn revoke(&self, grant: &Grant) {
        self.grants().revoke(grant);
    }
}
