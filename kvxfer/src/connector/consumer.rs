//! The decode side's shell, one for every carrier: loads, pull reads bounded by the lease,
//! the control-message thread. The protocol's decisions are [`LoadProtocol`]'s; every byte
//! leaves through the [`Carrier`].
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::agent_carrier::AgentCarrier;
use super::api::{failure_reason, load_failed, KvConsumer, LoadFailure, LoadSpec};
use super::carrier::{Carrier, InFlight, LayerMove, Role};
use super::config::ConnectorConfig;
use super::load_plan::{plan_groups, GroupLoad};
use super::shell::{
    join_thread, lock, spawn_thread, state_charge, take_control, wait_until, Figures,
};
use crate::agent::Agent;
use crate::budget::{Charge, MemoryBudget};
use crate::random;
use crate::telemetry::{RequestStats, Telemetry};
use kvxfer_proto::connector::{LoadEvent, LoadProtocol};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::groups::{held, CacheGroups};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::wire::connector::{Grant, Handoff, Mode, PushWant, ToConsumer, ToProducer};
use kvxfer_proto::wire::notify::Notification;

struct Load {
    h: Handoff,
    /// Per cache group: the producer's layout, the heads and the blocks paired.
    parts: Vec<GroupLoad>,
    /// Per cache group, the local blocks the load writes (what a failure leaves invalid).
    local_blocks: Vec<Vec<u32>>,
    /// Bytes of the producer's blocks held here already (a cached prefix).
    skipped: u64,
    /// The protocol: lease, ready and landed layers, heartbeats.
    proto: LoadProtocol,
    posted: usize,
    inflight: Vec<(usize, Box<dyn InFlight>)>,
    started: Instant,
    figures: Figures,
    /// Push: the grant its blocks are opened to the producer under, until the load ends.
    pushed_under: Option<Grant>,
    _charge: Charge,
}

enum Ended {
    Ok,
    Failed(String),
}

struct ConsumerState {
    loads: HashMap<String, Load>,
    finished: VecDeque<RequestStats>,
    failed: VecDeque<LoadFailure>,
    ended: HashMap<String, Ended>,
    ended_order: VecDeque<String>,
    /// Loads that failed with reads in flight: reported once those are cancelled and no
    /// longer write into the blocks (the consumer thread fences them).
    fencing: Vec<(String, Load, Error)>,
    /// Their names, while they are fenced: still in progress to `wait`.
    fencing_names: HashSet<String>,
    stop: bool,
}

/// What the engine's calls and the consumer's thread share.
struct ConsumerShared {
    carrier: Box<dyn Carrier>,
    t0: Instant,
    groups: CacheGroups,
    cfg: ConnectorConfig,
    st: Mutex<ConsumerState>,
    cv: Condvar,
    tel: Telemetry,
}

/// The decode side. See the module docs of [`crate::connector`].
pub struct Consumer {
    sh: Arc<ConsumerShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.sh.carrier.name())
            .finish()
    }
}

impl Consumer {
    /// A consumer over `agent`, whose registered cache `layout` describes.
    pub fn new(agent: Arc<Agent>, layout: KvLayout, cfg: ConnectorConfig) -> Result<Consumer> {
        Consumer::with_groups(agent, vec![layout], cfg)
    }

    /// [`Consumer::new`] for a cache of several groups ([`kvxfer_proto::groups`]), one
    /// layout each, in the order the engine numbers them.
    pub fn with_groups(
        agent: Arc<Agent>,
        groups: Vec<KvLayout>,
        cfg: ConnectorConfig,
    ) -> Result<Consumer> {
        let carrier = AgentCarrier::new(agent, Role::Consumer, None, None);
        Consumer::over(Box::new(carrier), CacheGroups::new(groups)?, cfg)
    }

    /// A consumer whose messages and blocks `carrier` moves; `groups` describes its cache.
    pub(crate) fn over(
        carrier: Box<dyn Carrier>,
        groups: CacheGroups,
        cfg: ConnectorConfig,
    ) -> Result<Consumer> {
        let name = format!("kvxfer-consumer-{}", carrier.name());
        // Only a push load's producer writes into the cache, into the blocks opened to it.
        for l in groups.layouts() {
            carrier.restrict(l, true);
        }
        let sh = Arc::new(ConsumerShared {
            carrier,
            t0: Instant::now(),
            groups,
            cfg,
            st: Mutex::new(ConsumerState {
                loads: HashMap::new(),
                finished: VecDeque::new(),
                failed: VecDeque::new(),
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
        let thread = spawn_thread(name, move || consumer_loop(&s2))?;
        Ok(Consumer {
            sh,
            thread: Some(thread),
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
        self.start_load_groups(h, &[local_blocks], spec)
    }

    /// [`Consumer::start_load_with`] for a cache of several groups: `local_blocks[g]` into
    /// group `g` ([`KvConsumer::start_load_groups`]).
    pub fn start_load_groups(
        &self,
        h: &Handoff,
        local_blocks: &[&[u32]],
        spec: &LoadSpec,
    ) -> Result<()> {
        let sh = &self.sh;
        // Before anything is dialled or read: the handoff came through clients.
        if let Some(key) = sh.carrier.handoff_key() {
            key.verify(h).map_err(|e| Error::Auth {
                peer: format!(
                    "handoff of request {:?} naming producer {:?}",
                    h.request, h.producer
                ),
                why: e.to_string(),
            })?;
        }
        let parts = plan_groups(&sh.groups, &sh.cfg, spec, h, local_blocks)?;
        if lock(&sh.st).loads.contains_key(&h.request) {
            return Err(Error::InvalidArgument(format!(
                "load {:?} is already in progress",
                h.request
            )));
        }
        sh.carrier.reach(h)?;
        let nl = sh.groups.total_layers();
        let moved: Vec<&[u32]> = parts.iter().map(|p| &p.local[..]).collect();
        let descs = sh.groups.descs(&moved);
        let charge = state_charge(&sh.cfg.budget, descs, "load state", sh.cfg.budget_wait)?;
        let nothing = moved.iter().all(|b| b.is_empty());
        // Where the block sizes differ, in the smaller one: the producer splits its own
        // blocks the same way (`block_size::split`).
        let wants: Vec<PushWant> = sh
            .groups
            .layouts()
            .iter()
            .zip(&parts)
            .map(|(l, p)| PushWant {
                blocks: p.want.clone(),
                num_blocks: p.view.as_ref().unwrap_or(l).num_blocks,
                layers: l.layers.clone(),
                block_tokens: p.view.as_ref().map(|v| v.block_tokens),
                more: Vec::new(),
            })
            .collect();
        let mut wants = wants.into_iter();
        let want = wants.next().map(|w| PushWant {
            more: wants.collect(),
            ..w
        });
        let proto = LoadProtocol::new(
            &h.request,
            &h.producer,
            h.mode,
            nl,
            want,
            nothing,
            sh.t0.elapsed(),
        )
        .declaring(spec.readers)
        .of_incarnation(h.epoch)
        .granted(h.grant);
        if let Some(why) = sh
            .carrier
            .peer_epoch(&h.producer)
            .and_then(|e| proto.restarted(e))
        {
            return Err(Error::Handoff {
                request: h.request.clone(),
                why,
            });
        }
        let first = proto.opening();
        // Push: the producer writes these blocks, and only these, over the lane.
        let pushed_under = if h.mode == Mode::Push && !nothing {
            let g = match h.grant {
                Some(g) => g,
                None => Grant(random::bytes()?),
            };
            for (i, (l, p)) in sh.groups.layouts().iter().zip(&parts).enumerate() {
                if let Err(e) = sh.carrier.grant(
                    g.for_group(i),
                    &h.producer,
                    true,
                    p.view.as_ref().unwrap_or(l),
                    &p.local,
                ) {
                    revoke_groups(sh, &g);
                    return Err(e);
                }
            }
            Some(g)
        } else {
            None
        };
        let skipped = parts
            .iter()
            .zip(sh.groups.layouts())
            .map(|(p, l)| {
                // A head slice skips its share of each cached block.
                p.cached_bytes * p.heads.width() / l.geometry.kv_heads.max(1)
            })
            .sum();
        let load = Load {
            h: h.clone(),
            parts,
            local_blocks: local_blocks.iter().map(|b| held(b).collect()).collect(),
            skipped,
            proto,
            posted: 0,
            inflight: Vec::new(),
            started: Instant::now(),
            figures: Figures::default(),
            pushed_under,
            _charge: charge,
        };
        {
            let mut st = lock(&sh.st);
            if st.loads.contains_key(&h.request) || st.fencing_names.contains(&h.request) {
                close_push(sh, &load);
                return Err(Error::InvalidArgument(format!(
                    "load {:?} is already in progress",
                    h.request
                )));
            }
            st.ended.remove(&h.request);
            st.loads.insert(h.request.clone(), load);
        }
        let mut st = lock(&sh.st);
        if !sh.carrier.send(&h.producer, &first.encode()) {
            let gone = Error::UnknownPeer {
                agent: h.producer.clone(),
            };
            fail(sh, &mut st, &h.request, gone);
        } else if nothing {
            finish(sh, &mut st, &h.request);
        }
        drop(st);
        sh.cv.notify_all();
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
            // Returns once nothing of the read touches the blocks, completed or not.
            t.cancel();
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
        std::mem::take(&mut lock(&self.sh.st).finished).into()
    }

    /// The figures of one finished load (taken out of [`Consumer::take_finished`]'s list).
    pub fn take_stats(&self, request: &str) -> Option<RequestStats> {
        let mut st = lock(&self.sh.st);
        let i = st.finished.iter().position(|s| s.request == request)?;
        st.finished.remove(i)
    }

    /// The oldest finished load, if `fits` accepts it (else it stays queued).
    pub fn take_finished_one(&self, fits: impl Fn(&RequestStats) -> bool) -> Option<RequestStats> {
        let mut st = lock(&self.sh.st);
        if !fits(st.finished.front()?) {
            return None;
        }
        st.finished.pop_front()
    }

    /// The oldest failed load, if `fits` accepts it (else it stays queued).
    pub fn take_failed_one(&self, fits: impl Fn(&LoadFailure) -> bool) -> Option<LoadFailure> {
        let mut st = lock(&self.sh.st);
        if !fits(st.failed.front()?) {
            return None;
        }
        st.failed.pop_front()
    }

    /// Loads failed since the last call, with the local blocks that are invalid.
    pub fn take_failed(&self) -> Vec<LoadFailure> {
        std::mem::take(&mut lock(&self.sh.st).failed).into()
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
        join_thread(&self.sh.cv, &mut self.thread);
        // Reads still in flight stop before the engine's blocks are its own again.
        let (loads, fencing) = {
            let mut st = lock(&self.sh.st);
            (
                std::mem::take(&mut st.loads),
                std::mem::take(&mut st.fencing),
            )
        };
        let left = loads.into_values().chain(fencing.into_iter().map(|f| f.1));
        for l in left {
            close_push(&self.sh, &l);
            for (_, t) in l.inflight {
                t.cancel();
            }
        }
        for l in self.sh.groups.layouts() {
            self.sh.carrier.restrict(l, false);
        }
        self.sh.carrier.close();
    }
}

const ENDED_MEMORY: usize = 4096;

fn remember(st: &mut ConsumerState, req: &str, e: Ended) {
    st.ended.insert(req.to_string(), e);
    st.ended_order.push_back(req.to_string());
    while st.ended_order.len() > ENDED_MEMORY {
        if let Some(old) = st.ended_order.pop_front() {
            st.ended.remove(&old);
        }
    }
}

/// A push load's blocks are closed to its producer again (what it queued is fenced apart).
fn close_push(sh: &ConsumerShared, l: &Load) {
    if let Some(g) = &l.pushed_under {
        revoke_groups(sh, g);
    }
}

/// Ends what `grant` opened of each cache group.
fn revoke_groups(sh: &ConsumerShared, grant: &Grant) {
    for g in 0..sh.groups.len() {
        sh.carrier.revoke(&grant.for_group(g));
    }
}

fn finish(sh: &ConsumerShared, st: &mut ConsumerState, req: &str) {
    let Some(l) = st.loads.remove(req) else {
        return;
    };
    close_push(sh, &l);
    let s = RequestStats {
        request: req.to_string(),
        bytes_moved: l.figures.bytes,
        bytes_skipped: l.skipped,
        descriptors: l.figures.descs,
        post_time: l.figures.post,
        transfer_time: l.figures.busy,
        handoff_time: l.started.elapsed(),
    };
    sh.tel.record(&s);
    st.finished.push_back(s);
    remember(st, req, Ended::Ok);
}

/// Fails the load of `req`. A load that may still have bytes on their way into its blocks is
/// fenced first, and its failure (and its blocks) reported only after ([`fence`]), so an
/// engine that reuses the blocks never has a late write land in them: a pull load's reads in
/// flight are cancelled; a push load's producer has its writes into this end fenced by the
/// carrier (the agent's: what it queued on the TCP lane, in a socket or mid-stream, is
/// dropped).
fn fail(sh: &ConsumerShared, st: &mut ConsumerState, req: &str, e: Error) {
    let Some(l) = st.loads.remove(req) else {
        return;
    };
    close_push(sh, &l);
    if !l.inflight.is_empty() || l.h.mode == Mode::Push {
        st.fencing_names.insert(req.to_string());
        st.fencing.push((req.to_string(), l, e));
        return;
    }
    report_failure(sh, st, req, l, e);
}

/// Cancels the reads of the loads that failed with reads in flight (on the consumer thread,
/// outside the lock: a cancel returns once nothing writes into the blocks), then reports them.
fn fence(sh: &ConsumerShared) {
    let fencing = std::mem::take(&mut lock(&sh.st).fencing);
    if fencing.is_empty() {
        return;
    }
    let mut fenced: Vec<String> = Vec::new();
    for (req, mut l, e) in fencing {
        for (_, t) in l.inflight.drain(..) {
            t.cancel();
        }
        if l.h.mode == Mode::Push && !fenced.contains(&l.h.producer) {
            let n = sh.carrier.fence(&l.h.producer);
            log::info!(
                "kvxfer consumer: {req:?} failed: {n} inbound stream(s) of {:?} fenced",
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

fn report_failure(sh: &ConsumerShared, st: &mut ConsumerState, req: &str, l: Load, e: Error) {
    log::warn!("kvxfer consumer: load of {req:?} failed: {e}");
    sh.tel.failed();
    // Tell the producer this reader is done with its blocks (it frees them on the last one).
    if l.h.mode == Mode::Pull {
        sh.carrier.send(&l.h.producer, &l.proto.ack().encode());
    }
    remember(st, req, Ended::Failed(failure_reason(&e)));
    st.failed.push_back(LoadFailure {
        request: req.to_string(),
        error: e,
        invalid_blocks: l.local_blocks.concat(),
        invalid_groups: l.local_blocks,
    });
}

fn consumer_loop(sh: &ConsumerShared) {
    loop {
        let busy = {
            let st = lock(&sh.st);
            if st.stop {
                return;
            }
            st.loads.values().any(|l| !l.inflight.is_empty())
        };
        take_control(&*sh.carrier, busy, |n| consumer_msg(sh, n));
        consumer_progress(sh);
        fence(sh);
    }
}

fn consumer_msg(sh: &ConsumerShared, n: Notification) {
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
        LoadEvent::Landed(layer) => {
            // Push: this layer's data landed before this message.
            if let Some((g, layout, _)) = sh.groups.locate(layer) {
                // In the view's blocks where the block sizes differ: they are what moved.
                let layout = l.parts[g].view.as_ref().unwrap_or(layout);
                let per_layer = l.parts[g].local.len() * layout.tensors_per_layer();
                l.figures.descs += per_layer as u64;
                l.figures.bytes += per_layer as u64 * layout.block_bytes();
            }
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

fn consumer_progress(sh: &ConsumerShared) {
    let mut st = lock(&sh.st);
    let mut changed = false;
    let mut out: Vec<(String, ToProducer)> = Vec::new();
    let mut failures: Vec<(String, Error)> = Vec::new();
    let mut done: Vec<String> = Vec::new();
    for (req, l) in st.loads.iter_mut() {
        // Until the producer has taken a push request, the heartbeat repeats it.
        if let Some(m) = l.proto.heartbeat_due(sh.t0.elapsed(), sh.cfg.heartbeat) {
            out.push((l.h.producer.clone(), m));
        }
        // No lease renewed, or none ever came: the load fails rather than wait for good.
        if let Some(why) = l.proto.silent(sh.t0.elapsed()) {
            if l.inflight.is_empty() {
                failures.push((req.clone(), load_failed(req, why)));
                continue;
            }
        }
        // The producer restarted: its blocks are gone, whatever its new incarnation answers.
        // (Reads in flight end on their own: the old incarnation's lanes are dropped.)
        let now_loaded = sh.carrier.peer_epoch(&l.h.producer).unwrap_or(0);
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
                    let Some((g, layout, layer)) = sh.groups.locate(l.posted) else {
                        break;
                    };
                    let p = &l.parts[g];
                    if p.local.is_empty() {
                        // Nothing of this group moves (a window, a cached prefix).
                        l.proto.mark_loaded(l.posted);
                        l.posted += 1;
                        changed = true;
                        continue;
                    }
                    let m = LayerMove {
                        local: p.view.as_ref().unwrap_or(layout),
                        local_blocks: &p.local,
                        remote: &p.remote,
                        remote_blocks: &p.theirs,
                        heads: &p.heads,
                        layer,
                    };
                    // Bounded by the lease: never read blocks the producer may have freed.
                    match sh.carrier.read(&l.h.producer, &m, until - now) {
                        Ok(t) => {
                            l.figures.posted();
                            l.inflight.push((l.posted, t));
                        }
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
            if !l.inflight[i].1.is_done() {
                i += 1;
                continue;
            }
            let (layer, t) = l.inflight.swap_remove(i);
            let r = t.wait();
            l.figures.finished(r.as_ref().ok(), l.inflight.is_empty());
            match r {
                Ok(_) => {
                    l.proto.mark_loaded(layer);
                    changed = true;
                }
                Err(e) => failures.push((req.clone(), e)),
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
            out.push((l.h.producer.clone(), l.proto.ack()));
        }
        finish(sh, &mut st, &req);
        changed = true;
    }
    drop(st);
    let mut gone: Vec<(String, String)> = Vec::new();
    for (to, m) in out {
        // An acknowledgement to a producer that is gone frees nothing (its blocks went with
        // it); a heartbeat that finds none ends the load.
        let ack = matches!(m, ToProducer::Ack { .. });
        if !sh.carrier.send(&to, &m.encode()) && !ack {
            gone.push((m.request().to_string(), to));
        }
    }
    if !gone.is_empty() {
        let mut st = lock(&sh.st);
        for (req, p) in gone {
            let why = format!("the producer {p:?} is gone");
            let e = Error::Handoff {
                request: req.clone(),
                why,
            };
            fail(sh, &mut st, &req, e);
        }
        changed = true;
    }
    if changed {
        sh.cv.notify_all();
    }
}

impl KvConsumer for Consumer {
    fn start_load_groups(
        &self,
        handoff: &Handoff,
        local_blocks: &[&[u32]],
        spec: &LoadSpec,
    ) -> Result<()> {
        Consumer::start_load_groups(self, handoff, local_blocks, spec)
    }
    fn wait_layer(&self, request: &str, layer: usize, timeout: Duration) -> Result<()> {
        Consumer::wait_layer(self, request, layer, timeout)
    }
    fn wait(&self, request: &str, timeout: Duration) -> Result<()> {
        Consumer::wait(self, request, timeout)
    }
    fn next_finished(&self) -> Option<RequestStats> {
        self.take_finished_one(|_| true)
    }
    fn next_failed(&self) -> Option<LoadFailure> {
        self.take_failed_one(|_| true)
    }
    fn in_progress(&self) -> usize {
        Consumer::in_progress(self)
    }
    fn telemetry(&self) -> &Telemetry {
        Consumer::telemetry(self)
    }
}
