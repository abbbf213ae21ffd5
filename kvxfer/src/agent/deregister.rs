//! Deregistration, fenced against every peer UCX reaches: UCX's emulated RMA checks no key on
//! this side, so only a peer can stop its own puts and gets into memory this agent lets go.
//! Peers kept on the side channel are told there
//! ([`crate::subscriptions::Subscriptions::fence_region`]); every peer that announced itself
//! to the UCX engine (each does before its first RMA) is told over UCX
//! (`crate::backend::ucx::fence`).
#![forbid(unsafe_code)]

#[cfg(doc)]
use super::config::AgentConfig;
use super::handle::Agent;
use crate::backend::ucx::driver::Cmd;
use crate::memory::Region;
use kvxfer_proto::error::{Error, Result};

impl Agent {
    /// Deregisters a region. Fails with [`Error::Busy`] while a transfer of this agent uses
    /// it, or while a peer that UCX reaches has not confirmed (within
    /// [`AgentConfig::deregister_wait`], 10 s) that nothing of its touches the region any
    /// more: each such peer is told first, refuses the region from then on
    /// ([`Error::Deregistered`]) and answers once its UCX transfers to this agent that were in
    /// flight have ended. That holds however the peer loaded this agent's metadata (side
    /// channel, by hand, etcd): a kvxfer peer announces itself to this agent's UCX engine
    /// before its first RMA here. A peer that does not answer (stopped, or past its own wait)
    /// keeps the region registered, and the next deregistrations do not wait for it but are
    /// `Busy` until it answers or is gone.
    pub fn deregister(&self, region: &Region) -> Result<()> {
        let id = region.inner.id.0;
        if !self.shared.regions.read().contains_key(&id) {
            return Err(Error::Deregistered { region: id });
        }
        // This agent's own transfers first: once the peers are told, they refuse the region
        // for good, so a deregistration that is going to be Busy here must not tell them.
        // Retiring it now (the pin handshake) makes it Busy while a transfer holds it, and
        // refuses every later pin, so nothing of this agent's can take it while peers are
        // being told.
        region.inner.retire()?;
        // Every peer kept on the side channel stops using the region and says so before its
        // memory may go: UCX's emulated RMA checks no key on this side.
        // Peers that UCX does not reach (loaded lane-only) write only through this agent's
        // TCP lane, whose target refuses a region in use itself.
        let wait = self.shared.deregister_wait;
        let ucx_reaches = |peer: &str| {
            self.shared
                .peers
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .get(peer)
                .is_none_or(|v| v.ucx)
        };
        // And every peer that announced itself to this agent's UCX engine before its first
        // RMA here, however it loaded the metadata (by hand, through etcd): the UCX fence,
        // asked first so that both waits run at once. A region UCX does not reach
        // (lane-only, staged device memory) needs none.
        let ucx_fence = if region.inner.ucx_mapped && !region.inner.restricted {
            let (reply, answer) = std::sync::mpsc::sync_channel(1);
            let asked = self.shared.cmds.send(Cmd::Fence {
                region: id,
                wait,
                reply,
            });
            if let Err(e) = asked {
                region.inner.unretire();
                return Err(e);
            }
            Some(answer)
        } else {
            None
        };
        let mut unconfirmed = self.shared.subs.fence_region(id, wait, ucx_reaches);
        if let Some(answer) = ucx_fence {
            match answer.recv().map_err(|_| Error::Shutdown).and_then(|r| r) {
                Ok(peers) => unconfirmed.extend(peers),
                Err(e) => {
                    region.inner.unretire();
                    return Err(e);
                }
            }
        }
        // A peer told both ways is one peer.
        unconfirmed.sort_unstable();
        unconfirmed.dedup();
        if !unconfirmed.is_empty() {
            region.inner.unretire();
            log::warn!(
                "kvxfer: region {id} stays registered: {} did not confirm within {wait:?} that \
                 nothing of theirs touches it",
                unconfirmed.join(", ")
            );
            return Err(Error::Busy {
                region: id,
                inflight: u32::try_from(unconfirmed.len()).unwrap_or(u32::MAX),
            });
        }
        // An error here leaves it retired: the peers were told, and UCX may have unmapped it.
        self.shared.cmds.call(|reply| Cmd::Deregister {
            region: region.inner.clone(),
            reply,
        })?;
        self.shared.regions.remove(region.inner.id);
        self.forget_share(id);
        for l in &self.shared.lanes {
            l.region_gone(region.inner.id.0);
        }
        Ok(())
    }
}
