//! The UCX fence's state on the engine (its logic is `fence`; its protocol core
//! `kvxfer_proto::ucx_fence`): as initiator, where each peer stands with this agent's
//! announcement; as owner, the initiators taken in and the deregistrations under way.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc};
use std::time::Instant;

use super::handle::{Endpoint, Request};
use crate::host::PeerProcess;
use kvxfer_proto::error::Result;
use kvxfer_proto::ucx_fence::{FenceId, FenceTable, UserId};

/// Active-message id of the fence's messages.
pub(super) const AM_FENCE: u32 = 0x4b59;
/// Initiators an owner keeps (each holds an endpoint, and on the same host a pidfd).
pub(crate) const MAX_USERS: usize = 1024;
/// Endpoints made only to say REFUSED (no endpoint back to the initiator's worker was open)
/// that may be closing at once; past it a refusal goes unsaid. Each holds a descriptor until
/// its close completes, and is made only where the reserve stays whole.
pub(super) const MAX_REFUSING: usize = 4;
/// Marks an endpoint error argument as an endpoint back to initiators (its id below it), not
/// a peer's.
pub(super) const USER_BIT: u64 = 1 << 63;
/// GONEs waiting for the agent to answer them; past it a GONE is dropped (its owner then
/// keeps the region, `Busy`).
pub(crate) const MAX_GONE_QUEUED: usize = 1024;

/// Where a deregistration's answer goes: the peers that did not confirm.
pub(super) type FenceReply = mpsc::SyncSender<Result<Vec<String>>>;

/// A peer's GONE, for the agent to act on.
#[derive(Debug)]
pub(crate) struct GoneNotice {
    /// The peer (the engine's entry and its name).
    pub(crate) peer: u64,
    pub(crate) name: String,
    /// The region it deregisters.
    pub(crate) region: u32,
}

/// Where a peer stands with this initiator's announcement (reset with each new endpoint).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) enum Announced {
    #[default]
    No,
    /// HELLO sent with this token. `acks_due`: regions whose GONE came before the WELCOME
    /// (an owner sends those of deregistrations under way first) and that the agent has
    /// answered already: their GONE_ACKs need the WELCOME's `ack`, so they go once it comes
    /// (at most [`MAX_GONE_QUEUED`], one per region). Dropped with the state: an entry refused
    /// or closed before its WELCOME owes the owner nothing (a closed one says BYE).
    Sent { token: u64, acks_due: Vec<u32> },
    /// WELCOME received: the peer's token for this agent's answers.
    Welcomed { token: u64, ack: u64 },
}

/// An initiator this owner took in.
pub(super) struct User {
    /// The endpoint back to its worker ([`Fence::backs`]).
    pub(super) back: u64,
    /// Its process, where it runs on this host and UCX cannot tell its death (shared memory):
    /// one pidfd per process, shared by its entries ([`Fence::processes`]).
    pub(super) process: Option<Rc<PeerProcess>>,
}

/// What the UCX engine (its fence above all) reports in the agent's metrics (the engine
/// writes, the agent reads).
#[derive(Debug, Default)]
pub(crate) struct EngineCounts {
    /// The most active-message bytes (notifications and fence messages) copied out of UCX
    /// in one round of the engine's loop, before any was handled: bounded by
    /// [`AM_BATCH_BYTES`](super::driver::AM_BATCH_BYTES) plus one progress call's worth.
    pub(crate) am_batch_peak: AtomicU64,
    /// Initiators taken in now.
    pub(crate) peers: AtomicU64,
    /// HELLOs not taken in: the table full, or the process short of descriptors.
    pub(crate) refused: AtomicU64,
    /// Of those, the ones whose initiator could not be told (REFUSED unsent): its transfers
    /// wait until their deadline.
    pub(crate) unanswered: AtomicU64,
}

/// An endpoint back to an initiator agent's worker, shared by every entry it announced (one
/// per endpoint it made to this owner): a second endpoint to one worker could lose the first
/// one's messages on UCX 1.13's TCP (a WELCOME never arrived, 3 runs of 3).
pub(super) struct Back {
    pub(super) ep: Endpoint,
    pub(super) worker: Vec<u8>,
    /// Entries using it; one without any stays open (for the initiator's next entry) until
    /// the owner holds [`MAX_USERS`] such endpoints.
    pub(super) users: usize,
}

/// The engine's fence state, both roles.
pub(super) struct Fence {
    pub(super) table: FenceTable,
    pub(super) users: HashMap<UserId, User>,
    /// The initiators' processes on this host, by pid: a HELLO names one as it likes, and a
    /// flood naming one process must not cost a descriptor each.
    pub(super) processes: HashMap<u32, Rc<PeerProcess>>,
    /// The process's descriptors as last counted, and when: a HELLO that would open one
    /// (an endpoint back, a pidfd) leaves the peer table's reserve free
    /// (`kvxfer_proto::peer_table::fd_reserve`).
    pub(super) fds: Option<(Instant, Option<kvxfer_proto::peer_table::Fds>)>,
    pub(super) counts: Arc<EngineCounts>,
    /// Endpoints back to initiators, by id, and their ids by worker address.
    pub(super) backs: HashMap<u64, Back>,
    pub(super) back_of: HashMap<Vec<u8>, u64>,
    pub(super) next_back: u64,
    /// Closes of endpoints made to say REFUSED, not complete yet ([`MAX_REFUSING`]).
    pub(super) refusing: Vec<Request>,
    /// Deregistrations under way: the region and who waits for the answer.
    pub(super) waits: HashMap<FenceId, (u32, FenceReply)>,
    /// This agent's tokens for its peers, to the peers' engine entries.
    pub(super) tokens: HashMap<u64, u64>,
    /// Tokens of entries closed with nothing in flight (their BYE may be lost with their
    /// endpoint): the owner's ack token (`None` while its WELCOME has not come: it is then
    /// answered with a BYE) and worker address, so that a GONE for one is answered at once
    /// over another endpoint to that owner. The oldest go past [`MAX_USERS`].
    pub(super) closed: HashMap<u64, (Option<u64>, Vec<u8>)>,
    pub(super) closed_order: std::collections::VecDeque<u64>,
    /// This agent's regions being deregistered (told to its initiators, or confirmed and
    /// about to go), and those deregistered (as ranges of ids, never reused: as few as the
    /// live regions between them): what a WELCOME lists as gone.
    pub(super) going: HashSet<u32>,
    pub(super) deregistered: Vec<(u32, u32)>,
    pub(super) gone: mpsc::SyncSender<GoneNotice>,
    pub(super) clock: Instant,
    /// When the initiators' processes were last looked at (at most once a `PROCESS_POLL`
    /// while a deregistration waits: the loop runs every few microseconds under load).
    pub(super) reaped_at: Option<Instant>,
    /// This process's host and pid, read once: every HELLO carries it.
    pub(super) host: Option<kvxfer_proto::types::HostInfo>,
}

impl Fence {
    pub(super) fn new(gone: mpsc::SyncSender<GoneNotice>, counts: Arc<EngineCounts>) -> Fence {
        Fence {
            table: FenceTable::new(MAX_USERS),
            users: HashMap::new(),
            processes: HashMap::new(),
            fds: None,
            counts,
            backs: HashMap::new(),
            back_of: HashMap::new(),
            next_back: 1,
            refusing: Vec::new(),
            waits: HashMap::new(),
            tokens: HashMap::new(),
            closed: HashMap::new(),
            closed_order: std::collections::VecDeque::new(),
            going: HashSet::new(),
            deregistered: Vec::new(),
            gone,
            clock: Instant::now(),
            reaped_at: None,
            host: crate::host::host_info(),
        }
    }
}
