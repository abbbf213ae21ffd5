//! The shared-memory lane: map a same-host peer's memfd-backed regions once, then move a
//! transfer with plain copies split over a few copy threads.
//!
//! The files come from the peer's own socket, handed over with `SCM_RIGHTS`
//! ([`super::shm_handover`]), and are mapped read-only until a WRITE needs them.
//!
//! Safety of the mappings: a mapping is of the peer's memory *file*, so it stays valid even if
//! the peer frees or deregisters the region (stores then land in pages nobody reads, never in
//! unrelated memory of the peer, unlike CMA or a stale rkey). Mappings are dropped with the
//! peer's metadata.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::api::{LaneKind, LaneSetup, PeerLane, Query};
use super::shm_handover::ControlMap;
use crate::host::PeerProcess;
use crate::transfer::NoteCarrier;
use crate::transfer::{Job, Work};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::{Lane, Transport, XferOp};
use kvxfer_proto::wire::lane_entries::LaneEntry;
use kvxfer_proto::wire::metadata::{HostInfo, Metadata};
use kvxfer_proto::wire::shm_fds::CONTROL_REGION;

/// Regions of one peer the lane maps at most.
pub(crate) const MAX_PEER_MAPPINGS: usize = 4096;
/// Peer regions mapped at most in this process, all agents together.
pub(crate) const MAX_MAPPINGS: usize = 16384;

/// Bytes of peers' memory files mapped in this process at most, all agents together: a
/// mapping costs address space (128 TiB in all on x86-64), not memory, until it is touched.
pub(crate) const MAX_MAPPED_BYTES: u64 = 32 << 40;
/// Bytes of peers' memory files mapped now.
static MAPPED_BYTES: AtomicU64 = AtomicU64::new(0);

struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// The region's base address in the peer (what descriptors carry).
    base: u64,
    /// Mapped for writing too (a WRITE into it came); read-only until then.
    writable: AtomicBool,
    /// The region's id in the peer (its word in the registration page).
    region: u32,
    _live: crate::live::Counted,
}

impl Mapping {
    /// Whether the mapping may be written, making it so if it is not yet.
    fn make_writable(&self) -> bool {
        if self.writable.load(Ordering::Acquire) {
            return true;
        }
        // SAFETY: ptr/len is this mapping, of a file opened read-write by its owner; adding
        // PROT_WRITE changes no byte. Concurrent calls do the same thing twice.
        let ok = unsafe {
            libc::mprotect(
                self.ptr.cast(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        } == 0;
        if ok {
            self.writable.store(true, Ordering::Release);
        }
        ok
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len is a mapping made in map_region, unmapped only here.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
        MAPPED_BYTES.fetch_sub(self.len as u64, Ordering::SeqCst);
    }
}

/// A peer's regions mapped into this process, by slot in the peer's region table, and the
/// peer's process, to tell when it is gone.
pub(crate) struct PeerMaps {
    maps: Vec<Option<Mapping>>,
    process: PeerProcess,
    /// The peer's registration page, mapped read-only: whether each region is registered.
    control: ControlMap,
}

/// The error of a transfer whose peer process `p` has exited `when`.
fn exited_error(p: &PeerProcess, peer: &str, when: &str) -> Error {
    Error::LaneFailed {
        agent: peer.to_string(),
        lane: "shm",
        why: format!(
            "the peer's process (pid {}) has exited {when}: its memory is read by nobody",
            p.pid()
        ),
    }
}

// SAFETY: the mappings (regions and the registration page) are plain shared memory owned by
// this struct; the region pointers are only dereferenced by copy threads for ranges checked
// against the peer's region table, the page only read atomically, and the struct (an Arc)
// outlives every copy that uses it.
unsafe impl Send for PeerMaps {}
// SAFETY: as above; &PeerMaps hands out no references, only raw pointers for copies.
unsafe impl Sync for PeerMaps {}

impl PeerMaps {
    /// Maps every region of `meta` that carries a handle, if the peer runs on this host in
    /// this pid namespace and its socket hands the memory files over (see
    /// [`super::shm_handover`]). None if nothing could be mapped (the transfer then takes
    /// the TCP lane or UCX).
    pub(crate) fn open(meta: &Metadata, me: Option<&HostInfo>) -> Option<PeerMaps> {
        let (me, them) = (me?, meta.host.as_ref()?);
        if me.boot_id != them.boot_id || me.pid_ns != them.pid_ns {
            return None;
        }
        let info = kvxfer_proto::wire::lane_entries::shm_of(&meta.lanes)?;
        // A mapping is a VMA of this process (vm.max_map_count, 65,530 by default): one peer
        // maps at most MAX_PEER_MAPPINGS regions, all peers at most MAX_MAPPINGS.
        let declared = meta.regions.iter().filter(|r| r.shm.is_some()).count();
        let live = crate::live::live().peer_mappings;
        if declared > MAX_PEER_MAPPINGS || live + declared > MAX_MAPPINGS {
            log::warn!(
                "kvxfer: {:?} declares {declared} shared regions (at most {MAX_PEER_MAPPINGS} a peer, {MAX_MAPPINGS} in all, {live} mapped now): none mapped, its transfers take the TCP lane or UCX",
                meta.name
            );
            return None;
        }
        // The process first: the files handed over next are then known to be this
        // process's (the socket's owner is checked to be it).
        let process = PeerProcess::open(them.pid);
        let mut files = match super::shm_handover::take(&info, them.pid, MAX_PEER_MAPPINGS) {
            Ok(f) => f.files,
            Err(e) => {
                log::info!(
                    "kvxfer: {:?} handed over no memory files ({e}); its transfers take the TCP lane or UCX",
                    meta.name
                );
                return None;
            }
        };
        let control = match files.iter().position(|(e, _)| e.region == CONTROL_REGION) {
            Some(at) => ControlMap::map(files.swap_remove(at).1),
            None => Err(Error::InvalidArgument("no registration page".into())),
        };
        let control = match control {
            Ok(c) => c,
            Err(e) => {
                log::info!(
                    "kvxfer: {:?}'s registration page ({e}); its transfers take the TCP lane or UCX",
                    meta.name
                );
                return None;
            }
        };
        let mut any = false;
        let maps: Vec<Option<Mapping>> = meta
            .regions
            .iter()
            .map(|r| {
                let h = r.shm?;
                let at = files.iter().position(|(e, _)| e.region == r.id.0)?;
                let (entry, fd) = files.swap_remove(at);
                match map_region(fd, h, entry.len.min(r.len), r.len, r.base, r.id.0) {
                    Ok(m) => {
                        any = true;
                        Some(m)
                    }
                    Err(e) => {
                        log::info!(
                            "kvxfer: cannot map region {} of {:?} ({e}); it goes over UCX",
                            r.id.0,
                            meta.name
                        );
                        None
                    }
                }
            })
            .collect();
        any.then_some(PeerMaps {
            maps,
            process,
            control,
        })
    }

    /// Makes the mappings of `plan`'s remote slots writable: they are mapped read-only, and
    /// only a WRITE into a region makes its mapping writable (once).
    fn writable(&self, plan: &Work) -> bool {
        plan.slot_runs(true)
            .all(|s| match self.maps.get(s as usize) {
                Some(Some(m)) => m.make_writable(),
                _ => false,
            })
    }

    /// The first region of `plan`'s remote side that its owner has deregistered, if any.
    fn deregistered(&self, plan: &Work) -> Option<u32> {
        plan.slot_runs(true).find_map(|s| {
            let m = self.maps.get(s as usize)?.as_ref()?;
            (!self.control.alive(m.region)).then_some(m.region)
        })
    }

    /// Whether every remote range of `plan` lies in a mapped region.
    pub(crate) fn covers(&self, plan: &Work) -> bool {
        plan.slot_runs(true)
            .all(|s| matches!(self.maps.get(s as usize), Some(Some(_))))
    }

    /// The local pointer for `len` bytes at the peer's address `addr` in slot `slot`.
    fn ptr(&self, slot: u32, addr: u64, len: u64) -> Option<*mut u8> {
        let m = self.maps.get(slot as usize)?.as_ref()?;
        let off = addr.checked_sub(m.base)?;
        if off.checked_add(len)? > m.len as u64 {
            return None;
        }
        // SAFETY: off + len <= m.len, so the result stays inside the mapping.
        Some(unsafe { m.ptr.add(off as usize) })
    }
}

/// Maps the memory file `fd` a peer's socket handed over for the region `h` describes (`len`
/// bytes at the peer's address `base`), read-only. `handed` is the length the hand-over
/// gave; both must fit the file.
fn map_region(
    fd: OwnedFd,
    h: kvxfer_proto::wire::metadata::ShmHandle,
    handed: u64,
    len: u64,
    base: u64,
    region: u32,
) -> Result<Mapping> {
    let what = format!("the memory file handed over for {:#x}", base);
    // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open; st is a valid out pointer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(Error::io(
            format!("fstat {what}"),
            std::io::Error::last_os_error(),
        ));
    }
    if st.st_dev != h.dev || st.st_ino != h.ino {
        return Err(Error::InvalidArgument(format!(
            "{what} is not the file the peer's metadata names (dev/ino differ)"
        )));
    }
    // Only a memory file the way kvxfer makes them: a memfd whose size is sealed (so a
    // mapping of it cannot fault), owned by this user, holding the region.
    crate::memory::check_sealed_file(&fd, len, &what)?;
    if handed < len {
        return Err(Error::InvalidArgument(format!(
            "{what} was handed over as {handed} bytes, the region {len}"
        )));
    }
    let reserved = MAPPED_BYTES.fetch_add(len, Ordering::SeqCst);
    if reserved.saturating_add(len) > MAX_MAPPED_BYTES {
        MAPPED_BYTES.fetch_sub(len, Ordering::SeqCst);
        return Err(Error::InvalidArgument(format!(
            "{what}: {len} bytes more would map past {MAX_MAPPED_BYTES} bytes of peers' memory \
             ({reserved} mapped now)"
        )));
    }
    let len = len as usize;
    // Read-only until a WRITE needs it (`make_writable`), and not populated: pages are
    // mapped as transfers touch them, so a peer's declared size costs nothing at connect.
    let p = crate::memory::map_shared(&fd, len, false, &what).inspect_err(|_| {
        MAPPED_BYTES.fetch_sub(len as u64, Ordering::SeqCst);
    })?;
    Ok(Mapping {
        ptr: p,
        len,
        base,
        writable: AtomicBool::new(false),
        region,
        _live: crate::live::Counted::peer_mapping(),
    })
}

/// A transfer into or out of region `id` of `peer`, which its owner deregistered `when`.
fn deregistered(peer: &str, id: u32, when: &str) -> Error {
    Error::LaneFailed {
        agent: peer.to_string(),
        lane: "shm",
        why: format!("region {id} of the peer was deregistered {when}: refused"),
    }
}

/// One transfer being copied by the copy threads.
struct ShmJob {
    job: Job,
    maps: Arc<PeerMaps>,
    /// Chunks not yet finished.
    left: AtomicUsize,
    /// Operations done (for deadline reports).
    done_ops: AtomicUsize,
    error: Mutex<Option<Error>>,
    /// Set with `error`: checked per operation without taking the lock.
    failed: std::sync::atomic::AtomicBool,
    carrier: NoteCarrier,
}

struct Task {
    job: Arc<ShmJob>,
    /// Byte range of the transfer's concatenated operations.
    from: u64,
    to: u64,
}

/// The copy threads of one agent.
pub(crate) struct Copier {
    tx: Mutex<Option<mpsc::Sender<Task>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    n: usize,
    carrier: NoteCarrier,
}

/// Transfers smaller than this are copied by one thread.
const SPLIT_MIN: u64 = 4 << 20;

impl Copier {
    pub(crate) fn start(name: &str, n: usize, carrier: NoteCarrier) -> Result<Copier> {
        let (tx, rx) = mpsc::channel::<Task>();
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::with_capacity(n);
        for i in 0..n.max(1) {
            let rx = rx.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvxfer-copy-{name}-{i}"))
                    .spawn(move || loop {
                        let t = {
                            let g = rx.lock().unwrap_or_else(|e| e.into_inner());
                            g.recv()
                        };
                        match t {
                            Ok(t) => run(t),
                            Err(_) => return,
                        }
                    })
                    .map_err(|e| Error::io("spawning a copy thread", e))?,
            );
        }
        Ok(Copier {
            tx: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
            n: n.max(1),
            carrier,
        })
    }

    /// Starts copying `job` through `maps`. The job's regions are pinned by the caller.
    pub(crate) fn submit(&self, job: Job, maps: Arc<PeerMaps>) {
        let total = job.plan.bytes();
        let parts = if total < SPLIT_MIN { 1 } else { self.n as u64 };
        let j = Arc::new(ShmJob {
            job,
            maps,
            left: AtomicUsize::new(parts as usize),
            done_ops: AtomicUsize::new(0),
            error: Mutex::new(None),
            failed: std::sync::atomic::AtomicBool::new(false),
            carrier: self.carrier.clone(),
        });
        if j.maps.process.exited() {
            let e = exited_error(&j.maps.process, &j.job.peer, "before the transfer");
            fail_all(j, e);
            return;
        }
        if let Some(id) = j.maps.deregistered(&j.job.plan) {
            let e = deregistered(&j.job.peer, id, "before the transfer");
            fail_all(j, e);
            return;
        }
        if j.job.op == XferOp::Write && !j.maps.writable(&j.job.plan) {
            let e = Error::LaneFailed {
                agent: j.job.peer.clone(),
                lane: "shm",
                why: format!(
                    "a peer region could not be made writable: {}",
                    std::io::Error::last_os_error()
                ),
            };
            fail_all(j, e);
            return;
        }
        let g = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = g.as_ref() else {
            drop(g);
            fail_all(j, Error::Shutdown);
            return;
        };
        // Cut at 4 KiB multiples so that each thread copies whole pages where it can.
        let step = (total / parts).next_multiple_of(4096);
        for k in 0..parts {
            let from = (k * step).min(total);
            let to = if k + 1 == parts {
                total
            } else {
                ((k + 1) * step).min(total)
            };
            if tx
                .send(Task {
                    job: j.clone(),
                    from,
                    to,
                })
                .is_err()
            {
                // The threads are gone (agent shutting down): account for the unsent chunk.
                set_error(&j, Error::Shutdown);
                chunk_done(&j);
            }
        }
    }

    /// Stops the threads after the queued copies.
    pub(crate) fn stop(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

fn fail_all(j: Arc<ShmJob>, e: Error) {
    set_error(&j, e);
    let n = j.left.load(Ordering::Acquire);
    for _ in 0..n {
        chunk_done(&j);
    }
}

fn set_error(j: &ShmJob, e: Error) {
    j.error
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert(e);
    j.failed.store(true, Ordering::Release);
}

fn run(t: Task) {
    let j = &t.job;
    let write = j.job.op == XferOp::Write;
    let deadline_at = j.job.deadline.map(|d| j.job.started + d);
    let mut at = 0u64; // byte offset of the current op in the transfer
    let mut ops_done = 0usize;
    for o in j.job.plan.ops() {
        let (start, end) = (at, at + o.len);
        at = end;
        if end <= t.from {
            continue;
        }
        if start >= t.to {
            break;
        }
        if j.job.state.is_canceled() {
            set_error(j, Error::Canceled);
            break;
        }
        if deadline_at.is_some_and(|d| Instant::now() >= d) {
            set_error(
                j,
                Error::Deadline {
                    agent: j.job.peer.clone(),
                    deadline: j.job.deadline.unwrap_or_default(),
                    posted_ops: j.done_ops.load(Ordering::Relaxed),
                    ops: j.job.plan.ops().len(),
                },
            );
            break;
        }
        if j.failed.load(Ordering::Acquire) {
            break;
        }
        let a = t.from.max(start) - start;
        let b = t.to.min(end) - start;
        let len = b - a;
        let Some(remote) = j.maps.ptr(o.rslot, o.remote + a, len) else {
            set_error(
                j,
                Error::LaneFailed {
                    agent: j.job.peer.clone(),
                    lane: "shm",
                    why: format!("range {:#x}+{len} is not mapped", o.remote + a),
                },
            );
            break;
        };
        let local = (o.local + a) as *mut u8;
        // SAFETY: the local range was bounds-checked against a registered host region pinned
        // by this job (inflight) until completion; the remote range lies inside a live shared
        // mapping (checked by `ptr`) held by `maps`. The two are distinct memory unless a user
        // registered one buffer in two agents of one process, which `copy` (memmove) tolerates.
        unsafe {
            if write {
                std::ptr::copy(local, remote, len as usize);
            } else {
                std::ptr::copy(remote, local, len as usize);
            }
        }
        ops_done += 1;
    }
    j.done_ops.fetch_add(ops_done, Ordering::Relaxed);
    chunk_done(&t.job);
}

fn chunk_done(j: &Arc<ShmJob>) {
    if j.left.fetch_sub(1, Ordering::AcqRel) != 1 {
        return;
    }
    // The last chunk: every store of every thread happened before this point (AcqRel above);
    // the fence orders them before the notification send.
    std::sync::atomic::fence(Ordering::SeqCst);
    let job = &j.job;
    let mut error = j.error.lock().unwrap_or_else(|e| e.into_inner()).take();
    if error.is_none() {
        if let Some(id) = j.maps.deregistered(&job.plan) {
            error = Some(deregistered(&job.peer, id, "during the transfer"));
        }
    }
    if error.is_none() && j.maps.process.exited() {
        error = Some(exited_error(
            &j.maps.process,
            &job.peer,
            "during the transfer",
        ));
    }
    let stats = job.stats(Lane::Shm, job.started.elapsed());
    if let Some(e) = error {
        job.finish(Err(e));
        return;
    }
    match &job.notification {
        None => job.finish(Ok(stats)),
        Some(_) => {
            // The data is in place: the notification goes over UCX's active messages.
            job.pins.release();
            if let Err(e) = (j.carrier)(job.notification_carrier(stats)) {
                job.finish(Err(e));
            }
        }
    }
}

/// The shared-memory lane as an agent holds it: its copy threads, and this host's identity
/// to tell a same-host peer.
pub(crate) struct ShmLane {
    copier: Arc<Copier>,
    host: Option<HostInfo>,
    /// Hands this agent's memory files to same-host peers of this user.
    handover: super::shm_handover::HandOver,
}

impl ShmLane {
    /// The lane, where the transport lets in-host peers be mapped (`Shm`, `Auto`; an explicit
    /// TCP or UCX list is taken at its word).
    pub(crate) fn start(setup: &LaneSetup) -> Result<Option<Box<dyn LaneKind>>> {
        if !matches!(setup.transport, Transport::Shm | Transport::Auto) {
            return Ok(None);
        }
        let copier = Copier::start(
            &setup.name,
            setup.config.shm.copy_threads,
            setup.notifier.clone(),
        )?;
        let handover = super::shm_handover::HandOver::start(
            &setup.name,
            setup.ctx.regions.clone(),
            super::shm_handover::Serves::HostFiles,
        )?;
        Ok(Some(Box::new(ShmLane {
            copier: Arc::new(copier),
            host: setup.host,
            handover,
        })))
    }
}

impl LaneKind for ShmLane {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn advertise(&self) -> Option<LaneEntry> {
        Some(LaneEntry::shm(&self.handover.info()))
    }

    fn open(&self, meta: &Metadata) -> Option<Arc<dyn PeerLane>> {
        let maps = PeerMaps::open(meta, self.host.as_ref())?;
        Some(Arc::new(ShmPeer {
            maps: Arc::new(maps),
            copier: self.copier.clone(),
        }))
    }

    fn region_gone(&self, id: u32) {
        self.handover.gone(id);
    }

    fn stop(&self) {
        self.copier.stop();
        self.handover.stop();
    }
}

/// The shared-memory lane towards one same-host peer: its regions mapped here.
struct ShmPeer {
    maps: Arc<PeerMaps>,
    copier: Arc<Copier>,
}

impl PeerLane for ShmPeer {
    fn lane(&self) -> Lane {
        Lane::Shm
    }

    /// Host memory only, every peer region of the plan mapped.
    fn carries(&self, q: &Query<'_>) -> bool {
        !q.device && !q.host_unmapped && self.maps.covers(q.plan)
    }

    fn submit(&self, job: Job) {
        self.copier.submit(job, self.maps.clone());
    }
}
