//! What either end of the side channel (the connecting end, `discovery`; the listening end,
//! `listener`; the connections kept after a handshake, `subscriptions`) needs of its agent,
//! apart from all three so that none imports another for it. Where connections are kept is
//! passed beside it.

use kvxfer_proto::error::Result;
use kvxfer_proto::wire::metadata::Metadata;

/// What one end of the side channel needs of its agent: its name (for thread names), the
/// compatibility hash peers must match, the shared secret, its own metadata, and what to do
/// with a peer's (load it; the peer's name back).
pub(crate) struct SideChannel {
    pub(crate) name: String,
    pub(crate) compat: u64,
    pub(crate) secret: Option<Vec<u8>>,
    /// This agent's transports (its `UCX_TLS`), named when a peer finds none in common.
    pub(crate) transport: String,
    pub(crate) local: Box<dyn Fn() -> Result<Vec<u8>> + Send + Sync>,
    pub(crate) on_peer: Box<dyn Fn(Metadata) -> Result<String> + Send + Sync>,
    /// A peer deregisters its region (name, id): true once nothing of this agent's touches
    /// it ([`crate::subscriptions`]).
    pub(crate) on_gone: OnGone,
}

/// What the side channel calls when a peer deregisters a region (name, id).
pub(crate) type OnGone = Box<dyn Fn(&str, u32) -> bool + Send + Sync>;
