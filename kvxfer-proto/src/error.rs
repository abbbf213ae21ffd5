//! Typed errors. Every error a user or a peer can cause is a variant with context.

use std::fmt;
use std::time::Duration;

/// A UCX status code (`ucs_status_t`), kept lossless: an unknown value from C is carried as is,
/// with UCX's own text for it (`ucs_status_string`), filled in where the status is created.
/// Two statuses are equal when their codes are.
#[derive(Clone, Copy)]
pub struct UcsStatus {
    code: i8,
    text: &'static str,
}

impl UcsStatus {
    /// `UCS_OK`.
    pub const OK: UcsStatus = UcsStatus::new(0, "Success");
    /// `UCS_INPROGRESS`.
    pub const INPROGRESS: UcsStatus = UcsStatus::new(1, "Operation in progress");
    /// `UCS_ERR_CANCELED`.
    pub const CANCELED: UcsStatus = UcsStatus::new(-16, "Operation canceled");
    /// `UCS_ERR_BUSY`.
    pub const BUSY: UcsStatus = UcsStatus::new(-15, "Busy");

    /// A status with its text (the UCX backend passes `ucs_status_string`'s).
    pub const fn new(code: i8, text: &'static str) -> UcsStatus {
        UcsStatus { code, text }
    }

    /// The `ucs_status_t` value.
    pub fn code(self) -> i8 {
        self.code
    }

    /// True for `UCS_OK`.
    pub fn is_ok(self) -> bool {
        self.code == 0
    }

    /// UCX's own text for this status (`ucs_status_string`).
    pub fn message(self) -> &'static str {
        self.text
    }
}

impl PartialEq for UcsStatus {
    fn eq(&self, other: &Self) -> bool {
        self.code == other.code
    }
}

impl Eq for UcsStatus {}

impl std::hash::Hash for UcsStatus {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.code.hash(h)
    }
}

impl fmt::Debug for UcsStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UcsStatus({}: {})", self.code, self.text)
    }
}

impl fmt::Display for UcsStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.text, self.code)
    }
}

/// Which side of a transfer a descriptor belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Side {
    /// This agent's memory.
    Local,
    /// The peer's memory.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Why metadata from a peer was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// Fewer bytes than the field being read needs.
    #[error("truncated: needed {needed} bytes at offset {at}, {available} available")]
    Truncated {
        /// Offset of the field.
        at: usize,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left.
        available: usize,
    },
    /// Not kvxfer metadata at all.
    #[error("bad magic {found:02x?}")]
    BadMagic {
        /// The first bytes found.
        found: [u8; 4],
    },
    /// Another wire version of kvxfer.
    #[error("wire version {found}, this build speaks {expected}")]
    Version {
        /// Version found.
        found: u16,
        /// Version this build speaks.
        expected: u16,
    },
    /// Another KV layout, dtype or library build: moving bytes would corrupt the cache.
    #[error("compatibility hash {found:#018x}, expected {expected:#018x}")]
    Incompatible {
        /// Hash found.
        found: u64,
        /// Hash expected.
        expected: u64,
    },
    /// A length field is above its bound.
    #[error("{field} is {len} bytes/entries, limit {max}")]
    TooLarge {
        /// Field name.
        field: &'static str,
        /// Value found.
        len: usize,
        /// Limit.
        max: usize,
    },
    /// A field holds a value that cannot be right.
    #[error("invalid {field}: {why}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// Why.
        why: String,
    },
    /// Bytes after the last field.
    #[error("{extra} trailing bytes")]
    Trailing {
        /// How many.
        extra: usize,
    },
}

/// The error type of every kvxfer operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A UCX call failed.
    #[error("UCX {op} failed: {status}")]
    Ucx {
        /// The UCX function.
        op: &'static str,
        /// Its status.
        status: UcsStatus,
    },
    /// UCX could not start with this agent's settings (no device for the transports asked,
    /// say): what was asked and what this host offers.
    #[error("UCX could not start ({op}: {status}): {why}")]
    UcxSetup {
        /// The UCX function that failed.
        op: &'static str,
        /// Its status.
        status: UcsStatus,
        /// The settings asked for and what the host has.
        why: String,
    },
    /// Metadata from a peer was refused.
    #[error("metadata from {source_desc} refused: {err}")]
    Metadata {
        /// Where it came from (peer address or "buffer").
        source_desc: String,
        /// Why.
        err: MetadataError,
    },
    /// A descriptor names a region that is not registered (locally) or not in the peer's table.
    #[error("{side} descriptor #{index} names region {region}, which is not registered")]
    UnknownRegion {
        /// Local or remote.
        side: Side,
        /// Index in the descriptor list.
        index: usize,
        /// Region id.
        region: u32,
    },
    /// A descriptor of zero bytes (every descriptor moves at least one).
    #[error("{side} descriptor #{index} of region {region} has zero length; a descriptor moves at least one byte")]
    ZeroLength {
        /// Local or remote.
        side: Side,
        /// Index in the descriptor list.
        index: usize,
        /// Region id.
        region: u32,
    },
    /// A descriptor reaches outside its registered region.
    #[error(
        "{side} descriptor #{index} [{offset}, +{len}) is outside region {region} of {region_len} bytes"
    )]
    OutOfBounds {
        /// Local or remote.
        side: Side,
        /// Index in the descriptor list.
        index: usize,
        /// Region id.
        region: u32,
        /// Offset in the region.
        offset: u64,
        /// Length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// An index into a prepared list is past its end.
    #[error("{side} index {index} is past the prepared list of {len} descriptors")]
    BadIndex {
        /// Local or remote.
        side: Side,
        /// The index.
        index: usize,
        /// The list's length.
        len: usize,
    },
    /// Local and remote descriptor lists do not pair up.
    #[error("descriptor pair #{index}: local {local_len} bytes vs remote {remote_len} bytes")]
    LengthMismatch {
        /// Pair index (or the list lengths when `index` is `usize::MAX`).
        index: usize,
        /// Local length.
        local_len: u64,
        /// Remote length.
        remote_len: u64,
    },
    /// A peer this agent has no metadata for.
    #[error("unknown peer {agent:?}")]
    UnknownPeer {
        /// The peer's name.
        agent: String,
    },
    /// A prepared list refers to metadata the peer has since replaced.
    #[error(
        "prepared list for {agent:?} is stale (peer metadata generation {prepared} != {current})"
    )]
    StalePeer {
        /// The peer's name.
        agent: String,
        /// Generation the list was prepared against.
        prepared: u64,
        /// Current generation.
        current: u64,
    },
    /// The UCX loaded at run time is another release than the one kvxfer was built against
    /// (bindgen's struct layouts and constants are the build's).
    #[error(
        "kvxfer was built against UCX {built} but loaded UCX {loaded}: make the loader find \
         {built} (an rpath, or LD_LIBRARY_PATH to its lib directory) or build against {loaded}"
    )]
    UcxVersion {
        /// The UCX of the build (its headers).
        built: String,
        /// The UCX loaded.
        loaded: String,
    },
    /// Two agents share no transport: this one reaches none of the peer's addresses through
    /// the transports it offers.
    #[error(
        "no transport in common with peer {agent:?}: this agent offers {ours:?} and reaches \
         none of the peer's addresses through it (both must offer one transport, e.g. both \
         \"tcp\"; \"shm\" reaches only agents on this host that offer it)"
    )]
    NoCommonTransport {
        /// The peer's name.
        agent: String,
        /// This agent's transports (its `UCX_TLS`).
        ours: String,
    },
    /// Another live agent already holds this name: two agents (two ranks, say) were given one
    /// name. A restarted agent (the one before it gone) is not a conflict.
    #[error("agent name {name:?} is taken by a live agent: {why}")]
    NameConflict {
        /// The name.
        name: String,
        /// Which incarnations, and how the first was found alive.
        why: String,
    },
    /// The agent's peer table is full (its cap of peers, or the file descriptors it keeps
    /// free) and no peer has been idle long enough to make room: the newcomer was not loaded.
    #[error("peer table of {agent:?} is full: {why}")]
    PeerLimit {
        /// The agent whose table is full (this one, or the listener that refused).
        agent: String,
        /// How full, and what to change.
        why: String,
    },
    /// The registry agents find each other through (etcd) is unreachable or refused a call.
    #[error("etcd at {endpoints}: {why}")]
    Registry {
        /// Its endpoints.
        endpoints: String,
        /// What failed.
        why: String,
    },
    /// The connection to a peer failed (the peer died or the link broke).
    #[error("peer {agent:?} failed: {status}")]
    PeerFailed {
        /// The peer's name.
        agent: String,
        /// UCX's status for the failure.
        status: UcsStatus,
    },
    /// A kvxfer-native lane (shared-memory mapping or TCP stream) to a peer failed: the
    /// connection broke, the peer refused the request, or a mapping could not be made.
    #[error("{lane} lane to {agent:?}: {why}")]
    LaneFailed {
        /// The peer's name.
        agent: String,
        /// `"tcp"` or `"shm"`.
        lane: &'static str,
        /// What happened.
        why: String,
    },
    /// The TCP lane's target fenced this agent's writes (`Agent::fence_inbound` there) after
    /// this transfer was queued, before this agent learned of it: nothing of it was written.
    /// What is queued from now on carries the count and is served.
    #[error("tcp lane to {agent:?}: fenced by the target (its fence count of this agent is now {epoch}) after this transfer was queued: nothing of it was written")]
    Fenced {
        /// The target's name.
        agent: String,
        /// The target's fence count for this agent.
        epoch: u64,
    },
    /// A connector handoff was refused or cannot be served (expired lease, aborted or unknown
    /// request, incompatible layout).
    #[error("handoff of request {request:?}: {why}")]
    Handoff {
        /// The request.
        request: String,
        /// Why.
        why: String,
    },
    /// Memory is in use by a transfer in flight.
    #[error("region {region} is in use by {inflight} transfer(s) in flight")]
    Busy {
        /// Region id.
        region: u32,
        /// Transfers using it.
        inflight: u32,
    },
    /// The region was deregistered.
    #[error("region {region} is not registered (anymore)")]
    Deregistered {
        /// Region id.
        region: u32,
    },
    /// A transfer did not complete in time; the connection to the peer was torn down so that
    /// UCX no longer touches the buffers, and is re-established on next use.
    #[error("transfer to {agent:?} missed its deadline of {deadline:?} ({posted_ops}/{ops} operations posted)")]
    Deadline {
        /// The peer's name.
        agent: String,
        /// The deadline, relative to the post.
        deadline: Duration,
        /// Operations posted before the deadline.
        posted_ops: usize,
        /// Operations in the transfer.
        ops: usize,
    },
    /// A wait ran out of time; the transfer itself goes on.
    #[error("nothing happened within the {0:?} waited (not a failure: waiting again is safe)")]
    WaitTimeout(Duration),
    /// The transfer was cancelled.
    #[error("transfer cancelled")]
    Canceled,
    /// Invalid argument from the caller.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Allocation failed or the memory budget is exhausted.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// CUDA is not usable for this registration (no driver, no such device, or a UCX that
    /// cannot move device memory).
    #[error("CUDA device {device}: {why}")]
    Cuda {
        /// Device ordinal.
        device: u32,
        /// What is missing.
        why: String,
    },
    /// The side-channel handshake failed authentication (no, or another, shared secret): no
    /// metadata was exchanged.
    #[error("side channel with {peer}: authentication failed: {why}")]
    Auth {
        /// The peer's address.
        peer: String,
        /// What failed.
        why: String,
    },
    /// The transport UCX selected for a peer is not what a strict agent asked for.
    #[error("peer {agent:?}: asked for {wanted}, UCX selected {got} (strict transport mode)")]
    TransportMismatch {
        /// The peer.
        agent: String,
        /// What the agent requires.
        wanted: String,
        /// What UCX selected.
        got: String,
    },
    /// A side-channel or other I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A peer broke the side-channel protocol.
    #[error("side-channel protocol error with {peer}: {why}")]
    Protocol {
        /// The peer's address.
        peer: String,
        /// What went wrong.
        why: String,
    },
    /// The agent was shut down.
    #[error("agent is shut down")]
    Shutdown,
    /// Compressed data from a peer failed its checks (nothing of it was used).
    #[error("compressed data from {peer}: {source}")]
    Frame {
        /// The peer that sent it.
        peer: String,
        /// What was wrong.
        source: crate::compress::frame::FrameError,
    },
}

/// Whether the UCX release `loaded` (as `ucp_get_version_string` gives it) can run a build
/// against `built`: the same major and minor version.
pub fn ucx_compatible(built: &str, loaded: &str) -> bool {
    let mm = |v: &str| {
        let mut it = v.split('.').map(|x| x.trim().parse::<u32>().ok());
        (it.next().flatten(), it.next().flatten())
    };
    mm(built) == mm(loaded)
}

impl Error {
    /// An I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// A peer broke the protocol: who, and how.
    pub fn protocol(peer: impl Into<String>, why: impl Into<String>) -> Self {
        Error::Protocol {
            peer: peer.into(),
            why: why.into(),
        }
    }
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod ucx_version_tests {
    use super::*;

    #[test]
    fn major_and_minor_must_match() {
        assert!(ucx_compatible("1.22.0", "1.22.1"));
        assert!(!ucx_compatible("1.22.0", "1.13.1"));
        let e = Error::UcxVersion {
            built: "1.22.0".into(),
            loaded: "1.13.1".into(),
        }
        .to_string();
        assert!(
            e.contains("built against UCX 1.22.0") && e.contains("loaded UCX 1.13.1"),
            "{e}"
        );
    }
}
