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
use kvxfer_proto::groups::CacheGroups;

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

    /// A carrier for a new end of `role` over `groups`, and their layouts.
    fn carrier(
        &self,
        role: &str,
        groups: &[KvCaches],
    ) -> Result<(Box<InProcessCarrier>, CacheGroups)> {
        let mem = Caches::new(groups)?;
        let layouts = CacheGroups::new(mem.layouts.clone())?;
        let c = InProcessCarrier::new(&self.hub, self.hub.name(role), End::new(mem))?;
        Ok((Box::new(c), layouts))
    }
}

impl KvConnector for InProcessConnector {
    fn producer_groups(
        &self,
        groups: &[KvCaches],
        cfg: &ConnectorConfig,
    ) -> Result<Box<dyn KvProducer>> {
        let (c, layouts) = self.carrier("producer", groups)?;
        Ok(Box::new(Producer::over(c, layouts, cfg.clone())?))
    }

    fn consumer_groups(
        &self,
        groups: &[KvCaches],
        cfg: &ConnectorConfig,
    ) -> Result<Box<dyn KvConsumer>> {
        let (c, layouts) = self.carrier("consumer", groups)?;
        Ok(Box::new(Consumer::over(c, layouts, cfg.clone())?))
    }
}
