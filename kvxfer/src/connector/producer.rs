//! The prefill side's shell, one for every carrier: publishing, the control-message thread,
//! push transfers. The protocol's decisions are [`ProducerCore`]'s; every byte leaves through
//! the [`Carrier`].
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::agent_carrier::AgentCarrier;
use super::api::KvProducer;
use super::carrier::{Carrier, InFlight, LayerMove, Role};
use super::config::ConnectorConfig;
use super::shell::{
    join_thread, lock, spawn_thread, state_charge, take_control, wait_until, Figures,
};
use crate::agent::Agent;
use crate::budget::Charge;
use crate::random;
use crate::telemetry::{PeerHeld, RequestStats, Telemetry};
use kvxfer_proto::connector::{LayerError, ProducerAction, ProducerCore};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::lifecycle::{FreeReason, Freed, PeerShare};
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::wire::connector::{
    Grant, Handoff, Mode, PushWant, Refusal, ToConsumer, ToProducer,
};
use kvxfer_proto::wire::notify::Notification;

/// One push consumer's progress through a request.
struct PushTarget {
    reader: String,
    /// The consumer's cache as its push request described it.
    local: KvLayout,
    blocks: Vec<u32>,
    /// Producer blocks before the consumer's (its cached prefix).
    skip: usize,
    posted: usize,
    inflight: Vec<(usize, Box<dyn InFlight>)>,
    landed: usize,
    figures: Figures,
    failed: bool,
    _charge: Charge,
}

/// The shell's side of a held request (the protocol's side is in the core).
struct HeldRequest {
    blocks: Vec<u32>,
    pushes: Vec<PushTarget>,
    published: Instant,
    /// The handoff's grant: what its readers are opened under.
    grant: Grant,
}

struct ProducerState {
    core: ProducerCore,
    requests: HashMap<String, HeldRequest>,
    freed: VecDeque<Freed>,
    stop: bool,
}

impl ProducerState {
    /// A request's blocks are free: the shell forgets it, the engine may take the blocks. A
    /// pull request every reader acknowledged counts as served, one that expired as failed
    /// (a push request was counted when its writes landed).
    fn record_freed(&mut self, f: Freed, tel: &Telemetry, mode: Mode, carrier: &dyn Carrier) {
        if let Some(r) = self.requests.remove(&f.request) {
            // Closed before the engine may reuse the blocks.
            carrier.revoke(&r.grant);
            match f.reason {
                FreeReason::Acked if mode == Mode::Pull => tel.served(r.published.elapsed()),
                FreeReason::Expired | FreeReason::HoldLimit => tel.failed(),
                _ => {}
            }
        }
        self.freed.push_back(f);
    }
}

/// What the engine's calls and the producer's thread share.
struct ProducerShared {
    carrier: Box<dyn Carrier>,
    layout: KvLayout,
    cfg: ConnectorConfig,
    st: Mutex<ProducerState>,
    cv: Condvar,
    t0: Instant,
    tel: Telemetry,
}

/// The prefill side. See the module docs of [`crate::connector`].
pub struct Producer {
    sh: Arc<ProducerShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("name", &self.sh.carrier.name())
            .finish()
    }
}

impl Producer {
    /// A producer over `agent`, whose registered cache `layout` describes; `side_channel` is
    /// where consumers reach the agent's [`Agent::listen`] (put into every handoff).
    pub fn new(
        agent: Arc<Agent>,
        layout: KvLayout,
        cfg: ConnectorConfig,
        side_channel: Option<SocketAddr>,
    ) -> Result<Producer> {
        let carrier = AgentCarrier::new(agent, Role::Producer, side_channel, None);
        Producer::over(Box::new(carrier), layout, cfg)
    }

    /// A producer whose messages and blocks `carrier` moves; `layout` describes its cache.
    pub(crate) fn over(
        carrier: Box<dyn Carrier>,
        layout: KvLayout,
        cfg: ConnectorConfig,
    ) -> Result<Producer> {
        let name = format!("kvxfer-producer-{}", carrier.name());
        // Peers read the cache only inside the leases they were granted.
        carrier.restrict(&layout, true);
        let share = peer_share(&cfg, &layout);
        let sh = Arc::new(ProducerShared {
            carrier,
            layout,
            st: Mutex::new(ProducerState {
                core: ProducerCore::new(cfg.lease, cfg.mode)
                    .with_max_hold(cfg.max_hold)
                    .with_share(share),
                requests: HashMap::new(),
                freed: VecDeque::new(),
                stop: false,
            }),
            cfg,
            cv: Condvar::new(),
            t0: Instant::now(),
            tel: Telemetry::new("producer"),
        });
        let s2 = sh.clone();
        let thread = spawn_thread(name, move || producer_loop(&s2))?;
        Ok(Producer {
            sh,
            thread: Some(thread),
        })
    }

    /// Holds `blocks` of `request` for consumers and returns the handoff to give them.
    /// `layers_done`: how many layers (from layer 0) are already computed: all of them when
    /// prefill finished, 0 to hand over layer by layer with [`Producer::layer_done`]. A
    /// request that is still held cannot be published again.
    ///
    /// The handoff carries a fresh [`Grant`]: only consumers that present it are answered.
    /// With a secret it is sealed ([`kvxfer_proto::handoff_seal::HandoffKey`]) too.
    pub fn publish(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
    ) -> Result<Handoff> {
        let grant = Grant(random::bytes()?);
        self.publish_granted(request, blocks, tokens, layers_done, grant)
    }

    /// [`Producer::publish`] under `grant`, chosen by the caller: for an engine whose
    /// scheduler writes the handoff its clients see (it puts the same grant into it).
    pub fn publish_granted(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
        grant: Grant,
    ) -> Result<Handoff> {
        let layout = &self.sh.layout;
        let nl = layout.layers.len();
        if request.is_empty() || layers_done > nl {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: layers_done {layers_done} of {nl}"
            )));
        }
        if let Some(&b) = blocks.iter().find(|&&b| u64::from(b) >= layout.num_blocks) {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: block {b} of {}",
                layout.num_blocks
            )));
        }
        let now = self.sh.t0.elapsed();
        let mut st = lock(&self.sh.st);
        if st.core.is_held(request) {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: already held"
            )));
        }
        st.core.publish(
            request,
            blocks.to_vec(),
            self.sh.cfg.readers,
            nl,
            layers_done,
            Some(grant),
            now,
        );
        st.requests.insert(
            request.to_string(),
            HeldRequest {
                blocks: blocks.to_vec(),
                pushes: Vec::new(),
                published: Instant::now(),
                grant,
            },
        );
        drop(st);
        self.sh.cv.notify_all();
        let carrier = &self.sh.carrier;
        let mut h = Handoff {
            request: request.to_string(),
            producer: carrier.name().to_string(),
            side_channel: carrier.side_channel(),
            blocks: blocks.to_vec(),
            tokens,
            compat: layout.compat_hash(),
            kv_heads: layout.geometry.kv_heads,
            num_blocks: layout.num_blocks,
            layers: layout.layers.clone(),
            mode: self.sh.cfg.mode,
            epoch: carrier.epoch(),
            grant: Some(grant),
            seal: None,
            groups: Vec::new(),
        };
        if let Some(key) = carrier.handoff_key() {
            key.seal(&mut h);
        }
        Ok(h)
    }

    /// Layer `layer` of `request` is computed: consumers may take it now.
    pub fn layer_done(&self, request: &str, layer: usize) -> Result<()> {
        let sends = lock(&self.sh.st)
            .core
            .layer_done(request, layer)
            .map_err(|e| match e {
                LayerError::NotHeld => Error::Handoff {
                    request: request.to_string(),
                    why: "not held by this producer".into(),
                },
                LayerError::NoSuchLayer(n) => {
                    Error::InvalidArgument(format!("layer {layer} of {n}"))
                }
            })?;
        self.sh.cv.notify_all();
        for (to, m) in sends {
            self.sh.carrier.send(&to, &m.encode());
        }
        Ok(())
    }

    /// Gives up a request: its blocks are freed now; consumers that ask get a typed refusal.
    pub fn abort(&self, request: &str) {
        let mut st = lock(&self.sh.st);
        if let Some(r) = st.requests.remove(request) {
            self.sh.carrier.revoke(&r.grant);
        }
        if let Some(f) = st.core.abort(request) {
            st.freed.push_back(f);
        }
        drop(st);
        self.sh.cv.notify_all();
    }

    /// Requests whose blocks the engine may reuse now (acknowledged, aborted or expired).
    pub fn take_freed(&self) -> Vec<Freed> {
        std::mem::take(&mut lock(&self.sh.st).freed).into()
    }

    /// Takes the oldest freed request if `fits` accepts it, waiting up to `timeout` for one.
    /// `Err((name_len, blocks))` when it does not fit (it stays queued); `Ok(None)`: none.
    pub fn take_freed_one(
        &self,
        timeout: Duration,
        fits: impl Fn(&Freed) -> bool,
    ) -> std::result::Result<Option<Freed>, (usize, usize)> {
        wait_until(&self.sh.st, &self.sh.cv, timeout, |st| {
            let f = st.freed.front()?;
            Some(if fits(f) {
                st.freed.pop_front().ok_or((0, 0))
            } else {
                Err((f.request.len(), f.blocks.len()))
            })
        })
        .transpose()
    }

    /// Waits up to `timeout` until `request`'s blocks are freed; returns how.
    pub fn wait_freed(&self, request: &str, timeout: Duration) -> Result<Freed> {
        wait_until(&self.sh.st, &self.sh.cv, timeout, |st| {
            let i = st.freed.iter().position(|f| f.request == request)?;
            st.freed.remove(i)
        })
        .ok_or(Error::WaitTimeout(timeout))
    }

    /// Requests held now.
    pub fn held(&self) -> usize {
        lock(&self.sh.st).core.held()
    }

    /// Aggregate telemetry (push mode records per-request figures here).
    pub fn telemetry(&self) -> &Telemetry {
        &self.sh.tel
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        lock(&self.sh.st).stop = true;
        join_thread(&self.sh.cv, &mut self.thread);
        // Pushes still in flight end before the carrier lets the engine's memory go; what
        // the held requests opened is closed first.
        let carrier = &self.sh.carrier;
        let pushes: Vec<PushTarget> = lock(&self.sh.st)
            .requests
            .drain()
            .flat_map(|(_, r)| {
                carrier.revoke(&r.grant);
                r.pushes
            })
            .collect();
        for (_, t) in pushes.into_iter().flat_map(|p| p.inflight) {
            t.cancel();
        }
        self.sh.carrier.restrict(&self.sh.layout, false);
        self.sh.carrier.close();
    }
}

/// Each reader's share of the cache in blocks: `cfg`'s bytes over the bytes of a block in
/// every layer (a hard limit), or by default half the cache as a fair share (it binds only
/// while another reader holds blocks too).
fn peer_share(cfg: &ConnectorConfig, layout: &KvLayout) -> PeerShare {
    let block = block_bytes_all_layers(layout).max(1);
    let (blocks, fair) = match cfg.peer_bytes {
        Some(b) => (b / block, false),
        None => (layout.num_blocks / 2, true),
    };
    PeerShare {
        requests: cfg.peer_requests.max(1),
        blocks: blocks.max(1),
        fair,
    }
}

/// The bytes one block id stands for: its tensors in every layer.
fn block_bytes_all_layers(layout: &KvLayout) -> u64 {
    layout.block_bytes() * layout.tensors_per_layer() as u64 * layout.layers.len() as u64
}

/// Readers' holds that changed, into the metrics.
fn publish_holds(st: &mut ProducerState, sh: &ProducerShared) {
    let block = block_bytes_all_layers(&sh.layout);
    for (peer, h) in st.core.take_hold_changes() {
        let held = PeerHeld {
            requests: h.requests as u64,
            bytes: h.blocks.saturating_mul(block),
        };
        sh.tel.peer_held(&peer, held);
    }
}

fn producer_loop(sh: &ProducerShared) {
    loop {
        let busy = {
            let st = lock(&sh.st);
            if st.stop {
                return;
            }
            st.requests.values().any(|r| !r.pushes.is_empty())
        };
        take_control(&*sh.carrier, busy, |n| producer_msg(sh, n));
        producer_pushes(sh);
        let now = sh.t0.elapsed();
        let mut st = lock(&sh.st);
        let freed = st.core.tick(now);
        publish_holds(&mut st, sh);
        if !freed.is_empty() {
            for f in freed {
                st.record_freed(f, &sh.tel, sh.cfg.mode, &*sh.carrier);
            }
            drop(st);
            sh.cv.notify_all();
        }
    }
}

fn producer_msg(sh: &ProducerShared, n: Notification) {
    let m = match ToProducer::decode(&n.payload) {
        Ok(m) => m,
        Err(why) => {
            log::warn!(
                "kvxfer connector: malformed control message from {:?}: {why}",
                n.from
            );
            return;
        }
    };
    let now = sh.t0.elapsed();
    let mut st = lock(&sh.st);
    let actions = st.core.handle(&n.from, m, now);
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut freed = false;
    for a in actions {
        match a {
            ProducerAction::Send { to, msg } => {
                if let ToConsumer::Refused {
                    kind: Some(Refusal::Share),
                    why,
                    ..
                } = &msg
                {
                    log::warn!("kvxfer producer: {why}");
                    sh.tel.share_refused();
                }
                out.push((to, msg.encode()))
            }
            ProducerAction::Open { reader, request } => {
                if let Some(r) = st.requests.get(&request) {
                    // Not opened: the reader's reads are refused typed ("holds no grant"),
                    // and the lease frees the request.
                    if let Err(e) = sh
                        .carrier
                        .grant(r.grant, &reader, false, &sh.layout, &r.blocks)
                    {
                        log::warn!(
                            "kvxfer producer: request {request:?} not opened to {reader:?}: {e}"
                        );
                    }
                }
            }
            ProducerAction::StartPush {
                reader,
                request,
                want,
                lease,
            } => {
                let published = st.requests.get(&request).map(|r| r.blocks.len());
                let target = published
                    .ok_or_else(|| Error::InvalidArgument("push request: not held".into()))
                    .and_then(|nb| push_target(sh, reader.clone(), want, nb));
                match target {
                    Ok(p) => {
                        if let Some(r) = st.requests.get_mut(&request) {
                            r.pushes.push(p);
                        }
                        st.core.push_accepted(&request, &reader);
                        out.push((reader, lease.encode()));
                    }
                    Err(e) => {
                        let refused = ToConsumer::Refused {
                            request,
                            kind: None,
                            why: e.to_string(),
                        };
                        out.push((reader, refused.encode()));
                    }
                }
            }
            ProducerAction::Freed(f) => {
                st.record_freed(f, &sh.tel, sh.cfg.mode, &*sh.carrier);
                freed = true;
            }
        }
    }
    drop(st);
    if freed {
        sh.cv.notify_all();
    }
    for (to, m) in out {
        sh.carrier.send(&to, &m);
    }
}

/// Builds a push target from a consumer's "want".
fn push_target(
    sh: &ProducerShared,
    reader: String,
    want: PushWant,
    producer_blocks: usize,
) -> Result<PushTarget> {
    let bad = |w: &str| Error::InvalidArgument(format!("push request: {w}"));
    let PushWant {
        blocks,
        num_blocks: nb,
        layers,
        ..
    } = want;
    if blocks.len() > producer_blocks || layers.len() != sh.layout.layers.len() {
        return Err(bad("more blocks than published, or another layer count"));
    }
    let local = KvLayout {
        num_blocks: nb,
        layers,
        ..sh.layout.clone()
    };
    let descs = (blocks.len() * local.layers.len() * local.tensors_per_layer()) as u64;
    // The producer's thread must not block: no room now is a refusal.
    let charge = state_charge(&sh.cfg.budget, descs, "push state", Duration::ZERO)?;
    Ok(PushTarget {
        reader,
        skip: producer_blocks - blocks.len(),
        blocks,
        local,
        posted: 0,
        inflight: Vec::new(),
        landed: 0,
        figures: Figures::default(),
        failed: false,
        _charge: charge,
    })
}

/// Posts the ready layers of every push target and collects finished ones.
fn producer_pushes(sh: &ProducerShared) {
    let mut st = lock(&sh.st);
    let mut acks: Vec<(String, String)> = Vec::new();
    // A push that failed is the consumer's to hear at once (else it waits out its lease).
    let mut notes: Vec<(String, Vec<u8>)> = Vec::new();
    let refusal = |req: &str, e: &Error| ToConsumer::Refused {
        request: req.to_string(),
        kind: None,
        why: format!("the push failed: {e}"),
    };
    let layout = &sh.layout;
    let nl = layout.layers.len();
    let heads = HeadMap::all(layout.geometry.kv_heads);
    let ProducerState { core, requests, .. } = &mut *st;
    for (req, r) in requests.iter_mut() {
        let ready = core.ready_layers(req);
        for p in r.pushes.iter_mut() {
            while !p.failed && p.posted < ready {
                let l = p.posted;
                let note = ToConsumer::Layer {
                    request: req.clone(),
                    layer: l,
                }
                .encode();
                // Whole blocks: the consumer's blocks as its push request named them.
                let m = LayerMove {
                    local: layout,
                    local_blocks: &r.blocks[p.skip..],
                    remote: &p.local,
                    remote_blocks: &p.blocks,
                    heads: &heads,
                    layer: l,
                };
                match sh.carrier.write(&p.reader, &m, &note, sh.cfg.lease) {
                    Ok(t) => {
                        p.figures.posted();
                        p.inflight.push((l, t));
                    }
                    Err(e) => {
                        log::warn!("kvxfer producer: push of {req:?} layer {l}: {e}");
                        notes.push((p.reader.clone(), refusal(req, &e).encode()));
                        p.failed = true;
                    }
                }
                p.posted += 1;
            }
            let mut i = 0;
            while i < p.inflight.len() {
                if !p.inflight[i].1.is_done() {
                    i += 1;
                    continue;
                }
                let (_, t) = p.inflight.swap_remove(i);
                let r = t.wait();
                p.figures.finished(r.as_ref().ok(), p.inflight.is_empty());
                match r {
                    Ok(_) => p.landed += 1,
                    Err(e) => {
                        log::warn!("kvxfer producer: push of {req:?}: {e}");
                        if !p.failed {
                            notes.push((p.reader.clone(), refusal(req, &e).encode()));
                        }
                        p.failed = true;
                    }
                }
            }
            if p.landed == nl && !p.failed {
                acks.push((req.clone(), p.reader.clone()));
                let f = &p.figures;
                sh.tel.record(&RequestStats {
                    request: req.clone(),
                    bytes_moved: f.bytes,
                    bytes_skipped: p.skip as u64
                        * layout.block_bytes()
                        * (nl * layout.tensors_per_layer()) as u64,
                    descriptors: f.descs,
                    post_time: f.post,
                    transfer_time: f.busy,
                    handoff_time: r.published.elapsed(),
                });
                p.failed = true; // done: forgotten below
            }
        }
        // A target is forgotten once done or failed with nothing of it in flight.
        r.pushes.retain(|p| !(p.failed && p.inflight.is_empty()));
    }
    drop(st);
    // The consumer hears of its failures before anything is freed.
    for (reader, m) in notes {
        sh.carrier.send(&reader, &m);
    }
    // The producer saw its writes land: that reader is done with the blocks. (The lock is
    // taken again only then: this runs every millisecond while pushes are in progress.)
    if acks.is_empty() {
        return;
    }
    let now = sh.t0.elapsed();
    let mut st = lock(&sh.st);
    for (req, reader) in acks {
        for a in st.core.push_landed(&reader, &req, now) {
            if let ProducerAction::Freed(f) = a {
                st.record_freed(f, &sh.tel, sh.cfg.mode, &*sh.carrier);
            }
        }
    }
    drop(st);
    sh.cv.notify_all();
}

impl KvProducer for Producer {
    fn publish(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
    ) -> Result<Handoff> {
        Producer::publish(self, request, blocks, tokens, layers_done)
    }
    fn publish_granted(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
        grant: Grant,
    ) -> Result<Handoff> {
        Producer::publish_granted(self, request, blocks, tokens, layers_done, grant)
    }
    fn layer_done(&self, request: &str, layer: usize) -> Result<()> {
        Producer::layer_done(self, request, layer)
    }
    fn abort(&self, request: &str) {
        Producer::abort(self, request)
    }
    fn next_freed(&self, timeout: Duration) -> Option<Freed> {
        self.take_freed_one(timeout, |_| true).ok().flatten()
    }
    fn wait_freed(&self, request: &str, timeout: Duration) -> Result<Freed> {
        Producer::wait_freed(self, request, timeout)
    }
    fn held(&self) -> usize {
        Producer::held(self)
    }
    fn telemetry(&self) -> &Telemetry {
        Producer::telemetry(self)
    }
}
