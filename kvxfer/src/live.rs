//! What this process holds of kvxfer right now: agents, regions registered, UCX memory
//! registrations, peers' regions mapped into it. A process that stops in order (on SIGTERM,
//! say) reads [`live`] last and finds zeros: nothing left registered or mapped.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

static AGENTS: AtomicUsize = AtomicUsize::new(0);
static REGIONS: AtomicUsize = AtomicUsize::new(0);
static UCX_REGISTRATIONS: AtomicUsize = AtomicUsize::new(0);
static PEER_MAPPINGS: AtomicUsize = AtomicUsize::new(0);
static LANE_WINDOWS: AtomicUsize = AtomicUsize::new(0);

/// Counts of what kvxfer holds in this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Live {
    /// Agents not yet dropped.
    pub agents: usize,
    /// Regions in agents' tables (registered, not deregistered, agent alive).
    pub regions: usize,
    /// Memory registrations held with UCX (`ucp_mem_map` not yet unmapped).
    pub ucx_registrations: usize,
    /// Peers' regions mapped into this process by the shared-memory lane.
    pub peer_mappings: usize,
    /// TCP lane connections to or from a same-host peer whose data goes through a shared
    /// window (`AgentConfig::lane_window`), counted at each end.
    pub lane_windows: usize,
}

impl Live {
    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        *self == Live::default()
    }
}

impl fmt::Display for Live {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} agents, {} regions registered, {} UCX registrations, {} peer mappings, {} lane \
             windows",
            self.agents,
            self.regions,
            self.ucx_registrations,
            self.peer_mappings,
            self.lane_windows
        )
    }
}

/// What kvxfer holds in this process now.
pub fn live() -> Live {
    Live {
        agents: AGENTS.load(Ordering::Acquire),
        regions: REGIONS.load(Ordering::Acquire),
        ucx_registrations: UCX_REGISTRATIONS.load(Ordering::Acquire),
        peer_mappings: PEER_MAPPINGS.load(Ordering::Acquire),
        lane_windows: LANE_WINDOWS.load(Ordering::Acquire),
    }
}

/// One of a kind counted while it lives: made with the thing it counts, dropped with it.
#[derive(Debug)]
pub(crate) struct Counted(&'static AtomicUsize);

impl Counted {
    pub(crate) fn agent() -> Counted {
        Counted::of(&AGENTS)
    }
    pub(crate) fn ucx_registration() -> Counted {
        Counted::of(&UCX_REGISTRATIONS)
    }
    pub(crate) fn peer_mapping() -> Counted {
        Counted::of(&PEER_MAPPINGS)
    }
    pub(crate) fn lane_window() -> Counted {
        Counted::of(&LANE_WINDOWS)
    }
    fn of(c: &'static AtomicUsize) -> Counted {
        c.fetch_add(1, Ordering::AcqRel);
        Counted(c)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Regions: a table entry added (`n` > 0) or removed.
pub(crate) fn regions_changed(added: bool, n: usize) {
    if added {
        REGIONS.fetch_add(n, Ordering::AcqRel);
    } else {
        REGIONS.fetch_sub(n, Ordering::AcqRel);
    }
}
