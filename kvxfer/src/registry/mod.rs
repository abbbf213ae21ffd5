//! How agents find each other by name: the [`Discovery`] interface, with the side channel
//! ([`SideChannelDiscovery`]: no server, addresses given) and, with the `etcd` feature, etcd
//! (`EtcdDiscovery`: agents publish their metadata under a namespace, held by a lease, and
//! watch each other, so a decode worker has every prefill worker loaded before its first
//! transfer and learns within the lease TTL that one is gone).
//!
//! Both end in the same place: the peer's metadata loaded into the agent, where an agent of a
//! name already loaded with another epoch is told apart as a restart or refused as a second
//! live agent ([`crate::Error::NameConflict`]).
//!
//! By name through etcd (a `no_run` sketch: it needs an etcd and the `etcd` feature):
//!
//! ```no_run
//! use std::time::Duration;
//! use kvxfer::registry::{join, Discovery, DiscoveryConfig};
//! use kvxfer::{AgentConfig, HostBuffer};
//! # fn main() -> kvxfer::Result<()> {
//! let disc = DiscoveryConfig::parse("etcd://127.0.0.1:2379", "/my-deployment", Duration::from_secs(10))?;
//! let decode = join(AgentConfig::new("decode-0"), disc)?; // created, published, watching
//! let _cache = decode.register(HostBuffer::new(1 << 20)?)?; // published as an update
//! decode.discovery().resolve(decode.agent(), "prefill-0")?; // loaded now if not yet
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod api;
#[cfg(feature = "etcd")]
mod assembly;
pub(crate) mod config;
#[cfg(feature = "etcd")]
mod etcd;
mod join;
#[cfg(feature = "etcd")]
mod listing;
#[cfg(feature = "etcd")]
mod own_keys;
#[cfg(feature = "etcd")]
mod seal;
#[cfg(feature = "etcd")]
mod watch;

pub use api::{Discovery, SideChannelDiscovery};
pub use config::{DiscoveryConfig, EtcdUser};
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use etcd::{EtcdConfig, EtcdDiscovery};
pub use join::{join, Member};
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use watch::WatchCounts;
