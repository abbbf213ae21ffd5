//! What the connector opens of its cache to whom: regions only grants open, and the grants
//! (`kvxfer_proto::grants`), which every TCP-lane request's table is checked against.
#![forbid(unsafe_code)]

use std::sync::RwLockWriteGuard;

use super::handle::Agent;
use kvxfer_proto::error::Result;
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
    /// `grant`. What the table holds for it is charged to the agent's budget first (a peer's
    /// accepted lease call makes it): [`kvxfer_proto::error::Error::OutOfMemory`] when it
    /// does not fit, and nothing is opened.
    pub(crate) fn grant(
        &self,
        grant: Grant,
        peer: &str,
        write: bool,
        layout: &KvLayout,
        blocks: &[u32],
    ) -> Result<()> {
        let bytes = GrantTable::cost(peer, layout, blocks);
        let charge = self
            .shared
            .budget
            .try_charge(bytes, "a grant's block set")?;
        self.grants().grant(grant, peer, write, layout, blocks);
        let mut c = self
            .shared
            .grant_charges
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        c.entry(grant).or_default().insert(peer.to_string(), charge);
        Ok(())
    }

    /// Ends what `grant` opened, and its charges.
    pub(crate) fn revoke(&self, grant: &Grant) {
        self.grants().revoke(grant);
        let gone = self
            .shared
            .grant_charges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(grant);
        drop(gone);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use crate::budget::MemoryBudget;
    use crate::{Agent, AgentConfig, Transport};
    use kvxfer_proto::error::Error;
    use kvxfer_proto::grants::GrantTable;
    use kvxfer_proto::layout::{KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking};
    use kvxfer_proto::types::RegionId;
    use kvxfer_proto::wire::connector::Grant;

    /// What a peer's accepted lease call makes the agent hold is charged to its budget until
    /// the grant is revoked; a grant past the budget is refused typed and opens nothing.
    #[test]
    fn a_grant_is_charged_until_revoked_and_refused_past_the_budget() {
        let budget = MemoryBudget::new(8192);
        let a = Agent::new(
            AgentConfig::new(format!("grant-charge-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo")
                .budget(budget.clone()),
        )
        .unwrap();
        let g = KvGeometry {
            name: "g".into(),
            layers: 2,
            kv_heads: 2,
            head_dim: 32,
            dtype: KvDtype::Bf16,
        };
        let layout =
            KvLayout::contiguous(g, 16, 2048, KvPacking::Separate, KvOrder::Nhd, RegionId(0));
        a.restrict(&layout, true);
        let blocks: Vec<u32> = (0..64).collect();
        let before = budget.used();
        a.grant(Grant([1; 16]), "reader", false, &layout, &blocks)
            .unwrap();
        let cost = GrantTable::cost("reader", &layout, &blocks);
        assert_eq!(budget.used() - before, cost);
        // The same grant given to the same peer again replaces its entry, and its charge.
        a.grant(Grant([1; 16]), "reader", false, &layout, &blocks)
            .unwrap();
        assert_eq!(
            budget.used() - before,
            cost,
            "a grant given again is charged once"
        );
        // 1,000 more blocks for another peer do not fit: refused, nothing opened to it.
        let many: Vec<u32> = (64..1064).collect();
        let e = a
            .grant(Grant([2; 16]), "intruder", false, &layout, &many)
            .unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)), "{e:?}");
        let d = layout.descs(&[100], 0..1, 0..2).unwrap()[0];
        let grants = a.shared.grants.read().unwrap();
        assert!(grants
            .access("intruder", false)
            .check(d.region.0, d.offset, d.len)
            .is_err());
        assert!(grants
            .access("reader", false)
            .check(
                d.region.0,
                layout.descs(&[3], 0..1, 0..2).unwrap()[0].offset,
                d.len
            )
            .is_ok());
        drop(grants);
        assert_eq!(
            budget.used() - before,
            cost,
            "the refused grant holds nothing"
        );
        a.revoke(&Grant([1; 16]));
        assert_eq!(budget.used(), before, "revoked: given back");
    }
}
