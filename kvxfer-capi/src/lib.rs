//! The C ABI of kvxfer (`libkvxfer.so`, `libkvxfer.a`, `include/kvxfer.h`), in rustls-ffi's
//! style:
//!
//! - opaque `kvx_*` handles with `_new` / `_free` pairs; `kvx_<object>_<verb>` names;
//! - every function returns a `kvx_status` with stable explicit values (or a plain value where
//!   nothing can fail); outputs are written only on success;
//! - every pointer is checked for NULL; no panic crosses the boundary (`KVX_PANIC`);
//! - a thread-local last-error message with context (`kvx_last_error`);
//! - blocking and polling calls only: no async runtime needed.
//!
//! Strings in are NUL-terminated UTF-8. Strings out are NUL-terminated, `*out_len` their
//! length without the NUL; bytes out are not; a buffer too small gives `KVX_BUFFER_TOO_SMALL`
//! and the capacity needed in `*out_len` (for a string, length + 1). A failed call has no
//! side effect (`kvx_agent_listen` / `kvx_agent_connect` check their buffer first).
//!
//! One file per object: `agent` (and its config builder) with what an agent does in
//! `agent/{region, transfer, budget}` (memory and descriptor lists; transfers and
//! notifications; its budget), `connector`, `metrics`; `ffi` and `error` are the plumbing they
//! share.

#![allow(non_camel_case_types)] // C names.

use std::ffi::c_char;
use std::sync::{Arc, Mutex};

use kvxfer_core::connector::{Freed, KvConnector, KvConsumer, KvProducer, LoadFailure};
use kvxfer_core::RequestStats;
use kvxfer_core::{Agent, AgentConfig, PreparedLocal, PreparedRemote, Region, Transfer, XferStats};

/// Status of a call. Values are stable.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvx_status {
    /// Success.
    KVX_OK = 0,
    /// A required pointer was NULL.
    KVX_NULL_PARAMETER = 1,
    /// An argument is invalid (see the last error).
    KVX_INVALID_ARGUMENT = 2,
    /// Peer metadata was refused (malformed, foreign, incompatible).
    KVX_METADATA = 3,
    /// A descriptor lies outside registered memory or names an unknown region or index.
    KVX_OUT_OF_BOUNDS = 4,
    /// No metadata for that peer.
    KVX_UNKNOWN_PEER = 5,
    /// The peer failed or the connection broke.
    KVX_PEER_FAILED = 6,
    /// Memory is in use by a transfer in flight.
    KVX_BUSY = 7,
    /// A transfer missed its deadline (the connection was torn down).
    KVX_DEADLINE = 8,
    /// A wait ran out of time; the operation goes on.
    KVX_TIMEOUT = 9,
    /// The transfer was cancelled.
    KVX_CANCELED = 10,
    /// Out of memory or over the memory budget.
    KVX_OUT_OF_MEMORY = 11,
    /// An I/O error (side channel, sockets).
    KVX_IO = 12,
    /// A UCX call failed.
    KVX_UCX = 13,
    /// A connector handoff was refused (expired, aborted, incompatible).
    KVX_HANDOFF = 14,
    /// The agent is shut down.
    KVX_SHUTDOWN = 15,
    /// A bug: kvxfer panicked (the message says where).
    KVX_PANIC = 16,
    /// An output buffer is too small; `*out_len` holds the size needed.
    KVX_BUFFER_TOO_SMALL = 17,
    /// Nothing to report (no notification, no finished request).
    KVX_NOT_FOUND = 18,
    /// The transfer is still in flight (`kvx_transfer_poll`).
    KVX_IN_PROGRESS = 19,
    /// A prepared list refers to replaced peer metadata.
    KVX_STALE = 20,
    /// The region was deregistered.
    KVX_DEREGISTERED = 21,
    /// A handle that this library did not make, or that was already freed (double free,
    /// use after free); nothing was done.
    KVX_INVALID_HANDLE = 22,
    /// Device memory cannot be used here: no CUDA driver or device, a library built without
    /// the `cuda` feature, or a forced path that cannot work (the message says which).
    KVX_CUDA = 23,
    /// Another live agent already holds the name (two agents given one name); a restarted
    /// agent is not refused.
    KVX_NAME_CONFLICT = 24,
    /// The side channel's handshake failed authentication (no, or another, shared secret):
    /// nothing was exchanged with the peer.
    KVX_AUTH = 25,
    /// A strict agent's peer is reached over another transport than the one it asked for.
    KVX_TRANSPORT_MISMATCH = 26,
    /// The transfer was fenced by its target (the consumer gave the load up, or the peer
    /// restarted): nothing of it was written.
    KVX_FENCED = 27,
    /// An error of a kind this build of the header does not name (a newer library): the
    /// last error says what happened.
    KVX_ERROR = 28,
    /// The agent's peer table is full (its cap, or the file descriptors it keeps free) and no
    /// peer was idle long enough to make room: the peer was not loaded.
    KVX_PEER_LIMIT = 29,
}

/// Direction of a transfer, seen from the initiator.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvx_op {
    /// Pull remote memory into local memory.
    KVX_READ = 0,
    /// Push local memory into remote memory.
    KVX_WRITE = 1,
}

/// How device memory moves between an agent and a peer (`kvx_agent_peer_gpu_path`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvx_gpu_path {
    /// Neither side has device memory registered.
    KVX_GPU_NONE = 0,
    /// UCX moves all of it (CUDA transports).
    KVX_GPU_DIRECT = 1,
    /// Through bounded pinned host chunks over kvxfer's TCP lane.
    KVX_GPU_STAGED = 2,
}

/// Longest agent name (bytes, without the NUL).
pub const KVX_MAX_NAME: usize = 255;

/// Room `kvx_agent_listen` needs for the address it writes (with the NUL): an IPv6 address
/// with a scope and a port fits.
pub const KVX_MAX_ADDRESS: usize = 64;
/// Largest notification payload.
pub const KVX_MAX_NOTIFICATION: usize = 65536;
/// Largest tensor-parallel size `kvx_tp_plan` takes (a larger one is `KVX_INVALID_ARGUMENT`).
pub const KVX_MAX_TP: u32 = 4096;
/// `kvx_layout::packing`: one tensor for K and one for V per layer.
pub const KVX_PACKING_SEPARATE: u32 = 0;
/// `kvx_layout::packing`: K and V in one tensor per layer, `[blocks, ..., 2 * head_dim]`.
pub const KVX_PACKING_FUSED: u32 = 1;
/// `kvx_layout::packing`: multi-head latent attention (DeepSeek-V2/V3): one tensor per layer,
/// `[blocks, block_tokens, head_dim]`, no head dimension (`kv_heads` 1), the same on every
/// tensor-parallel rank.
pub const KVX_PACKING_LATENT: u32 = 2;
/// `kvx_layout.packing`: per-request recurrent state (Mamba, GDN), one page per layer and
/// block: `kv_heads` split units per rank of `head_dim` elements of `dtype_bytes` each (a page
/// that does not split between TP sizes: `kv_heads` 1, `head_dim` its bytes, `dtype_bytes`
/// 1); `block_tokens` 1 and `hnd` 0.
pub const KVX_PACKING_STATE: u32 = 3;
/// A block-list entry for a slot a cache group does not hold (a sliding window's blocks before
/// it, vLLM's null block): a pair with it moves nothing.
pub const KVX_NO_BLOCK: u32 = 0xFFFF_FFFF;
/// The most cache groups a producer, a consumer or a handoff has.
pub const KVX_MAX_GROUPS: u32 = 64;
/// Most KV heads (of the whole model) `kvx_tp_plan` takes.
pub const KVX_MAX_KV_HEADS: u32 = 65536;
const _: () = assert!(KVX_MAX_NAME == kvxfer_proto::wire::metadata::MAX_NAME);
const _: () = assert!(KVX_MAX_TP as u64 == kvxfer_core::connector::MAX_TP);
const _: () = assert!(KVX_MAX_KV_HEADS as u64 == kvxfer_core::connector::MAX_KV_HEADS);
const _: () = assert!(KVX_MAX_NOTIFICATION == kvxfer_proto::wire::notify::MAX_NOTIFICATION);

/// A descriptor: `len` bytes at `offset` in registered region `region`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvx_desc {
    /// Region id (`kvx_region_id`, or the peer's).
    pub region: u32,
    /// Byte offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// What a completed transfer did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvx_xfer_stats {
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptor pairs.
    pub descs: u64,
    /// Operations after coalescing.
    pub ops: u64,
    /// Posting time, ns.
    pub post_ns: u64,
    /// Total time, ns.
    pub duration_ns: u64,
    /// Lane: 0 UCX, 1 shared memory, 2 TCP stream, 3 device (same-host GPU memory opened
    /// through CUDA IPC); `UINT32_MAX` for a lane a newer library added.
    pub lane: u32,
}

/// Where one layer's tensors are (for the connector).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvx_layer_base {
    /// Region of K (or of the fused K+V tensor).
    pub k_region: u32,
    /// Offset of block 0 of K in it.
    pub k_offset: u64,
    /// Region of V; `UINT32_MAX` for a fused layout.
    pub v_region: u32,
    /// Offset of block 0 of V.
    pub v_offset: u64,
}

/// The most parts and the most segments a part of a state page (`kvx_state_part`) describes.
pub const KVX_MAX_STATE_PARTS: u32 = 8;

/// One state tensor of a recurrent-state page (`KVX_PACKING_STATE`): `rows` rows, each the
/// rank's channels of every segment in turn (vLLM's DS conv state: one row, segments x, B and
/// C; the SSM state: one row of one segment of heads).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvx_state_part {
    /// Rows (1 unless the channels are the inner dimension).
    pub rows: u32,
    /// Entries of `per_unit`: 1 to `KVX_MAX_STATE_PARTS`.
    pub segments: u32,
    /// Per segment: channels per split unit (the same on every TP size).
    pub per_unit: *const u64,
    /// Bytes of one channel in one row.
    pub channel_bytes: u64,
}

/// A paged KV cache's shape (for the connector).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvx_layout {
    /// Attention layers (= entries of the layer-base array).
    pub layers: u32,
    /// KV heads in this cache.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Bytes per element: 1, 2 or 4.
    pub dtype_bytes: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Blocks per layer tensor.
    pub num_blocks: u64,
    /// How a layer's tensors hold K and V: `KVX_PACKING_SEPARATE` (0), `KVX_PACKING_FUSED`
    /// (1, vLLM 0.33's attention caches), `KVX_PACKING_LATENT` (2, MLA: one headless
    /// tensor, `kv_heads` 1) or `KVX_PACKING_STATE` (3, recurrent state pages); any other value
    /// is `KVX_INVALID_ARGUMENT`.
    pub packing: u32,
    /// 1: HND order inside a block, 0: NHD (any other value is `KVX_INVALID_ARGUMENT`).
    pub hnd: u32,
    /// `KVX_PACKING_STATE` only (else NULL): the page's state tensors in page order, read for
    /// `state_parts_len` entries (1 to `KVX_MAX_STATE_PARTS`); `kv_heads` then counts the
    /// page's split units per rank and `head_dim` and `dtype_bytes` are not used. NULL: a page
    /// of `kv_heads` units of `head_dim` elements of `dtype_bytes`.
    pub state_parts: *const kvx_state_part,
    /// Entries of `state_parts`.
    pub state_parts_len: u32,
    /// Bytes after the parts in each page, per split unit (vLLM pads a hybrid model's state
    /// page to its attention page, which shrinks with the TP size as the state does).
    pub state_padding: u64,
    /// Not `KVX_PACKING_STATE`: bytes after each block of each tensor, per KV head (vLLM pads
    /// a hybrid model's attention page to its state page where that is the larger; the
    /// padding per head does not change with the TP size). 0: compact blocks.
    pub pad_per_head: u64,
}

/// Connector settings. Zero fields take the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvx_connector_config {
    /// 0 pull (the consumer reads), 1 push (the producer writes); any other value is
    /// `KVX_INVALID_ARGUMENT`.
    pub mode: u32,
    /// Producer lease without heartbeats, ms (default 30000).
    pub lease_ms: u64,
    /// Consumer heartbeat interval, ms (default 1000).
    pub heartbeat_ms: u64,
    /// Readers per request (default 1).
    pub readers: u32,
    /// Consumer: first and past-last head of the producer's heads it reads (0, 0: all).
    pub heads_start: u64,
    /// See `heads_start`.
    pub heads_end: u64,
    /// Memory budget for request state, bytes (0: unlimited).
    pub budget_bytes: u64,
    /// How long a load waits for budget, ms (default 60000).
    pub budget_wait_ms: u64,
}

/// One request's handoff figures.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvx_request_stats {
    /// Bytes moved.
    pub bytes_moved: u64,
    /// Bytes not moved (already cached).
    pub bytes_skipped: u64,
    /// Descriptors.
    pub descriptors: u64,
    /// Posting time, ns.
    pub post_ns: u64,
    /// Transfer time, ns.
    pub transfer_ns: u64,
    /// Handoff time, ns.
    pub handoff_ns: u64,
}

/// An agent (one per worker process or GPU rank).
#[derive(Debug)]
pub struct kvx_agent {
    pub(crate) inner: Arc<Agent>,
    /// With a discovery configured: what publishes the agent (held, never read: dropping it
    /// with the agent ends the publishing).
    pub(crate) _published: Option<kvxfer_core::registry::Member>,
}

/// Where agents publish themselves and find each other by name (`kvx_discovery_*`).
#[derive(Debug)]
pub struct kvx_discovery {
    pub(crate) inner: std::sync::Arc<dyn kvxfer_core::registry::Discovery>,
}

/// A registered region.
#[derive(Debug)]
pub struct kvx_region {
    pub(crate) inner: Region,
}

/// Local descriptors resolved once.
#[derive(Debug)]
pub struct kvx_local_list {
    pub(crate) inner: PreparedLocal,
}

/// A peer's descriptors resolved once.
#[derive(Debug)]
pub struct kvx_remote_list {
    pub(crate) inner: PreparedRemote,
}

/// A transfer in flight (or done).
#[derive(Debug)]
pub struct kvx_transfer {
    pub(crate) inner: Option<Transfer>,
    pub(crate) result: Option<Result<XferStats, (kvx_status, String)>>,
}

/// The prefill side of the connector.
///
/// Any implementation of the connector traits: see `kvx_connector`.
#[derive(Debug)]
pub struct kvx_producer {
    pub(crate) inner: Box<dyn KvProducer>,
    /// A freed request that did not fit the caller's buffers, given on the next call.
    pub(crate) pending: Mutex<Option<Freed>>,
}

/// The decode side of the connector.
///
/// Any implementation of the connector traits: see `kvx_connector`.
#[derive(Debug)]
pub struct kvx_consumer {
    pub(crate) inner: Box<dyn KvConsumer>,
    /// A finished load that did not fit the caller's buffer, given on the next call.
    pub(crate) finished: Mutex<Option<RequestStats>>,
    /// A failed load that did not fit the caller's buffers, given on the next call.
    pub(crate) failed: Mutex<Option<LoadFailure>>,
}

/// Where producers and consumers are made: an implementation of the connector traits
/// (`kvx_connector_over_agent`: kvxfer's agent, across processes and hosts;
/// `kvx_connector_in_process`: memcpy within one process). Every `kvx_producer_*` and
/// `kvx_consumer_*` function works on what it makes.
#[derive(Debug)]
pub struct kvx_connector {
    pub(crate) inner: Box<dyn KvConnector>,
}

/// One layer's tensors for `kvx_connector_producer` / `kvx_connector_consumer`: K (or K and V
/// fused) and, for a separate layout, V (`v` NULL and `v_len` 0 for a fused one). Each holds
/// `num_blocks` blocks from its start.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvx_cache_tensor {
    /// K, or K and V fused.
    pub k: *mut std::ffi::c_void,
    /// Its length in bytes.
    pub k_len: u64,
    /// V (NULL when fused).
    pub v: *mut std::ffi::c_void,
    /// Its length in bytes.
    pub v_len: u64,
}

/// An agent's configuration, built with `kvx_agent_config_set_*` and used by
/// `kvx_agent_new_with`: every setting of the Rust `AgentConfig`, none read from the
/// environment.
#[derive(Debug)]
pub struct kvx_agent_config {
    pub(crate) inner: AgentConfig,
    /// Where the agent is published (`kvx_agent_config_set_discovery`): beside the agent's
    /// own configuration, as `registry::join` takes it.
    pub(crate) discovery: Option<kvxfer_core::registry::DiscoveryConfig>,
}

mod error;
mod ffi;

/// The library version, a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn kvx_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

// cbindgen emits the structs in the order the functions of modules, sorted by path, first
// use them: `agent::{region, transfer}` before `connector` keeps kvx_desc and kvx_xfer_stats
// first, as the first release had them.
mod agent;
mod connector;
mod discovery;
mod groups;
mod handoff;
mod metrics;
mod process;
mod tp;

#[cfg(test)]
mod abi_checks_tests;
#[cfg(test)]
mod handle_tests;
#[cfg(test)]
mod share_tests;
#[cfg(test)]
mod tp_limits_tests;
