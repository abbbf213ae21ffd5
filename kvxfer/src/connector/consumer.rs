//! The decode side's shell: loads, pull reads bounded by the lease, the control-message
//! thread.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::api::{failure_reason, load_failed, LoadFailure, LoadSpec};
use super::config::ConnectorConfig;
use super::shell::{
    add_stats, load_plan, lock, send, state_charge, take_control, wait_until, Registrations,
};
use crate::agent::Agent;
use crate::budget::{Charge, MemoryBudget};
use crate::telemetry::{RequestStats, Telemetry};
use crate::transfer::Transfer;
use kvxfer_proto::connector::{load_descs, load_paged, LoadEvent, LoadProtocol};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::types::XferOp;
use kvxfer_proto::wire::connector::{Handoff, Mode, PushWant, ToConsumer};
use kvxfer_proto::wire::notify::Notification;

struct Load {
    h: Handoff,
    remote: KvLayout,
    /// The producer's heads read, and the local heads they land in.
    heads: HeadMap,
    local_blocks: Vec<u32>,
    skip: usize,
    /// The protocol: lease, ready and landed layers, heartbeats.
    proto: LoadProtocol,
    posted: usize,
    inflight: Vec<(usize, Transfer)>,
    started: Instant,
    bytes: u64,
    descs: u64,
    post: Duration,
    xfer: Duration,
    _charge: Charge,
}

enum Ended {
    Ok,
    Failed(String),
}

struct CState {
    loads: HashMap<String, Load>,
    finished: Vec<RequestStats>,
    failed: Vec<LoadFailure>,
    ended: HashMap<String, Ended>,
    ended_order: std::collections::VecDeque<String>,
    /// Loads that failed with reads in flight: reported once those are cancelled and no
    /// longer write into the blocks (the consumer thread fences them).
    fencing: Vec<(String, Load, Error)>,
    /// Their names, while they are fenced: still in progress to `wait`.
    fencing_names: std::collections::HashSet<String>,
    stop: bool,
}

struct CShared {
    agent: Arc<Agent>,
    t0: Instant,
    layout: KvLayout,
    cfg: ConnectorConfig,
    st: Mutex<CState>,
    cv: Condvar,
    tel: Telemetry,
}

/// The decode side. See the module docs.
pub struct Consumer {
    sh: Arc<CShared>,
    thread: Option<JoinHandle<()>>,
    /// Regions its `AgentConnector` registered for it: deregistered after the thread has
    /// stopped (fields drop after `Drop::drop`).
    _regs: Option<Registrations>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("agent", &self.sh.agent.name())
            .finish()
    }
}

impl Consumer {
    /// This consumer, owning the registrations made for it.
    pub(crate) fn owning(mut self, regs: Registrations) -> Consumer {
        self._regs = Some(regs);
        self
    }

    /// A consumer over `agent`, whose registered cache `layout` describes.
    pub fn new(agent: Arc<Agent>, layout: KvLayout, cfg: ConnectorConfig) -> Result<Consumer> {
        let sh = Arc::new(CShared {
            agent,
            t0: Instant::now(),
            layout,
            cfg,
            st: Mutex::new(CState {
                loads: HashMap::new(),
                finished: Vec::new(),
                failed: Vec::new(),
                ended: HashMap::new(),
                ended_order: Default::default(),
                fencing: Vec::new(),
                fencing_names: Default::default(),
                stop: false,
            }),
            cv: Condvar::new(),
            tel: Telemetry::new("consumer"),
        });
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-consumer-{}", sh.agent.name()))
            .spawn(move || consumer_loop(&s2))
            .map_err(|e| Error::io("spawning the consumer thread", e))?;
        Ok(Consumer {
            sh,
            thread: Some(thread),
            _regs: None,
        })
    }

    /// Starts loading `handoff` into `local_blocks`. `local_blocks` pairs with the *last*
    /// `local_blocks.len()` of the producer's blocks: the consumer already holds the blocks
    /// before them (a cached prefix) and only these move. Empty: nothing moves, the producer
    /// is only told it may free its blocks. Waits for budget (backpressure) up to
    /// `budget_wait`.
    pub fn start_load(&self, h: &Handoff, local_blocks: &[u32]) -> Result<()> {
        self.start_load_with(h, local_blocks, &LoadSpec::default())
    }

    /// [`Consumer::start_load`] with the heads and readers of `spec` (tensor parallelism).
    pub fn start_load_with(
        &self,
        h: &Handoff,
        local_blocks: &[u32],
        spec: &LoadSpec,
    ) -> Result<()> {
        let sh = &self.sh;
        let (remote, heads) = load_plan(&sh.layout, &sh.cfg, spec, h, local_blocks)?;
        if lock(&sh.st).loads.contains_key(&h.request) {
            return Err(Error::InvalidArgument(format!(
                "load {:?} is already in progress",
                h.request
            )));
        }
        // Not loaded, or another incarnation than the one that published: (re)load the
        // producer through its side channel.
        let loaded = sh.agent.peer_epoch(&h.producer);
        if loaded.is_none() || (h.epoch != 0 && loaded != Some(h.epoch)) {
            match h.side_channel.map(|addr| (addr, sh.agent.connect(addr))) {
                Some((addr, Ok(got))) if got != h.producer => {
                    return Err(Error::Handoff {
                        request: h.request.clone(),
                        why: format!("{addr} is {got:?}, not the producer {:?}", h.producer),
                    });
                }
                Some((_, Ok(_))) => {}
                // Another incarnation is loaded and the handoff's side channel is gone (or
                // no side channel came): the epoch check below says why it cannot load.
                Some((_, Err(_))) | None if loaded.is_some() => {}
                Some((_, Err(e))) => return Err(e),
                None => {
                    return Err(Error::UnknownPeer {
                        agent: h.producer.clone(),
                    })
                }
            }
        }
        let nl = sh.layout.layers.len();
        let descs = (local_blocks.len() * nl * sh.layout.tensors_per_layer()) as u64;
        let charge = state_charge(&sh.cfg.budget, descs, "load state", sh.cfg.budget_wait)?;
        let skip = h.blocks.len() - local_blocks.len();
        let want = PushWant {
            blocks: local_blocks.to_vec(),
            num_blocks: sh.layout.num_blocks,
            layers: sh.layout.layers.clone(),
        };
        let proto = LoadProtocol::new(
            &h.request,
            &h.producer,
            h.mode,
            nl,
            Some(want),
            local_blocks.is_empty(),
            sh.t0.elapsed(),
        )
        .declaring(spec.readers)
        .of_incarnation(h.epoch);
        if let Some(why) = sh
            .agent
            .peer_epoch(&h.producer)
            .and_then(|e| proto.restarted(e))
        {
            return Err(Error::Handoff {
                request: h.request.clone(),
                why,
            });
        }
        let first = proto.opening();
        let load = Load {
            h: h.clone(),
            remote,
            heads,
            local_blocks: local_blocks.to_vec(),
            skip,
            proto,
            posted: 0,
            inflight: Vec::new(),
            started: Instant::now(),
            bytes: 0,
            descs: 0,
            post: Duration::ZERO,
            xfer: Duration::ZERO,
            _charge: charge,
        };
        lock(&sh.st).loads.insert(h.request.clone(), load);
        send(&sh.agent, &h.producer, &first.encode());
        if local_blocks.is_empty() {
            let mut st = lock(&sh.st);
            finish(sh, &mut st, &h.request);
            drop(st);
            sh.cv.notify_all();
        }
        Ok(())
    }

    /// Cancels the pull load of `request` (its client went away, the process is stopping):
    /// reads in flight are cancelled and waited for, so nothing writes into its blocks once
    /// this returns; the producer is told this reader is done; the load ends failed
    /// ("cancelled") with its blocks, as any failed load. A load that already ended stays as
    /// it ended. A push load cannot be cancelled from here (the producer writes it): that is
    /// an [`Error::InvalidArgument`].
    pub fn cancel(&self, request: &str) -> Result<()> {
        let sh = &self.sh;
        let inflight = {
            let mut st = lock(&sh.st);
            let Some(l) = st.loads.get_mut(request) else {
                return Ok(());
            };
            if l.h.mode == Mode::Push {
                return Err(Error::InvalidArgument(format!(
                    "cancel {request:?}: a push load ends when the producer's writes do"
                )));
            }
            // No further read is posted for it.
            l.posted = usize::MAX;
            std::mem::take(&mut l.inflight)
        };
        for (_, t) in inflight {
            // Returns once the lanes and UCX no longer touch the blocks, completed or not.
            let _ = t.cancel();
        }
        let mut st = lock(&sh.st);
        fail(
            sh,
            &mut st,
            request,
            Error::Handoff {
                request: request.to_string(),
                why: "cancelled".into(),
            },
        );
        drop(st);
        sh.cv.notify_all();
        Ok(())
    }

    /// Waits until layer `layer` of `request` is in local memory.
    pub fn wait_layer(&self, request: &str, layer: usize, timeout: Duration) -> Result<()> {
        self.wait_until(request, timeout, |l| l.proto.loaded(layer))
    }

    /// Waits until `request` is loaded completely.
    pub fn wait(&self, request: &str, timeout: Duration) -> Result<()> {
        self.wait_until(request, timeout, |_| false)
    }

    fn wait_until(
        &self,
        request: &str,
        timeout: Duration,
        f: impl Fn(&Load) -> bool,
    ) -> Result<()> {
        wait_until(&self.sh.st, &self.sh.cv, timeout, |st| {
            match (st.loads.get(request), st.ended.get(request)) {
                (Some(l), _) if f(l) => Some(Ok(())),
                (Some(_), _) => None,
                (None, _) if st.fencing_names.contains(request) => None,
                (None, Some(Ended::Ok)) => Some(Ok(())),
                (None, Some(Ended::Failed(why))) => Some(Err(Error::Handoff {
                    request: request.to_string(),
                    why: why.clone(),
                })),
                (None, None) => Some(Err(Error::Handoff {
                    request: request.to_string(),
                    why: "no load of this request was started".into(),
                })),
            }
        })
        .unwrap_or(Err(Error::WaitTimeout(timeout)))
    }

    /// Loads completed since the last call, with their figures.
    pub fn take_finished(&self) -> Vec<RequestStats> {
        std::mem::take(&mut lock(&self.sh.st).finished)
    }

    /// The figures of one finished load (taken out of [`Consumer::take_finished`]'s list).
    pub fn take_stats(&self, request: &str) -> Option<RequestStats> {
        let mut st = lock(&self.sh.st);
        let i = st.finished.iter().position(|s| s.request == request)?;
        Some(st.finished.remove(i))
    }

    /// The oldest finished load, if `fits` accepts it (else it stays queued).
    pub fn take_finished_one(&self, fits: impl Fn(&RequestStats) -> bool) -> Option<RequestStats> {
        let mut st = lock(&self.sh.st);
        if !fits(st.finished.first()?) {
            return None;
        }
        Some(st.finished.remove(0))
    }

    /// The oldest failed load, if `fits` accepts it (else it stays queued).
    pub fn take_failed_one(&self, fits: impl Fn(&LoadFailure) -> bool) -> Option<LoadFailure> {
        let mut st = lock(&self.sh.st);
        if !fits(st.failed.first()?) {
            return None;
        }
        Some(st.failed.remove(0))
    }

    /// Loads failed since the last call, with the local blocks that are invalid.
    pub fn take_failed(&self) -> Vec<LoadFailure> {
        std::mem::take(&mut lock(&self.sh.st).failed)
    }

    /// Loads in progress.
    pub fn in_progress(&self) -> usize {
        let st = lock(&self.sh.st);
        st.loads.len() + st.fencing_names.len()
    }

    /// Aggregate telemetry.
    pub fn telemetry(&self) -> &Telemetry {
        &self.sh.tel
    }

    /// The budget request state is charged to.
    pub fn budget(&self) -> &MemoryBudget {
        &self.sh.cfg.budget
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        lock(&self.sh.st).stop = true;
        self.sh.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Reads still in flight stop before the engine's blocks are its own again.
        let (loads, fencing) = {
            let mut st = lock(&self.sh.st);
            (
                std::mem::take(&mut st.loads),
                std::mem::take(&mut st.fencing),
            )
        };
        let left = loads.into_values().chain(fencing.into_iter().map(|f| f.1));
        for (_, t) in left.flat_map(|l| l.inflight) {
            let _ = t.cancel();
        }
    }
}

const ENDED_MEMORY: usize = 4096;

fn remember(st: &mut CState, req: &str, e: Ended) {
    st.ended.insert(req.to_string(), e);
    st.ended_order.push_back(req.to_string());
    while st.ended_order.len() > ENDED_MEMORY {
        if let Some(old) = st.ended_order.pop_front() {
            st.ended.remove(&old);
        }
    }
}

fn finish(sh: &CShared, st: &mut CState, req: &str) {
    let Some(l) = st.loads.remove(req) else {
        return;
    };
    let nl = sh.layout.layers.len() as u64;
    let per_block = sh.layout.block_bytes() * nl * sh.layout.tensors_per_layer() as u64;
    let s = RequestStats {
        request: req.to_string(),
        bytes_moved: l.bytes,
        // A head slice skips its share of each cached block.
        bytes_skipped: l.skip as u64 * per_block * l.heads.width()
            / sh.layout.geometry.kv_heads.max(1),
        descriptors: l.descs,
        post_time: l.post,
        transfer_time: l.xfer,
        handoff_time: l.started.elapsed(),
    };
    sh.tel.record(&s);
    st.finished.push(s);
    remember(st, req, Ended::Ok);
}

/// Fails the load of `req`. A load that may still have bytes on their way into its blocks is
/// fenced first, and its failure (and its blocks) reported only after ([`fence`]), so an
/// engine that reuses the blocks never has a late write land in them: a pull load's reads in
/// flight are cancelled; a push load's producer has its TCP lane writes into this agent
/// fenced (what it queued before, in a socket or mid-stream, is dropped).
fn fail(sh: &CShared, st: &mut CState, req: &str, e: Error) {
    let Some(l) = st.loads.remove(req) else {
        return;
    };
    if !l.inflight.is_empty() || l.h.mode == Mode::Push {
        st.fencing_names.insert(req.to_string());
        st.fencing.push((req.to_string(), l, e));
        return;
    }
    report_failure(sh, st, req, l, e);
}

/// Cancels the reads of the loads that failed with reads in flight (on the consumer thread,
/// outside the lock: a cancel returns once nothing writes into the blocks), then reports them.
fn fence(sh: &CShared) {
    let fencing = std::mem::take(&mut lock(&sh.st).fencing);
    if fencing.is_empty() {
        return;
    }
    let mut fenced: Vec<String> = Vec::new();
    for (req, mut l, e) in fencing {
        for (_, t) in l.inflight.drain(..) {
            let _ = t.cancel();
        }
        if l.h.mode == Mode::Push && !fenced.contains(&l.h.producer) {
            let n = sh.agent.fence_inbound(&l.h.producer);
            log::info!(
                "kvxfer consumer: {req:?} failed: {n} TCP lane connection(s) of {:?} fenced",
                l.h.producer
            );
            fenced.push(l.h.producer.clone());
        }
        let mut st = lock(&sh.st);
        st.fencing_names.remove(&req);
        report_failure(sh, &mut st, &req, l, e);
    }
    sh.cv.notify_all();
}

fn report_failure(sh: &CShared, st: &mut CState, req: &str, l: Load, e: Error) {
    log::warn!("kvxfer consumer: load of {req:?} failed: {e}");
    sh.tel.failed();
    // Tell the producer this reader is done with its blocks (it frees them on the last one).
    if l.h.mode == Mode::Pull {
        send(&sh.agent, &l.h.producer, &l.proto.ack().encode());
    }
    remember(st, req, Ended::Failed(failure_reason(&e)));
    st.failed.push(LoadFailure {
        request: req.to_string(),
        error: e,
        invalid_blocks: l.local_blocks,
    });
}

/// The error of a load whose producer stopped renewing its lease.
pub(super) fn lapsed(request: &str) -> Error {
    Error::Handoff {
        request: request.to_string(),
        why: "the producer stopped renewing the lease (it is gone or stalled)".into(),
    }
}

fn consumer_loop(sh: &CShared) {
    loop {
        if lock(&sh.st).stop {
            return;
        }
        let busy = lock(&sh.st).loads.values().any(|l| !l.inflight.is_empty());
        take_control(&sh.agent, false, busy, |n| consumer_msg(sh, n));
        consumer_progress(sh);
        fence(sh);
    }
}

fn consumer_msg(sh: &CShared, n: Notification) {
    let m = match ToConsumer::decode(&n.payload) {
        Ok(m) => m,
        Err(why) => {
            log::warn!(
                "kvxfer connector: malformed control message from {:?}: {why}",
                n.from
            );
            return;
        }
    };
    let req = m.request().to_string();
    let mut st = lock(&sh.st);
    let Some(l) = st.loads.get_mut(&req) else {
        return;
    };
    if l.h.producer != n.from {
        log::warn!(
            "kvxfer consumer: message about {req:?} from {:?}, not its producer",
            n.from
        );
        return;
    }
    match l.proto.handle(&n.from, &m, sh.t0.elapsed()) {
        LoadEvent::Ignored | LoadEvent::Progress => {}
        LoadEvent::Landed(_) => {
            // Push: this layer's data landed before this message.
            let per_layer = l.local_blocks.len() * sh.layout.tensors_per_layer();
            l.descs += per_layer as u64;
            l.bytes += per_layer as u64 * sh.layout.block_bytes();
            if l.proto.complete() {
                finish(sh, &mut st, &req);
            }
            drop(st);
            sh.cv.notify_all();
        }
        LoadEvent::Failed(why) => {
            let e = load_failed(&req, why);
            fail(sh, &mut st, &req, e);
            drop(st);
            sh.cv.notify_all();
        }
    }
}

fn consumer_progress(sh: &CShared) {
    let mut st = lock(&sh.st);
    let mut changed = false;
    let mut hbs: Vec<(String, Vec<u8>)> = Vec::new();
    let mut failures: Vec<(String, Error)> = Vec::new();
    let mut done: Vec<String> = Vec::new();
    for (req, l) in st.loads.iter_mut() {
        // Until the producer has taken a push request, the heartbeat repeats it.
        if let Some(m) = l.proto.heartbeat_due(sh.t0.elapsed(), sh.cfg.heartbeat) {
            hbs.push((l.h.producer.clone(), m.encode()));
        }
        if l.inflight.is_empty() && l.proto.lapsed(sh.t0.elapsed()) {
            failures.push((req.clone(), lapsed(req)));
            continue;
        }
        // The producer restarted: its blocks are gone, whatever its new incarnation answers.
        // (Reads in flight end on their own: the old incarnation's lanes are dropped.)
        let now_loaded = sh.agent.peer_epoch(&l.h.producer).unwrap_or(0);
        if let Some(why) = l
            .proto
            .restarted(now_loaded)
            .filter(|_| l.inflight.is_empty())
        {
            failures.push((req.clone(), load_failed(req, why)));
            continue;
        }
        if l.h.mode == Mode::Pull {
            if let Some(until) = l.proto.lease_until() {
                while l.posted < l.proto.ready() {
                    let now = sh.t0.elapsed();
                    if now >= until {
                        failures.push((
                            req.clone(),
                            Error::Handoff {
                                request: req.clone(),
                                why: "the lease ran out before the read could start".into(),
                            },
                        ));
                        break;
                    }
                    let layer = l.posted;
                    let r = (|| -> Result<Transfer> {
                        // Bounded by the lease: never read blocks the producer may have freed.
                        let within = Some(until - now);
                        // One entry per tensor of the layer, not one per block, where the
                        // heads allow it (a head slice in NHD order is one piece per token).
                        if let Some((lp, rp)) = load_paged(
                            &sh.layout,
                            &l.remote,
                            &l.heads,
                            &l.local_blocks,
                            &l.h.blocks[l.skip..],
                            layer..layer + 1,
                        )? {
                            return sh.agent.transfer_paged(
                                XferOp::Read,
                                &l.h.producer,
                                &lp,
                                &rp,
                                None,
                                within,
                            );
                        }
                        let (ld, rd) = load_descs(
                            &sh.layout,
                            &l.remote,
                            &l.heads,
                            &l.local_blocks,
                            &l.h.blocks[l.skip..],
                            layer..layer + 1,
                        )?;
                        let lp = sh.agent.prep_local(&ld)?;
                        let rp = sh.agent.prep_remote(&l.h.producer, &rd)?;
                        sh.agent.transfer_all(XferOp::Read, &lp, &rp, None, within)
                    })();
                    match r {
                        Ok(t) => l.inflight.push((layer, t)),
                        Err(e) => {
                            failures.push((req.clone(), e));
                            break;
                        }
                    }
                    l.posted += 1;
                }
            }
        }
        let mut i = 0;
        while i < l.inflight.len() {
            if l.inflight[i].1.is_done() {
                let (layer, t) = l.inflight.swap_remove(i);
                match t.wait() {
                    Ok(s) => {
                        l.proto.mark_loaded(layer);
                        add_stats(&mut l.bytes, &mut l.descs, &mut l.post, &mut l.xfer, &s);
                        changed = true;
                    }
                    Err(e) => failures.push((req.clone(), e)),
                }
            } else {
                i += 1;
            }
        }
        if l.h.mode == Mode::Pull && l.proto.complete() && l.inflight.is_empty() {
            done.push(req.clone());
        }
    }
    for (req, e) in failures {
        fail(sh, &mut st, &req, e);
        changed = true;
    }
    for req in done {
        if let Some(l) = st.loads.get(&req) {
            let p = l.h.producer.clone();
            send(&sh.agent, &p, &l.proto.ack().encode());
        }
        finish(sh, &mut st, &req);
        changed = true;
    }
    drop(st);
    for (p, m) in hbs {
        send(&sh.agent, &p, &m);
    }
    if changed {
        sh.cv.notify_all();
    }
}
