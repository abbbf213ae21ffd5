//! kvxfer's connector over an [`Agent`]: registers an engine's caches with the agent and
//! makes the shells over an [`AgentCarrier`], across processes and hosts.

use std::net::SocketAddr;
use std::sync::Arc;

use super::agent_carrier::{AgentCarrier, Registrations};
use super::api::{KvCaches, KvConnector, KvConsumer, KvProducer};
use super::carrier::Role;
use super::config::ConnectorConfig;
use super::consumer::Consumer;
use super::producer::Producer;
use crate::agent::Agent;
use kvxfer_proto::error::Result;
use kvxfer_proto::groups::CacheGroups;
use kvxfer_proto::types::RegionId;

/// Builds [`Producer`]s and [`Consumer`]s over one agent. A producer's handoffs carry
/// `side_channel` (the address of the agent's [`Agent::listen`]), through which a consumer
/// that has not met the agent yet reaches it.
#[derive(Debug, Clone)]
pub struct AgentConnector {
    agent: Arc<Agent>,
    side_channel: Option<SocketAddr>,
}

impl AgentConnector {
    /// A connector over `agent`.
    pub fn new(agent: Arc<Agent>, side_channel: Option<SocketAddr>) -> AgentConnector {
        AgentConnector {
            agent,
            side_channel,
        }
    }

    /// The agent.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// The layout of `caches` in the agent's regions: a tensor inside a region registered
    /// already uses it, any other is registered now (and deregistered when the returned
    /// registrations drop).
    fn register(
        &self,
        caches: &KvCaches,
    ) -> Result<(kvxfer_proto::layout::KvLayout, Registrations)> {
        caches.validate()?;
        let mut regs = Registrations::new(self.agent.clone());
        let mut bases: Vec<(RegionId, u64)> = Vec::new();
        for t in caches.tensors() {
            let base = match self.agent.region_containing(t.ptr(), t.len(), t.kind()) {
                Some(b) => b,
                None => {
                    // SAFETY: `CacheTensor::new`'s contract is `register_raw`'s: the memory
                    // stays valid, of this kind, while a producer or consumer over it lives;
                    // `Registrations` deregisters it when that producer or consumer drops.
                    let r = unsafe { self.agent.register_raw(t.ptr(), t.len(), t.kind())? };
                    let id = r.id();
                    regs.push(r);
                    (id, 0)
                }
            };
            bases.push(base);
        }
        let mut it = bases.into_iter();
        let layout = caches.layout(|_| it.next().unwrap_or((RegionId(u32::MAX), 0)));
        Ok((layout, regs))
    }
}

impl AgentConnector {
    /// [`AgentConnector::register`] for every group; a tensor two groups share (vLLM's hybrid
    /// allocator) is registered once.
    fn register_groups(&self, groups: &[KvCaches]) -> Result<(CacheGroups, Registrations)> {
        let mut regs = Registrations::new(self.agent.clone());
        let mut layouts = Vec::with_capacity(groups.len());
        for caches in groups {
            let (layout, r) = self.register(caches)?;
            regs.extend(r);
            layouts.push(layout);
        }
        Ok((CacheGroups::new(layouts)?, regs))
    }
}

impl KvConnector for AgentConnector {
    fn producer_groups(
        &self,
        groups: &[KvCaches],
        cfg: &ConnectorConfig,
    ) -> Result<Box<dyn KvProducer>> {
        let (layout, regs) = self.register_groups(groups)?;
        let carrier = AgentCarrier::new(
            self.agent.clone(),
            Role::Producer,
            self.side_channel,
            Some(regs),
        );
        Ok(Box::new(Producer::over(
            Box::new(carrier),
            layout,
            cfg.clone(),
        )?))
    }

    fn consumer_groups(
        &self,
        groups: &[KvCaches],
        cfg: &ConnectorConfig,
    ) -> Result<Box<dyn KvConsumer>> {
        let (layout, regs) = self.register_groups(groups)?;
        let carrier = AgentCarrier::new(self.agent.clone(), Role::Consumer, None, Some(regs));
        Ok(Box::new(Consumer::over(
            Box::new(carrier),
            layout,
            cfg.clone(),
        )?))
    }
}
