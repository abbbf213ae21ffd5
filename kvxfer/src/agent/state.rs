//! The agent's state: what the agent's threads share, and the tables only the agent writes.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};

use crate::backend::ucx::driver::{Cmd, Commands, LocalIdentity};
use crate::budget::MemoryBudget;
use crate::lane::api::{LaneKind, PeerLane, PeerLanes};
use crate::memory::RegionTable;
use crate::notify::Channels;
use crate::staging::pool::StagingCell;
use crate::transfer::Canceller;
use kvxfer_proto::error::{Error, Result, UcsStatus};
use kvxfer_proto::types::{GpuPath, HostInfo, Lane, LaneInfo, RegionSpan, Transport};
use kvxfer_proto::wire::lane_entries::LaneEntry;

/// The agent's state, shared with the threads it starts (side-channel listeners). Only the
/// agent writes its tables: the region table after the engine's replies, the peer views after
/// the engine loaded a peer.
pub(crate) struct AgentState {
    pub(crate) name: String,
    /// This incarnation (random, never 0): peers tell a restart from a second agent by it.
    pub(crate) epoch: u64,
    pub(crate) compat: u64,
    pub(crate) max_op: u64,
    pub(crate) cmds: Commands,
    pub(crate) regions: Arc<RegionTable>,
    pub(crate) peers: RwLock<HashMap<String, Arc<PeerView>>>,
    pub(crate) channels: Channels,
    pub(crate) next_region: AtomicU32,
    pub(crate) next_xfer: AtomicU64,
    pub(crate) ucx_version: String,
    pub(crate) host: Option<HostInfo>,
    /// What the lanes advertise in this agent's metadata, an entry each.
    pub(crate) advertised: Vec<LaneEntry>,
    pub(crate) transport: Transport,
    /// kvxfer's own lanes, in the order a transfer tries them (empty: UCX only).
    pub(crate) lanes: Vec<Box<dyn LaneKind>>,
    /// Serializes metadata loads, so that concurrent loads of one peer map its memory once.
    pub(crate) load_lock: Mutex<()>,
    pub(crate) budget: MemoryBudget,
    pub(crate) secret: Option<Vec<u8>>,
    pub(crate) gpu_path: GpuPath,
    pub(crate) staging: Arc<StagingCell>,
    pub(crate) canceller: Canceller,
    /// Peers known to be gone (their discovery key vanished), until a new incarnation loads:
    /// transfers to them fail with `PeerFailed`, not as to a name never heard of.
    pub(crate) gone: Mutex<HashSet<String>>,
    /// What the lanes' codec achieved (initiator links and lane target alike).
    pub(crate) codec: Arc<crate::codec_meter::CodecMeter>,
    /// How long each step of a connect's handshake waits.
    pub(crate) handshake: std::time::Duration,
    /// How long a deregistration waits for the peers' answers, and an answer for this
    /// agent's transfers to the region to end.
    pub(crate) deregister_wait: std::time::Duration,
    /// UCX's TCP transport is left out (lanes on, no `ucx_tcp`): a peer UCX cannot reach
    /// is loaded lane-only.
    pub(crate) ucx_tcp_off: bool,
    /// The side channel's connections kept for updates both ways.
    pub(crate) subs: Arc<crate::subscriptions::Subscriptions>,
    /// A WRITE to a same-host peer in another process is not left to UCX, which emulates it
    /// through the peer's shared-memory receive FIFO, where a writer killed mid-WRITE wedges
    /// the peer (UCX older than 1.22, lanes on): the lanes carry it.
    pub(crate) shm_writes_by_lane: bool,
    /// Notifications take the TCP lane ([`AgentState::lane_notes`]).
    pub(crate) lane_notes: bool,
    /// What carries a notification once UCX moved the data (the sealed TCP lane).
    pub(crate) notes: crate::transfer::NoteCarrier,
    /// The connector's grants, which the lanes' targets check every request against.
    pub(crate) grants: std::sync::Arc<std::sync::RwLock<kvxfer_proto::grants::GrantTable>>,
    /// What each grant's entry per peer in `grants` is charged to the budget (the table
    /// keeps one per grant and peer: a grant given again replaces it), released on revoke.
    pub(crate) grant_charges: Mutex<
        HashMap<kvxfer_proto::wire::connector::Grant, HashMap<String, crate::budget::Charge>>,
    >,
    /// The peer table's bounds ([`crate::AgentConfig::max_peers`]).
    pub(crate) peer_limits: kvxfer_proto::peer_table::PeerLimits,
    /// Peers evicted for a newcomer, and newcomers refused, since the start.
    pub(crate) peers_evicted: AtomicU64,
    pub(crate) peers_refused: AtomicU64,
    /// The agent's clock: peers' last use is measured on it.
    pub(crate) clock: std::time::Instant,
}

impl AgentState {
    /// This agent's part of its metadata.
    pub(crate) fn identity(&self) -> LocalIdentity {
        LocalIdentity {
            name: self.name.clone(),
            epoch: self.epoch,
            compat: self.compat,
            host: self.host,
            lanes: self.advertised.clone(),
        }
    }

    /// The error for a peer `name` that is not loaded: `PeerFailed` for one known to be gone,
    /// else `UnknownPeer`.
    pub(crate) fn missing(&self, name: &str) -> Error {
        if self
            .gone
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(name)
        {
            Error::PeerFailed {
                agent: name.to_string(),
                status: PEER_GONE,
            }
        } else {
            Error::UnknownPeer {
                agent: name.to_string(),
            }
        }
    }

    /// With a shared secret, or with UCX's TCP transport left out (and lanes on),
    /// notifications travel only over the TCP lane, whose sender the receiver knows from the
    /// session; none arrive over UCX's active messages, whose sender is whatever the payload
    /// says.
    pub(crate) fn lane_notes(&self) -> bool {
        self.lane_notes && !self.lanes.is_empty()
    }

    /// The lane that carries notifications to `peer` when [`AgentState::lane_notes`]: its
    /// sealed TCP lane.
    pub(crate) fn note_lane(&self, peer: &str) -> Result<Arc<dyn PeerLane>> {
        let g = self.peers.read().unwrap_or_else(|e| e.into_inner());
        g.get(peer)
            .and_then(|v| v.lanes.0.iter().find(|l| l.lane() == Lane::Tcp).cloned())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "notifications travel only over the TCP lane (a shared secret, or \
                     UCX's TCP transport off), and {peer:?} has none (lanes off on either side, or not loaded)"
                ))
            })
    }

    /// The peer `name` is in use (a request of its was served here).
    pub(crate) fn peer_used(&self, name: &str) {
        if let Some(v) = self
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
        {
            v.touch(self.now());
        }
    }

    /// Now, on the agent's clock.
    pub(crate) fn now(&self) -> std::time::Duration {
        self.clock.elapsed()
    }

    /// This agent's metadata, encoded for a peer.
    pub(crate) fn metadata(&self) -> Result<Vec<u8>> {
        self.cmds.call(|reply| Cmd::Metadata {
            local: self.identity(),
            reply,
        })
    }
}

/// The status of a transfer to a peer whose discovery key vanished (`UCS_ERR_NOT_CONNECTED`).
pub(crate) const PEER_GONE: UcsStatus = UcsStatus::new(
    -29,
    "Not connected: the peer left discovery (its lease ended)",
);

/// A peer's region table as the caller side sees it, for bounds checks without a round trip.
#[derive(Debug)]
pub(crate) struct PeerView {
    pub(crate) token: u64,
    pub(crate) spans: Vec<RegionSpan>,
    pub(crate) lanes: PeerLanes,
    /// Per region slot: memory UCX cannot reach (no remote key: staged device memory, or a
    /// region shared with named peers only).
    pub(crate) unmapped: Vec<bool>,
    /// Some host region of it has no remote key (shared with named peers only): routes
    /// look at the plan's regions only then.
    pub(crate) host_unmapped: bool,
    /// Checksum of the metadata the view was built from.
    pub(crate) meta_sum: u64,
    /// The peer's incarnation (0: a peer that sends none).
    pub(crate) epoch: u64,
    /// Where its TCP lane listens, to tell whether it is still alive when another agent
    /// offers its name.
    pub(crate) lane_addr: Option<std::net::SocketAddr>,
    /// Its TCP lane as advertised: with a secret, the key it must prove it holds to count as
    /// alive.
    pub(crate) lane: Option<LaneInfo>,
    /// Its host and process, for the same check when it has no lane.
    pub(crate) host: Option<HostInfo>,
    /// Its UCX worker's address: with the lane address and the process, what metadata of the
    /// same epoch must match to be taken as the same incarnation.
    pub(crate) worker_addr: Vec<u8>,
    /// UCX reaches it (false: loaded lane-only, every transfer takes its TCP lane).
    pub(crate) ucx: bool,
    /// When it was last used, in milliseconds on the agent's clock: an idle peer may be
    /// evicted for a newcomer when the table is full.
    pub(crate) used_ms: AtomicU64,
    /// Its regions it told this agent it deregisters, and this agent's UCX transfers to it;
    /// shared by the views of one incarnation (a reload of the same epoch keeps it, so that
    /// a deregistration also waits for transfers posted against an earlier view).
    pub(crate) fence: Arc<Mutex<RegionFence>>,
}

/// What a peer's deregistration fences on this side ([`PeerView::fence`]): the regions it
/// gave up (a transfer touching one is refused), and the UCX transfers in flight to it
/// (what must end before this agent answers that it no longer touches the region).
#[derive(Default)]
pub(crate) struct RegionFence {
    /// Region ids deregistered by their owner (never reused within an incarnation).
    pub(crate) gone: std::collections::HashSet<u32>,
    /// Whether any slot is: the per-transfer check is skipped while none is.
    pub(crate) any_gone: bool,
    /// UCX transfers to the peer, pruned of finished ones as new ones come.
    pub(crate) ucx: Vec<Arc<crate::transfer::XferState>>,
    /// `ucx`'s length after its last pruning: it is pruned again only once it has doubled,
    /// so that recording a transfer costs O(1) amortized whatever is in flight.
    pub(crate) pruned: usize,
}

impl std::fmt::Debug for RegionFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionFence")
            .field("gone", &self.gone.len())
            .field("ucx", &self.ucx.len())
            .finish()
    }
}

impl RegionFence {
    /// Whether region `id` was deregistered by its owner.
    pub(crate) fn is_gone(&self, id: u32) -> bool {
        self.gone.contains(&id)
    }

    /// Records a UCX transfer to the peer (pruning finished ones now and then).
    pub(crate) fn record(&mut self, s: Arc<crate::transfer::XferState>) {
        if self.ucx.len() >= 2 * self.pruned + 16 {
            self.ucx.retain(|s| !s.is_done());
            self.pruned = self.ucx.len();
        }
        self.ucx.push(s);
    }
}

impl PeerView {
    /// Marks the peer used at `now` (the agent's clock).
    pub(crate) fn touch(&self, now: std::time::Duration) {
        self.used_ms.fetch_max(
            u64::try_from(now.as_millis()).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// When it was last used.
    pub(crate) fn last_used(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.used_ms.load(std::sync::atomic::Ordering::Relaxed))
    }
}
