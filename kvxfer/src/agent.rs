//! The agent: one per worker process (or GPU rank). Owns a UCX context and worker, driven by
//! one progress thread (the only thread that touches UCX); registered memory; the table of
//! known peers; notifications.
//!
//! Order of calls: [`Agent::new`] → [`Agent::register`] → exchange metadata
//! ([`Agent::listen`] / [`Agent::connect`], or [`Agent::metadata`] /
//! [`Agent::load_remote_metadata`]) → [`Agent::prep_local`] / [`Agent::prep_remote`] once →
//! [`Agent::transfer`] many times → [`Agent::deregister`] → drop.

use std::collections::HashMap;
use std::ffi::CString;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::ucx::driver::{self, Cmd, Job, WorkerWaker};
use crate::backend::ucx::raw;
use crate::descriptor::{self, Desc, RegionId, RegionSpan, Resolved};
use crate::error::{Error, Result, Side};
use crate::memory::{MemKind, Memory, Region, RegionInner};
use crate::metadata::Metadata;
use crate::notify::{Inbox, Notification};
use crate::transfer::{Transfer, XferOp, XferState};

/// Which UCX transports an agent may use. Names map to `UCX_TLS`; RDMA (`rc`, `ud`, `dc`) and
/// CUDA (`cuda_copy`, `cuda_ipc`) go through [`Transport::Custom`] with the same code path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// TCP sockets only.
    Tcp,
    /// Shared memory inside one host: posix / sysv / cma (UCX's `sm`).
    Shm,
    /// Whatever UCX finds best.
    Auto,
    /// A `UCX_TLS` value, e.g. `"rc,sm"`.
    Custom(String),
}

impl Transport {
    /// The `UCX_TLS` value.
    pub fn ucx_tls(&self) -> String {
        match self {
            Transport::Tcp => "tcp".into(),
            Transport::Shm => "sm".into(),
            Transport::Auto => "all".into(),
            Transport::Custom(s) => s.clone(),
        }
    }

    /// Parses `tcp`, `shm`, `auto`, or any other string as a `UCX_TLS` list.
    pub fn parse(s: &str) -> Transport {
        match s {
            "tcp" => Transport::Tcp,
            "shm" | "sm" => Transport::Shm,
            "auto" | "all" => Transport::Auto,
            other => Transport::Custom(other.to_string()),
        }
    }
}

/// How device (GPU) memory moves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GpuPath {
    /// Direct where the loaded UCX has CUDA transports (`cuda_copy`/`cuda_ipc`, and GPUDirect
    /// RDMA where the NIC allows), staged otherwise.
    #[default]
    Auto,
    /// UCX moves device memory itself; registration fails if it cannot.
    Direct,
    /// Device memory moves through bounded pinned host chunks over kvxfer's TCP lane, each end
    /// copying its own device memory on a copy queue (a CUDA stream).
    Staged,
}

impl GpuPath {
    /// Parses `auto`, `direct` or `staged`.
    pub fn parse(s: &str) -> Option<GpuPath> {
        match s {
            "auto" => Some(GpuPath::Auto),
            "direct" => Some(GpuPath::Direct),
            "staged" => Some(GpuPath::Staged),
            _ => None,
        }
    }
}

impl std::fmt::Display for GpuPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuPath::Auto => "auto",
            GpuPath::Direct => "direct",
            GpuPath::Staged => "staged",
        })
    }
}

/// Configuration of an [`Agent`].
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Unique name among the agents that talk to each other.
    pub name: String,
    /// Transports UCX may use.
    pub transport: Transport,
    /// `UCX_NET_DEVICES` (e.g. `"lo"`, `"eth0"`); `None` leaves UCX's default.
    pub net_devices: Option<String>,
    /// Compatibility hash peers must share (the connector derives it from the KV layout).
    pub compat: u64,
    /// Spin on `ucp_worker_progress` instead of sleeping on the worker's event fd.
    pub busy_poll: bool,
    /// Split operations longer than this (0: never).
    pub max_op_bytes: u64,
    /// Extra UCX settings (names without the `UCX_` prefix), applied last.
    pub ucx: Vec<(String, String)>,
    /// UCX peer-failure detection (`UCP_ERR_HANDLING_MODE_PEER`). UCX then refuses transports
    /// that cannot detect a dead peer, which in UCX 1.13-1.22 excludes every shared-memory
    /// transport (RMA falls back to emulation over TCP). Default (`None`): on, except for
    /// [`Transport::Shm`]. A [`Transport::Custom`] list of shared-memory transports only
    /// (e.g. `"posix,cma"`) must set `Some(false)` itself, or UCX finds no usable lane.
    pub peer_failure: Option<bool>,
    /// kvxfer's own lanes next to UCX (see [`crate::lane`]): mapped shared memory towards a
    /// peer on the same host with [`Transport::Shm`] and [`Transport::Auto`], and a zero-copy
    /// TCP stream with [`Transport::Tcp`]. On by default; off forces every byte through UCX.
    pub lanes: bool,
    /// Threads that copy for the shared-memory lane (default: up to 4, one per core).
    pub copy_threads: usize,
    /// Address the TCP lane listens on and advertises. Default: 127.0.0.1 with
    /// [`Transport::Shm`] (every peer is on this host); otherwise the first IPv4 address of
    /// the first of `net_devices`, else of the first interface that is up and not loopback,
    /// else 127.0.0.1.
    pub lane_addr: Option<std::net::IpAddr>,
    /// Memory the agent may allocate for itself (stream-lane request buffers, on both ends);
    /// share it with the connector's to bound a worker as a whole. Default: unlimited.
    pub budget: crate::MemoryBudget,
    /// A shared secret for the side channel: both ends must hold it, and prove it before any
    /// metadata moves (HMAC-SHA256 challenge-response). `None`: open.
    pub secret: Option<Vec<u8>>,
    /// Strict transport: a peer connection whose UCX transports or kvxfer lane do not match
    /// [`AgentConfig::transport`] fails with [`Error::TransportMismatch`] instead of falling
    /// back silently (for example to TCP when shared memory was asked for).
    pub strict: bool,
    /// How device memory moves (forced or chosen per registration, see [`GpuPath`]).
    pub gpu_path: GpuPath,
    /// The device copy engine. Default: CUDA with the `cuda` feature, none without.
    /// [`crate::staging::SimulatedDevice`] stands in for a GPU on machines without one.
    pub copy_engine: Option<Arc<dyn crate::staging::CopyEngine>>,
    /// Staging for device memory on the staged path: chunk count (half for transfers this
    /// agent starts, half for its peers') and chunk size. Allocated once, at the first
    /// device registration that needs it, from [`AgentConfig::budget`].
    pub staging: (usize, usize),
}

impl AgentConfig {
    /// Defaults for an agent named `name`: any transport, event-driven progress.
    pub fn new(name: impl Into<String>) -> Self {
        AgentConfig {
            name: name.into(),
            transport: Transport::Auto,
            net_devices: None,
            compat: crate::DEFAULT_COMPAT,
            busy_poll: false,
            max_op_bytes: 0,
            ucx: Vec::new(),
            peer_failure: None,
            lanes: true,
            copy_threads: std::thread::available_parallelism()
                .map(|n| n.get().min(4))
                .unwrap_or(2),
            lane_addr: None,
            budget: crate::MemoryBudget::unlimited(),
            secret: None,
            strict: false,
            gpu_path: GpuPath::Auto,
            copy_engine: None,
            staging: (
                crate::staging::DEFAULT_STAGING_CHUNKS,
                crate::staging::DEFAULT_STAGING_CHUNK_BYTES,
            ),
        }
    }

    /// Requires peers to prove a shared secret on the side channel.
    pub fn secret(mut self, s: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(s.into());
        self
    }

    /// Strict transport mode.
    pub fn strict(mut self, on: bool) -> Self {
        self.strict = on;
        self
    }

    /// UCX peer-failure detection: `Some(on)` forces it, `None` picks the default (see
    /// [`AgentConfig::peer_failure`]).
    pub fn peer_failure(mut self, on: Option<bool>) -> Self {
        self.peer_failure = on;
        self
    }

    /// Forces or frees the path of device memory.
    pub fn gpu_path(mut self, p: GpuPath) -> Self {
        self.gpu_path = p;
        self
    }

    /// Sets the device copy engine.
    pub fn copy_engine(mut self, e: Arc<dyn crate::staging::CopyEngine>) -> Self {
        self.copy_engine = Some(e);
        self
    }

    /// Sets the device staging: `chunks` chunks of `chunk_bytes`.
    pub fn staging(mut self, chunks: usize, chunk_bytes: usize) -> Self {
        self.staging = (chunks, chunk_bytes);
        self
    }

    /// Sets the memory budget.
    pub fn budget(mut self, b: crate::MemoryBudget) -> Self {
        self.budget = b;
        self
    }

    /// Turns kvxfer's own lanes on or off (off: UCX moves every byte).
    pub fn lanes(mut self, on: bool) -> Self {
        self.lanes = on;
        self
    }

    /// Sets the address of the TCP lane.
    pub fn lane_addr(mut self, ip: std::net::IpAddr) -> Self {
        self.lane_addr = Some(ip);
        self
    }

    /// Sets the transport.
    pub fn transport(mut self, t: Transport) -> Self {
        self.transport = t;
        self
    }

    /// Sets `UCX_NET_DEVICES`.
    pub fn net_devices(mut self, d: impl Into<String>) -> Self {
        self.net_devices = Some(d.into());
        self
    }

    /// Sets the compatibility hash.
    pub fn compat(mut self, h: u64) -> Self {
        self.compat = h;
        self
    }

    /// Busy-polls for the lowest latency (one core spins).
    pub fn busy_poll(mut self, on: bool) -> Self {
        self.busy_poll = on;
        self
    }

    /// Adds a UCX setting.
    pub fn ucx_setting(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.ucx.push((k.into(), v.into()));
        self
    }

    fn ucx_settings(&self) -> Vec<(String, String)> {
        let mut v = vec![("TLS".to_string(), self.transport.ucx_tls())];
        // kvxfer registers its regions explicitly; UCX's registration cache only serves
        // implicit registrations, and its default limits are infinite (memory grows with
        // every buffer UCX ever saw). Bounded here; `AgentConfig::ucx` overrides.
        let ib = match &self.transport {
            Transport::Auto => true,
            Transport::Custom(l) => ["rc", "ud", "dc", "ib", "all"]
                .iter()
                .any(|t| l.split(',').any(|x| x.trim().starts_with(t))),
            Transport::Tcp | Transport::Shm => false,
        };
        if ib {
            // Only where IB transports may be used: UCX warns about settings no transport
            // of the context consumed.
            v.push(("?IB_RCACHE_MAX_SIZE".into(), "4G".into()));
            v.push(("?IB_RCACHE_MAX_REGIONS".into(), "65536".into()));
        }
        if let Some(d) = &self.net_devices {
            v.push(("NET_DEVICES".into(), d.clone()));
        }
        v.extend(self.ucx.iter().cloned());
        v
    }
}

/// A peer's region table as the caller side sees it, for bounds checks without a round trip.
#[derive(Debug)]
pub(crate) struct PeerView {
    pub(crate) token: u64,
    pub(crate) spans: Vec<RegionSpan>,
    pub(crate) lanes: crate::lane::PeerLanes,
    /// Per region slot: device memory UCX cannot reach (no remote key; staged path).
    pub(crate) unmapped: Vec<bool>,
    /// Checksum of the metadata the view was built from.
    pub(crate) meta_sum: u64,
}

/// What the agent knows about a peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// The peer's name.
    pub name: String,
    /// Regions in its table.
    pub regions: usize,
    /// Transports UCX selected for the connection (empty before the first connection).
    pub transports: String,
    /// Why the connection last failed, if it did.
    pub failed: Option<String>,
    /// How device memory moves between the two agents: `None` where neither has device
    /// memory registered, [`GpuPath::Direct`] where UCX reaches all of it, else
    /// [`GpuPath::Staged`].
    pub gpu_path: Option<GpuPath>,
}

pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) compat: u64,
    pub(crate) max_op: u64,
    tx: mpsc::Sender<Cmd>,
    pub(crate) waker: WorkerWaker,
    pub(crate) queued: Arc<AtomicUsize>,
    pub(crate) regions: RwLock<HashMap<u32, Arc<RegionInner>>>,
    pub(crate) peers: RwLock<HashMap<String, Arc<PeerView>>>,
    pub(crate) inbox: Inbox,
    /// Connector control messages to this agent's producer and to its consumer, kept apart
    /// from the user's notifications.
    pub(crate) control_p: Inbox,
    pub(crate) control_c: Inbox,
    next_region: AtomicU32,
    next_xfer: AtomicU64,
    pub(crate) ucx_version: String,
    pub(crate) host: Option<crate::metadata::HostInfo>,
    pub(crate) lane: std::sync::OnceLock<crate::metadata::LaneInfo>,
    pub(crate) transport: Transport,
    lanes_on: bool,
    copier: crate::lane::shm::Copier,
    /// Serializes metadata loads, so that concurrent loads of one peer map its memory once.
    load_lock: std::sync::Mutex<()>,
    pub(crate) budget: crate::MemoryBudget,
    pub(crate) secret: Option<Vec<u8>>,
    gpu_path: GpuPath,
    pub(crate) staging: Arc<crate::staging::StagingCell>,
}

impl Shared {
    pub(crate) fn send(&self, c: Cmd) -> Result<()> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.tx.send(c).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Shutdown);
        }
        self.waker.wake();
        Ok(())
    }

    pub(crate) fn call<T>(&self, f: impl FnOnce(mpsc::SyncSender<Result<T>>) -> Cmd) -> Result<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(f(tx))?;
        rx.recv().map_err(|_| Error::Shutdown)?
    }

    /// Queues a received notification: connector control messages to their own queue.
    pub(crate) fn deliver(&self, n: Notification) {
        if n.payload.starts_with(crate::connector::TAG_TO_PRODUCER) {
            self.control_p.push(n);
        } else if n.payload.starts_with(crate::connector::TAG_TO_CONSUMER) {
            self.control_c.push(n);
        } else {
            self.inbox.push(n);
        }
    }

    pub(crate) fn post(&self, job: Job) -> Result<()> {
        self.send(Cmd::Post(Box::new(job)))
    }

    pub(crate) fn cancel(&self, id: u64) {
        let _ = self.send(Cmd::Cancel { id });
    }
}

/// One kvxfer agent. See the module docs for the order of calls.
pub struct Agent {
    pub(crate) shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    strict: bool,
    listeners: std::sync::Mutex<Vec<crate::discovery::Listener>>,
    lane_server: Option<crate::lane::tcp::Server>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.shared.name)
            .field("ucx", &self.shared.ucx_version)
            .finish()
    }
}

impl Agent {
    /// Creates the UCX context and worker and starts the progress thread.
    pub fn new(cfg: AgentConfig) -> Result<Agent> {
        if cfg.name.is_empty()
            || cfg.name.len() > crate::metadata::MAX_NAME
            || cfg.name.chars().any(char::is_control)
        {
            return Err(Error::InvalidArgument(format!(
                "agent name {:?}: 1..={} printable characters",
                cfg.name,
                crate::metadata::MAX_NAME
            )));
        }
        let cname = CString::new(cfg.name.clone())
            .map_err(|_| Error::InvalidArgument("agent name contains NUL".into()))?;
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let (engine, waker) = driver::Engine::new(
            &cfg.ucx_settings(),
            &cname,
            cfg.busy_poll,
            cfg.peer_failure.unwrap_or(cfg.transport != Transport::Shm),
            rx,
            queued.clone(),
        )?;
        let shared = Arc::new(Shared {
            name: cfg.name.clone(),
            compat: cfg.compat,
            max_op: cfg.max_op_bytes,
            tx,
            waker,
            queued,
            regions: RwLock::new(HashMap::new()),
            peers: RwLock::new(HashMap::new()),
            inbox: Inbox::default(),
            control_p: Inbox::default(),
            control_c: Inbox::default(),
            next_region: AtomicU32::new(0),
            next_xfer: AtomicU64::new(1),
            ucx_version: raw::version_string(),
            host: crate::lane::host_info(),
            lane: std::sync::OnceLock::new(),
            transport: cfg.transport.clone(),
            lanes_on: cfg.lanes,
            copier: crate::lane::shm::Copier::start(&cfg.name, cfg.copy_threads)?,
            load_lock: std::sync::Mutex::new(()),
            budget: cfg.budget.clone(),
            secret: cfg.secret.clone(),
            gpu_path: cfg.gpu_path,
            staging: Arc::new(crate::staging::StagingCell::new(
                cfg.copy_engine.clone(),
                cfg.staging.0,
                cfg.staging.1,
                cfg.budget.clone(),
            )),
        });
        // The TCP lane carries every transfer with the TCP transport, and staged device memory
        // with any transport, in either direction: every agent with lanes on serves it, so that
        // a GPU peer can stage into a CPU-only one. With the shared-memory transport every peer
        // is on this host: loopback.
        let lane_server = if cfg.lanes {
            let ip = cfg
                .lane_addr
                .or_else(|| {
                    if cfg.transport == Transport::Shm {
                        Some(std::net::Ipv4Addr::LOCALHOST.into())
                    } else {
                        crate::lane::iface_addr(cfg.net_devices.as_deref())
                    }
                })
                .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
            let srv = crate::lane::tcp::Server::start(ip, Arc::downgrade(&shared), &cfg.name)?;
            let _ = shared.lane.set(srv.info());
            Some(srv)
        } else {
            None
        };
        let weak = Arc::downgrade(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-progress-{}", cfg.name))
            .spawn(move || engine.run(weak))
            .map_err(|e| Error::io("spawning the progress thread", e))?;
        Ok(Agent {
            shared,
            thread: Some(thread),
            strict: cfg.strict,
            listeners: std::sync::Mutex::new(Vec::new()),
            lane_server,
        })
    }

    /// The memory budget the agent charges its own buffers to.
    pub fn budget(&self) -> &crate::MemoryBudget {
        &self.shared.budget
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The UCX library version loaded at run time.
    pub fn ucx_version(&self) -> &str {
        &self.shared.ucx_version
    }

    /// The UCX version kvxfer was built against.
    pub fn ucx_build_version() -> &'static str {
        raw::BUILD_VERSION
    }

    /// Registers owned memory (page-aligned buffers, memory maps, and with the `cuda` feature
    /// cudarc device buffers); the agent keeps it alive.
    pub fn register(&self, mem: impl Into<Memory>) -> Result<Region> {
        let mut mem = mem.into();
        let (p, len) = mem.raw_parts();
        let kind = mem.kind();
        self.register_inner(p, len, kind, Some(mem))
    }

    /// Registers memory the agent does not own, such as an engine's KV cache tensor.
    ///
    /// # Safety
    /// 1. `[ptr, ptr+len)` is memory of kind `kind`, valid for reads and writes by this process
    ///    and by peers' transfers, until [`deregister`](Self::deregister) returns `Ok` or the
    ///    agent is dropped, whichever comes first.
    /// 2. The caller does not free or remap it before then.
    pub unsafe fn register_raw(&self, ptr: *mut u8, len: usize, kind: MemKind) -> Result<Region> {
        if ptr.is_null() {
            return Err(Error::InvalidArgument("register_raw: NULL pointer".into()));
        }
        self.register_inner(ptr, len, kind, None)
    }

    fn register_inner(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemKind,
        backing: Option<Memory>,
    ) -> Result<Region> {
        if len == 0 {
            return Err(Error::InvalidArgument("registering 0 bytes".into()));
        }
        let ucx_mapped = match kind {
            MemKind::Host => true,
            MemKind::Cuda(d) => self.device_path(d)? == GpuPath::Direct,
        };
        let id = RegionId(self.shared.next_region.fetch_add(1, Ordering::Relaxed));
        let shm = backing.as_ref().and_then(Memory::shm_handle);
        let inner = Arc::new(RegionInner {
            shm,
            id,
            addr: ptr as u64,
            len: len as u64,
            kind,
            ucx_mapped,
            _backing: backing,
            inflight: AtomicU32::new(0),
            registered: AtomicBool::new(false),
        });
        self.shared.call(|reply| Cmd::Register {
            region: inner.clone(),
            reply,
        })?;
        Ok(Region { inner })
    }

    /// The path device memory of `device` takes here ([`GpuPath::Direct`] or
    /// [`GpuPath::Staged`]); a typed error where it can take none.
    fn device_path(&self, device: u32) -> Result<GpuPath> {
        let engine = self.shared.staging.engine(device)?;
        engine.check_device(device)?;
        let path = choose_gpu_path(
            self.shared.gpu_path,
            engine.ucx_visible().then_some(engine.name()),
            raw::supports_cuda(driver::MEMORY_TYPES.load(Ordering::Relaxed)),
            &self.shared.transport,
            &self.shared.ucx_version,
        )
        .map_err(|why| Error::Cuda { device, why })?;
        if path == GpuPath::Staged {
            if self.shared.lane.get().is_none() {
                return Err(Error::Cuda {
                    device,
                    why: "the staged path moves device memory over kvxfer's TCP lane, which is \
                          off (AgentConfig::lanes(false))"
                        .into(),
                });
            }
            // The staging chunks: allocated now, from the budget, or the registration fails.
            self.shared.staging.pools(device)?;
        }
        Ok(path)
    }

    /// The agent's memory in Prometheus text format: its budget (limit, used, peak, waits),
    /// the device staging chunks (bytes, in use, peaks, waits) once allocated, and dropped
    /// notifications. Labelled with the agent's name.
    pub fn prometheus(&self) -> String {
        use std::fmt::Write;
        let n = self.shared.name.replace(['\\', '"', '\n'], "_");
        let b = &self.shared.budget;
        let mut o = String::new();
        let mut gauge = |name: &str, help: &str, kind: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}");
            let _ = writeln!(o, "# TYPE {name} {kind}");
            let _ = writeln!(o, "{name}{{agent=\"{n}\"}} {v}");
        };
        if b.limit() != u64::MAX {
            gauge(
                "kvxfer_budget_limit_bytes",
                "Memory the agent may allocate.",
                "gauge",
                b.limit(),
            );
        }
        gauge(
            "kvxfer_budget_used_bytes",
            "Memory charged now.",
            "gauge",
            b.used(),
        );
        gauge(
            "kvxfer_budget_peak_bytes",
            "Most memory charged at once.",
            "gauge",
            b.peak(),
        );
        gauge(
            "kvxfer_budget_waits_total",
            "Charges that waited for memory (backpressure).",
            "counter",
            b.waits(),
        );
        gauge(
            "kvxfer_notifications_dropped_total",
            "Notifications dropped on a full queue.",
            "counter",
            self.shared.inbox.dropped(),
        );
        if let Some(st) = self.staging_stats() {
            gauge(
                "kvxfer_staging_bytes",
                "Pinned host chunks for device memory (allocated once).",
                "gauge",
                st.bytes,
            );
            gauge(
                "kvxfer_staging_chunks_in_use",
                "Staging chunks held by transfers now.",
                "gauge",
                st.in_use as u64,
            );
            gauge(
                "kvxfer_staging_chunks_peak",
                "Most staging chunks held at once (either pool).",
                "gauge",
                st.peak_initiator.max(st.peak_target) as u64,
            );
            gauge(
                "kvxfer_staging_waits_total",
                "Transfers that waited for staging chunks.",
                "counter",
                st.waits,
            );
        }
        o
    }

    /// Counters of the device staging chunks, once allocated.
    pub fn staging_stats(&self) -> Option<crate::staging::StagingStats> {
        self.shared.staging.existing().map(|s| s.stats())
    }

    /// Deregisters a region. Fails with [`Error::Busy`] while a transfer uses it.
    pub fn deregister(&self, region: &Region) -> Result<()> {
        self.shared.call(|reply| Cmd::Deregister {
            region: region.inner.clone(),
            reply,
        })
    }

    /// This agent's metadata, encoded for a peer.
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.shared.call(|reply| Cmd::Metadata { reply })
    }

    /// Loads a peer's metadata (from any channel). Returns the peer's name. Metadata of a
    /// known name replaces the old (a restarted peer): lists prepared against the old one
    /// become stale, its connection and keys are dropped once transfers on them finish.
    pub fn load_remote_metadata(&self, bytes: &[u8]) -> Result<String> {
        let meta = Metadata::decode(bytes, self.shared.compat).map_err(|err| Error::Metadata {
            source_desc: Metadata::peek_name(bytes)
                .map(|n| format!("agent {n:?}"))
                .unwrap_or_else(|| "buffer".into()),
            err,
        })?;
        load_decoded(&self.shared, meta)
    }

    /// Forgets a peer: its connection is closed once its transfers finish.
    pub fn remove_peer(&self, name: &str) -> Result<()> {
        self.shared.call(|reply| Cmd::RemovePeer {
            name: name.to_string(),
            reply,
        })
    }

    /// What the agent knows about a peer, including the transports UCX selected. Connects if
    /// not connected yet.
    pub fn peer_info(&self, name: &str) -> Result<PeerInfo> {
        let mut info = self.shared.call(|reply| Cmd::PeerInfo {
            name: name.to_string(),
            reply,
        })?;
        let mut device = false;
        let mut staged = false;
        for r in self
            .shared
            .regions
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            if r.kind != MemKind::Host {
                device = true;
                staged |= !r.ucx_mapped;
            }
        }
        if let Some(v) = self
            .shared
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
        {
            for (s, &u) in v.spans.iter().zip(&v.unmapped) {
                if s.kind != MemKind::Host {
                    device = true;
                    staged |= u;
                }
            }
        }
        info.gpu_path = device.then_some(if staged {
            GpuPath::Staged
        } else {
            GpuPath::Direct
        });
        Ok(info)
    }

    /// Listens for peers on `addr` (port 0 picks one): each peer that connects sends its
    /// metadata and receives ours. Returns the bound address.
    pub fn listen(&self, addr: SocketAddr) -> Result<SocketAddr> {
        let l = crate::discovery::Listener::start(self.shared.clone(), addr)?;
        let a = l.addr();
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(l);
        Ok(a)
    }

    /// Connects to a peer's side channel, exchanges metadata both ways. Returns its name.
    pub fn connect(&self, addr: SocketAddr) -> Result<String> {
        crate::discovery::exchange(&self.shared, addr, Duration::from_secs(10))
    }

    /// Resolves a list of local descriptors once, for reuse by index.
    pub fn prep_local(&self, descs: &[Desc]) -> Result<PreparedLocal> {
        let regions = self
            .shared
            .regions
            .read()
            .unwrap_or_else(|e| e.into_inner());
        let mut table: Vec<Arc<RegionInner>> = Vec::new();
        let mut spans: Vec<RegionSpan> = Vec::new();
        // Only the regions the list names go into the prepared table.
        for (index, d) in descs.iter().enumerate() {
            if spans.iter().any(|s| s.id == d.region) {
                continue;
            }
            let r = regions.get(&d.region.0).ok_or(Error::UnknownRegion {
                side: Side::Local,
                index,
                region: d.region.0,
            })?;
            spans.push(RegionSpan {
                id: r.id,
                base: r.addr,
                len: r.len,
                kind: r.kind,
            });
            table.push(r.clone());
        }
        drop(regions);
        let entries = descriptor::resolve(Side::Local, descs, &spans)?;
        Ok(PreparedLocal {
            entries,
            regions: table,
        })
    }

    /// Resolves a list of the peer's descriptors once, checking each against the peer's
    /// region table, for reuse by index.
    pub fn prep_remote(&self, peer: &str, descs: &[Desc]) -> Result<PreparedRemote> {
        let view = self
            .shared
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(peer)
            .cloned()
            .ok_or_else(|| Error::UnknownPeer {
                agent: peer.to_string(),
            })?;
        let entries = descriptor::resolve(Side::Remote, descs, &view.spans)?;
        Ok(PreparedRemote {
            peer: peer.to_string(),
            token: view.token,
            entries,
        })
    }

    /// Starts a transfer of the descriptor pairs `(local[li[k]], remote[ri[k]])`; with
    /// `notification`, the peer receives it after all the data has landed. With `deadline`, a
    /// transfer not done in time fails with [`Error::Deadline`] (its endpoint is torn down).
    // The argument list mirrors NIXL's makeXferReq: two prepared lists, two index selections.
    #[allow(clippy::too_many_arguments)]
    pub fn transfer(
        &self,
        op: XferOp,
        local: &PreparedLocal,
        li: &[usize],
        remote: &PreparedRemote,
        ri: &[usize],
        notification: Option<&[u8]>,
        deadline: Option<Duration>,
    ) -> Result<Transfer> {
        let t0 = Instant::now();
        if let Some(n) = notification {
            if n.len() > crate::notify::MAX_NOTIFICATION {
                return Err(Error::InvalidArgument(format!(
                    "notification of {} bytes, limit {}",
                    n.len(),
                    crate::notify::MAX_NOTIFICATION
                )));
            }
        }
        let plan = descriptor::plan(&local.entries, li, &remote.entries, ri, self.shared.max_op)?;
        let view = self
            .shared
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&remote.peer)
            .filter(|v| v.token == remote.token)
            .cloned();
        // Device memory: UCX where it reaches every device region of the plan (direct path),
        // else the TCP lane, each end staging its own device memory; never the shm lane.
        // One pass over the plan, only where either side has device memory.
        let mut local_dev: Vec<Option<u32>> = Vec::new();
        let mut device = false;
        let mut unreachable = false;
        let local_has = local.regions.iter().any(|r| r.kind != MemKind::Host);
        let remote_dev = view
            .as_ref()
            .filter(|v| v.spans.iter().any(|s| s.kind != MemKind::Host));
        if local_has || remote_dev.is_some() {
            for o in &plan.ops {
                let r = &local.regions[o.lslot as usize];
                let d = match r.kind {
                    MemKind::Host => None,
                    MemKind::Cuda(d) => {
                        device = true;
                        unreachable |= !r.ucx_mapped;
                        Some(d)
                    }
                };
                if local_has {
                    local_dev.push(d);
                }
                if let Some(v) = remote_dev {
                    let k = o.rslot as usize;
                    if v.spans[k].kind != MemKind::Host {
                        device = true;
                        unreachable |= v.unmapped[k];
                    }
                }
            }
        }
        let lane = match &view {
            Some(v) if device => {
                if unreachable {
                    match &v.lanes.tcp {
                        Some(l) => Some((None, Some(l.clone()))),
                        None => {
                            return Err(Error::InvalidArgument(format!(
                                "the transfer touches staged device memory, which moves over \
                                 kvxfer's TCP lane, and {:?} has none (lanes off on either side)",
                                remote.peer
                            )))
                        }
                    }
                } else {
                    None
                }
            }
            Some(v) => match (&v.lanes.shm, &v.lanes.tcp) {
                (Some(m), _) if m.covers(&plan) => Some((Some(m.clone()), None)),
                (_, Some(l)) if self.shared.transport == Transport::Tcp => {
                    Some((None, Some(l.clone())))
                }
                _ => None,
            },
            None => None,
        };
        if self.strict && lane.is_none() {
            self.check_strict(&remote.peer)?;
        }
        // Pin the local regions the plan uses: deregistering them now fails with Busy.
        let mut used = vec![false; local.regions.len()];
        for o in &plan.ops {
            used[o.lslot as usize] = true;
        }
        let regions: Vec<Arc<RegionInner>> = local
            .regions
            .iter()
            .zip(&used)
            .filter(|(_, &u)| u)
            .map(|(r, _)| r.clone())
            .collect();
        for r in &regions {
            r.inflight.fetch_add(1, Ordering::AcqRel);
        }
        for r in &regions {
            // Pairs with deregister (clear `registered`, then check `inflight`).
            if !r.registered.load(Ordering::SeqCst) {
                for r in &regions {
                    r.inflight.fetch_sub(1, Ordering::AcqRel);
                }
                return Err(Error::Deregistered { region: r.id.0 });
            }
        }
        let id = self.shared.next_xfer.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(XferState::default());
        let job = Job {
            id,
            op,
            peer: remote.peer.clone(),
            token: remote.token,
            plan,
            regions,
            notification: notification.map(|n| crate::notify::encode(&self.shared.name, n)),
            deadline,
            started: t0,
            state: state.clone(),
            lane_stats: None,
            local_dev,
        };
        match lane {
            Some((Some(maps), _)) => {
                self.shared.copier.submit(job, maps, self.shared.clone());
            }
            Some((None, Some(link))) => link.submit(job),
            // On error the job was dropped with the channel; the engine never saw it.
            _ => self.shared.send(Cmd::Post(Box::new(job)))?,
        }
        Ok(Transfer {
            state,
            id,
            agent: self.shared.clone(),
        })
    }

    /// Strict mode, for a transfer UCX carries: the transports UCX selected for `peer` must be
    /// the kind asked for.
    fn check_strict(&self, peer: &str) -> Result<()> {
        let t = &self.shared.transport;
        let shm = ["posix", "sysv", "cma", "xpmem", "knem"];
        let wanted: Vec<String> = match t {
            Transport::Shm => shm.iter().map(|s| s.to_string()).collect(),
            Transport::Custom(list) => {
                let named: Vec<String> = list
                    .split(',')
                    .map(|x| x.trim().to_string())
                    .filter(|x| !x.is_empty() && x != "tcp" && x != "self")
                    .flat_map(|x| {
                        if x == "sm" || x == "shm" {
                            shm.iter().map(|s| s.to_string()).collect::<Vec<_>>()
                        } else {
                            vec![x]
                        }
                    })
                    .collect();
                if named.is_empty() {
                    return Ok(()); // only TCP asked for
                }
                named
            }
            Transport::Tcp | Transport::Auto => return Ok(()),
        };
        let info = self.peer_info(peer)?;
        let got: Vec<&str> = info
            .transports
            .split(',')
            .map(|x| x.trim().trim_end_matches("(rma)"))
            .collect();
        if got
            .iter()
            .any(|g| wanted.iter().any(|w| g.starts_with(w.as_str())))
        {
            return Ok(());
        }
        Err(Error::TransportMismatch {
            agent: peer.to_string(),
            wanted: wanted.join("|"),
            got: if info.transports.is_empty() {
                "nothing (not connected)".into()
            } else {
                info.transports
            },
        })
    }

    /// Convenience: transfers every pair of two prepared lists of equal length.
    pub fn transfer_all(
        &self,
        op: XferOp,
        local: &PreparedLocal,
        remote: &PreparedRemote,
        notification: Option<&[u8]>,
        deadline: Option<Duration>,
    ) -> Result<Transfer> {
        let li: Vec<usize> = (0..local.len()).collect();
        let ri: Vec<usize> = (0..remote.len()).collect();
        self.transfer(op, local, &li, remote, &ri, notification, deadline)
    }

    /// Sends a notification alone (no data) to `peer`, ordered after every transfer to it that
    /// completed before this call.
    pub fn notify(&self, peer: &str, payload: &[u8]) -> Result<Transfer> {
        let local = self.prep_local(&[])?;
        let remote = self.prep_remote(peer, &[])?;
        self.transfer(
            XferOp::Write,
            &local,
            &[],
            &remote,
            &[],
            Some(payload),
            None,
        )
    }

    /// The next notification, if one has arrived.
    pub fn try_notification(&self) -> Option<Notification> {
        self.shared.inbox.try_pop()
    }

    /// Waits up to `timeout` for a notification.
    pub fn wait_notification(&self, timeout: Duration) -> Result<Notification> {
        self.shared.inbox.wait(timeout)
    }

    /// All notifications that have arrived.
    pub fn notifications(&self) -> Vec<Notification> {
        self.shared.inbox.drain()
    }

    /// The next connector control message (crate-internal queue).
    pub(crate) fn wait_control(&self, producer: bool, timeout: Duration) -> Result<Notification> {
        if producer {
            self.shared.control_p.wait(timeout)
        } else {
            self.shared.control_c.wait(timeout)
        }
    }

    pub(crate) fn try_control(&self, producer: bool) -> Option<Notification> {
        if producer {
            self.shared.control_p.try_pop()
        } else {
            self.shared.control_c.try_pop()
        }
    }

    /// Notifications dropped because the queue was full.
    pub fn notifications_dropped(&self) -> u64 {
        self.shared.inbox.dropped()
    }
}

/// The path of device memory: `policy`, the engine's name if UCX can reach its memory at all
/// (CUDA), whether the loaded UCX has CUDA memory support, and whether the transport list
/// lets UCX use its CUDA transports (`Auto` = all, or a custom list naming them; `tcp` and
/// `shm` leave them out).
pub(crate) fn choose_gpu_path(
    policy: GpuPath,
    ucx_visible: Option<&str>,
    ucx_has_cuda: bool,
    transport: &Transport,
    ucx_version: &str,
) -> std::result::Result<GpuPath, String> {
    let tls_cuda = match transport {
        Transport::Auto => true,
        Transport::Custom(l) => l
            .split(',')
            .map(str::trim)
            .any(|x| x.starts_with("cuda") || x == "all" || x == "gdr_copy"),
        Transport::Tcp | Transport::Shm => false,
    };
    let direct_ok = ucx_visible.is_some() && ucx_has_cuda && tls_cuda;
    match policy {
        GpuPath::Staged => Ok(GpuPath::Staged),
        GpuPath::Auto if direct_ok => Ok(GpuPath::Direct),
        GpuPath::Auto => Ok(GpuPath::Staged),
        GpuPath::Direct if direct_ok => Ok(GpuPath::Direct),
        GpuPath::Direct => Err(format!(
            "the direct path was forced, but {}; or use GpuPath::Staged",
            match (ucx_visible, ucx_has_cuda) {
                (None, _) => "UCX cannot reach this engine's device memory".to_string(),
                (Some(_), false) => format!(
                    "UCX {ucx_version} reports no CUDA transports (a build without \
                     cuda_copy/cuda_ipc, such as Debian's, or a CUDA module that did not load: \
                     see `ucx_info -d`); use a CUDA-aware UCX (KVXFER_UCX=wheel)"
                ),
                (Some(_), true) => format!(
                    "the transport {:?} leaves out UCX's CUDA transports: use Transport::Auto \
                     or a list naming cuda_copy / cuda_ipc",
                    transport.ucx_tls()
                ),
            }
        )),
    }
}

pub(crate) fn load_decoded(shared: &Shared, meta: Metadata) -> Result<String> {
    if meta.name == shared.name {
        return Err(Error::InvalidArgument(format!(
            "peer metadata carries this agent's own name {:?}",
            meta.name
        )));
    }
    let name = meta.name.clone();
    let _serial = shared.load_lock.lock().unwrap_or_else(|e| e.into_inner());
    let sum = meta_sum(&meta);
    // The same metadata again (a second handshake): keep the lanes already built, so that a
    // peer's memory is never mapped twice.
    let existing = shared
        .peers
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&name)
        .filter(|v| v.meta_sum == sum)
        .map(|v| crate::lane::PeerLanes {
            shm: v.lanes.shm.clone(),
            tcp: v.lanes.tcp.clone(),
        });
    if let Some(lanes) = existing {
        shared.call(|reply| Cmd::LoadPeer {
            meta,
            lanes,
            sum,
            reply,
        })?;
        return Ok(name);
    }
    let mut lanes = crate::lane::PeerLanes::default();
    // An explicit TCP or UCX transport list is taken at its word; shm and auto map a
    // same-host peer's memory.
    if shared.lanes_on && matches!(shared.transport, Transport::Shm | Transport::Auto) {
        lanes.shm = crate::lane::shm::PeerMaps::open(&meta, shared.host.as_ref()).map(Arc::new);
    }
    // The TCP lane: for every transfer with the TCP transport, and for staged device memory
    // with any transport.
    if shared.lanes_on {
        if let Some(info) = meta.lane {
            let spans = meta.regions.iter().map(|r| r.span()).collect();
            lanes.tcp = Some(Arc::new(crate::lane::tcp::Link::new(
                &shared.name,
                &name,
                info,
                spans,
                shared.budget.clone(),
                shared.staging.clone(),
            )));
        }
    }
    shared.call(|reply| Cmd::LoadPeer {
        meta,
        lanes,
        sum,
        reply,
    })?;
    Ok(name)
}

fn meta_sum(m: &Metadata) -> u64 {
    m.encode().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.lane_server.take();
        self.shared.copier.stop();
        let _ = self.shared.send(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("kvxfer progress thread of {} panicked", self.shared.name);
            }
        }
    }
}

/// Local descriptors resolved once ([`Agent::prep_local`]).
#[derive(Clone)]
pub struct PreparedLocal {
    entries: Vec<Resolved>,
    regions: Vec<Arc<RegionInner>>,
}

impl std::fmt::Debug for PreparedLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedLocal")
            .field("descs", &self.entries.len())
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl PreparedLocal {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A peer's descriptors resolved once ([`Agent::prep_remote`]).
#[derive(Clone, Debug)]
pub struct PreparedRemote {
    peer: String,
    token: u64,
    entries: Vec<Resolved>,
}

impl PreparedRemote {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// The peer.
    pub fn peer(&self) -> &str {
        &self.peer
    }
}

#[cfg(test)]
mod gpu_path_tests {
    use super::*;

    #[test]
    fn the_path_follows_policy_engine_ucx_and_transport() {
        let v = "1.22.0";
        let c = |p, vis, has, t: Transport| choose_gpu_path(p, vis, has, &t, v);
        let cuda = Some("cuda");
        let rdma = || Transport::Custom("rc,cuda_copy,gdr_copy".into());
        use GpuPath::{Auto, Direct, Staged};
        // (policy, UCX-visible engine, UCX has CUDA, transport, path): auto is direct only
        // where UCX can reach the memory, has CUDA, and may use it; staged is always possible
        // here (the lane and pools are checked after).
        let table = [
            (Auto, cuda, true, Transport::Auto, Direct),
            (Auto, cuda, true, rdma(), Direct),
            (Auto, cuda, true, Transport::Tcp, Staged),
            (Auto, cuda, true, Transport::Shm, Staged),
            (Auto, cuda, false, Transport::Auto, Staged),
            (Auto, None, true, Transport::Auto, Staged),
            (Staged, cuda, true, Transport::Auto, Staged),
            (Direct, cuda, true, Transport::Auto, Direct),
        ];
        for (p, vis, has, t, want) in table {
            assert_eq!(
                c(p, vis, has, t.clone()),
                Ok(want),
                "{p} {vis:?} {has} {t:?}"
            );
        }
        // Forced direct: each impossibility names itself.
        let e = c(GpuPath::Direct, cuda, false, Transport::Auto).unwrap_err();
        assert!(
            e.contains("no CUDA transports") && e.contains("1.22.0"),
            "{e}"
        );
        let e = c(GpuPath::Direct, cuda, true, Transport::Tcp).unwrap_err();
        assert!(e.contains("leaves out"), "{e}");
        let e = c(GpuPath::Direct, None, true, Transport::Auto).unwrap_err();
        assert!(e.contains("cannot reach"), "{e}");
    }
}
