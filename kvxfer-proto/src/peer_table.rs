//! The bound on an agent's peer table, as a pure decision: whether a new peer may be loaded,
//! which idle peer makes room for it, or why it is refused. The agent's shell passes the
//! clock, the peers' last use and its file descriptors, and carries the answer out.
//!
//! Every loaded peer holds a UCX endpoint, a kept side-channel connection (two descriptors
//! and a thread), its lanes' connections and mappings. Without a bound, anyone who can
//! complete a handshake (everyone, without a secret) grows that table until the process is
//! out of descriptors, and a good peer's connect then fails. So the table has a cap, and a
//! reserve of descriptors is kept free for the side channel, the lanes and a good peer's
//! connect: past either, the least recently used peer idle for at least
//! [`PeerLimits::idle`] is evicted, and with none idle, the new peer is refused, typed.

use std::time::Duration;

/// Peers loaded at once by default.
pub const DEFAULT_MAX_PEERS: usize = 1024;
/// How long a peer must have been unused before it may be evicted for a newcomer, by
/// default: longer than a handoff's lease, so that only peers that stopped talking go.
pub const DEFAULT_IDLE: Duration = Duration::from_secs(60);
/// Descriptors a loaded peer may hold (kept connection, UCX endpoint, lane connections):
/// what a load must find free beyond the reserve.
pub const FDS_PER_PEER: u64 = 8;
/// The least number of descriptors kept free ([`fd_reserve`]).
pub const MIN_FD_RESERVE: u64 = 64;

/// Descriptors kept free under a limit of `limit`: an eighth of it, at least
/// [`MIN_FD_RESERVE`] (a good peer's connect, a lane's accept, a listener's spare).
pub fn fd_reserve(limit: u64) -> u64 {
    (limit / 8).max(MIN_FD_RESERVE)
}

/// The table's bounds, from the agent's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerLimits {
    /// Peers loaded at once (at least 1).
    pub max_peers: usize,
    /// How long a peer must have been unused before a newcomer may evict it.
    pub idle: Duration,
}

impl Default for PeerLimits {
    fn default() -> Self {
        PeerLimits {
            max_peers: DEFAULT_MAX_PEERS,
            idle: DEFAULT_IDLE,
        }
    }
}

/// The process's file descriptors at the moment of a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fds {
    /// Open now.
    pub open: u64,
    /// The soft limit (`RLIMIT_NOFILE`).
    pub limit: u64,
}

impl Fds {
    /// Whether a new peer would eat into the reserve.
    pub fn short(&self) -> bool {
        self.short_of(FDS_PER_PEER, 1)
    }

    /// Whether opening `n` more would leave fewer than `reserves` times the reserve free (a
    /// consumer of lower rank than the peer table keeps more than one reserve free, so that
    /// the table's loads still find room past it).
    pub fn short_of(&self, n: u64, reserves: u64) -> bool {
        self.open + n + reserves * fd_reserve(self.limit) > self.limit
    }
}

/// A loaded peer as the decision sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerUse<'a> {
    /// Its name.
    pub name: &'a str,
    /// When it was last used (loaded, updated, or a transfer or notification to it), on the
    /// caller's clock.
    pub last_used: Duration,
}

/// What to do with a new peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission<'a> {
    /// There is room: load it.
    Admit,
    /// Evict this idle peer first, then load it.
    Evict(&'a str),
    /// No room and nobody idle: refuse it, for this reason.
    Refuse(String),
}

/// Whether a new peer may join `loaded` at `now`, with the process's descriptors `fds` (None
/// where they cannot be read). Peers already loaded (a reload of one of them) are not asked.
pub fn admit<'a>(
    limits: &PeerLimits,
    fds: Option<Fds>,
    loaded: &[PeerUse<'a>],
    now: Duration,
) -> Admission<'a> {
    let by_count = loaded.len() >= limits.max_peers.max(1);
    let by_fds = fds.filter(Fds::short);
    if !by_count && by_fds.is_none() {
        return Admission::Admit;
    }
    let victim = loaded
        .iter()
        .filter(|p| now.saturating_sub(p.last_used) >= limits.idle)
        .min_by_key(|p| (p.last_used, p.name));
    if let Some(v) = victim {
        return Admission::Evict(v.name);
    }
    let full = match by_fds {
        Some(f) => format!(
            "{} of {} file descriptors are open and {} are kept free for the side channel, \
             the lanes and connects ({} peers loaded)",
            f.open,
            f.limit,
            fd_reserve(f.limit),
            loaded.len()
        ),
        None => format!("{} peers loaded, the cap", loaded.len()),
    };
    let least = loaded
        .iter()
        .map(|p| now.saturating_sub(p.last_used))
        .max()
        .unwrap_or_default();
    Admission::Refuse(format!(
        "{full}, and none has been idle for {:?} (the longest idle: {least:?}); raise \
         max_peers or the descriptor limit, or lower the idle time",
        limits.idle
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn limits(max_peers: usize) -> PeerLimits {
        PeerLimits {
            max_peers,
            idle: 10 * S,
        }
    }

    fn peer(name: &str, last_used: Duration) -> PeerUse<'_> {
        PeerUse { name, last_used }
    }

    #[test]
    fn room_admits() {
        let l = [peer("a", S)];
        assert_eq!(admit(&limits(2), None, &l, 2 * S), Admission::Admit);
        let fds = Fds {
            open: 10,
            limit: 1024,
        };
        assert_eq!(admit(&limits(2), Some(fds), &l, 2 * S), Admission::Admit);
    }

    #[test]
    fn full_evicts_the_least_recently_used_idle_peer() {
        let l = [peer("b", 5 * S), peer("a", 3 * S), peer("c", 19 * S)];
        // At 20 s: a (17 s idle) and b (15 s) may go, c (1 s) may not; a was used longest ago.
        assert_eq!(admit(&limits(3), None, &l, 20 * S), Admission::Evict("a"));
    }

    #[test]
    fn full_with_nobody_idle_refuses() {
        let l = [peer("a", 15 * S), peer("b", 19 * S)];
        match admit(&limits(2), None, &l, 20 * S) {
            Admission::Refuse(why) => {
                assert!(why.contains("2 peers loaded"), "{why}");
                assert!(why.contains("longest idle: 5s"), "{why}");
            }
            a => panic!("{a:?}"),
        }
    }

    #[test]
    fn short_of_descriptors_is_full_whatever_the_count() {
        let fds = Fds {
            open: 256 - 64 - 4,
            limit: 256,
        };
        assert!(fds.short());
        let l = [peer("a", 19 * S)];
        match admit(&limits(1000), Some(fds), &l, 20 * S) {
            Admission::Refuse(why) => assert!(why.contains("file descriptors"), "{why}"),
            a => panic!("{a:?}"),
        }
        let idle = [peer("a", S)];
        assert_eq!(
            admit(&limits(1000), Some(fds), &idle, 20 * S),
            Admission::Evict("a")
        );
    }

    #[test]
    fn a_lower_consumer_keeps_the_reserve_twice_over() {
        let f = Fds {
            open: 120,
            limit: 256,
        };
        // 120 + 8 + 2 * 64 = 256: the last that fits.
        assert!(!f.short_of(8, 2));
        assert!(f.short_of(9, 2));
        assert!(!f.short_of(9, 1));
        assert_eq!(f.short(), f.short_of(FDS_PER_PEER, 1));
    }

    #[test]
    fn the_reserve_is_an_eighth_and_at_least_the_minimum() {
        assert_eq!(fd_reserve(256), MIN_FD_RESERVE);
        assert_eq!(fd_reserve(1 << 20), 1 << 17);
        assert!(!Fds {
            open: 100,
            limit: 1 << 20
        }
        .short());
    }

    #[test]
    fn a_cap_of_zero_is_one() {
        assert_eq!(admit(&limits(0), None, &[], S), Admission::Admit);
    }
}
