//! The agent: one per worker process (or GPU rank). Owns a UCX context and worker, driven by
//! one progress thread (the only thread that touches UCX); registered memory; the table of
//! known peers; notifications.
//!
//! Order of calls: [`Agent::new`] → [`Agent::register`] → exchange metadata
//! ([`Agent::listen`] / [`Agent::connect`], or [`Agent::metadata`] /
//! [`Agent::load_remote_metadata`]) → [`Agent::prep_local`] / [`Agent::prep_remote`] once →
//! [`Agent::transfer`] many times → [`Agent::deregister`] → drop.

mod config;
mod deregister;
mod grants;
mod handle;
mod metrics;
mod paged;
mod peers;
mod prepared;
mod register;
mod route;
mod state;
mod submit;

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

pub use config::{AgentConfig, DEFAULT_COMPAT};
pub use handle::Agent;
use peers::{load_decoded, peer_info, remove_peer, retire_peer};
pub use prepared::{PreparedLocal, PreparedRemote};
pub use register::Share;
use state::AgentState;

use crate::backend::ucx::driver::{Cmd, Engine};
use crate::backend::ucx::raw;
use crate::budget::MemoryBudget;
use crate::codec_meter::CodecMeter;
use crate::discovery::exchange;
use crate::host::host_info;
use crate::lane::api::{LaneCtx, LaneSetup};
use crate::lane::iface_addr;
use crate::listener::Listener;
use crate::memory::{Region, RegionTable};
use crate::notify::{Channels, Inbox};
use crate::side_channel::SideChannel;
use crate::staging::pool::{StagingCell, StagingStats};
use crate::subscriptions::Subscriptions;
use crate::transfer::{Canceller, NoteCarrier, Transfer};
use kvxfer_proto::descriptor::{self, Desc};
use kvxfer_proto::error::{Error, Result, Side};
use kvxfer_proto::grants::GrantTable;
use kvxfer_proto::types::{MemKind, PeerInfo, RegionId, RegionSpan, Transport, XferOp};
use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::notify::{check_payload, Notification};

impl Agent {
    /// Creates the UCX context and worker and starts the progress thread.
    pub fn new(cfg: AgentConfig) -> Result<Agent> {
        cfg.check()?;
        let cname = CString::new(cfg.name.clone())
            .map_err(|_| Error::InvalidArgument("agent name contains NUL".into()))?;
        // Notifications take the TCP lane where UCX cannot be believed (a secret: its active
        // messages name their sender in the payload) or cannot reach (its TCP left out).
        let lane_notes = cfg.lanes.on && (cfg.security.secret.is_some() || cfg.ucx_tcp_off());
        if cfg.may_use("tcp") {
            log::warn!(
                "kvxfer: agent {:?}: UCX's own TCP transport is on (ucx_tcp): it \
                 authenticates nobody, reads or writes any address a message names, and \
                 aborts this process when a peer's connection fails while it serves that \
                 peer's READ; trusted peers and network only (SECURITY.md)",
                cfg.name
            );
        }
        raw::route_log();
        let loaded = raw::version_string();
        if !kvxfer_proto::error::ucx_compatible(raw::BUILD_VERSION, &loaded) {
            return Err(Error::UcxVersion {
                built: raw::BUILD_VERSION.to_string(),
                loaded,
            });
        }
        cfg.check_ucx(&loaded)?;
        let channels = Channels::new(&cfg.budget);
        // Peers' deregistrations reaching this agent over UCX (the UCX fence), answered by a
        // thread of their own: the answer waits for this agent's transfers to the peer.
        let (gone_tx, gone_rx) =
            std::sync::mpsc::sync_channel(crate::backend::ucx::fence_state::MAX_GONE_QUEUED);
        let (engine, cmds) = Engine::new(
            &cfg.ucx.settings(&cfg.transport),
            &cname,
            cfg.ucx.busy_poll,
            cfg.ucx.peer_failure(&cfg.transport),
            !lane_notes,
            channels.clone(),
            gone_tx,
        )
        .map_err(|e| setup_failed(e, &cfg))?;
        // Where a notification goes once a lane or UCX moved the data: UCX's active messages,
        // or with a secret the peer's sealed TCP lane (found through the agent, built below).
        let me: Arc<std::sync::OnceLock<std::sync::Weak<AgentState>>> = Arc::default();
        let notifier: NoteCarrier = {
            let (c, me) = (cmds.clone(), me.clone());
            Arc::new(move |job| {
                if !lane_notes {
                    return c.post(job);
                }
                let st = me
                    .get()
                    .and_then(std::sync::Weak::upgrade)
                    .ok_or(Error::Shutdown)?;
                st.note_lane(&job.peer)?.submit(job);
                Ok(())
            })
        };
        let canceller: Canceller = {
            let c = cmds.clone();
            Arc::new(move |id| c.cancel(id))
        };
        let regions: Arc<RegionTable> = Arc::default();
        let staging = Arc::new(StagingCell::new(
            cfg.staging.copy_engine.clone(),
            cfg.staging.shape,
            cfg.budget.clone(),
        ));
        let codec: Arc<CodecMeter> = Arc::default();
        let grants: Arc<RwLock<GrantTable>> = Arc::default();
        // The lanes' targets see the agent only through this.
        let ctx = Arc::new(LaneCtx {
            regions: regions.clone(),
            channels: channels.clone(),
            staging: staging.clone(),
            budget: cfg.budget.clone(),
            codec: codec.clone(),
            compress_threads: cfg.lanes.tcp.compressing.threads,
            stall: cfg.lanes.tcp.stall,
            secret: cfg.security.secret.clone(),
            seal_data: cfg.security.lane_encryption,
            grants: grants.clone(),
            peer_used: {
                let me = me.clone();
                Arc::new(move |name: &str| {
                    if let Some(st) = me.get().and_then(std::sync::Weak::upgrade) {
                        st.peer_used(name);
                    }
                })
            },
        });
        // The TCP lane carries every transfer with the TCP transport, and staged device memory
        // with any transport, in either direction: every agent with lanes on serves it, so that
        // a GPU peer can stage into a CPU-only one. With the shared-memory transport every peer
        // is on this host: loopback.
        let bind = match cfg.lanes.tcp.addr {
            Some(a) => Some(a),
            None if cfg.transport == Transport::Shm => Some(std::net::Ipv4Addr::LOCALHOST.into()),
            None => lane_bind(&cfg)?,
        }
        .unwrap_or(std::net::Ipv4Addr::LOCALHOST.into());
        let host = host_info();
        let setup = LaneSetup {
            name: cfg.name.clone(),
            transport: cfg.transport.clone(),
            host,
            ctx,
            bind,
            notifier: notifier.clone(),
            config: cfg.lanes.clone(),
        };
        let lanes = crate::lane::start(&setup)?;
        let shared = Arc::new(AgentState {
            name: cfg.name.clone(),
            epoch: new_epoch()?,
            compat: cfg.compat,
            max_op: cfg.ucx.max_op_bytes,
            cmds,
            regions,
            peers: RwLock::new(HashMap::new()),
            channels,
            next_region: AtomicU32::new(0),
            next_xfer: AtomicU64::new(1),
            ucx_version: raw::version_string(),
            host,
            advertised: lanes.iter().filter_map(|l| l.advertise()).collect(),
            transport: cfg.transport.clone(),
            lanes,
            load_lock: Mutex::new(()),
            budget: cfg.budget.clone(),
            secret: cfg.security.secret.clone(),
            gpu_path: cfg.staging.gpu_path,
            staging,
            canceller,
            gone: Mutex::new(HashSet::new()),
            codec,
            handshake: cfg.handshake_timeout,
            deregister_wait: cfg.deregister_wait,
            ucx_tcp_off: cfg.ucx_tcp_off(),
            shm_writes_by_lane: cfg.lanes.on
                && crate::backend::settings::shm_writes_emulated(&loaded),
            lane_notes,
            grant_charges: Mutex::default(),
            subs: Arc::new(Subscriptions::new(cfg.budget.clone())),
            notes: notifier,
            grants,
            peer_limits: cfg.peers,
            peers_evicted: AtomicU64::new(0),
            peers_refused: AtomicU64::new(0),
            clock: Instant::now(),
        });
        let _ = me.set(Arc::downgrade(&shared));
        spawn_gone_answers(&shared, gone_rx)?;
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-progress-{}", cfg.name))
            .spawn(move || engine.run())
            .map_err(|e| Error::io("spawning the progress thread", e))?;
        Ok(Agent {
            shared,
            thread: Some(thread),
            strict: cfg.strict,
            listeners: Mutex::new(Vec::new()),
            _live: crate::live::Counted::agent(),
        })
    }

    /// The memory budget the agent charges its own buffers to.
    pub fn budget(&self) -> &MemoryBudget {
        &self.shared.budget
    }

    /// The agent's memory in Prometheus text format: its budget (limit, used, peak, waits),
    /// the device staging chunks (bytes, in use, peaks, waits) once allocated, and dropped
    /// notifications. Labelled with the agent's name.
    pub fn prometheus(&self) -> String {
        metrics::prometheus(&self.shared)
    }

    /// What the TCP lane's codec did for this agent: frames it compressed (sending) and
    /// decompressed (receiving), their raw and wire bytes and the coding time.
    pub fn codec_totals(&self) -> crate::codec_meter::CodecTotals {
        self.shared.codec.totals()
    }

    /// Counters of the device staging chunks, once allocated.
    pub fn staging_stats(&self) -> Option<StagingStats> {
        metrics::staging_stats(&self.shared)
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// This incarnation: random, drawn at start, carried in the metadata; peers tell a restart
    /// (same name, new epoch) from a second live agent of the name by it.
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }

    /// The shared secret peers prove, if one is set.
    pub(crate) fn secret(&self) -> Option<&[u8]> {
        self.shared.secret.as_deref()
    }

    /// The compatibility hash peers' metadata must carry (`AgentConfig::compat`).
    pub fn compat(&self) -> u64 {
        self.shared.compat
    }

    /// The UCX library version loaded at run time.
    pub fn ucx_version(&self) -> &str {
        &self.shared.ucx_version
    }

    /// The UCX version kvxfer was built against.
    pub fn ucx_build_version() -> &'static str {
        raw::BUILD_VERSION
    }

    /// Registers memory the agent does not own, such as an engine's KV cache tensor.
    ///
    /// # Safety
    /// 1. `[ptr, ptr+len)` is memory of kind `kind`, valid for reads and writes by this process
    ///    and by peers' transfers, until [`deregister`](Self::deregister) returns `Ok` or the
    ///    agent is dropped, whichever comes first.
    /// 2. The caller does not free or remap it before then.
    pub unsafe fn register_raw(&self, ptr: *mut u8, len: usize, kind: MemKind) -> Result<Region> {
        // SAFETY: this function's contract is register_raw_shared's.
        unsafe { self.register_raw_shared(ptr, len, kind, Share::AllPeers) }
    }

    /// As [`register_raw`](Self::register_raw), shared as `with` says
    /// ([`register_shared`](Self::register_shared)): an engine's KV cache registered with
    /// `Share::Only(vec![])` and restricted by a connector opens only through its grants, on
    /// every path (it moves only on the TCP lane, in-host too).
    ///
    /// # Safety
    /// As [`register_raw`](Self::register_raw).
    pub unsafe fn register_raw_shared(
        &self,
        ptr: *mut u8,
        len: usize,
        kind: MemKind,
        with: Share,
    ) -> Result<Region> {
        if ptr.is_null() {
            return Err(Error::InvalidArgument("register_raw: NULL pointer".into()));
        }
        let only = self.share_set(with)?;
        self.register_inner(ptr, len, kind, None, only)
    }

    /// The registered region that holds `[addr, addr+len)` of memory of kind `kind`, and the
    /// offset of `addr` in it.
    pub fn region_containing(
        &self,
        addr: *const u8,
        len: usize,
        kind: MemKind,
    ) -> Option<(RegionId, u64)> {
        self.shared
            .regions
            .containing(addr as u64, len as u64, kind)
    }

    /// This agent's metadata, encoded for a peer.
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.shared.metadata()
    }

    /// Loads a peer's metadata (from any channel). Returns the peer's name. Metadata of a
    /// known name that only adds regions to it (the same incarnation) grows the peer in
    /// place, and lists prepared against it stay valid; any other change replaces it (a
    /// restarted peer): lists prepared against the old one become stale, its connection and
    /// keys are dropped once transfers on them finish.
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
        remove_peer(&self.shared, name)
    }

    /// Forgets a peer known to be gone (discovery saw its key vanish): as
    /// [`Agent::remove_peer`], and later transfers to it fail at once with
    /// [`Error::PeerFailed`] until metadata of a new incarnation is loaded.
    pub fn retire_peer(&self, name: &str) -> Result<()> {
        retire_peer(&self.shared, name)
    }

    /// What the agent knows about a peer, including the transports UCX selected. Connects if
    /// not connected yet.
    pub fn peer_info(&self, name: &str) -> Result<PeerInfo> {
        peer_info(&self.shared, name)
    }

    /// Fences the writes peer `name` makes into this agent's memory through the TCP lane:
    /// its connections are closed and their threads waited for, and its fence count goes up,
    /// so that nothing it sent before, and no transfer it queued before it learns of the fence
    /// (however late that transfer's connection opens), is written after this returns. Such a
    /// transfer fails on the writer with [`Error::Fenced`](crate::Error::Fenced) (or the
    /// broken connection's error); a writer whose transfer was cut learns the count before it
    /// reports the failure, so what it queues next lands. Returns the connections closed.
    /// Writes through the shared-memory lane or UCX are the writer's own and cannot be fenced
    /// here.
    pub fn fence_inbound(&self, name: &str) -> usize {
        self.shared.lanes.iter().map(|l| l.fence(name)).sum()
    }

    /// The incarnation of peer `name` loaded now (0: a peer that sends none), or `None` when
    /// no incarnation of it is loaded (never connected, removed, or retired).
    pub fn peer_epoch(&self, name: &str) -> Option<u64> {
        self.shared
            .peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|v| v.epoch)
    }

    /// Listens for peers on `addr` (port 0 picks one): each peer that connects sends its
    /// metadata and receives ours. Returns the bound address.
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<SocketAddr> {
        let addr = resolve(addr, "listen")?;
        let l = Listener::start(
            side_channel(&self.shared),
            self.shared.subs.clone(),
            addr,
            self.shared.handshake,
        )?;
        let a = l.addr();
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(l);
        Ok(a)
    }

    /// Connects to a peer's side channel, exchanges metadata both ways, and keeps the
    /// connection: regions either agent registers later reach the other
    /// without a reconnect. Returns the peer's name.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> Result<String> {
        let addr = resolve(addr, "connect")?;
        exchange(
            &side_channel(&self.shared),
            &self.shared.subs,
            addr,
            self.shared.handshake,
        )
    }

    /// A WRITE of `local` into the peer's `remote`, described by name, posted by
    /// [`TransferBuilder::start`].
    pub fn write<'a>(
        &'a self,
        local: &'a PreparedLocal,
        remote: &'a PreparedRemote,
    ) -> TransferBuilder<'a> {
        TransferBuilder::new(self, XferOp::Write, local, remote)
    }

    /// A READ of the peer's `remote` into `local`, described by name.
    pub fn read<'a>(
        &'a self,
        local: &'a PreparedLocal,
        remote: &'a PreparedRemote,
    ) -> TransferBuilder<'a> {
        TransferBuilder::new(self, XferOp::Read, local, remote)
    }

    /// The regions of peer `peer` (ids, lengths, memory kinds), as its metadata listed them:
    /// how a process learns the other side's region ids to build descriptors.
    pub fn peer_regions(&self, peer: &str) -> Result<Vec<RegionSpan>> {
        let peers = self.shared.peers.read().unwrap_or_else(|e| e.into_inner());
        let v = peers.get(peer).ok_or_else(|| self.shared.missing(peer))?;
        Ok(v.spans.clone())
    }

    /// Resolves a list of local descriptors once, for reuse by index.
    pub fn prep_local(&self, descs: &[Desc]) -> Result<PreparedLocal> {
        let (table, spans) = self.local_regions(descs.iter().map(|d| d.region))?;
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
            .ok_or_else(|| self.shared.missing(peer))?;
        view.touch(self.shared.now());
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
        check_payload(notification)?;
        let plan = descriptor::plan(&local.entries, li, &remote.entries, ri, self.shared.max_op)?;
        self.submit(
            op,
            local,
            &remote.peer,
            remote.token,
            crate::transfer::Work::Flat(plan),
            notification,
            deadline,
            t0,
        )
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
        self.shared.channels.user.try_pop()
    }

    /// Waits up to `timeout` for a notification.
    pub fn wait_notification(&self, timeout: Duration) -> Result<Notification> {
        self.shared.channels.user.wait(timeout)
    }

    /// All notifications that have arrived.
    pub fn notifications(&self) -> Vec<Notification> {
        self.shared.channels.user.drain()
    }

    /// The next connector control message for this agent's producer (`producer`) or
    /// consumer, waiting up to `timeout`.
    pub(crate) fn wait_control(&self, producer: bool, timeout: Duration) -> Result<Notification> {
        self.control(producer).wait(timeout)
    }

    /// The next connector control message, if one has arrived.
    pub(crate) fn try_control(&self, producer: bool) -> Option<Notification> {
        self.control(producer).try_pop()
    }

    fn control(&self, producer: bool) -> &Inbox {
        if producer {
            &self.shared.channels.producer
        } else {
            &self.shared.channels.consumer
        }
    }

    /// Notifications dropped from the user's queue for room: past 65,536 waiting, 16 MiB
    /// waiting, or the budget (`AgentConfig::budget`) they are charged to.
    pub fn notifications_dropped(&self) -> u64 {
        self.shared.channels.user.dropped()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.shared.subs.close();
        // The TCP lane's target first (no new peer write lands), then the copy threads.
        for l in self.shared.lanes.iter().rev() {
            l.stop();
        }
        let _ = self.shared.cmds.send(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                log::error!("kvxfer progress thread of {} panicked", self.shared.name);
            }
        }
    }
}

/// Answers the peers' deregistrations that reach this agent over UCX (the UCX fence): each
/// is refused from then on, and answered once this agent's UCX transfers to the peer that
/// were in flight have ended. Ends with the engine (its sender).
fn spawn_gone_answers(
    st: &Arc<AgentState>,
    rx: std::sync::mpsc::Receiver<crate::backend::ucx::fence_state::GoneNotice>,
) -> Result<()> {
    let (me, cmds) = (Arc::downgrade(st), st.cmds.clone());
    std::thread::Builder::new()
        .name(format!("kvxfer-fence-{}", st.name))
        .spawn(move || {
            for n in rx {
                let Some(st) = me.upgrade() else { break };
                let done = peers::region_gone_at(&st, &n.name, n.region, st.deregister_wait);
                drop(st);
                if done {
                    let _ = cmds.send(Cmd::FenceAnswer {
                        peer: n.peer,
                        region: n.region,
                    });
                }
            }
        })
        .map(|_| ())
        .map_err(|e| Error::io("spawning the fence thread", e))
}

/// A random, non-zero incarnation number for a new agent.
fn new_epoch() -> Result<u64> {
    Ok(u64::from_le_bytes(crate::random::bytes()?).max(1))
}

/// The side channel's view of this agent.
fn side_channel(st: &Arc<AgentState>) -> Arc<SideChannel> {
    let (a, b, c) = (st.clone(), st.clone(), Arc::downgrade(st));
    Arc::new(SideChannel {
        name: st.name.clone(),
        compat: st.compat,
        secret: st.secret.clone(),
        transport: st.transport.ucx_tls(),
        local: Box::new(move || a.metadata()),
        on_peer: Box::new(move |meta| load_decoded(&b, meta)),
        on_gone: Box::new(move |peer, id| {
            c.upgrade()
                .is_none_or(|st| peers::region_gone_at(&st, peer, id, st.deregister_wait))
        }),
    })
}

/// The TCP lane's address on the interfaces `net_devices` names (the default route's when
/// none is set, or when it names only RDMA devices, `dev:port`). A name that is neither, where
/// the lane carries what UCX's TCP would have, is a typo the agent refuses rather than binding
/// to loopback, which no peer on another host reaches.
fn lane_bind(cfg: &AgentConfig) -> Result<Option<std::net::IpAddr>> {
    let Some(devs) = cfg.ucx.net_devices.as_deref() else {
        return Ok(iface_addr(None));
    };
    if let Some(a) = iface_addr(Some(devs)) {
        return Ok(Some(a));
    }
    if cfg.lanes.on && cfg.ucx_tcp_off() && !devs.split(',').any(|d| d.contains(':')) {
        return Err(Error::InvalidArgument(format!(
            "net_devices {devs:?}: no interface of that name has an IPv4 address for the TCP \
             lane; this host has: {}",
            crate::lane::interface_names().join(", ")
        )));
    }
    Ok(iface_addr(None))
}

/// A UCX start-up failure with what was asked and what this host has (UCX itself says only
/// "No such device"); other errors as they are.
fn setup_failed(e: Error, cfg: &AgentConfig) -> Error {
    let Error::Ucx { op, status } = e else {
        return e;
    };
    let tls = cfg.transport.ucx_tls();
    let devices = cfg
        .ucx
        .net_devices
        .as_deref()
        .unwrap_or("all (UCX_NET_DEVICES unset)");
    let mut why = format!("transports {tls:?} on devices {devices}");
    // UCS_ERR_NO_DEVICE, UCS_ERR_UNSUPPORTED: nothing asked for exists here.
    if matches!(status.code(), -14 | -22) {
        why.push_str(&format!(
            "; none of them is usable here. This host's interfaces: {}. RDMA transports (rc, \
             ud, dc) need an InfiniBand or RoCE device; \"tcp\", \"shm\" or \"auto\" work \
             anywhere",
            crate::lane::interface_names().join(", ")
        ));
    }
    Error::UcxSetup { op, status, why }
}

/// The first address `addr` names (`"localhost:0"`, `"127.0.0.1:7000"`, a `SocketAddr`).
fn resolve(addr: impl ToSocketAddrs, what: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("{what}: the address does not resolve: {e}")))?
        .next()
        .ok_or_else(|| Error::InvalidArgument(format!("{what}: the address names no host")))
}

/// A transfer being described; [`TransferBuilder::start`] posts it. Every descriptor of both
/// lists by default, no notification, no deadline.
#[derive(Debug)]
#[must_use = "a transfer is posted by start()"]
pub struct TransferBuilder<'a> {
    agent: &'a Agent,
    op: XferOp,
    local: &'a PreparedLocal,
    remote: &'a PreparedRemote,
    indices: Option<(&'a [usize], &'a [usize])>,
    notification: Option<&'a [u8]>,
    deadline: Option<Duration>,
}

impl<'a> TransferBuilder<'a> {
    fn new(
        agent: &'a Agent,
        op: XferOp,
        local: &'a PreparedLocal,
        remote: &'a PreparedRemote,
    ) -> Self {
        TransferBuilder {
            agent,
            op,
            local,
            remote,
            indices: None,
            notification: None,
            deadline: None,
        }
    }

    /// Only these descriptors, paired index by index (`local[li[k]]` with `remote[ri[k]]`).
    pub fn indices(mut self, li: &'a [usize], ri: &'a [usize]) -> Self {
        self.indices = Some((li, ri));
        self
    }

    /// A notification the peer receives after the data has landed.
    pub fn notify(mut self, payload: &'a [u8]) -> Self {
        self.notification = Some(payload);
        self
    }

    /// Fails the transfer with a typed error if it has not completed within `d`.
    pub fn deadline(mut self, d: Duration) -> Self {
        self.deadline = Some(d);
        self
    }

    /// Posts it.
    pub fn start(self) -> Result<Transfer> {
        match self.indices {
            Some((li, ri)) => self.agent.transfer(
                self.op,
                self.local,
                li,
                self.remote,
                ri,
                self.notification,
                self.deadline,
            ),
            None => self.agent.transfer_all(
                self.op,
                self.local,
                self.remote,
                self.notification,
                self.deadline,
            ),
        }
    }
}
