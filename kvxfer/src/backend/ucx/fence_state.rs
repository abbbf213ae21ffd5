//! The UCX fence's state on the engine (its logic is `fence`; its protocol core
//! `kvxfer_proto::ucx_fence`): as initiator, where each peer stands with this agent's
//! announcement; as owner, the initiators taken in and the deregistrations under way.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::time::Instant;

use super::handle::Endpoint;
use crate::host::PeerProcess;
use kvxfer_proto::error::Result;
use kvxfer_proto::ucx_fence::{FenceId, FenceTable, UserId};

/// Active-message id of the fence's messages.
pub(super) const AM_FENCE: u32 = 0x4b59;
/// Initiators an owner keeps (each holds an endpoint, and on the same host a pidfd).
pub(crate) const MAX_USERS: usize = 1024;
/// Marks an endpoint error argument as an initiator's (its [`UserId`] below it), not a peer's.
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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Announced {
    #[default]
    No,
    /// HELLO sent with this token.
    Sent(u64),
    /// WELCOME received: the peer's token for this agent's answers.
    Welcomed { token: u64, ack: u64 },
}

/// An initiator this owner took in.
pub(super) struct User {
    pub(super) ep: Endpoint,
    /// Its process, where it runs on this host and UCX cannot tell its death (shared memory).
    pub(super) process: Option<PeerProcess>,
}

/// The engine's fence state, both roles.
pub(super) struct Fence {
    pub(super) table: FenceTable,
    pub(super) users: HashMap<UserId, User>,
    /// Deregistrations under way: the region and who waits for the answer.
    pub(super) waits: HashMap<FenceId, (u32, FenceReply)>,
    /// This agent's tokens for its peers, to the peers' engine entries.
    pub(super) tokens: HashMap<u64, u64>,
    /// This agent's regions being deregistered (told to its initiators, or confirmed and
    /// about to go): left out of the live regions a WELCOME lists.
    pub(super) going: HashSet<u32>,
    pub(super) gone: mpsc::SyncSender<GoneNotice>,
    pub(super) clock: Instant,
}

impl Fence {
    pub(super) fn new(gone: mpsc::SyncSender<GoneNotice>) -> Fence {
        Fence {
            table: FenceTable::new(MAX_USERS),
            users: HashMap::new(),
            waits: HashMap::new(),
            tokens: HashMap::new(),
            going: HashSet::new(),
            gone,
            clock: Instant::now(),
        }
    }
}
