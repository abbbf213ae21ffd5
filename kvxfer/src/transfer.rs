//! Transfer handles: await (any executor), poll, wait with a timeout, cancel. Dropping a handle
//! only detaches the waiter: the progress engine keeps the registrations alive until UCX reports
//! completion, so no buffer is ever freed while UCX may still touch it.
#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::memory::Pins;
use kvxfer_proto::descriptor::{Op, Plan};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::paged::PagedPlan;
use kvxfer_proto::types::{Lane, XferOp};

/// What a completed transfer did, for telemetry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XferStats {
    /// The peer.
    pub peer: String,
    /// Direction.
    pub op: XferOp,
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptor pairs asked for.
    pub descs: usize,
    /// UCX operations posted after coalescing and splitting.
    pub ops: usize,
    /// From the call that created the transfer until its last operation was posted.
    pub post_time: Duration,
    /// From the call that created the transfer until completion (and notification) was reported.
    pub duration: Duration,
    /// Which lane moved the bytes.
    pub lane: Lane,
    /// Bytes of data that crossed the wire: `bytes`, or fewer when the TCP lane compressed
    /// them (frame headers included).
    pub wire_bytes: u64,
    /// This side's time coding the data (compressing a write, decompressing a read); zero
    /// when it moved raw.
    pub codec_time: Duration,
}

#[derive(Default)]
struct Slot {
    result: Option<Result<XferStats>>,
    done: bool,
    waker: Option<Waker>,
}

/// State shared between a [`Transfer`] handle and the progress engine.
#[derive(Default)]
pub(crate) struct XferState {
    slot: Mutex<Slot>,
    cv: Condvar,
    canceled: std::sync::atomic::AtomicBool,
}

impl XferState {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        // A poisoned lock only means a waiter panicked; the slot itself is always consistent.
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the transfer completed (UCX no longer touches its buffers, unless given up).
    pub(crate) fn is_done(&self) -> bool {
        self.lock().done
    }

    /// Whether the caller asked to cancel (the lanes poll this between steps).
    pub(crate) fn is_canceled(&self) -> bool {
        self.canceled.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Called once by the progress engine when UCX no longer touches the buffers.
    pub(crate) fn complete(&self, r: Result<XferStats>) {
        let waker = {
            let mut s = self.lock();
            s.result = Some(r);
            s.done = true;
            s.waker.take()
        };
        self.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// A transfer in flight. Created by [`Agent::transfer`](crate::Agent::transfer).
///
/// Await it, or call [`wait`](Self::wait) / [`wait_timeout`](Self::wait_timeout) from threads
/// without an async runtime, or [`is_done`](Self::is_done) to poll. [`cancel`](Self::cancel)
/// stops posting and returns once UCX no longer touches the buffers. Dropping it detaches.
pub struct Transfer {
    pub(crate) state: Arc<XferState>,
    pub(crate) id: u64,
    pub(crate) cancel: Canceller,
}

/// Asks whoever moves a transfer to stop it (by transfer id).
pub(crate) type Canceller = Arc<dyn Fn(u64) + Send + Sync>;

/// What a job moves: a flat list of operations, or paged runs ([`PagedPlan`]), which the TCP
/// lane carries as they are, over the wire too. The UCX engine and the shared-memory lane post
/// from a list: [`Agent::submit`](crate::agent::Agent) hands them the flat form, so they never
/// see a paged job.
pub(crate) enum Work {
    Flat(Plan),
    Paged(PagedPlan),
}

impl Default for Work {
    fn default() -> Self {
        Work::Flat(Plan::default())
    }
}

impl Work {
    pub(crate) fn bytes(&self) -> u64 {
        match self {
            Work::Flat(p) => p.bytes,
            Work::Paged(p) => p.bytes,
        }
    }

    /// Descriptor pairs (block pairs for a paged job).
    pub(crate) fn descs(&self) -> usize {
        match self {
            Work::Flat(p) => p.descs,
            Work::Paged(p) => p.blocks,
        }
    }

    /// Operations: the flat list's, or a paged job's block pairs (contiguous ones are merged
    /// as they move, so this is their most).
    pub(crate) fn op_count(&self) -> usize {
        match self {
            Work::Flat(p) => p.ops.len(),
            Work::Paged(p) => p.blocks,
        }
    }

    /// The flat list (empty for a paged job, which only the TCP lane receives).
    pub(crate) fn ops(&self) -> &[Op] {
        match self {
            Work::Flat(p) => &p.ops,
            Work::Paged(_) => &[],
        }
    }

    /// Every operation, in order, without building a list.
    pub(crate) fn iter_ops(&self) -> Box<dyn Iterator<Item = Op> + '_> {
        match self {
            Work::Flat(p) => Box::new(p.ops.iter().copied()),
            Work::Paged(p) => Box::new(p.ops()),
        }
    }

    /// The slots of the remote (`remote` true) or local side, each run of one slot once: a KV
    /// plan's thousands of blocks lie in a few regions, one after another, so per-region
    /// checks run per region.
    pub(crate) fn slot_runs(&self, remote: bool) -> impl Iterator<Item = u32> + '_ {
        let mut last = None;
        self.slots(remote)
            .filter(move |s| last.replace(*s) != Some(*s))
    }

    /// The region slots used on the local (`remote` false) or remote side, with repeats.
    pub(crate) fn slots(&self, remote: bool) -> Box<dyn Iterator<Item = u32> + '_> {
        match self {
            Work::Flat(p) => Box::new(
                p.ops
                    .iter()
                    .map(move |o| if remote { o.rslot } else { o.lslot }),
            ),
            Work::Paged(p) => {
                Box::new(p.runs.iter().map(
                    move |r| {
                        if remote {
                            r.remote.slot
                        } else {
                            r.local.slot
                        }
                    },
                ))
            }
        }
    }
}

/// What takes a notification-only job ([`Job::notification_carrier`]) once a transfer's data
/// has landed: UCX's active messages, or with a shared secret the sealed TCP lane.
pub(crate) type NoteCarrier = Arc<dyn Fn(Job) -> Result<()> + Send + Sync>;

/// A transfer as the agent hands it to the lane that moves it (the UCX engine, the shared
/// memory lane or the TCP lane). Its local regions are pinned for as long as it lives; it ends
/// in exactly one place, [`Job::finish`].
pub(crate) struct Job {
    pub(crate) id: u64,
    pub(crate) op: XferOp,
    pub(crate) peer: String,
    /// The peer entry the remote descriptors were prepared against.
    pub(crate) token: u64,
    pub(crate) plan: Work,
    /// The local regions the plan uses.
    pub(crate) pins: Pins,
    pub(crate) notification: Option<Vec<u8>>,
    pub(crate) deadline: Option<Duration>,
    pub(crate) started: Instant,
    pub(crate) state: Arc<XferState>,
    /// Set when a lane already moved the data and another only carries the notification.
    pub(crate) lane_stats: Option<XferStats>,
    /// Where the notification goes once UCX has moved the data, instead of UCX's active
    /// messages (with a shared secret: the sealed TCP lane, whose sender the receiver knows).
    pub(crate) note_via: Option<NoteCarrier>,
    /// Per plan operation, the device of its local memory (None: host); empty when the plan
    /// has no local device memory. The TCP lane stages those pieces.
    pub(crate) local_dev: Vec<Option<u32>>,
}

impl Job {
    /// What the job did, moved by `lane`, its last operation posted at `post_time`.
    pub(crate) fn stats(&self, lane: Lane, post_time: Duration) -> XferStats {
        XferStats {
            peer: self.peer.clone(),
            op: self.op,
            bytes: self.plan.bytes(),
            descs: self.plan.descs(),
            ops: self.plan.op_count(),
            post_time,
            duration: self.started.elapsed(),
            lane,
            wire_bytes: self.plan.bytes(),
            codec_time: Duration::ZERO,
        }
    }

    /// Ends the transfer: drops the pins, then reports `r` to the caller's handle. Called once,
    /// when no lane touches the job's memory any more.
    pub(crate) fn finish(&self, r: Result<XferStats>) {
        self.pins.release();
        self.state.complete(r);
    }

    /// A job that only carries this one's notification, after a lane moved its data with
    /// `stats` (the UCX engine sends it, ordered after earlier transfers to the peer).
    pub(crate) fn notification_carrier(&self, stats: XferStats) -> Job {
        Job {
            id: self.id,
            op: self.op,
            peer: self.peer.clone(),
            token: self.token,
            plan: Work::default(),
            pins: Pins::default(),
            notification: self.notification.clone(),
            deadline: self.deadline,
            started: self.started,
            state: self.state.clone(),
            lane_stats: Some(stats),
            note_via: None,
            local_dev: Vec::new(),
        }
    }
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("id", &self.id)
            .field("done", &self.is_done())
            .finish()
    }
}

impl Transfer {
    /// Whether the transfer has completed (successfully or not).
    pub fn is_done(&self) -> bool {
        self.state.lock().done
    }

    /// Blocks until the transfer completes.
    pub fn wait(self) -> Result<XferStats> {
        let mut s = self.state.lock();
        while !s.done {
            s = self.state.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        take(&mut s)
    }

    /// Blocks up to `timeout`. On time-out the transfer goes on and the handle stays usable:
    /// the error is [`Error::WaitTimeout`].
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<XferStats> {
        let end = Instant::now() + timeout;
        let mut s = self.state.lock();
        while !s.done {
            let now = Instant::now();
            if now >= end {
                return Err(Error::WaitTimeout(timeout));
            }
            s = self
                .state
                .cv
                .wait_timeout(s, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        take(&mut s)
    }

    /// Cancels: no further operation is posted; returns once every posted operation is done
    /// and UCX no longer touches the buffers. Returns the result if the transfer completed
    /// before the cancel took effect, else [`Error::Canceled`].
    pub fn cancel(self) -> Result<XferStats> {
        self.state
            .canceled
            .store(true, std::sync::atomic::Ordering::Release);
        (self.cancel)(self.id);
        self.wait()
    }
}

fn take(s: &mut Slot) -> Result<XferStats> {
    s.result.take().unwrap_or(Err(Error::InvalidArgument(
        "transfer result was already taken".into(),
    )))
}

impl Future for Transfer {
    type Output = Result<XferStats>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.state.lock();
        if s.done {
            return Poll::Ready(take(&mut s));
        }
        match &s.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}
