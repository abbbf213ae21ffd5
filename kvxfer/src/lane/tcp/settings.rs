//! The TCP lane's settings, owned by the lane: striping and compression, each a default with
//! per-peer overrides (the agent's configuration builds them).
#![forbid(unsafe_code)]

use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::Compression;

/// TCP-lane striping: a default and per-peer overrides (the last one for a peer wins).
#[derive(Clone, Debug)]
pub(crate) struct Striping {
    default: usize,
    per_peer: Vec<(String, usize)>,
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
    default: Compression,
    per_peer: Vec<(String, Compression)>,
    link_rates: Vec<(String, f64)>,
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
