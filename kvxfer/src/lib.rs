//! kvxfer moves the KV cache of LLM requests between inference workers (prefill → decode)
//! with one-sided READ/WRITE over UCX (TCP, shared memory, RDMA), with notifications that
//! arrive only after the data has landed.
//!
//! # Quick start
//! 1. Create an [`Agent`] per worker process and register memory with [`Agent::register`].
//! 2. Exchange metadata: one side [`Agent::listen`]s, the other [`Agent::connect`]s.
//! 3. Resolve descriptor lists once with [`Agent::prep_local`] / [`Agent::prep_remote`].
//! 4. Start transfers with [`Agent::write`] / [`Agent::read`] (or [`Agent::transfer`] with
//!    indices) and `wait()` (or `.await`) on them.
//!
//! ```
//! use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport};
//! # fn main() -> kvxfer::Result<()> {
//! let decode = Agent::new(AgentConfig::new("decode").transport(Transport::Shm))?;
//! let prefill = Agent::new(AgentConfig::new("prefill").transport(Transport::Shm))?;
//! let dst = decode.register(HostBuffer::new(1 << 20)?)?;
//! let src = prefill.register(HostBuffer::new(1 << 20)?)?;
//! src.write(0, b"kv bytes")?;
//! let addr = decode.listen("127.0.0.1:0")?;
//! let peer = prefill.connect(addr)?; // both sides now know each other
//! let local = prefill.prep_local(&[Desc::new(src.id(), 0, 4096)])?;
//! let remote = prefill.prep_remote(&peer, &[Desc::new(dst.id(), 0, 4096)])?;
//! let stats = prefill.write(&local, &remote).notify(b"req-1").start()?.wait()?;
//! let note = decode.wait_notification(std::time::Duration::from_secs(5))?; // data has landed
//! println!("wrote {} bytes to {peer:?}; {:?} arrived after them", stats.bytes, note.payload);
//! # Ok(()) }
//! ```
//!
//! Features: `etcd` (discovery through etcd: `registry::EtcdDiscovery`) and `cuda` (GPU
//! memory: `kvxfer::cuda`). `cargo doc --features etcd,cuda` documents them too (docs.rs
//! builds with both, each item marked with the feature it needs).
//!
//! `examples/quickstart.rs` is this program; `examples/two_process.rs` runs the two agents in
//! two processes, where the writer learns the other side's region ids with
//! [`Agent::peer_regions`]; `examples/connector.rs` sets the connector up in its natural
//! order. CI runs all three (`tests/readme_examples.rs`).

#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs, unreachable_pub)]
// The layers, bottom up (ARCHITECTURE.md has the map): the pure core is `kvxfer_proto`;
// memory, budget, notify, telemetry and transfer sit on it; the device copy engines and the
// staging pools above those; then the transports, siblings that never import each other or
// the agent (UCX, the shm and TCP lanes, the side channel); the agent, the one composition
// root; the connector and the explicit staged path on top.
mod agent;
mod backend;
mod budget;
mod cgroup;
mod codec_meter;
pub mod connector;
mod device;
mod discovery;
mod fd_limit;
mod gate;
mod host;
mod lane;
mod listener;
pub mod live;
mod memory;
mod notify;
mod random;
pub mod registry;
mod side_channel;
pub mod staged;
pub mod staging;
pub mod stop;
mod subscriptions;
mod telemetry;
mod transfer;

/// GPU memory (feature `cuda`): probing, the CUDA copy engine, the cudarc kvxfer uses.
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use device::cuda;
pub use kvxfer_proto::{layout, paged, planning};

pub use agent::{
    Agent, AgentConfig, PreparedLocal, PreparedRemote, Share, TransferBuilder, DEFAULT_COMPAT,
};
pub use budget::{cgroup_memory_limit, Charge, MemoryBudget};
pub use codec_meter::CodecTotals;
pub use kvxfer_proto::compress::codec::CodecTally;
pub use kvxfer_proto::compress::planes::Transform;
pub use kvxfer_proto::compress::policy::Compression;
pub use kvxfer_proto::descriptor::{Desc, RegionId};
pub use kvxfer_proto::error::{Error, MetadataError, Result, Side, UcsStatus};
pub use kvxfer_proto::types::{
    DeviceAlloc, GpuPath, Lane, MemKind, PeerInfo, RegionSpan, Transport, XferOp,
};
pub use memory::{page_size, HostBuffer, Memory, Region};
pub use notify::Notification;
pub use telemetry::{PeerHeld, RequestStats, Telemetry};
pub use transfer::{Transfer, XferStats};
