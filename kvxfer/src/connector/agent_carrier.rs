//! The agent as a connector shell's carrier: control messages as notifications on the
//! agent's connector queues, a layer's blocks as one of the agent's transfers (UCX, the shm
//! and TCP lanes), across processes and hosts.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::carrier::{Carrier, InFlight, LayerMove, Moved, Role};
use super::shell::lock;
use crate::agent::Agent;
use crate::memory::Region;
use crate::transfer::Transfer;
use kvxfer_proto::connector::{load_descs, load_paged};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::handoff_seal::HandoffKey;
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::types::XferOp;
use kvxfer_proto::wire::connector::{Grant, Handoff};
use kvxfer_proto::wire::notify::Notification;

/// Regions a connector registered for an engine's tensors, deregistered on drop.
#[derive(Debug)]
pub(crate) struct Registrations {
    agent: Arc<Agent>,
    regions: Vec<Region>,
}

impl Registrations {
    pub(crate) fn new(agent: Arc<Agent>) -> Registrations {
        Registrations {
            agent,
            regions: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, r: Region) {
        self.regions.push(r);
    }

    /// Takes over `other`'s regions (deregistered when this drops).
    pub(crate) fn extend(&mut self, mut other: Registrations) {
        self.regions.append(&mut other.regions);
    }
}

impl Drop for Registrations {
    fn drop(&mut self) {
        for r in &self.regions {
            // Transfers of a dropped producer or consumer are over; a peer's read still in
            // flight makes this `Busy`: the agent then keeps the mapping until it drops.
            if let Err(e) = self.agent.deregister(r) {
                log::warn!(
                    "kvxfer connector: region {} stays registered: {e}",
                    r.id().0
                );
            }
        }
    }
}

/// The agent as a connector shell's carrier.
#[derive(Debug)]
pub(crate) struct AgentCarrier {
    agent: Arc<Agent>,
    role: Role,
    side_channel: Option<SocketAddr>,
    /// Regions registered for this shell's caches: deregistered on [`Carrier::close`], after
    /// the shell's thread has stopped.
    regs: Mutex<Option<Registrations>>,
}

impl AgentCarrier {
    pub(crate) fn new(
        agent: Arc<Agent>,
        role: Role,
        side_channel: Option<SocketAddr>,
        regs: Option<Registrations>,
    ) -> AgentCarrier {
        AgentCarrier {
            agent,
            role,
            side_channel,
            regs: Mutex::new(regs),
        }
    }
}

impl Carrier for AgentCarrier {
    fn name(&self) -> &str {
        self.agent.name()
    }

    fn epoch(&self) -> u64 {
        self.agent.epoch()
    }

    fn side_channel(&self) -> Option<SocketAddr> {
        self.side_channel
    }

    fn handoff_key(&self) -> Option<HandoffKey> {
        self.agent.secret().map(HandoffKey::new)
    }

    fn restrict(&self, layout: &KvLayout, on: bool) {
        self.agent.restrict(layout, on);
    }

    fn grant(
        &self,
        grant: Grant,
        peer: &str,
        write: bool,
        layout: &KvLayout,
        blocks: &[u32],
    ) -> Result<()> {
        self.agent.grant(grant, peer, write, layout, blocks)
    }

    fn revoke(&self, grant: &Grant) {
        self.agent.revoke(grant);
    }

    fn send(&self, to: &str, msg: &[u8]) -> bool {
        match self.agent.notify(to, msg) {
            Ok(t) => drop(t), // completes on its own
            // The peer's departure shows in its epoch and its lease: a lost message is
            // covered by the protocol's heartbeats.
            Err(e) => log::warn!("kvxfer connector: message to {to:?} not sent: {e}"),
        }
        true
    }

    fn recv(&self, wait: Duration) -> Option<Notification> {
        self.agent
            .wait_control(self.role == Role::Producer, wait)
            .ok()
    }

    fn try_recv(&self) -> Option<Notification> {
        self.agent.try_control(self.role == Role::Producer)
    }

    fn reach(&self, h: &Handoff) -> Result<()> {
        // Not loaded, or another incarnation than the one that published: (re)load the
        // producer through its side channel.
        let loaded = self.agent.peer_epoch(&h.producer);
        if loaded.is_some() && (h.epoch == 0 || loaded == Some(h.epoch)) {
            return Ok(());
        }
        match h.side_channel.map(|addr| (addr, self.agent.connect(addr))) {
            Some((addr, Ok(got))) if got != h.producer => Err(Error::Handoff {
                request: h.request.clone(),
                why: format!("{addr} is {got:?}, not the producer {:?}", h.producer),
            }),
            Some((_, Ok(_))) => Ok(()),
            // Another incarnation is loaded and the handoff's side channel is gone (or no
            // side channel came): the shell's epoch check says why it cannot load.
            Some((_, Err(_))) | None if loaded.is_some() => Ok(()),
            Some((_, Err(e))) => Err(e),
            None => Err(Error::UnknownPeer {
                agent: h.producer.clone(),
            }),
        }
    }

    fn peer_epoch(&self, peer: &str) -> Option<u64> {
        self.agent.peer_epoch(peer)
    }

    fn read(
        &self,
        producer: &str,
        m: &LayerMove<'_>,
        within: Duration,
    ) -> Result<Box<dyn InFlight>> {
        let layers = m.layer..m.layer + 1;
        // One entry per tensor of the layer, not one per block, where the heads allow it (a
        // head slice in NHD order is one piece per token).
        let paged = load_paged(
            m.local,
            m.remote,
            m.heads,
            m.local_blocks,
            m.remote_blocks,
            layers.clone(),
        )?;
        let t = if let Some((lp, rp)) = paged {
            let a = &self.agent;
            a.transfer_paged(XferOp::Read, producer, &lp, &rp, None, Some(within))?
        } else {
            let (ld, rd) = load_descs(
                m.local,
                m.remote,
                m.heads,
                m.local_blocks,
                m.remote_blocks,
                layers,
            )?;
            let lp = self.agent.prep_local(&ld)?;
            let rp = self.agent.prep_remote(producer, &rd)?;
            self.agent
                .transfer_all(XferOp::Read, &lp, &rp, None, Some(within))?
        };
        Ok(Box::new(AgentMove(t)))
    }

    fn write(
        &self,
        reader: &str,
        m: &LayerMove<'_>,
        note: &[u8],
        within: Duration,
    ) -> Result<Box<dyn InFlight>> {
        // Whole blocks: one paged entry per tensor of the layer on each side.
        let layers = m.layer..m.layer + 1;
        let ld = m
            .local
            .paged(m.local_blocks, layers.clone(), m.heads.local.clone())?;
        let rd = m
            .remote
            .paged(m.remote_blocks, layers, m.heads.remote.clone())?;
        let t =
            self.agent
                .transfer_paged(XferOp::Write, reader, &ld, &rd, Some(note), Some(within))?;
        Ok(Box::new(AgentMove(t)))
    }

    fn fence(&self, peer: &str) -> usize {
        self.agent.fence_inbound(peer)
    }

    fn close(&self) {
        drop(lock(&self.regs).take());
    }
}

/// An agent transfer as a move in flight.
struct AgentMove(Transfer);

impl InFlight for AgentMove {
    fn is_done(&self) -> bool {
        self.0.is_done()
    }

    fn wait(self: Box<Self>) -> Result<Moved> {
        let s = self.0.wait()?;
        Ok(Moved {
            bytes: s.bytes,
            descs: s.descs as u64,
            post: s.post_time,
        })
    }

    fn cancel(self: Box<Self>) {
        // Returns once the lanes and UCX no longer touch the blocks, completed or not.
        let _ = self.0.cancel();
    }
}
