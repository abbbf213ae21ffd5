//! The lane's initiator: one queue per peer, served in order by one thread; each job is a
//! request, its data, and the target's reply, over one connection, or striped over several
//! (one scoped thread each) with the notification sent once all of them have landed.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::conn::Conn;
use super::dial::{close_all, lost_connection, Dialer, Sealing, CONNECT_TIMEOUT};
use super::framed::{FramesFailed, RECV_BYTES, SEND_BYTES};
use super::mixed::{stage_pair, stream_mixed, stream_windows, Framing};
use super::stream::{Ctl, Stop};
use crate::budget::MemoryBudget;
use crate::codec_meter::CodecMeter;
use crate::staging::pool::StagingCell;
use crate::transfer::Work;
use crate::transfer::{Job, XferStats};
use kvxfer_proto::compress::codec::CodecTally;
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::{
    blend, decide, CodecRates, Compression, Decision, Estimates, MIN_BYTES,
};
use kvxfer_proto::descriptor::Op;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::lane::{ReplyError, PIECE_BYTES};
use kvxfer_proto::lane_request::{LaneRequest, Step, Table};
use kvxfer_proto::paged::{Paged, ResolvedPaged, Run, WINDOW_BLOCKS};
use kvxfer_proto::types::{Lane, LaneInfo, RegionSpan, XferOp};
use kvxfer_proto::wire::lane::{ReplyHeader, Segment, HEADER_LEN, MAX_SEGS, REPLY_FIXED_LEN};

/// Transfers below this go over one connection even when striping is on: one connection moves
/// them at full speed, and every stripe costs a thread and a request.
pub(crate) const STRIPE_MIN_BYTES: u64 = 16 << 20;

struct LinkJob {
    job: Job,
    /// The target's fence count this agent had learned when the job was queued: its
    /// connections' hellos name it, and the target refuses them if it fenced this agent since.
    epoch: u64,
}

/// How a link compresses: its peer's mode and configured link rate, the transform, and the
/// agent's codec measurements.
pub(crate) struct Compressor {
    pub(crate) policy: (Compression, Option<f64>),
    pub(crate) transform: Transform,
    pub(crate) meter: Arc<CodecMeter>,
    /// Threads coding a compressed write (the peer is assumed to code its reads with as many).
    pub(crate) threads: usize,
}

/// What the link measured of itself.
#[derive(Default)]
struct LinkRate {
    /// Bytes per second of its raw transfers of [`MIN_BYTES`] or more.
    measured: Option<f64>,
    /// Compressed transfers since the last raw one.
    since_raw: u32,
}

struct LinkInner {
    peer: String,
    /// Opens the connections (hello, welcome, the fence epochs).
    dial: Dialer,
    spans: Vec<RegionSpan>,
    budget: MemoryBudget,
    staging: Arc<StagingCell>,
    /// Connections a large transfer is striped over.
    stripes: usize,
    comp: Compressor,
    rate: Mutex<LinkRate>,
    q: Mutex<(VecDeque<LinkJob>, bool)>,
    /// The link thread runs a job (set under `q`'s lock as it takes one).
    busy: AtomicBool,
    cv: Condvar,
    /// The epoch of the job the link thread runs now (its connections' hellos name it).
    running: AtomicU64,
}

/// The initiator's side of the lane to one peer: a queue served in order by one thread.
pub(crate) struct Link {
    inner: Arc<LinkInner>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What a link towards one peer is made of.
pub(crate) struct LinkSetup<'a> {
    /// This agent's name and the peer's.
    pub(crate) me: &'a str,
    pub(crate) peer: &'a str,
    /// The peer's lane entry: address, credential, key.
    pub(crate) info: LaneInfo,
    /// The peer's regions, by slot.
    pub(crate) spans: Vec<RegionSpan>,
    pub(crate) budget: MemoryBudget,
    pub(crate) staging: Arc<StagingCell>,
    /// Connections a large transfer is striped over.
    pub(crate) stripes: usize,
    pub(crate) comp: Compressor,
    /// The peer's fence count as this agent learned it.
    pub(crate) view: Arc<AtomicU64>,
    /// With a secret: how connections are sealed.
    pub(crate) seal: Option<Sealing>,
}

impl Link {
    pub(crate) fn new(s: LinkSetup<'_>) -> Link {
        Link {
            inner: Arc::new(LinkInner {
                peer: s.peer.to_string(),
                dial: Dialer::new(s.me, s.peer, s.info, s.view, s.seal, s.budget.clone()),
                spans: s.spans,
                budget: s.budget,
                staging: s.staging,
                stripes: s.stripes.max(1),
                comp: s.comp,
                rate: Mutex::default(),
                q: Mutex::new((VecDeque::new(), false)),
                busy: AtomicBool::new(false),
                cv: Condvar::new(),
                running: AtomicU64::new(0),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Queues `job` (its local regions pinned by the caller).
    pub(crate) fn submit(&self, job: Job) {
        {
            let mut g = self.inner.q.lock().unwrap_or_else(|e| e.into_inner());
            // Under the queue's lock: the epochs of queued jobs never decrease.
            let epoch = self.inner.dial.learned();
            g.0.push_back(LinkJob { job, epoch });
        }
        self.inner.cv.notify_one();
        let mut t = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if t.is_none() {
            let inner = self.inner.clone();
            match std::thread::Builder::new()
                .name(format!("kvxfer-link-{}", self.inner.peer))
                .spawn(move || link_loop(inner))
            {
                Ok(h) => *t = Some(h),
                Err(e) => {
                    let mut g = self.inner.q.lock().unwrap_or_else(|e| e.into_inner());
                    for j in g.0.drain(..) {
                        j.job.finish(Err(Error::io(
                            "spawning the TCP lane thread",
                            std::io::Error::new(e.kind(), e.to_string()),
                        )));
                    }
                }
            }
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let idle = {
            let mut g = self.inner.q.lock().unwrap_or_else(|e| e.into_inner());
            g.1 = true;
            g.0.is_empty() && !self.inner.busy.load(Ordering::SeqCst)
        };
        self.inner.cv.notify_all();
        // A thread with jobs finishes them (each bounded by its deadline or the peer's
        // liveness) and exits; it is not joined then, to keep drops on callers' threads
        // short. An idle one exits at once: joined, so that its connections (and their
        // windows) are gone when the agent is.
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t.filter(|t| idle && t.thread().id() != std::thread::current().id()) {
            let _ = t.join();
        }
    }
}

fn link_loop(inner: Arc<LinkInner>) {
    let mut conns: Vec<Option<Conn>> = (0..inner.stripes).map(|_| None).collect();
    // The epoch the open connections' hellos named.
    let mut conns_epoch = 0;
    loop {
        let j = {
            let mut g = inner.q.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(j) = g.0.pop_front() {
                    inner.busy.store(true, Ordering::SeqCst);
                    break j;
                }
                if g.1 {
                    return;
                }
                g = inner.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        };
        let job = &j.job;
        // Queued before this agent learned of a fence the target told since: it would be
        // refused; nothing of it is sent.
        let learned = inner.dial.learned();
        if j.epoch < learned {
            job.finish(Err(Error::Fenced {
                agent: inner.peer.clone(),
                epoch: learned,
            }));
            inner.busy.store(false, Ordering::SeqCst);
            continue;
        }
        // Connections opened before a fence this job's epoch knows of were closed by it.
        if j.epoch > conns_epoch {
            close_all(&mut conns);
            conns_epoch = j.epoch;
        }
        inner.running.store(j.epoch, Ordering::Release);
        let striped = conns.len() > 1
            && job.plan.bytes() >= STRIPE_MIN_BYTES
            && job.local_dev.is_empty()
            && match &job.plan {
                Work::Flat(p) => p.ops.len() <= MAX_SEGS,
                Work::Paged(_) => true,
            };
        let (decision, why) = decide(inner.comp.policy.0, job.plan.bytes(), &estimates(&inner));
        log::debug!(
            "kvxfer: transfer {} to {}: {decision:?} ({why})",
            job.id,
            inner.peer
        );
        let frames = (decision == Decision::Compress).then_some(inner.comp.transform);
        let t0 = Instant::now();
        let r = if striped {
            run_striped(&inner, &mut conns, job, frames)
        } else {
            let note = job.notification.as_deref().unwrap_or(&[]);
            let part = match &job.plan {
                Work::Flat(p) => Part::Ops(&p.ops),
                Work::Paged(p) => Part::Runs(&p.runs),
            };
            run_on(&inner, &mut conns[0], job, part, note, None, frames)
                .map(|(posted, tally)| with_codec(job.stats(Lane::Tcp, posted), &tally))
        };
        // A notification carried for data another lane moved reports that lane's figures.
        let r = r.map(|s| match &job.lane_stats {
            Some(moved) => XferStats {
                duration: job.started.elapsed(),
                ..moved.clone()
            },
            None => s,
        });
        if r.is_ok() {
            learn(&inner, job, frames.is_some(), t0.elapsed());
            // The data is real KV and still pinned: in auto, a large raw transfer before the
            // codec was ever measured measures it on a sample of this data (about 2 ms), so
            // that the next transfer can be decided.
            let unmeasured = decision == Decision::Calibrate
                || (inner.comp.policy.0 == Compression::Auto
                    && frames.is_none()
                    && job.plan.bytes() >= MIN_BYTES
                    && inner.comp.meter.rates().is_none());
            if unmeasured && job.local_dev.is_empty() {
                calibrate(&inner, job);
            }
        }
        // A transfer that lost its connection may have been fenced: before it is reported
        // (and the caller queues the next), a reconnect asks, so that what is queued after
        // the report carries the target's count and is not refused in turn.
        // The other connections may have been closed with it (a fence closes all): they are
        // not reused.
        if let Err(e) = &r {
            if lost_connection(e) {
                close_all(&mut conns);
                conns[0] = inner.dial.probe(j.epoch);
            }
        }
        job.finish(r);
        inner.busy.store(false, Ordering::SeqCst);
    }
}

/// The estimates the policy weighs for this link's next transfer.
fn estimates(inner: &LinkInner) -> Estimates {
    let r = inner.rate.lock().unwrap_or_else(|e| e.into_inner());
    let threads = inner.comp.threads.max(1) as f64;
    Estimates {
        link: inner.comp.policy.1.or(r.measured),
        // The meter's encode rate is one thread's.
        codec: inner.comp.meter.rates().map(|c| CodecRates {
            encode: c.encode * threads,
            ..c
        }),
        since_raw: r.since_raw,
    }
}

/// A finished transfer's lesson: a raw one of [`MIN_BYTES`] or more measures the link.
fn learn(inner: &LinkInner, job: &Job, framed: bool, took: Duration) {
    let mut r = inner.rate.lock().unwrap_or_else(|e| e.into_inner());
    if framed {
        r.since_raw = r.since_raw.saturating_add(1);
    } else if job.plan.bytes() >= MIN_BYTES && !took.is_zero() {
        r.measured = Some(blend(
            r.measured,
            job.plan.bytes() as f64 / took.as_secs_f64(),
        ));
        r.since_raw = 0;
    }
}

/// Bytes of a transfer's data the codec is measured on, in [`SAMPLE_PIECES`] pieces spread
/// over it (layers differ).
const SAMPLE_BYTES: u64 = 1 << 20;
const SAMPLE_PIECES: u64 = 8;

/// Codes a sample of `job`'s local data (the source of a write, the landed data of a read).
fn calibrate(inner: &LinkInner, job: &Job) {
    let total = job.plan.bytes();
    let piece = (SAMPLE_BYTES / SAMPLE_PIECES) & !1;
    if total < SAMPLE_BYTES || piece == 0 {
        return;
    }
    // The sample, its frames and the codec's planes, from the budget; none free: not now.
    let Ok(_charge) = inner
        .budget
        .try_charge(6 * SAMPLE_BYTES, "measuring the codec")
    else {
        return;
    };
    let mut sample = Vec::with_capacity(SAMPLE_BYTES as usize);
    let mut ops = job.plan.iter_ops();
    let mut at = 0u64; // byte offset of the current op's start in the transfer
    let mut cur = ops.next();
    for k in 0..SAMPLE_PIECES {
        let mut want = (total / SAMPLE_PIECES * k) & !1;
        let mut need = piece;
        while need > 0 {
            let Some(o) = cur else { break };
            if want >= at + o.len {
                at += o.len;
                cur = ops.next();
                continue;
            }
            let off = want - at;
            let take = need.min(o.len - off);
            // SAFETY: [o.local + off, +take) lies inside one of the plan's operations, local
            // host memory (no device pieces) that the job pins until it finishes, after this.
            let b =
                unsafe { std::slice::from_raw_parts((o.local + off) as *const u8, take as usize) };
            sample.extend_from_slice(b);
            want += take;
            need -= take;
        }
    }
    let r = inner.comp.meter.calibrate(inner.comp.transform, &sample);
    log::debug!(
        "kvxfer: codec measured on {} bytes of transfer {}: {r:?}",
        sample.len(),
        job.id
    );
}

/// `stats` with what the codec did for it (when it was compressed).
fn with_codec(mut stats: XferStats, tally: &CodecTally) -> XferStats {
    if tally.frames > 0 {
        stats.wire_bytes = tally.wire;
        stats.codec_time = tally.busy;
    }
    stats
}

/// What one request of a job moves: operations of a flat plan, or runs of a paged one (sent
/// as a paged table, the data a window at a time).
#[derive(Clone, Copy)]
enum Part<'a> {
    Ops(&'a [Op]),
    Runs(&'a [Run]),
}

impl Part<'_> {
    fn is_empty(&self) -> bool {
        match self {
            Part::Ops(o) => o.is_empty(),
            Part::Runs(r) => r.is_empty(),
        }
    }
}

/// Runs one request of `job` on `conn`, which it resets on failure (the stream may be
/// mid-message: the next request starts over on a new connection).
fn run_on(
    inner: &LinkInner,
    conn: &mut Option<Conn>,
    job: &Job,
    part: Part<'_>,
    note: &[u8],
    abort: Option<&AtomicBool>,
    frames: Option<Transform>,
) -> Result<(Duration, CodecTally)> {
    let r = run_job(inner, conn, job, part, note, abort, frames);
    if r.is_err() {
        if let Some(c) = conn.take() {
            c.shutdown();
        }
    }
    r
}

/// `runs` cut into at most `n` parts of about equal bytes, at block boundaries: a run across a
/// cut is split in two, each half with its own copy of its block indices (4 bytes a block per
/// side; a run that stays whole keeps its shared list).
fn split_runs(runs: &[Run], n: usize) -> Vec<Vec<Run>> {
    let bytes = |r: &Run| r.local.block_len * r.local.blocks.len() as u64;
    let total: u64 = runs.iter().map(bytes).sum();
    let per = total.div_ceil(n.max(1) as u64).max(1);
    let mut parts: Vec<Vec<Run>> = vec![Vec::new()];
    let mut room = per;
    for r in runs {
        let (len, nb) = (r.local.block_len, r.local.blocks.len());
        let mut k = 0;
        while k < nb {
            if room == 0 {
                parts.push(Vec::new());
                room = per;
            }
            let take = (room.div_ceil(len) as usize).clamp(1, nb - k);
            let sub = if take == nb {
                r.clone()
            } else {
                let cut = |side: &ResolvedPaged| ResolvedPaged {
                    blocks: side.blocks[k..k + take].into(),
                    ..side.clone()
                };
                Run {
                    local: cut(&r.local),
                    remote: cut(&r.remote),
                }
            };
            if let Some(p) = parts.last_mut() {
                p.push(sub);
            }
            room = room.saturating_sub(take as u64 * len);
            k += take;
        }
    }
    parts
}

/// `ops` cut into `n` runs of about equal bytes (an operation across a cut is split).
fn split_ops(ops: &[Op], n: usize) -> Vec<Vec<Op>> {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let per = total.div_ceil(n.max(1) as u64).max(1);
    let mut parts: Vec<Vec<Op>> = vec![Vec::new()];
    let mut room = per;
    for o in ops {
        let mut o = *o;
        while o.len > 0 {
            if room == 0 {
                parts.push(Vec::new());
                room = per;
            }
            let take = o.len.min(room);
            if let Some(p) = parts.last_mut() {
                p.push(Op { len: take, ..o });
            }
            o.local += take;
            o.remote += take;
            o.len -= take;
            room -= take;
        }
    }
    parts
}

/// Moves `job`'s data over `conns.len()` connections at once, one request each and one scoped
/// thread each, then its notification (a request without data) on the first connection: the
/// target hands it out only after every stripe's data has landed. The first failure stops the
/// other stripes at their next check and is the job's error.
fn run_striped(
    inner: &LinkInner,
    conns: &mut [Option<Conn>],
    job: &Job,
    frames: Option<Transform>,
) -> Result<XferStats> {
    let (ops, runs);
    let parts: Vec<Part<'_>> = match &job.plan {
        Work::Flat(p) => {
            ops = split_ops(&p.ops, conns.len());
            ops.iter().map(|o| Part::Ops(o)).collect()
        }
        // Fewer blocks than stripes (one large block): cut inside them, as operations.
        Work::Paged(p) if p.blocks < conns.len() => {
            ops = split_ops(&p.expand(0).ops, conns.len());
            ops.iter().map(|o| Part::Ops(o)).collect()
        }
        Work::Paged(p) => {
            runs = split_runs(&p.runs, conns.len());
            runs.iter().map(|r| Part::Runs(r)).collect()
        }
    };
    let abort = AtomicBool::new(false);
    let results: Vec<Result<(Duration, CodecTally)>> = std::thread::scope(|s| {
        let handles: Vec<_> = conns
            .iter_mut()
            .zip(&parts)
            .enumerate()
            .map(|(i, (conn, &part))| {
                let abort = &abort;
                std::thread::Builder::new()
                    .name(format!("kvxfer-stripe-{i}"))
                    .spawn_scoped(s, move || {
                        let r = run_on(inner, conn, job, part, &[], Some(abort), frames);
                        if r.is_err() {
                            abort.store(true, Ordering::Release);
                        }
                        r
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(lane_err(inner, "a stripe's thread panicked"))),
                Err(e) => {
                    abort.store(true, Ordering::Release);
                    Err(Error::io("spawning a TCP lane stripe", e))
                }
            })
            .collect()
    });
    let mut posted = Duration::ZERO;
    let mut tally = CodecTally::default();
    let mut first: Option<Error> = None;
    for r in results {
        match r {
            Ok((p, t)) => {
                posted = posted.max(p);
                tally.add(&t);
            }
            // A stripe stopped by another's failure reports Canceled: keep the cause.
            Err(e) => {
                if first.is_none() || matches!(first, Some(Error::Canceled)) {
                    first = Some(e);
                }
            }
        }
    }
    if let Some(e) = first {
        return Err(e);
    }
    if let Some(note) = job.notification.as_deref() {
        run_on(inner, &mut conns[0], job, Part::Ops(&[]), note, None, None)?;
    }
    Ok(with_codec(job.stats(Lane::Tcp, posted), &tally))
}

fn lane_err(inner: &LinkInner, why: impl Into<String>) -> Error {
    Error::LaneFailed {
        agent: inner.peer.clone(),
        lane: "tcp",
        why: why.into(),
    }
}

fn stop_err(inner: &LinkInner, s: Stop, what: &str) -> Error {
    match s {
        Stop::Abort(e) => e,
        Stop::Eof => lane_err(inner, format!("peer closed the connection during {what}")),
        Stop::Io(e) => lane_err(inner, format!("{what}: {e}")),
    }
}

fn run_job(
    inner: &LinkInner,
    conn: &mut Option<Conn>,
    job: &Job,
    part: Part<'_>,
    note: &[u8],
    abort: Option<&AtomicBool>,
    frames: Option<Transform>,
) -> Result<(Duration, CodecTally)> {
    // A request without data (a striped job's notification) goes raw.
    let frames = frames.filter(|_| !part.is_empty());
    let deadline_at = job.deadline.map(|d| job.started + d);
    // A deadline reports the job's operations, not this stripe's.
    let job_ops = job.plan.op_count();
    let check = || -> Result<(), Stop> {
        if job.state.is_canceled() || abort.is_some_and(|a| a.load(Ordering::Acquire)) {
            return Err(Stop::Abort(Error::Canceled));
        }
        if deadline_at.is_some_and(|d| Instant::now() >= d) {
            return Err(Stop::Abort(Error::Deadline {
                agent: job.peer.clone(),
                deadline: job.deadline.unwrap_or_default(),
                // The stream lane does not count operations as it goes.
                posted_ops: 0,
                ops: job_ops,
            }));
        }
        Ok(())
    };
    check().map_err(|s| stop_err(inner, s, "start"))?;
    for r in job.pins.regions() {
        if !r.registered.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Error::Deregistered { region: r.id.0 });
        }
    }
    if conn.is_none() {
        *conn = Some(
            inner
                .dial
                .connect(inner.running.load(Ordering::Acquire), CONNECT_TIMEOUT)?,
        );
    }
    let c = conn
        .as_ref()
        .ok_or_else(|| lane_err(inner, "no connection"))?;
    // The request header, its table and the local pieces, charged to the agent's budget
    // (waits while other transfers hold it, up to the deadline or a minute).
    let wait = deadline_at.map_or(Duration::from_secs(60), |d| {
        d.saturating_duration_since(Instant::now())
    });
    let codec_bytes = match (frames, job.op) {
        (None, _) => 0,
        (Some(_), XferOp::Write) => SEND_BYTES * inner.comp.threads.max(1) as u64,
        (Some(_), XferOp::Read) => RECV_BYTES,
    };
    // The table in the target's terms: a segment per operation, or a paged part's runs'
    // remote sides (lists shared); the local pieces beside it.
    let slot = |s: u32| {
        inner
            .spans
            .get(s as usize)
            .ok_or_else(|| lane_err(inner, format!("remote slot {s} unknown")))
    };
    let mut segments = Vec::new();
    let mut remote: Vec<Paged> = Vec::new();
    let mut pieces = Vec::new();
    let mut local: Vec<ResolvedPaged> = Vec::new();
    match part {
        Part::Ops(ops) => {
            segments.reserve_exact(ops.len());
            pieces.reserve_exact(ops.len());
            for o in ops {
                let span = slot(o.rslot)?;
                segments.push(Segment {
                    region: span.id.0,
                    offset: o.remote - span.base,
                    len: o.len,
                });
                pieces.push((o.local, o.len));
            }
        }
        Part::Runs(runs) => {
            for r in runs {
                let span = slot(r.remote.slot)?;
                remote.push(Paged {
                    region: span.id,
                    offset: r.remote.base - span.base,
                    block_len: r.remote.block_len,
                    stride: r.remote.stride,
                    blocks: r.remote.blocks.clone(),
                });
            }
            local = runs.iter().map(|r| r.local.clone()).collect();
        }
    }
    let table = match part {
        Part::Ops(_) => Table::Segments(&segments),
        Part::Runs(_) => Table::Paged(&remote),
    };
    // The request, its table and what this side holds besides (the pieces, or a paged part's
    // entries and one window's pieces), charged to the agent's budget (waits while other
    // transfers hold it, up to the deadline or a minute).
    let table_len = table.wire_len().map_err(Error::InvalidArgument)?;
    let held = match part {
        Part::Ops(o) => o.len() * (PIECE_BYTES + std::mem::size_of::<Segment>()),
        Part::Runs(r) => {
            r.len() * (std::mem::size_of::<Paged>() + std::mem::size_of::<ResolvedPaged>())
                + WINDOW_BLOCKS * (PIECE_BYTES + 4)
        }
    };
    let _charge = inner.budget.charge(
        (HEADER_LEN + table_len + held) as u64 + codec_bytes,
        "TCP lane request",
        wait,
    )?;
    let (mut req, opening) =
        LaneRequest::start(job.op, job.id, table, note, frames).map_err(Error::InvalidArgument)?;
    drop((segments, remote));
    // Cancel, a failed stripe and the deadline end the job; progress changes nothing here.
    let mut ctl = |_moved: bool| check();
    // Local device memory: two chunks of this agent's initiator pool, taken before the request
    // goes out (a transfer holding chunks never waits for more).
    let stage = match job.local_dev.iter().flatten().next() {
        Some(&d) => Some(inner.staging.pools(d)?),
        None => None,
    };
    let pair = match &stage {
        Some(st) => stage_pair(st, true, Duration::MAX, &mut ctl)
            .map_err(|s| stop_err(inner, s, "waiting for staging chunks"))?,
        None => None,
    };
    let st = stage.as_deref().zip(pair.as_ref());
    let framing = frames.map(|transform| Framing {
        transform,
        peer: &inner.peer,
        threads: inner.comp.threads,
    });
    let data_err = |e: FramesFailed, what: &str| match e {
        FramesFailed::Stop(s) => stop_err(inner, s, what),
        FramesFailed::Corrupt { error, .. } => Error::Frame {
            peer: inner.peer.clone(),
            source: error,
        },
    };
    // The data, sent (a write) or received (a read).
    let data = |send: bool, ctl: &mut Ctl<'_>| {
        // SAFETY: the pieces (or the runs' local blocks) come from the job's plan,
        // bounds-checked against its local regions (kinds in `local_dev`; a paged job's are
        // host memory), which the job pins until it finishes.
        unsafe {
            match part {
                Part::Ops(_) => {
                    stream_mixed(c, send, &pieces, &job.local_dev, st, framing, None, ctl)
                }
                Part::Runs(_) => stream_windows(c, send, &local, &[], st, framing, None, ctl),
            }
        }
    };
    // The request's steps (`LaneRequest`): the opening bytes, then the data, the note and the
    // reply in the order its operation takes them. Posted: once all this side sends is out.
    c.send(&opening, &mut ctl)
        .map_err(|s| stop_err(inner, s, "request"))?;
    let mut posted_at = job.started.elapsed();
    let mut tally = CodecTally::default();
    loop {
        match req.step() {
            Step::SendData => {
                tally = data(true, &mut ctl).map_err(|e| data_err(e, "sending data"))?;
                req.advance();
            }
            Step::SendNote => {
                c.send(note, &mut ctl)
                    .map_err(|s| stop_err(inner, s, "notification"))?;
                posted_at = job.started.elapsed();
                req.advance();
            }
            Step::AwaitReply => read_reply(inner, c, &mut req, &mut ctl)?,
            Step::ReceiveData => {
                tally = data(false, &mut ctl).map_err(|e| data_err(e, "receiving data"))?;
                req.advance();
            }
            Step::Done => break,
        }
    }
    if frames.is_some() {
        match job.op {
            XferOp::Write => inner.comp.meter.encoded(&tally),
            XferOp::Read => inner.comp.meter.decoded(&tally),
        }
    }
    log::debug!(
        "kvxfer: {:?} {}: posted {posted_at:?}, done {:?}",
        job.op,
        job.id,
        job.started.elapsed()
    );
    Ok((posted_at, tally))
}

/// Reads the reply `req` waits on and gives it to `req`.
fn read_reply(inner: &LinkInner, c: &Conn, req: &mut LaneRequest, ctl: &mut Ctl<'_>) -> Result<()> {
    let mut h = [0u8; REPLY_FIXED_LEN];
    c.recv(&mut h, ctl)
        .map_err(|s| stop_err(inner, s, "waiting for the reply"))?;
    let r = ReplyHeader::read(&h);
    let mut msg = vec![0u8; r.msg_len];
    c.recv(&mut msg, ctl)
        .map_err(|s| stop_err(inner, s, "reading the reply"))?;
    req.on_reply(&r, &msg).map(drop).map_err(|e| match e {
        ReplyError::OutOfStep { got, expected } => lane_err(
            inner,
            format!(
                "reply kind {} id {}, expected kind {} id {}",
                got.0, got.1, expected.0, expected.1
            ),
        ),
        ReplyError::Refused(msg) => lane_err(inner, format!("peer refused: {msg}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(blocks: &[u32], slot: u32) -> ResolvedPaged {
        ResolvedPaged {
            base: 0x1000 * u64::from(slot + 1),
            block_len: 64,
            stride: 64,
            slot,
            blocks: blocks.into(),
        }
    }

    /// Parts of about equal bytes, at most `n`, that move the same block pairs in the same
    /// order; a run left whole keeps its shared list.
    #[test]
    fn runs_split_at_blocks_into_balanced_parts() {
        let one: Vec<u32> = (0..1001).rev().collect();
        let runs = vec![
            Run {
                local: side(&one, 0),
                remote: side(&one, 1),
            },
            Run {
                local: side(&[5, 6], 2),
                remote: side(&[7, 8], 3),
            },
        ];
        let pairs = |rs: &[Run]| -> Vec<(u32, u32, u32)> {
            rs.iter()
                .flat_map(|r| {
                    r.local
                        .blocks
                        .iter()
                        .zip(r.remote.blocks.iter())
                        .map(move |(&l, &m)| (r.local.slot, l, m))
                })
                .collect()
        };
        for n in 1..=6 {
            let parts = split_runs(&runs, n);
            assert!(
                !parts.is_empty() && parts.len() <= n,
                "n {n}: {}",
                parts.len()
            );
            let all: Vec<Run> = parts.iter().flatten().cloned().collect();
            assert_eq!(pairs(&all), pairs(&runs), "n {n}");
            let bytes: Vec<u64> = parts
                .iter()
                .map(|p| p.iter().map(|r| 64 * r.local.blocks.len() as u64).sum())
                .collect();
            let per = (1003 * 64u64).div_ceil(n as u64);
            for b in &bytes[..bytes.len() - 1] {
                assert!(*b >= per && *b < per + 64, "n {n}: {bytes:?}");
            }
        }
        let whole = split_runs(&runs, 1);
        assert!(Arc::ptr_eq(
            &whole[0][0].local.blocks,
            &runs[0].local.blocks
        ));
    }
}
