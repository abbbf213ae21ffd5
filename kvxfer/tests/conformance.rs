//! The connector conformance suite against both of kvxfer's implementations: the agent's
//! (two or three agents in this process over the TCP transport and lanes, each consumer a
//! separate agent that reaches the producer through the handoff's side channel) and the
//! in-process one.

use std::sync::Arc;

use kvxfer::connector::conformance::{Connectors, Harness};
use kvxfer::connector::{AgentConnector, InProcessConnector, KvConnector};
use kvxfer::{Agent, AgentConfig, Result, Transport};

struct OverAgents;

fn agent(role: &str) -> Result<Arc<Agent>> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("conf-{role}-{}-{n}", std::process::id());
    let cfg = AgentConfig::new(name)
        .transport(Transport::Tcp)
        .net_devices("lo");
    Ok(Arc::new(Agent::new(cfg)?))
}

impl Harness for OverAgents {
    fn connectors(&self, producers: usize, consumers: usize) -> Result<Connectors> {
        let mut ps: Vec<Box<dyn KvConnector>> = Vec::new();
        for _ in 0..producers {
            let p = agent("prefill")?;
            let side = p.listen("127.0.0.1:0")?;
            ps.push(Box::new(AgentConnector::new(p, Some(side))));
        }
        let mut cs: Vec<Box<dyn KvConnector>> = Vec::new();
        for _ in 0..consumers {
            cs.push(Box::new(AgentConnector::new(agent("decode")?, None)));
        }
        Ok(Connectors {
            producers: ps,
            consumers: cs,
        })
    }
}

struct InProcess;

impl Harness for InProcess {
    fn connectors(&self, producers: usize, consumers: usize) -> Result<Connectors> {
        let c = InProcessConnector::new();
        let each = |n| {
            (0..n)
                .map(|_| Box::new(c.clone()) as Box<dyn KvConnector>)
                .collect()
        };
        Ok(Connectors {
            producers: each(producers),
            consumers: each(consumers),
        })
    }
}

mod over_agents {
    kvxfer::connector_conformance!(super::OverAgents);
}

mod in_process {
    kvxfer::connector_conformance!(super::InProcess);
}
