//! The progress engine: one thread per agent owns the UCX context, worker, endpoints, rkeys
//! and memory handles, so no UCX object is ever touched by two threads. Other threads submit
//! commands through a channel and wake the worker with `ucp_worker_signal`.
//!
//! Loop: take queued commands → post the next batch of each transfer's operations (bounded
//! per iteration) → progress until idle → handle completions (collected by callbacks into a
//! thread-local list) → check deadlines → `ucp_worker_arm` and sleep on the worker's event fd
//! (or spin, with busy-poll).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::fence_state::{Announced, EngineCounts, Fence, GoneNotice, AM_FENCE, USER_BIT};
use super::handle::{Context, Endpoint, MemHandle, Request, Rkey, Worker, WorkerWaker};
use super::raw;
use crate::memory::RegionInner;
use crate::notify::Channels;
use crate::transfer::Job;
use kvxfer_proto::error::{Error, Result, UcsStatus};
use kvxfer_proto::types::{HostInfo, MemKind, PeerInfo};
use kvxfer_proto::wire::lane_entries::LaneEntry;
use kvxfer_proto::wire::metadata::{Metadata, RegionMeta};

/// Active-message id of notifications.
pub(super) const AM_NOTIFY: u32 = 0x4b58;
/// Operations posted per transfer per loop iteration: bounds the time between progress calls.
pub(super) const POST_BATCH: usize = 1024;
/// Longest sleep on the event fd; a safety net only, wakeups are event driven.
const MAX_SLEEP: Duration = Duration::from_millis(250);
/// How long shutdown waits for endpoints to close gracefully.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Rounds in a row in which UCX says it is busy and nothing progresses, after a transfer was
/// given up or with none under way, before the loop sleeps [`STUCK_SLEEP`] between rounds
/// instead of spinning.
const SPIN_ROUNDS: u32 = 64;
/// The sleep between such rounds: what a command or a served peer may wait then.
const STUCK_SLEEP: Duration = Duration::from_micros(200);

type Reply<T> = mpsc::SyncSender<Result<T>>;

/// Commands from API threads to the engine. The engine answers with data; it never writes
/// into the agent's tables.
pub(crate) enum Cmd {
    /// Map a region (when UCX moves it) and mark it registered.
    Register {
        region: Arc<RegionInner>,
        reply: Reply<()>,
    },
    /// Retire a region (the pin handshake) and unmap it.
    Deregister {
        region: Arc<RegionInner>,
        reply: Reply<()>,
    },
    /// Encode this agent's metadata: its identity and the engine's regions and address.
    Metadata {
        local: LocalIdentity,
        reply: Reply<Vec<u8>>,
    },
    /// Load a peer's metadata (replacing a peer of the same name).
    LoadPeer {
        meta: Metadata,
        reply: Reply<LoadedPeer>,
    },
    RemovePeer {
        name: String,
        reply: Reply<()>,
    },
    /// What the engine knows of a peer (`gpu_path` left for the agent to fill in).
    PeerInfo {
        name: String,
        reply: Reply<PeerInfo>,
    },
    Post(Box<Job>),
    /// Region `region` is being deregistered: tell every peer that announced itself for UCX
    /// and answer, within `wait`, with those that did not confirm (the UCX fence).
    Fence {
        region: u32,
        wait: Duration,
        reply: Reply<Vec<String>>,
    },
    /// Nothing of this agent's touches peer `peer`'s region `region` any more: tell it.
    FenceAnswer {
        peer: u64,
        region: u32,
    },
    Cancel {
        id: u64,
    },
    Shutdown,
}

/// What the agent puts into its metadata besides the engine's part.
#[derive(Clone, Debug)]
pub(crate) struct LocalIdentity {
    pub(crate) name: String,
    pub(crate) epoch: u64,
    pub(crate) compat: u64,
    pub(crate) host: Option<HostInfo>,
    /// What each lane advertises.
    pub(crate) lanes: Vec<LaneEntry>,
}

/// The engine's answer to [`Cmd::LoadPeer`].
#[derive(Debug)]
pub(crate) struct LoadedPeer {
    /// The new peer entry's token; `None` when the same metadata was loaded again and nothing
    /// changed.
    pub(crate) token: Option<u64>,
    /// Whether the endpoint could be created (the peer stays loaded either way).
    pub(crate) connected: Result<()>,
}

/// The sending side of the engine's command channel: any thread, any number of clones.
#[derive(Clone)]
pub(crate) struct Commands {
    tx: mpsc::Sender<Cmd>,
    waker: Arc<WorkerWaker>,
    queued: Arc<AtomicUsize>,
    counts: Arc<EngineCounts>,
}

impl Commands {
    /// The UCX engine's counts (its fence's above all), for the agent's metrics.
    pub(crate) fn engine_counts(&self) -> &EngineCounts {
        &self.counts
    }

    /// Queues a command and wakes the engine.
    pub(crate) fn send(&self, c: Cmd) -> Result<()> {
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.tx.send(c).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Shutdown);
        }
        self.waker.wake();
        Ok(())
    }

    /// Sends a command and waits for its reply.
    pub(crate) fn call<T>(&self, f: impl FnOnce(mpsc::SyncSender<Result<T>>) -> Cmd) -> Result<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(f(tx))?;
        rx.recv().map_err(|_| Error::Shutdown)?
    }

    /// Hands a transfer to the engine; on error the job was dropped with the channel.
    pub(crate) fn post(&self, job: Job) -> Result<()> {
        self.send(Cmd::Post(Box::new(job)))
    }

    /// Asks the engine to stop posting a transfer.
    pub(crate) fn cancel(&self, id: u64) {
        let _ = self.send(Cmd::Cancel { id });
    }
}

/// Memory types the last UCX context created in this process supports (UCX's CUDA support is
/// a property of the loaded UCX library and its configuration, the same for all agents).
pub(crate) static MEMORY_TYPES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(super) enum Event {
    /// A transfer's flush or notification send completed.
    Done { job: u64, status: UcsStatus },
    /// An endpoint failed.
    EpError { peer: u64, status: UcsStatus },
    /// A notification arrived.
    Notify(Vec<u8>),
    /// A UCX fence message arrived.
    Fence(Vec<u8>),
}

thread_local! {
    /// Filled by UCX callbacks, which run inside `ucp_worker_progress` on the engine thread.
    static EVENTS: RefCell<Vec<Event>> = const { RefCell::new(Vec::new()) };
    /// Active-message bytes in [`EVENTS`].
    static EVENT_BYTES: Cell<usize> = const { Cell::new(0) };
}

/// Once this many active-message bytes wait in [`EVENTS`], the engine handles them before
/// it progresses UCX again: what peers send then waits in UCX's own bounded queues (and
/// their sends in theirs), so a flood of the largest messages (a fence WELCOME is up to
/// 524 KB) holds this much here, plus what one progress call delivers, never more.
pub(super) const AM_BATCH_BYTES: usize = 1 << 20;

pub(super) fn push_event(e: Event) {
    EVENTS.with(|v| v.borrow_mut().push(e));
}

/// Completion of a flush or notification send. The request is freed here: freeing it earlier
/// would suppress this callback (`ucp_request_free`).
pub(super) unsafe extern "C" fn on_send_done(
    req: *mut c_void,
    status: raw::ucs_status_t,
    user: *mut c_void,
) {
    let _ = std::panic::catch_unwind(|| {
        push_event(Event::Done {
            job: user as u64,
            status: raw::cb_status(status),
        })
    });
    if let Some(req) = NonNull::new(req) {
        // SAFETY: UCX passes the live request this callback completes; freed once, here.
        unsafe { raw::request_free(req) };
    }
}

pub(super) unsafe extern "C" fn on_ep_error(
    arg: *mut c_void,
    _ep: raw::ucp_ep_h,
    status: raw::ucs_status_t,
) {
    let _ = std::panic::catch_unwind(|| {
        push_event(Event::EpError {
            peer: arg as u64,
            status: raw::cb_status(status),
        })
    });
}

/// An active message's bytes, copied out for the engine's loop: only eager ones (anything
/// else, a rendezvous from a foreign sender, is dropped rather than trusted), at most `max`.
fn am_bytes(
    data: *mut c_void,
    len: usize,
    param: *const raw::ucp_am_recv_param_t,
    max: usize,
) -> Option<Vec<u8>> {
    if !raw::am_data_in_place(param) || data.is_null() || len > max {
        return None;
    }
    // SAFETY: UCX passes `len` readable bytes at `data` for the callback's duration, which
    // this call is inside.
    Some(unsafe { std::slice::from_raw_parts(data as *const u8, len) }.to_vec())
}

/// Active messages of both ids: notifications (`arg` null) and the UCX fence's (`arg`
/// [`FENCE_ARG`]), each sent eager.
unsafe extern "C" fn on_am(
    arg: *mut c_void,
    _header: *const c_void,
    _header_len: usize,
    data: *mut c_void,
    len: usize,
    param: *const raw::ucp_am_recv_param_t,
) -> raw::ucs_status_t {
    let _ = std::panic::catch_unwind(|| {
        let fence = arg as usize == FENCE_ARG;
        let max = match fence {
            true => kvxfer_proto::wire::ucx_fence::MAX_ENCODED,
            false => kvxfer_proto::wire::notify::MAX_ENCODED,
        };
        if let Some(v) = am_bytes(data, len, param, max) {
            EVENT_BYTES.with(|b| b.set(b.get() + v.len()));
            push_event(match fence {
                true => Event::Fence(v),
                false => Event::Notify(v),
            });
        }
    });
    raw::STATUS_OK
}

/// [`on_am`]'s argument for the UCX fence's id (a plain number, never dereferenced).
const FENCE_ARG: usize = 1;

pub(super) struct LocalReg {
    /// None for regions UCX does not map (staged device memory).
    pub(super) memh: Option<MemHandle>,
    pub(super) rkey: Vec<u8>,
    pub(super) region: Arc<RegionInner>,
}

pub(super) struct Peer {
    pub(super) name: String,
    pub(super) meta: Metadata,
    pub(super) ep: Option<Endpoint>,
    /// Unpacked rkeys, by region slot (index in `meta.regions`); None for staged device
    /// memory, which UCX cannot reach.
    pub(super) rkeys: Vec<Option<Rkey>>,
    pub(super) failed: Option<UcsStatus>,
    pub(super) transports: String,
    /// Transfers using this peer that have not completed.
    pub(super) jobs: usize,
    pub(super) retired: bool,
    /// Without peer-failure detection (shared memory), a same-host peer's process, watched
    /// through a pidfd: its death fails its transfers at once, deadline or none.
    pub(super) process: Option<crate::host::PeerProcess>,
    /// This agent's announcement to it (the UCX fence): nothing is posted before its WELCOME.
    pub(super) announced: Announced,
    /// Region slots its WELCOME listed as gone (deregistered before this agent
    /// announced itself), sorted: a transfer touching one is refused, never posted.
    pub(super) gone_slots: Vec<u32>,
}

pub(super) struct Active {
    pub(super) job: Box<Job>,
    pub(super) next: usize,
    pub(super) phase: Phase,
    pub(super) error: Option<Error>,
    pub(super) canceled: bool,
    pub(super) posted_at: Option<Duration>,
    pub(super) deadline_at: Option<Instant>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Phase {
    Posting,
    Flushing,
    Notifying,
}

pub(crate) struct Engine {
    pub(super) ctx: Rc<Context>,
    pub(super) worker: Rc<Worker>,
    pub(super) efd: i32,
    pub(super) busy_poll: bool,
    pub(super) peer_failure: bool,
    /// When the processes of same-host peers were last looked at (every `WATCH_PERIOD`
    /// while transfers to them are in flight, not every round: a round is a few us), and
    /// whether one had transfers then or got one since.
    pub(super) watched_at: Instant,
    pub(super) watching: bool,
    /// UCX keeps only its loopback to this worker (`TLS=self`: its TCP transport left out):
    /// no endpoint to another agent can be made, so none is tried (UCX would log an error).
    pub(super) self_only: bool,
    /// Whether notifications arriving over active messages are delivered (off with a shared
    /// secret: they then come only over the sealed TCP lane).
    am_notes: bool,
    pub(super) rx: mpsc::Receiver<Cmd>,
    pub(super) queued: Arc<AtomicUsize>,
    /// Where received notifications go.
    channels: Channels,
    pub(super) regions: HashMap<u32, LocalReg>,
    pub(super) peers: HashMap<u64, Peer>,
    pub(super) names: HashMap<String, u64>,
    pub(super) next_token: u64,
    pub(super) active: HashMap<u64, Active>,
    /// Endpoint close requests still in progress, with the rkeys to destroy once they are done.
    pub(super) closing: Vec<(Request, Vec<Option<Rkey>>)>,
    /// A transfer was given up with its operations still in UCX
    /// ([`super::transfer::ABANDON_AFTER`]); cleared once UCX can sleep again.
    pub(super) stuck: bool,
    pub(super) worker_addr: Vec<u8>,
    /// The UCX fence, as initiator and as owner.
    pub(super) fence: Fence,
    /// The agent's name (what its announcements say).
    pub(super) name: String,
}

// SAFETY: the Engine is created on the caller's thread and then moved, once, to the progress
// thread, which is the only thread that uses its UCX handles from then on. The handle owners'
// `Rc`s are all inside the engine (none is kept or handed out), so they move with it.
unsafe impl Send for Engine {}

impl Engine {
    /// Creates the context and worker. Returns the engine (to be run on its own thread) and a
    /// waker for other threads.
    pub(crate) fn new(
        settings: &[(String, String)],
        name: &CStr,
        busy_poll: bool,
        peer_failure: bool,
        am_notes: bool,
        channels: Channels,
        gone: mpsc::SyncSender<GoneNotice>,
    ) -> Result<(Engine, Commands)> {
        let (tx, rx) = mpsc::channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let counts = Arc::new(EngineCounts::default());
        let ctx = Context::new(settings, name).map_err(|(op, status)| {
            log::error!("UCX context with settings {settings:?}: {op}: {status}");
            Error::Ucx {
                op: if op.starts_with("ucp_config_modify") {
                    "ucp_config_modify"
                } else {
                    "ucp_init"
                },
                status,
            }
        })?;
        MEMORY_TYPES.store(ctx.memory_types(), std::sync::atomic::Ordering::Relaxed);
        // On any error below the handles made so far are released by their owners.
        let fail = |op| move |status| Error::Ucx { op, status };
        let worker = Worker::new(&ctx).map_err(fail("ucp_worker_create"))?;
        let w = worker.as_ptr();
        // SAFETY: worker live, on this thread, created with wakeup events.
        let efd = unsafe { raw::worker_efd(w) }.map_err(fail("ucp_worker_get_efd"))?;
        // SAFETY: worker live; arg is a plain number (never dereferenced); on_am accepts any
        // input.
        unsafe { raw::worker_set_am_handler(w, AM_NOTIFY, on_am, std::ptr::null_mut()) }
            .map_err(fail("ucp_worker_set_am_recv_handler"))?;
        // SAFETY: as above.
        unsafe { raw::worker_set_am_handler(w, AM_FENCE, on_am, FENCE_ARG as *mut c_void) }
            .map_err(fail("ucp_worker_set_am_recv_handler"))?;
        // SAFETY: worker live, on this thread.
        let worker_addr = unsafe { raw::worker_address(w) }.map_err(fail("ucp_worker_query"))?;
        let waker = Arc::new(worker.waker());
        Ok((
            Engine {
                ctx,
                worker,
                efd,
                busy_poll,
                peer_failure,
                watched_at: Instant::now(),
                watching: false,
                self_only: settings.iter().any(|(k, v)| k == "TLS" && v == "self"),
                am_notes,
                rx,
                queued: queued.clone(),
                channels,
                regions: HashMap::new(),
                peers: HashMap::new(),
                names: HashMap::new(),
                next_token: 1,
                active: HashMap::new(),
                closing: Vec::new(),
                stuck: false,
                worker_addr,
                fence: Fence::new(gone, counts.clone()),
                name: name.to_string_lossy().into_owned(),
            },
            Commands {
                tx,
                waker,
                queued,
                counts,
            },
        ))
    }

    /// The progress loop; returns after `Shutdown` (or when every API handle is gone).
    pub(crate) fn run(mut self) {
        let mut shutdown = false;
        // Rounds in a row where UCX said busy and nothing progressed.
        let mut unproductive = 0u32;
        while !shutdown {
            let mut busy = false;
            // 1. Commands (bounded per iteration).
            for _ in 0..256 {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        self.queued.fetch_sub(1, Ordering::AcqRel);
                        busy = true;
                        if self.command(cmd) {
                            shutdown = true;
                            break;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        shutdown = true;
                        break;
                    }
                }
            }
            // 2. Post the next batch of each transfer.
            busy |= self.post_batches();
            // 3. Progress until idle (or until a batch of active messages waits), then
            // handle what callbacks reported.
            for _ in 0..64 {
                if EVENT_BYTES.with(Cell::get) >= AM_BATCH_BYTES {
                    busy = true;
                    break;
                }
                // SAFETY: worker live, this is the engine thread.
                if unsafe { raw::worker_progress(self.worker.as_ptr()) } == 0 {
                    break;
                }
                busy = true;
            }
            busy |= self.handle_events();
            self.reap_closing();
            // 4. Deadlines, and deregistrations waiting for peers' answers.
            let next_deadline = match (self.check_deadlines(), self.poll_fences()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if busy {
                unproductive = 0;
            }
            if busy || shutdown || self.busy_poll {
                continue;
            }
            // 5. Sleep until UCX or a command wakes us.
            // SAFETY: worker live, this is the engine thread.
            match unsafe { raw::worker_arm(self.worker.as_ptr()) } {
                Ok(true) => {
                    unproductive = 0;
                    if std::mem::take(&mut self.stuck) {
                        log::info!("kvxfer: UCX let go of the operations of transfers given up");
                    }
                }
                // Busy with events to progress: progress again, at once. A large copy over
                // UCX's shared memory (ours, or a peer's that this side serves) reports no
                // progress until it ends, so "busy, nothing progressed" alone is no reason
                // to sleep: sleeping there cost 10x on 273 MB READs. Only once a transfer
                // was given up (`stuck`: its operation towards a dead shared-memory peer
                // keeps UCX "busy" for good, and its fd readable), or while no transfer of
                // this agent's is under way (a target whose shared-memory writer was killed
                // mid-WRITE: UCX 1.13 stays "busy" for good, and the loop spun a core for
                // minutes), does the loop, after a few such rounds, sleep between rounds
                // rather than spin, until UCX can sleep again.
                Ok(false)
                    if !(self.stuck || self.active.is_empty()) || unproductive < SPIN_ROUNDS =>
                {
                    unproductive += 1;
                    continue;
                }
                Ok(false) => {
                    std::thread::sleep(STUCK_SLEEP);
                    continue;
                }
                Err(s) => {
                    log::warn!("ucp_worker_arm: {s}");
                    continue;
                }
            }
            if self.queued.load(Ordering::Acquire) > 0 {
                continue;
            }
            let mut timeout = MAX_SLEEP;
            if let Some(d) = next_deadline {
                timeout = timeout.min(d.saturating_duration_since(Instant::now()));
            }
            if !self.closing.is_empty() {
                timeout = timeout.min(Duration::from_millis(10));
            }
            let mut pfd = libc::pollfd {
                fd: self.efd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: pfd is a valid pollfd array of length 1 for the call.
            unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
        }
        self.shutdown();
    }

    /// Handles one command; true for shutdown.
    fn command(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Register { region, reply } => {
                let _ = reply.send(self.register(region));
            }
            Cmd::Deregister { region, reply } => {
                let _ = reply.send(self.deregister(&region));
            }
            Cmd::Metadata { local, reply } => {
                let _ = reply.send(Ok(self.metadata(local)));
            }
            Cmd::LoadPeer { meta, reply } => {
                let _ = reply.send(Ok(self.load_peer(meta)));
            }
            Cmd::RemovePeer { name, reply } => {
                let r = match self.names.remove(&name) {
                    Some(t) => {
                        self.retire(t);
                        Ok(())
                    }
                    None => Err(Error::UnknownPeer { agent: name }),
                };
                let _ = reply.send(r);
            }
            Cmd::PeerInfo { name, reply } => {
                let _ = reply.send(self.peer_info(name));
            }
            Cmd::Post(job) => self.start(job),
            Cmd::Fence {
                region,
                wait,
                reply,
            } => self.fence_start(region, wait, reply),
            Cmd::FenceAnswer { peer, region } => self.fence_answer(peer, region),
            Cmd::Cancel { id } => {
                if let Some(a) = self.active.get_mut(&id) {
                    a.canceled = true;
                }
            }
            Cmd::Shutdown => return true,
        }
        false
    }

    fn register(&mut self, region: Arc<RegionInner>) -> Result<()> {
        // Staged device memory gets no UCX handle and no remote key: kvxfer's lane moves it.
        let (memh, rkey) = if region.ucx_mapped {
            let (m, k) = self.map(&region)?;
            (Some(m), k)
        } else {
            (None, Vec::new())
        };
        region.registered.store(true, Ordering::Release);
        self.regions
            .insert(region.id.0, LocalReg { memh, rkey, region });
        Ok(())
    }

    /// `ucp_mem_map` (told the memory type of device memory) and `ucp_rkey_pack`.
    fn map(&mut self, region: &RegionInner) -> Result<(MemHandle, Vec<u8>)> {
        // SAFETY: the region's memory is owned by `region` (or promised valid by the caller
        // of register_raw) and outlives the mapping: LocalReg holds the Arc with the handle.
        let memh = unsafe {
            self.ctx.map(
                region.addr as *mut u8,
                region.len as usize,
                region.kind != MemKind::Host,
            )
        }
        .map_err(|status| Error::Ucx {
            op: "ucp_mem_map",
            status,
        })?;
        // On an error memh is unmapped by its drop.
        let rkey = memh.rkey().map_err(|status| Error::Ucx {
            op: "ucp_rkey_pack",
            status,
        })?;
        Ok((memh, rkey))
    }

    fn deregister(&mut self, region: &Arc<RegionInner>) -> Result<()> {
        let id = region.id.0;
        // The agent retired it (the pin handshake with every lane and transfer) before it
        // told the peers: no pin holds it, and new ones are refused.
        let reg = self
            .regions
            .remove(&id)
            .ok_or(Error::Deregistered { region: id })?;
        self.fence_forget(id, reg.memh.is_some());
        // No transfer uses it: inflight was 0, and new posts check `registered` on this thread.
        match reg.memh {
            Some(memh) => memh.unmap().map_err(|status| Error::Ucx {
                op: "ucp_mem_unmap",
                status,
            }),
            None => Ok(()),
        }
    }

    fn metadata(&self, local: LocalIdentity) -> Vec<u8> {
        let LocalIdentity {
            name,
            epoch,
            compat,
            host,
            lanes,
        } = local;
        let mut ids: Vec<&u32> = self.regions.keys().collect();
        ids.sort_unstable();
        Metadata {
            name,
            compat,
            worker_addr: self.worker_addr.clone(),
            epoch,
            host,
            lanes,
            regions: ids
                .into_iter()
                .map(|id| {
                    let r = &self.regions[id];
                    RegionMeta {
                        id: r.region.id,
                        kind: r.region.kind,
                        // Memory shared with named peers only is reached by region and
                        // offset on the TCP lane: its address stays here (nothing a peer
                        // could aim UCX's keyless emulated RMA or a device mapping at).
                        base: if r.region.restricted {
                            0
                        } else {
                            r.region.addr
                        },
                        len: r.region.len,
                        rkey: r.rkey.clone(),
                        shm: r.region.shm,
                    }
                })
                .collect(),
        }
        .encode()
    }

    pub(super) fn handle_events(&mut self) -> bool {
        let events = EVENTS.with(|v| std::mem::take(&mut *v.borrow_mut()));
        let bytes = EVENT_BYTES.with(|b| b.replace(0));
        self.fence
            .counts
            .am_batch_peak
            .fetch_max(bytes as u64, Ordering::Relaxed);
        if events.is_empty() {
            return false;
        }
        for e in events {
            match e {
                Event::Done { job, status } => self.step(job, status),
                Event::EpError { peer, status } if peer & USER_BIT != 0 => {
                    log::info!("kvxfer: a UCX peer that announced itself failed: {status}");
                    self.back_failed(peer & !USER_BIT);
                }
                Event::EpError { peer, status } => {
                    if let Some(p) = self.peers.get_mut(&peer) {
                        log::warn!("kvxfer: peer {:?} failed: {status}", p.name);
                        p.failed = Some(status);
                    }
                    // UCX completes the outstanding operations with errors once the endpoint
                    // is closed; they are reported through their flush callbacks.
                    self.close_peer(peer, true);
                }
                Event::Fence(bytes) => self.fence_message(&bytes),
                Event::Notify(_) if !self.am_notes => {
                    // Its sender is whatever the payload says: with a secret, only the sealed
                    // lane's notifications are believed.
                    log::debug!("kvxfer: a notification over UCX active messages dropped");
                }
                Event::Notify(bytes) => match kvxfer_proto::wire::notify::decode(&bytes) {
                    Some(n) => self.channels.deliver(n),
                    None => log::warn!(
                        "kvxfer: malformed notification ({} bytes) dropped",
                        bytes.len()
                    ),
                },
            }
        }
        true
    }

    fn shutdown(mut self) {
        // Fail what is still queued, let posted operations finish or be cancelled.
        while let Ok(cmd) = self.rx.try_recv() {
            if let Cmd::Post(job) = cmd {
                job.finish(Err(Error::Shutdown));
            }
        }
        for a in self.active.values_mut() {
            a.canceled = true;
        }
        self.close_fence();
        let tokens: Vec<u64> = self.peers.keys().copied().collect();
        let end = Instant::now() + CLOSE_GRACE;
        while !self.active.is_empty() && Instant::now() < end {
            self.post_batches();
            // SAFETY: worker live, engine thread.
            unsafe { raw::worker_progress(self.worker.as_ptr()) };
            self.handle_events();
        }
        for t in &tokens {
            self.close_peer(*t, !self.active.is_empty());
        }
        let end = Instant::now() + CLOSE_GRACE;
        while (!self.closing.is_empty() || !self.active.is_empty()) && Instant::now() < end {
            // SAFETY: worker live, engine thread.
            unsafe { raw::worker_progress(self.worker.as_ptr()) };
            self.handle_events();
            self.reap_closing();
        }
        for (_, a) in self.active.drain() {
            // Buffers stay pinned (leaked) rather than freed under UCX.
            a.job.pins.leak();
            a.job.state.complete(Err(Error::Shutdown));
        }
        for r in self.regions.values() {
            r.region.registered.store(false, Ordering::Release);
        }
        // Dropping the engine releases every handle in order: keys, endpoints and memory
        // handles first (their owners hold the worker and the context), then the worker (its
        // wakers stop), then the context.
    }
}
