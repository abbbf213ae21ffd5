//! The TCP lane's section of an agent's configuration, owned by the lane: its address, its
//! stall limit, striping and compression (each a default with per-peer overrides). The
//! agent's configuration builds it through its setters.
#![forbid(unsafe_code)]

use std::time::Duration;

use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::Compression;

/// The TCP lane's settings.
#[derive(Clone, Debug)]
pub(crate) struct TcpLaneConfig {
    /// Where it listens and what it advertises; `None`: the agent picks (see
    /// `AgentConfig::lane_addr`).
    pub(crate) addr: Option<std::net::IpAddr>,
    /// How long a target waits for a peer that moves no byte mid-message.
    pub(crate) stall: Duration,
    pub(crate) striping: Striping,
    pub(crate) compressing: Compressing,
    /// With a secret and clear data, a same-host peer's connections move the data through a
    /// shared window instead of the socket.
    pub(crate) window: bool,
}

impl Default for TcpLaneConfig {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(4, |n| n.get());
        TcpLaneConfig {
            addr: None,
            stall: Duration::from_secs(30),
            striping: Striping::new(4, Vec::new()),
            compressing: Compressing::new(
                Compression::Auto,
                Vec::new(),
                Vec::new(),
                Transform::Bf16,
                (cpus / 4).clamp(1, 4),
            ),
            window: false,
        }
    }
}

/// TCP-lane striping: a default and per-peer overrides (the last one for a peer wins).
#[derive(Clone, Debug)]
pub(crate) struct Striping {
    pub(crate) default: usize,
    pub(crate) per_peer: Vec<(String, usize)>,
}

impl Striping {
    /// `default` connections (at least 1), with `per_peer` overrides.
    pub(crate) fn new(default: usize, per_peer: Vec<(String, usize)>) -> Striping {
        Striping {
            default: default.max(1),
            per_peer,
        }
    }

    /// Connections a transfer to `peer` is striped over.
    pub(crate) fn of(&self, peer: &str) -> usize {
        self.per_peer
            .iter()
            .rev()
            .find(|(p, _)| p == peer)
            .map_or(self.default, |&(_, n)| n)
            .max(1)
    }
}

/// TCP-lane compression: a default, per-peer overrides and configured link rates (the last
/// one for a peer wins).
#[derive(Clone, Debug)]
pub(crate) struct Compressing {
    pub(crate) default: Compression,
    pub(crate) per_peer: Vec<(String, Compression)>,
    pub(crate) link_rates: Vec<(String, f64)>,
    pub(crate) transform: Transform,
    pub(crate) threads: usize,
}

impl Compressing {
    /// `default` with per-peer overrides and link rates, coded by `threads` (at least 1).
    pub(crate) fn new(
        default: Compression,
        per_peer: Vec<(String, Compression)>,
        link_rates: Vec<(String, f64)>,
        transform: Transform,
        threads: usize,
    ) -> Compressing {
        Compressing {
            default,
            per_peer,
            link_rates,
            transform,
            threads: threads.max(1),
        }
    }

    /// The mode and the configured link rate for `peer`.
    pub(crate) fn of(&self, peer: &str) -> (Compression, Option<f64>) {
        let mode = self
            .per_peer
            .iter()
            .rev()
            .find(|(p, _)| p == peer)
            .map_or(self.default, |&(_, c)| c);
        let rate = self
            .link_rates
            .iter()
            .rev()
            .find(|(p, r)| p == peer && *r > 0.0)
            .map(|&(_, r)| r);
        (mode, rate)
    }
}
