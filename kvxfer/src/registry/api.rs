//! The discovery interface and its server-less implementation (the side channel).
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use crate::agent::Agent;
use kvxfer_proto::error::{Error, Result};

/// Where an agent makes itself findable and finds peers by name.
pub trait Discovery: Send + Sync + std::fmt::Debug {
    /// Makes `agent` findable by its name (and keeps it so while `self` lives).
    fn publish(&self, agent: &Arc<Agent>) -> Result<()>;

    /// Loads the peer `name` into `agent` (its metadata), ready for transfers.
    fn resolve(&self, agent: &Agent, name: &str) -> Result<()>;

    /// Loads every agent findable through `self` into `agent` now, and keeps doing so (and
    /// retires those that go) while `self` lives. Without a registry to list (the side
    /// channel), nothing: peers are resolved one by one.
    fn watch(&self, agent: &Arc<Agent>) -> Result<()> {
        let _ = agent;
        Ok(())
    }
}

/// Discovery without a server: an agent is findable at its side channel's address, and peers
/// are resolved from addresses given to [`SideChannelDiscovery::with_peer`].
#[derive(Debug)]
pub struct SideChannelDiscovery {
    listen: SocketAddr,
    peers: Mutex<HashMap<String, SocketAddr>>,
}

impl SideChannelDiscovery {
    /// Agents published through it listen at `listen` (port 0: any).
    pub fn new(listen: SocketAddr) -> SideChannelDiscovery {
        SideChannelDiscovery {
            listen,
            peers: Mutex::new(HashMap::new()),
        }
    }

    /// The peer `name` listens at `addr`.
    pub fn with_peer(self, name: &str, addr: SocketAddr) -> SideChannelDiscovery {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), addr);
        self
    }
}

impl Discovery for SideChannelDiscovery {
    fn publish(&self, agent: &Arc<Agent>) -> Result<()> {
        agent.listen(self.listen).map(|_| ())
    }

    fn resolve(&self, agent: &Agent, name: &str) -> Result<()> {
        let addr = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .copied()
            .ok_or_else(|| Error::UnknownPeer {
                agent: name.to_string(),
            })?;
        let got = agent.connect(addr)?;
        if got != name {
            return Err(Error::Protocol {
                peer: addr.to_string(),
                why: format!("{addr} is agent {got:?}, not {name:?}"),
            });
        }
        Ok(())
    }
}
