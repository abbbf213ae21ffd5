//! The lane interface: what every lane implements ([`LaneKind`], [`PeerLane`]), what the
//! agent gives a lane when it starts it ([`LaneSetup`], [`LaneCtx`]) and what a route asks
//! ([`Query`]). A sibling of the lanes, so that none imports its parent.
#![forbid(unsafe_code)]

use std::sync::{Arc, RwLock};

use crate::budget::MemoryBudget;
use crate::memory::RegionTable;
use crate::notify::Channels;
use crate::staging::pool::StagingCell;
use crate::transfer::{Job, NoteCarrier, Work};
use kvxfer_proto::grants::GrantTable;
use kvxfer_proto::types::{HostInfo, Lane, Transport};
use kvxfer_proto::wire::lane_entries::LaneEntry;
use kvxfer_proto::wire::metadata::Metadata;

/// What a route asks a lane about a transfer.
pub(crate) struct Query<'a> {
    /// The planned operations.
    pub(crate) plan: &'a Work,
    /// Either side of it has device memory.
    pub(crate) device: bool,
    /// Per operation, the device of its local memory (None: host); empty when the local side
    /// has no device memory at all.
    pub(crate) local_devices: &'a [Option<u32>],
    /// UCX maps every device region of it (the direct path); false with no device memory.
    pub(crate) ucx_reaches: bool,
    /// It touches host memory UCX has no key for on either side (a region shared with named
    /// peers only): only the TCP lane, whose target checks the share set, may carry it.
    pub(crate) host_unmapped: bool,
    /// A WRITE to a same-host peer that UCX would emulate through the peer's shared-memory
    /// receive FIFO (`AgentState::shm_writes_by_lane`): the TCP lane carries its host memory
    /// where the shm lane does not.
    pub(crate) host_write_by_lane: bool,
}

/// One of kvxfer's own lanes towards one peer.
pub(crate) trait PeerLane: Send + Sync {
    /// Which lane this is, as `XferStats::lane` reports it.
    fn lane(&self) -> Lane;

    /// Whether it carries the transfer `q` describes to this peer.
    fn carries(&self, q: &Query<'_>) -> bool;

    /// Whether it takes a paged plan as it is (else the agent expands it into a flat one).
    fn takes_paged(&self) -> bool {
        false
    }

    /// Starts `job` (its local regions pinned by the caller); the job's state reports its end.
    fn submit(&self, job: Job);
}

/// A lane as an agent holds it.
pub(crate) trait LaneKind: Send + Sync {
    /// Its name, for logs.
    fn name(&self) -> &'static str;

    /// What this agent's metadata tells peers of it, in the lane's own entry (the TCP lane's
    /// address, credential and key); none for a lane peers need nothing to reach.
    fn advertise(&self) -> Option<LaneEntry> {
        None
    }

    /// The lane towards the peer `meta` describes, if this lane reaches it.
    fn open(&self, meta: &Metadata) -> Option<Arc<dyn PeerLane>>;

    /// Drops what `peer` has queued to write into this agent through the lane; the streams
    /// closed.
    fn fence(&self, _peer: &str) -> usize {
        0
    }

    /// Region `id` of this agent was deregistered: peers the lane gave it to stop using it.
    fn region_gone(&self, _id: u32) {}

    /// Stops its threads (the agent is going).
    fn stop(&self) {}
}

/// What the agent gives every lane when it starts them.
pub(crate) struct LaneSetup {
    /// The agent's name.
    pub(crate) name: String,
    /// The transports asked for.
    pub(crate) transport: Transport,
    /// This host and process.
    pub(crate) host: Option<HostInfo>,
    /// The target side's view of the agent.
    pub(crate) ctx: Arc<LaneCtx>,
    /// Where the lanes' listeners bind (the TCP lane's address).
    pub(crate) bind: std::net::IpAddr,
    /// Hands a notification-only job to UCX once a lane's data has landed.
    pub(crate) notifier: NoteCarrier,
    /// The lanes' sections of the agent's configuration.
    pub(crate) config: super::config::LaneConfig,
}

/// The lanes towards one peer, in the agent's order.
#[derive(Clone, Default)]
pub(crate) struct PeerLanes(pub(crate) Vec<Arc<dyn PeerLane>>);

impl std::fmt::Debug for PeerLanes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|l| l.lane()))
            .finish()
    }
}

/// What a lane's target needs of its agent: the registered regions to check and pin requests
/// against, where to deliver notifications, the device staging and the memory budget. Built
/// by the agent; the lanes never name it.
pub(crate) struct LaneCtx {
    pub(crate) regions: Arc<RegionTable>,
    pub(crate) channels: Channels,
    pub(crate) staging: Arc<StagingCell>,
    pub(crate) budget: MemoryBudget,
    pub(crate) codec: Arc<crate::codec_meter::CodecMeter>,
    /// Threads coding the data of a compressed read this target sends.
    pub(crate) compress_threads: usize,
    /// How long a peer may move no byte mid-message ([`crate::AgentConfig::lane_stall`]).
    pub(crate) stall: std::time::Duration,
    /// The deployment's shared secret ([`crate::AgentConfig::secret`]): with it the TCP lane
    /// is sealed.
    pub(crate) secret: Option<Vec<u8>>,
    /// Seal the blocks' bytes on the TCP lane too ([`crate::AgentConfig::lane_encryption`]).
    pub(crate) seal_data: bool,
    /// What the connector granted to whom, and the regions only grants open: every request's
    /// table is checked against it.
    pub(crate) grants: Arc<RwLock<GrantTable>>,
    /// A peer's request was admitted: it is in use, and not to be evicted as idle.
    pub(crate) peer_used: Arc<dyn Fn(&str) + Send + Sync>,
}
