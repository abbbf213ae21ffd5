//! The device lane: GPU memory of a same-host peer, the device counterpart of the shm lane.
//! Each registered device allocation is exported once (`CopyEngine::export`: a legacy CUDA
//! IPC handle, or a file descriptor for virtual-memory allocations and the simulated device)
//! and handed to same-host peers of this user by the lane's own hand-over socket
//! ([`super::shm_handover`], `SO_PEERCRED` and a token, descriptors by `SCM_RIGHTS`). A peer
//! opens each allocation on first use, on the device of its own memory in the transfer, and
//! keeps it open for as long as it keeps the owner's metadata (one incarnation).
//!
//! A transfer is one submission per table of copies ([`kvxfer_proto::copy_batch`]: a
//! thousand-block paged request is one table), on the copy engine's stream of the highest
//! priority; the notification goes once the stream has finished the copies, never before.
//! Like the shm lane it refuses a region its owner deregistered (the owner's registration
//! page) and a peer whose process has exited.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::api::{LaneKind, LaneSetup, PeerLane, Query};
use super::shm_handover::{ControlMap, HandOver, Serves};
use crate::device::copy::{Exported, Opened};
use crate::host::PeerProcess;
use crate::memory::RegionInner;
use crate::staging::pool::StagingCell;
use crate::transfer::{Job, NoteCarrier};
use kvxfer_proto::copy_batch::{batches, BatchLimits, CopyRange};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::{Lane, MemKind, Transport, XferOp};
use kvxfer_proto::wire::lane_entries::LaneEntry;
use kvxfer_proto::wire::metadata::{HostInfo, Metadata};
use kvxfer_proto::wire::shm_fds::{DeviceEntry, CONTROL_REGION};

/// Device regions of one peer the lane takes at most.
const MAX_PEER_REGIONS: usize = 4096;

/// The device lane as an agent holds it.
pub(crate) struct DeviceLane {
    host: Option<HostInfo>,
    handover: HandOver,
    exports: Exports,
    worker: Arc<Worker>,
}

/// This agent's exported device regions, by region id: each exported once, on first ask.
#[derive(Clone)]
struct Exports {
    staging: Arc<StagingCell>,
    by_region: Arc<Mutex<HashMap<u32, Arc<Exported>>>>,
}

impl Exports {
    fn get(&self, r: &RegionInner) -> Option<Arc<Exported>> {
        let MemKind::Cuda(device) = r.kind else {
            return None;
        };
        if r.restricted {
            // Shared with named peers only: a mapping would open all of it to any peer.
            return None;
        }
        let mut g = self.by_region.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(x) = g.get(&r.id.0) {
            return Some(x.clone());
        }
        let engine = self.staging.engine(device).ok()?;
        match engine.export(device, r.addr, r.len) {
            Ok(x) => {
                let x = Arc::new(x);
                g.insert(r.id.0, x.clone());
                Some(x)
            }
            Err(e) => {
                log::info!(
                    "kvxfer: device region {} is not exported to same-host peers ({e}); they \
                     reach it over UCX or the staged path",
                    r.id.0
                );
                None
            }
        }
    }
}

impl DeviceLane {
    /// The lane, where the transport lets in-host peers be reached directly (`Shm`, `Auto`)
    /// and the configuration leaves it on.
    pub(crate) fn start(setup: &LaneSetup) -> Result<Option<Box<dyn LaneKind>>> {
        if !setup.config.device || !matches!(setup.transport, Transport::Shm | Transport::Auto) {
            return Ok(None);
        }
        let exports = Exports {
            staging: setup.ctx.staging.clone(),
            by_region: Arc::default(),
        };
        let serves = Serves::Devices(Arc::new({
            let exports = exports.clone();
            move |r: &RegionInner| exports.get(r)
        }));
        let handover = HandOver::start(&setup.name, setup.ctx.regions.clone(), serves)?;
        Ok(Some(Box::new(DeviceLane {
            host: setup.host,
            handover,
            exports,
            worker: Arc::new(Worker::start(
                &setup.name,
                Held {
                    staging: setup.ctx.staging.clone(),
                    budget: setup.ctx.budget.clone(),
                    wait: setup.ctx.stall,
                },
                setup.notifier.clone(),
            )?),
        })))
    }
}

impl LaneKind for DeviceLane {
    fn name(&self) -> &'static str {
        "device"
    }

    fn advertise(&self) -> Option<LaneEntry> {
        Some(LaneEntry::device(&self.handover.info()))
    }

    fn open(&self, meta: &Metadata) -> Option<Arc<dyn PeerLane>> {
        let own = meta
            .host
            .as_ref()
            .is_some_and(|h| h.pid == std::process::id());
        if own && !self.exports.staging.engine(0).ok()?.opens_own_exports() {
            return None;
        }
        let peer = DevicePeer::open(meta, self.host.as_ref())?;
        Some(Arc::new(DevicePeerLane {
            peer: Arc::new(peer),
            worker: self.worker.clone(),
        }))
    }

    fn region_gone(&self, id: u32) {
        self.handover.gone(id);
        // Peers that opened it keep the allocation open until they let the metadata go; the
        // registration page tells them it is gone, and a new registration exports anew.
        self.exports
            .by_region
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    fn stop(&self) {
        self.worker.stop();
        self.handover.stop();
    }
}

/// One exported region of a peer, and where it is opened here.
struct PeerRegion {
    entry: DeviceEntry,
    file: Option<OwnedFd>,
    /// The region's base address in the peer (what descriptors carry).
    base: u64,
    /// Opened per local device, on first use.
    opened: Mutex<HashMap<u32, Arc<dyn Opened>>>,
}

/// A same-host peer's exported device regions, by slot in its region table.
struct DevicePeer {
    name: String,
    regions: Vec<Option<PeerRegion>>,
    process: PeerProcess,
    control: ControlMap,
}

impl DevicePeer {
    fn open(meta: &Metadata, me: Option<&HostInfo>) -> Option<DevicePeer> {
        let (me, them) = (me?, meta.host.as_ref()?);
        if me.boot_id != them.boot_id || me.pid_ns != them.pid_ns {
            return None;
        }
        let info = kvxfer_proto::wire::lane_entries::device_of(&meta.lanes)?;
        if !meta.regions.iter().any(|r| r.kind != MemKind::Host) {
            return None;
        }
        let process = PeerProcess::open(them.pid);
        let handed = match super::shm_handover::take(&info, them.pid, MAX_PEER_REGIONS) {
            Ok(h) => h,
            Err(e) => {
                log::info!(
                    "kvxfer: {:?} handed over no device exports ({e}); its device memory \
                     moves over UCX or the staged path",
                    meta.name
                );
                return None;
            }
        };
        let control = handed
            .files
            .into_iter()
            .find(|(e, _)| e.region == CONTROL_REGION)
            .map(|(_, fd)| ControlMap::map(fd));
        let control = match control {
            Some(Ok(c)) => c,
            other => {
                log::info!(
                    "kvxfer: {:?}'s device lane gave no registration page ({:?})",
                    meta.name,
                    other.map(|r| r.err())
                );
                return None;
            }
        };
        let mut devices = handed.devices;
        let mut any = false;
        let regions = meta
            .regions
            .iter()
            .map(|r| {
                if r.kind == MemKind::Host {
                    return None;
                }
                let at = devices.iter().position(|(e, _)| e.region == r.id.0)?;
                let (entry, file) = devices.swap_remove(at);
                // The metadata's length is what descriptors were checked against.
                if entry.len < r.len {
                    log::info!(
                        "kvxfer: {:?} exported {} bytes of device region {}, its metadata \
                         says {}: not used",
                        meta.name,
                        entry.len,
                        r.id.0,
                        r.len
                    );
                    return None;
                }
                any = true;
                Some(PeerRegion {
                    entry,
                    file,
                    base: r.base,
                    opened: Mutex::default(),
                })
            })
            .collect();
        any.then(|| DevicePeer {
            name: meta.name.clone(),
            regions,
            process,
            control,
        })
    }

    /// The region in slot `slot`, opened on `device` (once).
    fn opened(&self, slot: u32, device: u32, staging: &StagingCell) -> Result<(u64, u64)> {
        let r = self
            .regions
            .get(slot as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| self.failed(format!("slot {slot} is not an exported device region")))?;
        let mut g = r.opened.lock().unwrap_or_else(|e| e.into_inner());
        let o = match g.get(&device) {
            Some(o) => o.clone(),
            None => {
                let engine = staging.engine(device)?;
                let o: Arc<dyn Opened> = Arc::from(
                    engine
                        .open(device, &r.entry.handle, r.file.as_ref(), r.entry.size)
                        .map_err(|e| {
                            self.failed(format!(
                                "its device region {} does not open here: {e}",
                                r.entry.region
                            ))
                        })?,
                );
                g.insert(device, o.clone());
                o
            }
        };
        // The region's first byte here, and its base in the peer.
        Ok((o.base() + r.entry.offset, r.base))
    }

    fn failed(&self, why: String) -> Error {
        Error::LaneFailed {
            agent: self.name.clone(),
            lane: "device",
            why,
        }
    }

    /// The first region of `job`'s remote side its owner has deregistered, if any.
    fn deregistered(&self, job: &Job) -> Option<u32> {
        job.plan.slot_runs(true).find_map(|s| {
            let r = self.regions.get(s as usize)?.as_ref()?;
            (!self.control.alive(r.entry.region)).then_some(r.entry.region)
        })
    }
}

/// The device lane towards one peer.
struct DevicePeerLane {
    peer: Arc<DevicePeer>,
    worker: Arc<Worker>,
}

impl PeerLane for DevicePeerLane {
    fn lane(&self) -> Lane {
        Lane::Device
    }

    /// Device memory on both sides of every operation, the local side on one device, every
    /// remote region exported to this agent.
    fn carries(&self, q: &Query<'_>) -> bool {
        let ops = q.plan.op_count();
        if !q.device || q.local_devices.len() != ops || ops == 0 {
            return false;
        }
        let first = q.local_devices[0];
        first.is_some()
            && q.local_devices.iter().all(|d| *d == first)
            && q.plan
                .slot_runs(true)
                .all(|s| matches!(self.peer.regions.get(s as usize), Some(Some(_))))
    }

    fn submit(&self, job: Job) {
        self.worker.submit(job, self.peer.clone());
    }
}

/// What the lane's thread uses: the copy engines, and the budget its copy lists and tables
/// are charged to (waiting up to `wait` for room).
struct Held {
    staging: Arc<StagingCell>,
    budget: crate::budget::MemoryBudget,
    wait: std::time::Duration,
}

/// Bytes a transfer's working set takes per copy: the copy in the list (24) and its entry in
/// the table (three words).
const BYTES_PER_COPY: u64 = 48;

/// A transfer waiting for the lane's thread, and the peer it goes to.
type Queued = (Job, Arc<DevicePeer>);

/// The thread that runs the lane's transfers, one after another (the device runs them on one
/// stream anyway).
struct Worker {
    tx: Mutex<Option<mpsc::Sender<Queued>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Worker {
    fn start(name: &str, held: Held, carrier: NoteCarrier) -> Result<Worker> {
        let (tx, rx) = mpsc::channel::<Queued>();
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-device-{name}"))
            .spawn(move || {
                while let Ok((job, peer)) = rx.recv() {
                    run(job, &peer, &held, &carrier);
                }
            })
            .map_err(|e| Error::io("spawning the device lane's thread", e))?;
        Ok(Worker {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    fn submit(&self, job: Job, peer: Arc<DevicePeer>) {
        let g = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        match g.as_ref() {
            Some(tx) => {
                if let Err(mpsc::SendError((job, _))) = tx.send((job, peer)) {
                    job.finish(Err(Error::Shutdown));
                }
            }
            None => job.finish(Err(Error::Shutdown)),
        }
    }

    /// Stops the thread after the queued transfers.
    fn stop(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// The device the job's local memory is on (the route checked it is one).
fn local_device(job: &Job) -> Option<u32> {
    job.pins.regions().iter().find_map(|r| match r.kind {
        MemKind::Cuda(d) => Some(d),
        MemKind::Host => None,
    })
}

/// Moves one transfer: its copies as tables, each one submission, then the notification.
fn run(job: Job, peer: &DevicePeer, held: &Held, carrier: &NoteCarrier) {
    let r = copy(&job, peer, held);
    let r = r.and_then(|()| {
        // What happened while the copies ran: the region given up, the process gone.
        if let Some(id) = peer.deregistered(&job) {
            return Err(peer.failed(format!(
                "region {id} of the peer was deregistered during the transfer: refused"
            )));
        }
        if peer.process.exited() {
            return Err(peer.failed(format!(
                "the peer's process (pid {}) has exited during the transfer",
                peer.process.pid()
            )));
        }
        Ok(())
    });
    let stats = job.stats(Lane::Device, job.started.elapsed());
    match (r, &job.notification) {
        (Err(e), _) => job.finish(Err(e)),
        (Ok(()), None) => job.finish(Ok(stats)),
        (Ok(()), Some(_)) => {
            // The stream has finished: the data is in place before the notification leaves.
            job.pins.release();
            if let Err(e) = carrier(job.notification_carrier(stats)) {
                job.finish(Err(e));
            }
        }
    }
}

fn copy(job: &Job, peer: &DevicePeer, held: &Held) -> Result<()> {
    let staging = &*held.staging;
    if job.state.is_canceled() {
        return Err(Error::Canceled);
    }
    if let Some(d) = job.deadline {
        if Instant::now() >= job.started + d {
            return Err(Error::Deadline {
                agent: job.peer.clone(),
                deadline: d,
                posted_ops: 0,
                ops: job.plan.op_count(),
            });
        }
    }
    if peer.process.exited() {
        return Err(peer.failed(format!(
            "the peer's process (pid {}) has exited before the transfer",
            peer.process.pid()
        )));
    }
    if let Some(id) = peer.deregistered(job) {
        return Err(peer.failed(format!(
            "region {id} of the peer was deregistered before the transfer: refused"
        )));
    }
    let device = local_device(job)
        .ok_or_else(|| peer.failed("the transfer has no local device memory".into()))?;
    // The remote side's addresses here: the peer's address less its region's base, plus
    // where that region lies in the allocation opened on this device.
    // A KV plan's blocks come in runs of one region: the last slot's answer is kept. Tables
    // are submitted as they fill, so the device copies one while the next is built.
    let mut q = staging.engine(device)?.queue(device)?;
    let limits = BatchLimits::DEVICE;
    let entries = job.plan.op_count().min(limits.max_entries) as u64;
    let _charged = held.budget.charge(
        entries * BYTES_PER_COPY,
        "the device lane's copy list and table",
        held.wait,
    )?;
    let mut last: Option<(u32, (u64, u64))> = None;
    let mut copies = Vec::with_capacity(job.plan.op_count().min(limits.max_entries));
    let mut submit = |copies: &mut Vec<CopyRange>| -> Result<()> {
        let tables = batches(copies.drain(..), &limits)
            .map_err(|e| peer.failed(format!("the transfer's copies: {e}")))?;
        for t in &tables {
            // SAFETY: local ranges were checked against regions pinned by the job until it
            // finishes; remote ranges were checked against the peer's regions when the
            // descriptors were prepared, and lie in allocations opened on `device`, kept open
            // by `peer` (held by the caller).
            unsafe { q.copy_batch(t)? };
        }
        Ok(())
    };
    for o in job.plan.iter_ops() {
        let (here, base) = match last {
            Some((slot, v)) if slot == o.rslot => v,
            _ => {
                let v = peer.opened(o.rslot, device, staging)?;
                last = Some((o.rslot, v));
                v
            }
        };
        let remote = here + (o.remote - base);
        copies.push(match job.op {
            XferOp::Write => CopyRange {
                src: o.local,
                dst: remote,
                len: o.len,
            },
            XferOp::Read => CopyRange {
                src: remote,
                dst: o.local,
                len: o.len,
            },
        });
        if copies.len() == limits.max_entries {
            submit(&mut copies)?;
        }
    }
    submit(&mut copies)?;
    q.sync()
}
