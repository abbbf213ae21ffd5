//! kvxfer's connector over an [`Agent`]: [`Producer`] and [`Consumer`] behind the traits,
//! reaching peers across processes and hosts (UCX, the shm and TCP lanes).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::api::{KvCaches, KvConnector, KvConsumer, KvProducer, LoadFailure, LoadSpec};
use super::config::ConnectorConfig;
use super::consumer::Consumer;
use super::producer::Producer;
use super::shell::Registrations;
use crate::agent::Agent;
use crate::telemetry::{RequestStats, Telemetry};
use kvxfer_proto::error::Result;
use kvxfer_proto::lifecycle::Freed;
use kvxfer_proto::types::RegionId;
use kvxfer_proto::wire::connector::Handoff;

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
        let mut regs = Registrations {
            agent: self.agent.clone(),
            regions: Vec::new(),
        };
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
                    regs.regions.push(r);
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

impl KvConnector for AgentConnector {
    fn producer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvProducer>> {
        let (layout, regs) = self.register(caches)?;
        let p = Producer::new(self.agent.clone(), layout, cfg.clone(), self.side_channel)?;
        Ok(Box::new(p.owning(regs)))
    }

    fn consumer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvConsumer>> {
        let (layout, regs) = self.register(caches)?;
        let c = Consumer::new(self.agent.clone(), layout, cfg.clone())?;
        Ok(Box::new(c.owning(regs)))
    }
}

impl KvProducer for Producer {
    fn publish(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
    ) -> Result<Handoff> {
        Producer::publish(self, request, blocks, tokens, layers_done)
    }
    fn layer_done(&self, request: &str, layer: usize) -> Result<()> {
        Producer::layer_done(self, request, layer)
    }
    fn abort(&self, request: &str) {
        Producer::abort(self, request)
    }
    fn next_freed(&self, timeout: Duration) -> Option<Freed> {
        self.take_freed_one(timeout, |_| true).ok().flatten()
    }
    fn wait_freed(&self, request: &str, timeout: Duration) -> Result<Freed> {
        Producer::wait_freed(self, request, timeout)
    }
    fn held(&self) -> usize {
        Producer::held(self)
    }
    fn telemetry(&self) -> &Telemetry {
        Producer::telemetry(self)
    }
}

impl KvConsumer for Consumer {
    fn start_load_with(
        &self,
        handoff: &Handoff,
        local_blocks: &[u32],
        spec: &LoadSpec,
    ) -> Result<()> {
        Consumer::start_load_with(self, handoff, local_blocks, spec)
    }
    fn wait_layer(&self, request: &str, layer: usize, timeout: Duration) -> Result<()> {
        Consumer::wait_layer(self, request, layer, timeout)
    }
    fn wait(&self, request: &str, timeout: Duration) -> Result<()> {
        Consumer::wait(self, request, timeout)
    }
    fn next_finished(&self) -> Option<RequestStats> {
        self.take_finished_one(|_| true)
    }
    fn next_failed(&self) -> Option<LoadFailure> {
        self.take_failed_one(|_| true)
    }
    fn in_progress(&self) -> usize {
        Consumer::in_progress(self)
    }
    fn telemetry(&self) -> &Telemetry {
        Consumer::telemetry(self)
    }
}
