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
//! Strings in are NUL-terminated UTF-8; strings and bytes out go to caller buffers with a
//! capacity; a buffer too small gives `KVX_BUFFER_TOO_SMALL` and the size needed in `*out_len`.
//!
//! Every `#[no_mangle]` function of the library is in this file.

#![allow(non_camel_case_types)] // C names.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr};
use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use kvxfer_core::connector::{ConnectorConfig, Consumer, Handoff, Mode, Producer};
use kvxfer_core::layout::{KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking, LayerBase};
use kvxfer_core::{
    Agent, AgentConfig, Desc, Error, HostBuffer, MemKind, MemoryBudget, PreparedLocal,
    PreparedRemote, Region, RegionId, Transfer, Transport, XferOp, XferStats,
};

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
/// Largest notification payload.
pub const KVX_MAX_NOTIFICATION: usize = 65536;
const _: () = assert!(KVX_MAX_NAME == kvxfer_core::metadata::MAX_NAME);
const _: () = assert!(KVX_MAX_NOTIFICATION == kvxfer_core::notify::MAX_NOTIFICATION);

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
    /// Lane: 0 UCX, 1 shared memory, 2 TCP stream.
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
    /// 1: K and V fused per layer (vLLM 0.33), 0: separate tensors.
    pub fused: u32,
    /// 1: HND order inside a block, 0: NHD.
    pub hnd: u32,
}

/// Connector settings. Zero fields take the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvx_connector_config {
    /// 0 pull (the consumer reads), 1 push (the producer writes).
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
    inner: Arc<Agent>,
}

/// A registered region.
#[derive(Debug)]
pub struct kvx_region {
    inner: Region,
}

/// Local descriptors resolved once.
#[derive(Debug)]
pub struct kvx_local_list {
    inner: PreparedLocal,
}

/// A peer's descriptors resolved once.
#[derive(Debug)]
pub struct kvx_remote_list {
    inner: PreparedRemote,
}

/// A transfer in flight (or done).
#[derive(Debug)]
pub struct kvx_transfer {
    inner: Option<Transfer>,
    result: Option<Result<XferStats, (kvx_status, String)>>,
}

/// The prefill side of the connector.
#[derive(Debug)]
pub struct kvx_producer {
    inner: Producer,
}

/// The decode side of the connector.
#[derive(Debug)]
pub struct kvx_consumer {
    inner: Consumer,
}

// ---------------------------------------------------------------------------------------------
// Live handles: every handle is checked before use and before free, so that a double free or
// a use after free through the C ABI is a status code, not memory corruption. (An address the
// allocator reuses for a new handle of the same type is indistinguishable: that is the limit.)
// ---------------------------------------------------------------------------------------------

/// Handle types, tagged for the registry.
trait Kind {
    const KIND: u8;
    const NAME: &'static str;
}

macro_rules! kinds {
    ($($t:ident = $k:expr),*) => {$(
        impl Kind for $t {
            const KIND: u8 = $k;
            const NAME: &'static str = stringify!($t);
        }
    )*};
}
kinds!(
    kvx_agent = 1,
    kvx_region = 2,
    kvx_local_list = 3,
    kvx_remote_list = 4,
    kvx_transfer = 5,
    kvx_producer = 6,
    kvx_consumer = 7
);

fn live() -> std::sync::MutexGuard<'static, std::collections::HashSet<(usize, u8)>> {
    static LIVE: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<(usize, u8)>>> =
        std::sync::OnceLock::new();
    LIVE.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Boxes a handle and records it as live.
fn new_handle<T: Kind>(v: T) -> *mut T {
    let p = Box::into_raw(Box::new(v));
    live().insert((p as usize, T::KIND));
    p
}

/// Frees a live handle; a NULL, foreign or already freed one is refused (recorded in the last
/// error) and left alone.
///
/// # Safety
/// `p` is NULL or a pointer this library returned (possibly already freed).
unsafe fn free_handle<T: Kind>(p: *mut T, fname: &str) {
    if p.is_null() {
        return;
    }
    let known = live().remove(&(p as usize, T::KIND));
    if !known {
        set_error(format!(
            "{fname}: {} {p:p} is not live (double free?); ignored",
            T::NAME
        ));
        return;
    }
    // SAFETY: p was made by new_handle (Box::into_raw) and was live until the removal above,
    // which happens once.
    let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(p) })));
}

// ---------------------------------------------------------------------------------------------
// Errors and the panic boundary
// ---------------------------------------------------------------------------------------------

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_error(msg: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = msg);
}

struct Fail(kvx_status, String);

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        Fail(status_of(&e), e.to_string())
    }
}

fn status_of(e: &Error) -> kvx_status {
    use kvx_status::*;
    match e {
        Error::Ucx { .. } => KVX_UCX,
        Error::Metadata { .. } => KVX_METADATA,
        Error::UnknownRegion { .. }
        | Error::OutOfBounds { .. }
        | Error::BadIndex { .. }
        | Error::LengthMismatch { .. } => KVX_OUT_OF_BOUNDS,
        Error::UnknownPeer { .. } => KVX_UNKNOWN_PEER,
        Error::StalePeer { .. } => KVX_STALE,
        Error::PeerFailed { .. } | Error::LaneFailed { .. } => KVX_PEER_FAILED,
        Error::Handoff { .. } => KVX_HANDOFF,
        Error::Busy { .. } => KVX_BUSY,
        Error::Deregistered { .. } => KVX_DEREGISTERED,
        Error::Deadline { .. } => KVX_DEADLINE,
        Error::WaitTimeout(_) => KVX_TIMEOUT,
        Error::Canceled => KVX_CANCELED,
        Error::InvalidArgument(_) => KVX_INVALID_ARGUMENT,
        Error::OutOfMemory(_) => KVX_OUT_OF_MEMORY,
        Error::Io { .. } | Error::Protocol { .. } => KVX_IO,
        Error::Shutdown => KVX_SHUTDOWN,
        Error::Cuda { .. } => KVX_CUDA,
        _ => KVX_INVALID_ARGUMENT,
    }
}

fn fail(s: kvx_status, msg: impl Into<String>) -> Fail {
    Fail(s, msg.into())
}

/// Runs `f` inside the panic boundary; records the error message on failure.
fn guard(name: &str, f: impl FnOnce() -> Result<(), Fail>) -> kvx_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => kvx_status::KVX_OK,
        Ok(Err(Fail(s, m))) => {
            set_error(format!("{name}: {m}"));
            s
        }
        Err(p) => {
            let why = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_error(format!("{name}: kvxfer panicked (a bug): {why}"));
            kvx_status::KVX_PANIC
        }
    }
}

fn null(name: &str) -> Fail {
    fail(kvx_status::KVX_NULL_PARAMETER, format!("{name} is NULL"))
}

/// # Safety
/// `p` is NULL or a NUL-terminated string valid for reads.
unsafe fn cstr<'a>(p: *const c_char, name: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(null(name));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| {
        fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            format!("{name} is not UTF-8"),
        )
    })
}

/// # Safety
/// `p` is NULL (then `n` must be 0) or valid for reads of `n` elements.
unsafe fn slice<'a, T>(p: *const T, n: usize, name: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(name));
    }
    // SAFETY: non-NULL, valid for n elements per the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Copies `src` to a caller buffer.
///
/// # Safety
/// `buf` is valid for writes of `cap` bytes (or NULL with `cap` 0); `out_len` is valid.
unsafe fn put(src: &[u8], buf: *mut u8, cap: usize, out_len: *mut usize) -> Result<(), Fail> {
    if out_len.is_null() {
        return Err(null("out_len"));
    }
    if src.len() > cap || (buf.is_null() && !src.is_empty()) {
        // SAFETY: out_len non-NULL and valid per the contract.
        unsafe { *out_len = src.len() };
        return Err(fail(
            kvx_status::KVX_BUFFER_TOO_SMALL,
            format!("{} bytes needed, buffer holds {cap}", src.len()),
        ));
    }
    if !src.is_empty() {
        // SAFETY: buf valid for cap >= src.len() bytes; src is a separate Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), buf, src.len()) };
    }
    // SAFETY: as above.
    unsafe { *out_len = src.len() };
    Ok(())
}

/// A caller's input struct (not a handle).
///
/// # Safety
/// `p` is NULL or valid for reads of a `T`.
unsafe fn plain<'a, T>(p: *const T, name: &str) -> Result<&'a T, Fail> {
    // SAFETY: per this function's contract.
    unsafe { p.as_ref() }.ok_or_else(|| null(name))
}

/// A live handle of type `T`, or why not.
///
/// # Safety
/// `p` is NULL or a pointer this library returned (freed ones are refused, not dereferenced).
unsafe fn handle<'a, T: Kind>(p: *const T, name: &str) -> Result<&'a T, Fail> {
    if p.is_null() {
        return Err(null(name));
    }
    if !live().contains(&(p as usize, T::KIND)) {
        return Err(fail(
            kvx_status::KVX_INVALID_HANDLE,
            format!(
                "{name} is not a live {} (freed, or not from this library)",
                T::NAME
            ),
        ));
    }
    // SAFETY: live: made by new_handle and not freed.
    Ok(unsafe { &*p })
}

/// As `handle`, mutably.
///
/// # Safety
/// As `handle`; the caller does not use the handle from two threads at once.
unsafe fn handle_mut<'a, T: Kind>(p: *mut T, name: &str) -> Result<&'a mut T, Fail> {
    // SAFETY: per this function's contract.
    unsafe { handle(p, name) }?;
    // SAFETY: checked live above; exclusivity per the contract.
    Ok(unsafe { &mut *p })
}

fn ms(v: u64) -> Option<Duration> {
    (v > 0).then(|| Duration::from_millis(v))
}

// ---------------------------------------------------------------------------------------------
// Library
// ---------------------------------------------------------------------------------------------

/// The library version, a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn kvx_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// Copies the calling thread's last error message (NUL-terminated, truncated to `cap`) into
/// `buf`; returns its full length without the NUL. 0: no error recorded.
///
/// # Safety
/// `buf` is valid for writes of `cap` bytes, or NULL with `cap` 0.
#[no_mangle]
pub unsafe extern "C" fn kvx_last_error(buf: *mut c_char, cap: usize) -> usize {
    let r = catch_unwind(|| {
        LAST_ERROR.with(|e| {
            let e = e.borrow();
            if !buf.is_null() && cap > 0 {
                let n = e.len().min(cap - 1);
                // SAFETY: buf valid for cap bytes; n + 1 <= cap.
                unsafe {
                    std::ptr::copy_nonoverlapping(e.as_ptr(), buf.cast(), n);
                    *buf.add(n) = 0;
                }
            }
            e.len()
        })
    });
    r.unwrap_or(0)
}

/// A static name for a status (e.g. "KVX_BUSY").
#[no_mangle]
pub extern "C" fn kvx_status_name(s: kvx_status) -> *const c_char {
    use kvx_status::*;
    let n: &'static str = match s {
        KVX_OK => "KVX_OK\0",
        KVX_NULL_PARAMETER => "KVX_NULL_PARAMETER\0",
        KVX_INVALID_ARGUMENT => "KVX_INVALID_ARGUMENT\0",
        KVX_METADATA => "KVX_METADATA\0",
        KVX_OUT_OF_BOUNDS => "KVX_OUT_OF_BOUNDS\0",
        KVX_UNKNOWN_PEER => "KVX_UNKNOWN_PEER\0",
        KVX_PEER_FAILED => "KVX_PEER_FAILED\0",
        KVX_BUSY => "KVX_BUSY\0",
        KVX_DEADLINE => "KVX_DEADLINE\0",
        KVX_TIMEOUT => "KVX_TIMEOUT\0",
        KVX_CANCELED => "KVX_CANCELED\0",
        KVX_OUT_OF_MEMORY => "KVX_OUT_OF_MEMORY\0",
        KVX_IO => "KVX_IO\0",
        KVX_UCX => "KVX_UCX\0",
        KVX_HANDOFF => "KVX_HANDOFF\0",
        KVX_SHUTDOWN => "KVX_SHUTDOWN\0",
        KVX_PANIC => "KVX_PANIC\0",
        KVX_BUFFER_TOO_SMALL => "KVX_BUFFER_TOO_SMALL\0",
        KVX_NOT_FOUND => "KVX_NOT_FOUND\0",
        KVX_IN_PROGRESS => "KVX_IN_PROGRESS\0",
        KVX_STALE => "KVX_STALE\0",
        KVX_DEREGISTERED => "KVX_DEREGISTERED\0",
        KVX_INVALID_HANDLE => "KVX_INVALID_HANDLE\0",
        KVX_CUDA => "KVX_CUDA\0",
    };
    n.as_ptr().cast()
}

// ---------------------------------------------------------------------------------------------
// Agent
// ---------------------------------------------------------------------------------------------

/// Creates an agent. `transport`: "tcp", "shm", "auto" or a UCX_TLS list; `net_devices` may be
/// NULL (UCX's default), e.g. "lo" or "eth0". `budget_bytes` 0: unlimited.
///
/// Device memory (a library built with the `cuda` feature) follows the environment:
/// `KVXFER_GPU_PATH` = `auto` (default: direct where UCX has CUDA transports, else staged),
/// `direct` or `staged`; `KVXFER_STAGING_CHUNKS` and `KVXFER_STAGING_CHUNK_BYTES` size the
/// staging pool (default 8 x 4 MiB, charged to the budget at the first device registration).
///
/// # Safety
/// Strings are NULL or NUL-terminated; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_new(
    name: *const c_char,
    transport: *const c_char,
    net_devices: *const c_char,
    budget_bytes: u64,
    out: *mut *mut kvx_agent,
) -> kvx_status {
    guard("kvx_agent_new", || {
        // SAFETY: per this function's contract.
        let name = unsafe { cstr(name, "name") }?;
        // SAFETY: as above.
        let transport = unsafe { cstr(transport, "transport") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let mut cfg = AgentConfig::new(name).transport(Transport::parse(transport));
        if !net_devices.is_null() {
            // SAFETY: as above.
            cfg = cfg.net_devices(unsafe { cstr(net_devices, "net_devices") }?);
        }
        if budget_bytes > 0 {
            cfg = cfg.budget(MemoryBudget::new(budget_bytes));
        }
        cfg = gpu_env(cfg)?;
        let a = Agent::new(cfg)?;
        let h = new_handle(kvx_agent { inner: Arc::new(a) });
        // SAFETY: out non-NULL and valid per the contract.
        unsafe { *out = h };
        Ok(())
    })
}

/// Applies KVXFER_GPU_PATH, KVXFER_STAGING_CHUNKS and KVXFER_STAGING_CHUNK_BYTES.
fn gpu_env(mut cfg: AgentConfig) -> kvxfer_core::Result<AgentConfig> {
    if let Ok(v) = std::env::var("KVXFER_GPU_PATH") {
        let p = kvxfer_core::GpuPath::parse(v.trim()).ok_or_else(|| {
            kvxfer_core::Error::InvalidArgument(format!(
                "KVXFER_GPU_PATH={v:?}: auto, direct or staged"
            ))
        })?;
        cfg = cfg.gpu_path(p);
    }
    let num = |k: &str, d: usize| -> kvxfer_core::Result<usize> {
        match std::env::var(k) {
            Ok(v) => v.trim().parse().map_err(|_| {
                kvxfer_core::Error::InvalidArgument(format!(
                    "{k}={v:?}: a number of bytes or chunks"
                ))
            }),
            Err(_) => Ok(d),
        }
    };
    let (c, b) = cfg.staging;
    let staging = (
        num("KVXFER_STAGING_CHUNKS", c)?,
        num("KVXFER_STAGING_CHUNK_BYTES", b)?,
    );
    Ok(cfg.staging(staging.0, staging.1))
}

/// Destroys an agent (NULL is ignored). Transfers in flight finish first; handles made from it
/// (regions, lists, transfers, producers, consumers) stay valid to free.
///
/// # Safety
/// `a` is NULL or from `kvx_agent_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_free(a: *mut kvx_agent) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(a, "kvx_agent_free") }
}

/// Listens for peers' metadata exchange on `addr` ("127.0.0.1:0" picks a port); writes the
/// bound address (text) to `buf`.
///
/// # Safety
/// `a` is a live agent; `addr` NUL-terminated; `buf` valid for `cap` bytes; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_listen(
    a: *const kvx_agent,
    addr: *const c_char,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_listen", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let addr: SocketAddr = unsafe { cstr(addr, "addr") }?
            .parse()
            .map_err(|e| fail(kvx_status::KVX_INVALID_ARGUMENT, format!("addr: {e}")))?;
        let bound = a.inner.listen(addr)?.to_string();
        // SAFETY: as above.
        unsafe { put(bound.as_bytes(), buf.cast(), cap, out_len) }
    })
}

/// Exchanges metadata with the peer listening at `addr`; writes its name to `buf`.
///
/// # Safety
/// As `kvx_agent_listen`.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_connect(
    a: *const kvx_agent,
    addr: *const c_char,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_connect", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let addr: SocketAddr = unsafe { cstr(addr, "addr") }?
            .parse()
            .map_err(|e| fail(kvx_status::KVX_INVALID_ARGUMENT, format!("addr: {e}")))?;
        let name = a.inner.connect(addr)?;
        // SAFETY: as above.
        unsafe { put(name.as_bytes(), buf.cast(), cap, out_len) }
    })
}

/// This agent's metadata, for a peer's `kvx_agent_load_metadata`.
///
/// # Safety
/// `a` live; `buf` valid for `cap` bytes; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_metadata(
    a: *const kvx_agent,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_metadata", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        let m = a.inner.metadata()?;
        // SAFETY: as above.
        unsafe { put(&m, buf, cap, out_len) }
    })
}

/// Loads a peer's metadata; writes the peer's name to `name_buf`.
///
/// # Safety
/// `a` live; `md` valid for `len` bytes; `name_buf` valid for `cap` bytes; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_load_metadata(
    a: *const kvx_agent,
    md: *const u8,
    len: usize,
    name_buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_load_metadata", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let md = unsafe { slice(md, len, "metadata") }?;
        let name = a.inner.load_remote_metadata(md)?;
        // SAFETY: as above.
        unsafe { put(name.as_bytes(), name_buf.cast(), cap, out_len) }
    })
}

/// Registers `len` bytes at `ptr`: host memory (`cuda_device` < 0) or CUDA device memory
/// (needs a CUDA build). The memory must stay valid until `kvx_agent_deregister` succeeds or
/// the agent is freed.
///
/// # Safety
/// `a` live; `[ptr, ptr+len)` valid memory of that kind for the stated lifetime; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_register(
    a: *const kvx_agent,
    ptr: *mut c_void,
    len: usize,
    cuda_device: i32,
    out: *mut *mut kvx_region,
) -> kvx_status {
    guard("kvx_agent_register", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let kind = if cuda_device < 0 {
            MemKind::Host
        } else {
            MemKind::Cuda(cuda_device as u32)
        };
        // SAFETY: the caller guarantees validity and lifetime (this function's contract).
        let r = unsafe { a.inner.register_raw(ptr.cast(), len, kind) }?;
        // SAFETY: out non-NULL, valid.
        unsafe { *out = new_handle(kvx_region { inner: r }) };
        Ok(())
    })
}

/// Allocates `len` zeroed, page-aligned bytes of host memory owned by kvxfer (memfd-backed,
/// so a same-host peer maps it for the shared-memory lane) and registers it. The memory lives
/// until the region is deregistered and freed; `kvx_region_ptr` gives its address.
///
/// # Safety
/// `a` live; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_alloc(
    a: *const kvx_agent,
    len: usize,
    out: *mut *mut kvx_region,
) -> kvx_status {
    guard("kvx_agent_alloc", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let r = a.inner.register(HostBuffer::new(len)?)?;
        // SAFETY: out non-NULL, valid.
        unsafe { *out = new_handle(kvx_region { inner: r }) };
        Ok(())
    })
}

/// Deregisters a region; `KVX_BUSY` while a transfer uses it. The handle stays to be freed.
///
/// # Safety
/// `a` and `r` live.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_deregister(
    a: *const kvx_agent,
    r: *const kvx_region,
) -> kvx_status {
    guard("kvx_agent_deregister", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let r = unsafe { handle(r, "region") }?;
        a.inner.deregister(&r.inner)?;
        Ok(())
    })
}

/// The region's id, as descriptors name it (`UINT32_MAX` for NULL or a handle not live).
///
/// # Safety
/// `r` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvx_region_id(r: *const kvx_region) -> u32 {
    // SAFETY: per this function's contract.
    unsafe { handle(r, "region") }.map_or(u32::MAX, |r| r.inner.id().0)
}

/// The region's base address (NULL for NULL or a handle not live).
///
/// # Safety
/// `r` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvx_region_ptr(r: *const kvx_region) -> *mut c_void {
    // SAFETY: per this function's contract.
    unsafe { handle(r, "region") }.map_or(std::ptr::null_mut(), |r| r.inner.addr() as *mut c_void)
}

/// Frees a region handle (NULL ignored). Owned memory is released once it is deregistered (or
/// the agent is gone) and no transfer uses it.
///
/// # Safety
/// `r` NULL or from this library, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvx_region_free(r: *mut kvx_region) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(r, "kvx_region_free") }
}

fn descs(d: &[kvx_desc]) -> Vec<Desc> {
    d.iter()
        .map(|d| Desc::new(RegionId(d.region), d.offset, d.len))
        .collect()
}

/// Resolves local descriptors once.
///
/// # Safety
/// `a` live; `d` valid for `n` elements; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_prep_local(
    a: *const kvx_agent,
    d: *const kvx_desc,
    n: usize,
    out: *mut *mut kvx_local_list,
) -> kvx_status {
    guard("kvx_agent_prep_local", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let d = unsafe { slice(d, n, "descs") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let l = a.inner.prep_local(&descs(d))?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_local_list { inner: l }) };
        Ok(())
    })
}

/// Resolves a peer's descriptors once, checked against its region table.
///
/// # Safety
/// `a` live; `peer` NUL-terminated; `d` valid for `n` elements; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_prep_remote(
    a: *const kvx_agent,
    peer: *const c_char,
    d: *const kvx_desc,
    n: usize,
    out: *mut *mut kvx_remote_list,
) -> kvx_status {
    guard("kvx_agent_prep_remote", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let peer = unsafe { cstr(peer, "peer") }?;
        // SAFETY: as above.
        let d = unsafe { slice(d, n, "descs") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let l = a.inner.prep_remote(peer, &descs(d))?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_remote_list { inner: l }) };
        Ok(())
    })
}

/// Frees a local list (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_local_list_free(l: *mut kvx_local_list) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(l, "kvx_local_list_free") }
}

/// Frees a remote list (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_remote_list_free(l: *mut kvx_remote_list) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(l, "kvx_remote_list_free") }
}

/// Starts a transfer of the pairs `(local[li[k]], remote[ri[k]])`, k < n; `li` and `ri` NULL:
/// every pair of two lists of length n. With a notification, the peer receives it after the
/// data. `deadline_ms` 0: none.
///
/// # Safety
/// Handles live; `li`/`ri` NULL or valid for `n`; `note` valid for `note_len`; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_transfer(
    a: *const kvx_agent,
    op: kvx_op,
    local: *const kvx_local_list,
    li: *const usize,
    remote: *const kvx_remote_list,
    ri: *const usize,
    n: usize,
    note: *const u8,
    note_len: usize,
    deadline_ms: u64,
    out: *mut *mut kvx_transfer,
) -> kvx_status {
    guard("kvx_agent_transfer", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let local = unsafe { handle(local, "local") }?;
        // SAFETY: as above.
        let remote = unsafe { handle(remote, "remote") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let all: Vec<usize> = (0..n).collect();
        let li = if li.is_null() {
            all.clone()
        } else {
            // SAFETY: as above.
            unsafe { slice(li, n, "li") }?.to_vec()
        };
        let ri = if ri.is_null() {
            all
        } else {
            // SAFETY: as above.
            unsafe { slice(ri, n, "ri") }?.to_vec()
        };
        let note = if note.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(unsafe { slice(note, note_len, "note") }?)
        };
        let op = match op {
            kvx_op::KVX_READ => XferOp::Read,
            kvx_op::KVX_WRITE => XferOp::Write,
        };
        let t = a.inner.transfer(
            op,
            &local.inner,
            &li,
            &remote.inner,
            &ri,
            note,
            ms(deadline_ms),
        )?;
        let h = kvx_transfer {
            inner: Some(t),
            result: None,
        };
        // SAFETY: out valid.
        unsafe { *out = new_handle(h) };
        Ok(())
    })
}

fn stats_c(s: &XferStats) -> kvx_xfer_stats {
    kvx_xfer_stats {
        bytes: s.bytes,
        descs: s.descs as u64,
        ops: s.ops as u64,
        post_ns: s.post_time.as_nanos() as u64,
        duration_ns: s.duration.as_nanos() as u64,
        lane: match s.lane {
            kvxfer_core::Lane::Ucx => 0,
            kvxfer_core::Lane::Shm => 1,
            kvxfer_core::Lane::Tcp => 2,
        },
    }
}

/// Takes the result if the transfer is done (waiting up to `timeout`).
fn settle(t: &mut kvx_transfer, timeout: Duration) -> Result<(), Fail> {
    if t.result.is_some() {
        return Ok(());
    }
    let Some(x) = t.inner.as_mut() else {
        return Err(fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            "transfer has no state",
        ));
    };
    match x.wait_timeout(timeout) {
        Err(Error::WaitTimeout(_)) => Err(fail(kvx_status::KVX_IN_PROGRESS, "in flight")),
        r => {
            t.result = Some(r.map_err(|e| (status_of(&e), e.to_string())));
            t.inner = None;
            Ok(())
        }
    }
}

fn report(t: &kvx_transfer, out: *mut kvx_xfer_stats) -> Result<(), Fail> {
    match &t.result {
        Some(Ok(s)) => {
            if !out.is_null() {
                // SAFETY: out non-NULL and valid per the callers' contracts.
                unsafe { *out = stats_c(s) };
            }
            Ok(())
        }
        Some(Err((st, m))) => Err(Fail(*st, m.clone())),
        None => Err(fail(kvx_status::KVX_IN_PROGRESS, "in flight")),
    }
}

/// Polls: `KVX_IN_PROGRESS` while in flight, else the transfer's final status (repeatable);
/// on `KVX_OK` writes `*stats` (may be NULL).
///
/// # Safety
/// `t` live; `stats` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_poll(
    t: *mut kvx_transfer,
    stats: *mut kvx_xfer_stats,
) -> kvx_status {
    guard("kvx_transfer_poll", || {
        // SAFETY: per this function's contract.
        let t = unsafe { handle_mut(t, "transfer") }?;
        match settle(t, Duration::ZERO) {
            Ok(()) => report(t, stats),
            Err(f) => Err(f),
        }
    })
}

/// Waits up to `timeout_ms` (0: forever); `KVX_TIMEOUT` leaves the transfer in flight.
///
/// # Safety
/// As `kvx_transfer_poll`.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_wait(
    t: *mut kvx_transfer,
    timeout_ms: u64,
    stats: *mut kvx_xfer_stats,
) -> kvx_status {
    guard("kvx_transfer_wait", || {
        // SAFETY: per this function's contract.
        let t = unsafe { handle_mut(t, "transfer") }?;
        let timeout = ms(timeout_ms).unwrap_or(Duration::from_secs(u32::MAX as u64));
        match settle(t, timeout) {
            Ok(()) => report(t, stats),
            Err(Fail(kvx_status::KVX_IN_PROGRESS, _)) => Err(fail(
                kvx_status::KVX_TIMEOUT,
                format!("not done within {timeout_ms} ms; still in flight"),
            )),
            Err(f) => Err(f),
        }
    })
}

/// Cancels: returns once nothing is in flight any more; the final status is `KVX_CANCELED`, or
/// the result if it completed first.
///
/// # Safety
/// `t` live.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_cancel(t: *mut kvx_transfer) -> kvx_status {
    guard("kvx_transfer_cancel", || {
        // SAFETY: per this function's contract.
        let t = unsafe { handle_mut(t, "transfer") }?;
        if let Some(x) = t.inner.take() {
            t.result = Some(x.cancel().map_err(|e| (status_of(&e), e.to_string())));
        }
        report(t, std::ptr::null_mut())
    })
}

/// Frees a transfer handle (NULL ignored). A transfer still in flight completes on its own;
/// the memory it uses stays pinned until then.
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_free(t: *mut kvx_transfer) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(t, "kvx_transfer_free") }
}

/// Sends a notification alone to `peer` (ordered after earlier completed transfers to it).
///
/// # Safety
/// `a` live; `peer` NUL-terminated; `note` valid for `len`.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_notify(
    a: *const kvx_agent,
    peer: *const c_char,
    note: *const u8,
    len: usize,
) -> kvx_status {
    guard("kvx_agent_notify", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let peer = unsafe { cstr(peer, "peer") }?;
        // SAFETY: as above.
        let note = unsafe { slice(note, len, "note") }?;
        a.inner.notify(peer, note)?.wait()?;
        Ok(())
    })
}

/// Takes the next notification, waiting up to `timeout_ms` (0: do not wait); `KVX_NOT_FOUND`
/// if none. `from` must hold `KVX_MAX_NAME` + 1 bytes (written NUL-terminated), `payload`
/// `KVX_MAX_NOTIFICATION` bytes.
///
/// # Safety
/// `a` live; buffers valid for their capacities; length pointers valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_next_notification(
    a: *const kvx_agent,
    timeout_ms: u64,
    from: *mut c_char,
    from_cap: usize,
    payload: *mut u8,
    payload_cap: usize,
    payload_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_next_notification", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        if from.is_null() || payload_len.is_null() || (payload.is_null() && payload_cap > 0) {
            return Err(null("from, payload or payload_len"));
        }
        if from_cap < KVX_MAX_NAME + 1 || payload_cap < KVX_MAX_NOTIFICATION {
            return Err(fail(
                kvx_status::KVX_BUFFER_TOO_SMALL,
                format!(
                    "buffers must hold {} and {KVX_MAX_NOTIFICATION} bytes",
                    KVX_MAX_NAME + 1
                ),
            ));
        }
        let n = match ms(timeout_ms) {
            None => a.inner.try_notification(),
            Some(t) => a.inner.wait_notification(t).ok(),
        };
        let Some(n) = n else {
            return Err(fail(kvx_status::KVX_NOT_FOUND, "no notification"));
        };
        // SAFETY: capacities checked above against the largest name and payload.
        unsafe {
            std::ptr::copy_nonoverlapping(n.from.as_ptr(), from.cast::<u8>(), n.from.len());
            *from.add(n.from.len()) = 0;
            std::ptr::copy_nonoverlapping(n.payload.as_ptr(), payload, n.payload.len());
            *payload_len = n.payload.len();
        }
        Ok(())
    })
}

/// The agent's memory budget: limit (UINT64_MAX: unlimited), bytes in use, peak.
///
/// # Safety
/// `a` live; outputs valid (each may be NULL).
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_budget(
    a: *const kvx_agent,
    limit: *mut u64,
    used: *mut u64,
    peak: *mut u64,
) -> kvx_status {
    guard("kvx_agent_budget", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        let b = a.inner.budget();
        // SAFETY: each output NULL or valid.
        unsafe {
            if let Some(p) = limit.as_mut() {
                *p = b.limit();
            }
            if let Some(p) = used.as_mut() {
                *p = b.used();
            }
            if let Some(p) = peak.as_mut() {
                *p = b.peak();
            }
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Connector
// ---------------------------------------------------------------------------------------------

fn layout_of(l: &kvx_layout, bases: &[kvx_layer_base]) -> Result<KvLayout, Fail> {
    let bad = |w: &str| fail(kvx_status::KVX_INVALID_ARGUMENT, format!("layout: {w}"));
    if l.layers as usize != bases.len() || l.layers == 0 {
        return Err(bad(
            "layers must be > 0 and equal the number of layer bases",
        ));
    }
    if l.kv_heads == 0 || l.head_dim == 0 || l.block_tokens == 0 || l.num_blocks == 0 {
        return Err(bad("zero heads, head_dim, block_tokens or num_blocks"));
    }
    let dtype = match l.dtype_bytes {
        1 => KvDtype::Fp8,
        2 => KvDtype::Bf16,
        4 => KvDtype::F32,
        _ => return Err(bad("dtype_bytes must be 1, 2 or 4")),
    };
    let fused = l.fused != 0;
    let layers = bases
        .iter()
        .map(|b| {
            let v = (b.v_region != u32::MAX).then_some((RegionId(b.v_region), b.v_offset));
            if fused == v.is_some() {
                return Err(bad(
                    "a fused layout has no V bases, a separate one needs them",
                ));
            }
            Ok(LayerBase {
                k: (RegionId(b.k_region), b.k_offset),
                v,
            })
        })
        .collect::<Result<Vec<_>, Fail>>()?;
    Ok(KvLayout {
        geometry: KvGeometry {
            name: "c".into(),
            layers: u64::from(l.layers),
            kv_heads: u64::from(l.kv_heads),
            head_dim: u64::from(l.head_dim),
            dtype,
        },
        block_tokens: u64::from(l.block_tokens),
        num_blocks: l.num_blocks,
        packing: if fused {
            KvPacking::Fused
        } else {
            KvPacking::Separate
        },
        order: if l.hnd != 0 {
            KvOrder::Hnd
        } else {
            KvOrder::Nhd
        },
        layers,
    })
}

fn config_of(c: Option<&kvx_connector_config>) -> ConnectorConfig {
    let mut cfg = ConnectorConfig::default();
    if let Some(c) = c {
        cfg.mode = if c.mode == 1 { Mode::Push } else { Mode::Pull };
        if let Some(d) = ms(c.lease_ms) {
            cfg.lease = d;
        }
        if let Some(d) = ms(c.heartbeat_ms) {
            cfg.heartbeat = d;
        }
        if c.readers > 0 {
            cfg.readers = c.readers as usize;
        }
        if c.heads_end > c.heads_start {
            cfg.heads = Some(c.heads_start..c.heads_end);
        }
        if c.budget_bytes > 0 {
            cfg.budget = MemoryBudget::new(c.budget_bytes);
        }
        if let Some(d) = ms(c.budget_wait_ms) {
            cfg.budget_wait = d;
        }
    }
    cfg
}

/// The compatibility hash of a layout (what a handoff's `compat` carries, and what agents that
/// exchange blocks should share); 0 with an invalid layout (see the last error).
///
/// # Safety
/// `layout` valid; `bases` valid for `layout->layers`.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_compat_hash(
    layout: *const kvx_layout,
    bases: *const kvx_layer_base,
) -> u64 {
    let mut h = 0;
    let s = guard("kvx_layout_compat_hash", || {
        // SAFETY: per this function's contract.
        let l = unsafe { plain(layout, "layout") }?;
        // SAFETY: as above.
        let b = unsafe { slice(bases, l.layers as usize, "bases") }?;
        h = layout_of(l, b)?.compat_hash();
        Ok(())
    });
    if s == kvx_status::KVX_OK {
        h
    } else {
        0
    }
}

/// A producer over `a`'s registered cache. `side_channel` (may be NULL): the address of the
/// agent's `kvx_agent_listen`, put into handoffs. `cfg` may be NULL (defaults).
///
/// # Safety
/// `a` live; `layout` valid; `bases` valid for `layout->layers`; strings NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_new(
    a: *const kvx_agent,
    layout: *const kvx_layout,
    bases: *const kvx_layer_base,
    cfg: *const kvx_connector_config,
    side_channel: *const c_char,
    out: *mut *mut kvx_producer,
) -> kvx_status {
    guard("kvx_producer_new", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let l = unsafe { plain(layout, "layout") }?;
        // SAFETY: as above.
        let b = unsafe { slice(bases, l.layers as usize, "bases") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let side = if side_channel.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(
                unsafe { cstr(side_channel, "side_channel") }?
                    .parse()
                    .map_err(|e| {
                        fail(
                            kvx_status::KVX_INVALID_ARGUMENT,
                            format!("side_channel: {e}"),
                        )
                    })?,
            )
        };
        // SAFETY: cfg NULL or valid.
        let cfg = config_of(unsafe { cfg.as_ref() });
        let p = Producer::new(a.inner.clone(), layout_of(l, b)?, cfg, side)?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_producer { inner: p }) };
        Ok(())
    })
}

/// Frees a producer (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_free(p: *mut kvx_producer) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(p, "kvx_producer_free") }
}

/// Holds `blocks` of `request` for consumers; writes the handoff (bytes to pass to the
/// consumer) to `buf`. `layers_done`: layers already computed (all, or 0 for layer-wise).
///
/// # Safety
/// `p` live; strings NUL-terminated; `blocks` valid for `n`; `buf` for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_publish(
    p: *const kvx_producer,
    request: *const c_char,
    blocks: *const u32,
    n: usize,
    tokens: u64,
    layers_done: u32,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_producer_publish", || {
        // SAFETY: per this function's contract.
        let p = unsafe { handle(p, "producer") }?;
        // SAFETY: as above.
        let r = unsafe { cstr(request, "request") }?;
        // SAFETY: as above.
        let b = unsafe { slice(blocks, n, "blocks") }?;
        if out_len.is_null() {
            return Err(null("out_len"));
        }
        // Size check before publishing, so a too-small buffer has no side effect.
        let h = p.inner.publish(r, b, tokens, layers_done as usize)?;
        let bytes = h.encode();
        if bytes.len() > cap {
            p.inner.abort(r);
        }
        // SAFETY: as above.
        unsafe { put(&bytes, buf, cap, out_len) }
    })
}

/// Layer `layer` of `request` is computed.
///
/// # Safety
/// `p` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_layer_done(
    p: *const kvx_producer,
    request: *const c_char,
    layer: u32,
) -> kvx_status {
    guard("kvx_producer_layer_done", || {
        // SAFETY: per this function's contract.
        let p = unsafe { handle(p, "producer") }?;
        // SAFETY: as above.
        let r = unsafe { cstr(request, "request") }?;
        p.inner.layer_done(r, layer as usize)?;
        Ok(())
    })
}

/// Aborts `request`: its blocks are freed now.
///
/// # Safety
/// `p` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_abort(
    p: *const kvx_producer,
    request: *const c_char,
) -> kvx_status {
    guard("kvx_producer_abort", || {
        // SAFETY: per this function's contract.
        let p = unsafe { handle(p, "producer") }?;
        // SAFETY: as above.
        let r = unsafe { cstr(request, "request") }?;
        p.inner.abort(r);
        Ok(())
    })
}

/// Takes the next request whose blocks may be reused, waiting up to `timeout_ms` (0: none);
/// `KVX_NOT_FOUND` if none. Writes its name, blocks, and the reason (0 acknowledged,
/// 1 aborted, 2 expired). `KVX_BUFFER_TOO_SMALL` keeps it for the next call.
///
/// # Safety
/// `p` live; buffers valid for their capacities; outputs valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_next_freed(
    p: *const kvx_producer,
    timeout_ms: u64,
    req_buf: *mut c_char,
    req_cap: usize,
    req_len: *mut usize,
    blocks: *mut u32,
    blocks_cap: usize,
    nblocks: *mut usize,
    reason: *mut u32,
) -> kvx_status {
    guard("kvx_producer_next_freed", || {
        // SAFETY: per this function's contract.
        let p = unsafe { handle(p, "producer") }?;
        if req_len.is_null() || nblocks.is_null() || reason.is_null() {
            return Err(null("req_len, nblocks or reason"));
        }
        let f = match p
            .inner
            .take_freed_one(ms(timeout_ms).unwrap_or(Duration::ZERO), |f| {
                f.request.len() <= req_cap && f.blocks.len() <= blocks_cap
            }) {
            Ok(Some(f)) => f,
            Ok(None) => return Err(fail(kvx_status::KVX_NOT_FOUND, "nothing freed")),
            Err((r, b)) => {
                // SAFETY: outputs valid.
                unsafe {
                    *req_len = r;
                    *nblocks = b;
                }
                return Err(fail(
                    kvx_status::KVX_BUFFER_TOO_SMALL,
                    format!("{r} name bytes, {b} blocks"),
                ));
            }
        };
        // SAFETY: capacities checked by take_freed_one's predicate; outputs valid.
        unsafe {
            put(f.request.as_bytes(), req_buf.cast(), req_cap, req_len)?;
            if !f.blocks.is_empty() {
                if blocks.is_null() {
                    return Err(null("blocks"));
                }
                std::ptr::copy_nonoverlapping(f.blocks.as_ptr(), blocks, f.blocks.len());
            }
            *nblocks = f.blocks.len();
            *reason = match f.reason {
                kvxfer_core::lifecycle::FreeReason::Acked => 0,
                kvxfer_core::lifecycle::FreeReason::Aborted => 1,
                kvxfer_core::lifecycle::FreeReason::Expired => 2,
            };
        }
        Ok(())
    })
}

/// A consumer over `a`'s registered cache. `cfg` may be NULL.
///
/// # Safety
/// As `kvx_producer_new`.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_new(
    a: *const kvx_agent,
    layout: *const kvx_layout,
    bases: *const kvx_layer_base,
    cfg: *const kvx_connector_config,
    out: *mut *mut kvx_consumer,
) -> kvx_status {
    guard("kvx_consumer_new", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let l = unsafe { plain(layout, "layout") }?;
        // SAFETY: as above.
        let b = unsafe { slice(bases, l.layers as usize, "bases") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: cfg NULL or valid.
        let cfg = config_of(unsafe { cfg.as_ref() });
        let c = Consumer::new(a.inner.clone(), layout_of(l, b)?, cfg)?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_consumer { inner: c }) };
        Ok(())
    })
}

/// Frees a consumer (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_free(c: *mut kvx_consumer) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(c, "kvx_consumer_free") }
}

/// Starts loading a handoff into `local_blocks` (pairs with the producer's last blocks; the
/// blocks before are a cached prefix and do not move; none: only the acknowledgement).
///
/// # Safety
/// `c` live; `handoff` valid for `len`; `local_blocks` valid for `n`.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_start_load(
    c: *const kvx_consumer,
    handoff: *const u8,
    len: usize,
    local_blocks: *const u32,
    n: usize,
) -> kvx_status {
    guard("kvx_consumer_start_load", || {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "consumer") }?;
        // SAFETY: as above.
        let h = Handoff::decode(unsafe { slice(handoff, len, "handoff") }?)?;
        // SAFETY: as above.
        let b = unsafe { slice(local_blocks, n, "local_blocks") }?;
        c.inner.start_load(&h, b)?;
        Ok(())
    })
}

/// Waits until layer `layer` of `request` is loaded (`timeout_ms` 0: forever).
///
/// # Safety
/// `c` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_wait_layer(
    c: *const kvx_consumer,
    request: *const c_char,
    layer: u32,
    timeout_ms: u64,
) -> kvx_status {
    guard("kvx_consumer_wait_layer", || {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "consumer") }?;
        // SAFETY: as above.
        let r = unsafe { cstr(request, "request") }?;
        let t = ms(timeout_ms).unwrap_or(Duration::from_secs(u32::MAX as u64));
        c.inner.wait_layer(r, layer as usize, t)?;
        Ok(())
    })
}

/// Waits until `request` is loaded completely (`timeout_ms` 0: forever).
///
/// # Safety
/// `c` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_wait(
    c: *const kvx_consumer,
    request: *const c_char,
    timeout_ms: u64,
) -> kvx_status {
    guard("kvx_consumer_wait", || {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "consumer") }?;
        // SAFETY: as above.
        let r = unsafe { cstr(request, "request") }?;
        let t = ms(timeout_ms).unwrap_or(Duration::from_secs(u32::MAX as u64));
        c.inner.wait(r, t)?;
        Ok(())
    })
}

/// Takes the next finished load: its name and figures; `KVX_NOT_FOUND` if none.
///
/// # Safety
/// `c` live; `req_buf` valid for `cap`; `req_len` and `stats` valid (stats may be NULL).
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_next_finished(
    c: *const kvx_consumer,
    req_buf: *mut c_char,
    cap: usize,
    req_len: *mut usize,
    stats: *mut kvx_request_stats,
) -> kvx_status {
    guard("kvx_consumer_next_finished", || {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "consumer") }?;
        if req_len.is_null() {
            return Err(null("req_len"));
        }
        let Some(s) = c.inner.take_finished_one(|s| s.request.len() <= cap) else {
            return Err(fail(
                kvx_status::KVX_NOT_FOUND,
                "nothing finished (or the buffer is too small)",
            ));
        };
        // SAFETY: as above; the predicate checked the capacity.
        unsafe { put(s.request.as_bytes(), req_buf.cast(), cap, req_len) }?;
        // SAFETY: stats NULL or valid.
        if let Some(o) = unsafe { stats.as_mut() } {
            *o = kvx_request_stats {
                bytes_moved: s.bytes_moved,
                bytes_skipped: s.bytes_skipped,
                descriptors: s.descriptors,
                post_ns: s.post_time.as_nanos() as u64,
                transfer_ns: s.transfer_time.as_nanos() as u64,
                handoff_ns: s.handoff_time.as_nanos() as u64,
            };
        }
        Ok(())
    })
}

/// Takes the next failed load: its name, the invalid local blocks, and the error in the last
/// error message; returns `KVX_OK` when one was taken, `KVX_NOT_FOUND` if none.
///
/// # Safety
/// `c` live; buffers valid for their capacities; outputs valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_next_failed(
    c: *const kvx_consumer,
    req_buf: *mut c_char,
    cap: usize,
    req_len: *mut usize,
    blocks: *mut u32,
    blocks_cap: usize,
    nblocks: *mut usize,
) -> kvx_status {
    guard("kvx_consumer_next_failed", || {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "consumer") }?;
        if req_len.is_null() || nblocks.is_null() {
            return Err(null("req_len or nblocks"));
        }
        let Some(f) = c
            .inner
            .take_failed_one(|f| f.request.len() <= cap && f.invalid_blocks.len() <= blocks_cap)
        else {
            return Err(fail(
                kvx_status::KVX_NOT_FOUND,
                "nothing failed (or buffers too small)",
            ));
        };
        // SAFETY: as above; the predicate checked the capacities.
        unsafe {
            put(f.request.as_bytes(), req_buf.cast(), cap, req_len)?;
            if !f.invalid_blocks.is_empty() {
                if blocks.is_null() {
                    return Err(null("blocks"));
                }
                std::ptr::copy_nonoverlapping(
                    f.invalid_blocks.as_ptr(),
                    blocks,
                    f.invalid_blocks.len(),
                );
            }
            *nblocks = f.invalid_blocks.len();
        }
        set_error(format!("load of {:?} failed: {}", f.request, f.error));
        Ok(())
    })
}

/// Prometheus text of the consumer's (or producer's, with `kvx_producer_metrics`) telemetry.
///
/// # Safety
/// `c` live; `buf` valid for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_metrics(
    c: *const kvx_consumer,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_consumer_metrics", || {
        // SAFETY: per this function's contract.
        let c = unsafe { handle(c, "consumer") }?;
        let t = c.inner.telemetry().prometheus();
        // SAFETY: as above.
        unsafe { put(t.as_bytes(), buf.cast(), cap, out_len) }
    })
}

/// How device memory moves between `a` and the peer named `peer` (after their metadata was
/// exchanged).
///
/// # Safety
/// `a` live; `peer` NUL-terminated; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_peer_gpu_path(
    a: *const kvx_agent,
    peer: *const c_char,
    out: *mut kvx_gpu_path,
) -> kvx_status {
    guard("kvx_agent_peer_gpu_path", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        // SAFETY: as above.
        let peer = unsafe { cstr(peer, "peer") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let p = match a.inner.peer_info(peer)?.gpu_path {
            None => kvx_gpu_path::KVX_GPU_NONE,
            Some(kvxfer_core::GpuPath::Staged) => kvx_gpu_path::KVX_GPU_STAGED,
            Some(_) => kvx_gpu_path::KVX_GPU_DIRECT,
        };
        // SAFETY: out non-NULL, valid per the contract.
        unsafe { *out = p };
        Ok(())
    })
}

/// Prometheus text of the agent's memory: budget, device staging chunks, dropped
/// notifications.
///
/// # Safety
/// `a` live; `buf` valid for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_metrics(
    a: *const kvx_agent,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_metrics", || {
        // SAFETY: per this function's contract.
        let a = unsafe { handle(a, "agent") }?;
        let t = a.inner.prometheus();
        // SAFETY: as above.
        unsafe { put(t.as_bytes(), buf.cast(), cap, out_len) }
    })
}

/// Prometheus text of the producer's telemetry.
///
/// # Safety
/// `p` live; `buf` valid for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_metrics(
    p: *const kvx_producer,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_producer_metrics", || {
        // SAFETY: per this function's contract.
        let p = unsafe { handle(p, "producer") }?;
        let t = p.inner.telemetry().prometheus();
        // SAFETY: as above.
        unsafe { put(t.as_bytes(), buf.cast(), cap, out_len) }
    })
}
