//! kvxfer moves the KV cache of LLM requests between inference workers (prefill → decode)
//! with one-sided READ/WRITE over UCX (TCP, shared memory, RDMA), with notifications that
//! arrive only after the data has landed.
//!
//! # Quick start
//! 1. Create an [`Agent`] per worker process and register memory with [`Agent::register`].
//! 2. Exchange metadata: one side [`Agent::listen`]s, the other [`Agent::connect`]s.
//! 3. Resolve descriptor lists once with [`Agent::prep_local`] / [`Agent::prep_remote`].
//! 4. Start transfers with [`Agent::transfer`] and `wait()` (or `.await`) on them.
//!
//! ```no_run
//! use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport, XferOp};
//! # fn main() -> kvxfer::Result<()> {
//! let mut decode = Agent::new(AgentConfig::new("decode").transport(Transport::Shm))?;
//! let prefill = Agent::new(AgentConfig::new("prefill").transport(Transport::Shm))?;
//! let dst = decode.register(HostBuffer::new(1 << 20)?)?;
//! let src = prefill.register(HostBuffer::new(1 << 20)?)?;
//! src.write(0, b"kv bytes")?;
//! let addr = decode.listen("127.0.0.1:0".parse().unwrap())?;
//! let peer = prefill.connect(addr)?; // both sides now know each other
//! let local = prefill.prep_local(&[Desc::new(src.id(), 0, 4096)])?;
//! let remote = prefill.prep_remote(&peer, &[Desc::new(dst.id(), 0, 4096)])?;
//! let stats = prefill.transfer_all(XferOp::Write, &local, &remote, Some(b"req-1"), None)?.wait()?;
//! let note = decode.wait_notification(std::time::Duration::from_secs(5))?; // data has landed
//! # let _ = (stats, note); Ok(()) }
//! ```

pub mod agent;
pub(crate) mod backend;
pub mod budget;
pub mod connector;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod descriptor;
pub mod discovery;
pub mod error;
pub mod lane;
pub mod layout;
pub mod lifecycle;
pub mod memory;
pub mod metadata;
pub mod notify;
pub mod planning;
pub mod staging;
pub mod telemetry;
pub mod transfer;

/// Pure decoders of peer input, exposed for the fuzz targets in `fuzz/` (not a stable API).
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::discovery::read_frame;
    pub use crate::lane::tcp::{parse_hello, parse_request_header, parse_segments};
}

pub use agent::{Agent, AgentConfig, GpuPath, PeerInfo, PreparedLocal, PreparedRemote, Transport};
pub use budget::{Charge, MemoryBudget};
pub use descriptor::{Desc, RegionId};
pub use error::{Error, MetadataError, Result, Side, UcsStatus};
pub use lane::Lane;
pub use memory::{HostBuffer, MemKind, Memory, Region};
pub use notify::Notification;
pub use transfer::{Transfer, XferOp, XferStats};

/// Compatibility hash used when no KV layout is given: the wire version alone.
pub const DEFAULT_COMPAT: u64 = 0x6b76_7866_0000_0000 | metadata::WIRE_VERSION as u64;
