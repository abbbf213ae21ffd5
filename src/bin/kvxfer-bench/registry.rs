//! `--etcd URL`: both processes find each other through etcd instead of `--listen` /
//! `--connect`. The peer publishes its agent and, as a note on the agent's lease, its control
//! address; the initiator reads the note and loads the peer's metadata from etcd (no side
//! channel). After each SETUP the peer publishes its new region as an update before it
//! answers, and the initiator loads it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use kvxfer::Agent;

use crate::cli::Args;
use crate::BoxErr;

/// The note holding the peer's control address.
#[cfg(feature = "etcd")]
const CONTROL: &str = "kvxfer-bench-control";

/// The etcd side of a bench process.
pub(crate) struct Registry {
    #[cfg(feature = "etcd")]
    d: Arc<kvxfer::registry::EtcdDiscovery>,
}

impl Registry {
    /// Connects to etcd when `--etcd` is given.
    pub(crate) fn connect(args: &Args) -> Result<Option<Registry>, BoxErr> {
        let Some(url) = &args.etcd else {
            return Ok(None);
        };
        #[cfg(feature = "etcd")]
        {
            use kvxfer::registry::{EtcdConfig, EtcdDiscovery};
            let cfg = EtcdConfig::new(&[url.as_str()], &args.namespace);
            Ok(Some(Registry {
                d: EtcdDiscovery::connect(cfg)?,
            }))
        }
        #[cfg(not(feature = "etcd"))]
        {
            Err(format!(
                "--etcd {url}: this kvxfer-bench was built without etcd (cargo build --release \
                 --features etcd)"
            )
            .into())
        }
    }

    /// The peer: publishes `agent` and its control address `ctl`.
    pub(crate) fn publish(&self, agent: &Arc<Agent>, ctl: SocketAddr) -> Result<(), BoxErr> {
        #[cfg(feature = "etcd")]
        {
            use kvxfer::registry::Discovery;
            self.d.publish(agent)?;
            self.d.note(agent, CONTROL, ctl.to_string().as_bytes())?;
        }
        let _ = (agent, ctl);
        Ok(())
    }

    /// The peer, after registering memory: publishes it now.
    pub(crate) fn refresh(&self, agent: &Agent) -> Result<(), BoxErr> {
        #[cfg(feature = "etcd")]
        self.d.refresh(agent)?;
        let _ = agent;
        Ok(())
    }

    /// The initiator: the control address of the peer `name`.
    pub(crate) fn control(&self, name: &str) -> Result<SocketAddr, BoxErr> {
        #[cfg(feature = "etcd")]
        {
            let v = self.d.read_note(name, CONTROL)?.ok_or_else(|| {
                format!("no kvxfer-bench peer {name:?} in etcd (start one with --etcd URL --serve)")
            })?;
            Ok(String::from_utf8_lossy(&v).parse()?)
        }
        #[cfg(not(feature = "etcd"))]
        Err(format!("no peer {name:?}: built without etcd").into())
    }

    /// The initiator: loads the peer `name`'s metadata (with the updates since it published).
    pub(crate) fn resolve(&self, agent: &Agent, name: &str) -> Result<(), BoxErr> {
        #[cfg(feature = "etcd")]
        {
            use kvxfer::registry::Discovery;
            self.d.resolve(agent, name)?;
        }
        let _ = (agent, name);
        Ok(())
    }
}

/// The address of this host towards `url`'s host: where a peer that reaches etcd can reach
/// this process (no packet is sent).
pub(crate) fn ip_towards(url: &str) -> Result<IpAddr, BoxErr> {
    let host = url
        .split("://")
        .last()
        .unwrap_or(url)
        .trim_end_matches('/')
        .to_string();
    let target = std::net::ToSocketAddrs::to_socket_addrs(&host)?
        .next()
        .ok_or_else(|| format!("{url}: no address"))?;
    let s = std::net::UdpSocket::bind(SocketAddr::new(
        if target.is_ipv4() {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        },
        0,
    ))?;
    s.connect(target)?;
    Ok(s.local_addr()?.ip())
}
