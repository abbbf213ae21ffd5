//! Agents for the same-host tests (the shm lane): transport `auto`, on loopback.
#![allow(dead_code, clippy::unwrap_used)]

use kvxfer::{Agent, AgentConfig, Transport};

/// An agent named `name` that takes the shm lane to same-host peers.
pub fn agent(name: &str) -> Agent {
    Agent::new(
        AgentConfig::new(name)
            .transport(Transport::Auto)
            .net_devices("lo"),
    )
    .unwrap()
}
