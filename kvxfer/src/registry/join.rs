//! An agent made with a discovery configuration beside its own: created, published and
//! watching, with the discovery kept alive beside it. (The agent knows nothing of discovery:
//! it sits below the registry.)
#![forbid(unsafe_code)]

use std::sync::Arc;

use super::api::Discovery;
use super::config::DiscoveryConfig;
use crate::agent::{Agent, AgentConfig};
#[cfg(not(feature = "etcd"))]
use kvxfer_proto::error::Error;
use kvxfer_proto::error::Result;

/// An agent and the discovery that publishes it (dropped with it).
#[derive(Debug)]
pub struct Member {
    agent: Arc<Agent>,
    discovery: Arc<dyn Discovery>,
}

impl Member {
    /// The agent.
    pub fn agent(&self) -> &Arc<Agent> {
        &self.agent
    }

    /// Its discovery (to resolve a name now, say).
    pub fn discovery(&self) -> &Arc<dyn Discovery> {
        &self.discovery
    }
}

impl std::ops::Deref for Member {
    type Target = Agent;

    fn deref(&self) -> &Agent {
        &self.agent
    }
}

/// Creates the agent of `cfg` and, through `discovery`, publishes it under its name and has it
/// load every agent of its namespace now and as they come and go. Register memory afterwards
/// as usual: registrations are published as updates. (Without discovery, [`Agent::new`].)
pub fn join(cfg: AgentConfig, discovery: DiscoveryConfig) -> Result<Member> {
    // Connect first: an unreachable registry creates no agent.
    let discovery = etcd(discovery)?;
    let agent = Arc::new(Agent::new(cfg)?);
    discovery.publish(&agent)?;
    discovery.watch(&agent)?;
    Ok(Member { agent, discovery })
}

#[cfg(feature = "etcd")]
fn etcd(d: DiscoveryConfig) -> Result<Arc<dyn Discovery>> {
    let DiscoveryConfig::Etcd {
        endpoints,
        namespace,
        ttl,
        user,
        tls_ca,
    } = d;
    let eps: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    let mut cfg = super::etcd::EtcdConfig::new(&eps, &namespace).ttl(ttl);
    if let Some(u) = user {
        cfg = cfg.user(u);
    }
    cfg.tls_ca = tls_ca;
    Ok(super::etcd::EtcdDiscovery::connect(cfg)?)
}

#[cfg(not(feature = "etcd"))]
fn etcd(d: DiscoveryConfig) -> Result<Arc<dyn Discovery>> {
    let DiscoveryConfig::Etcd { endpoints, .. } = d;
    Err(Error::Registry {
        endpoints: endpoints.join(","),
        why: "this kvxfer was built without etcd discovery (cargo feature `etcd`)".into(),
    })
}
