//! The in-process connector: a producer and consumers in one process, KV moved by memcpy
//! between their caches, no network. For engines that run prefill and decode in one process
//! (and for engines' own tests). The same shells as the agent's connector ([`Producer`],
//! [`Consumer`]: the protocol cores of [`kvxfer_proto::connector`], leases, readers,
//! refusals, layer-wise readiness) over a carrier that hands messages over in memory and
//! copies blocks on a mover thread. Host memory only.

mod carrier;
mod copy;
mod hub;

use std::sync::Arc;

use super::api::{KvCaches, KvConnector, KvConsumer, KvProducer};
use super::config::ConnectorConfig;
use super::consumer::Consumer;
use super::producer::Producer;
use carrier::InProcessCarrier;
use copy::Caches;
use hub::{End, Hub};
use kvxfer_proto::error::Result;

/// Builds producers and consumers that find each other in memory: a handoff published by
/// one of this connector's producers can be loaded by any of its consumers (clones share
/// them).
#[derive(Debug, Clone, Default)]
pub struct InProcessConnector {
    hub: Arc<Hub>,
}

impl InProcessConnector {
    /// A connector with no producer or consumer yet.
    pub fn new() -> InProcessConnector {
        InProcessConnector::default()
    }

    /// A carrier for a new end of `role` over `caches`, and the caches' layout.
    fn carrier(
        &self,
        role: &str,
        caches: &KvCaches,
    ) -> Result<(Box<InProcessCarrier>, kvxfer_proto::layout::KvLayout)> {
        let mem = Caches::new(caches)?;
        let layout = mem.layout.clone();
        let c = InProcessCarrier::new(&self.hub, self.hub.name(role), End::new(mem))?;
        Ok((Box::new(c), layout))
    }
}

impl KvConnector for InProcessConnector {
    fn producer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvProducer>> {
        let (c, layout) = self.carrier("producer", caches)?;
        Ok(Box::new(Producer::over(c, layout, cfg.clone())?))
    }

    fn consumer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvConsumer>> {
        let (c, layout) = self.carrier("consumer", caches)?;
        Ok(Box::new(Consumer::over(c, layout, cfg.clone())?))
    }
}
