//! The in-process connector: a producer and consumers in one process, KV moved by memcpy
//! between their caches, no network. For engines that run prefill and decode in one process
//! (and for engines' own tests). It runs the same protocol cores as the agent's connector
//! ([`kvxfer_proto::connector`]: leases, readers, refusals, layer-wise readiness), with
//! messages handed over in memory instead of sent as notifications. Host memory only.

mod consumer;
mod copy;
mod hub;
mod producer;

use std::sync::Arc;

use super::api::{KvCaches, KvConnector, KvConsumer, KvProducer};
use super::config::ConnectorConfig;
use consumer::InProcessConsumer;
use copy::Caches;
use hub::Hub;
use kvxfer_proto::error::Result;
use producer::InProcessProducer;

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
}

impl KvConnector for InProcessConnector {
    fn producer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvProducer>> {
        let name = self.hub.name("producer");
        let p = InProcessProducer::new(&self.hub, name, Caches::new(caches)?, cfg.clone())?;
        Ok(Box::new(p))
    }

    fn consumer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvConsumer>> {
        let name = self.hub.name("consumer");
        let c = InProcessConsumer::new(&self.hub, name, Caches::new(caches)?, cfg.clone())?;
        Ok(Box::new(c))
    }
}
