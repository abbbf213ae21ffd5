//! The prefill side's shell: publishing, the control-message thread, push transfers.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::config::ConnectorConfig;
use super::shell::{add_stats, lock, send, state_charge, take_control, wait_until, Registrations};
use crate::agent::Agent;
use crate::budget::Charge;
use crate::telemetry::{RequestStats, Telemetry};
use crate::transfer::Transfer;
use kvxfer_proto::connector::{LayerError, ProducerAction, ProducerCore};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::lifecycle::Freed;
use kvxfer_proto::types::XferOp;
use kvxfer_proto::wire::connector::{Handoff, PushWant, ToConsumer, ToProducer};
use kvxfer_proto::wire::notify::Notification;

struct Push {
    reader: String,
    local: KvLayout,
    blocks: Vec<u32>,
    skip: usize,
    posted: usize,
    inflight: Vec<(usize, Transfer)>,
    landed: usize,
    bytes: u64,
    descs: u64,
    post: Duration,
    xfer: Duration,
    failed: bool,
    _charge: Charge,
}

/// The shell's side of a held request (the protocol's side is in the core).
struct PReq {
    blocks: Vec<u32>,
    pushes: Vec<Push>,
    published: Instant,
}

struct PState {
    core: ProducerCore,
    reqs: HashMap<String, PReq>,
    freed: Vec<Freed>,
    stop: bool,
}

impl PState {
    /// A request's blocks are free: the shell forgets it, the engine may take the blocks.
    fn record_freed(&mut self, f: Freed) {
        self.reqs.remove(&f.request);
        self.freed.push(f);
    }
}

struct PShared {
    agent: Arc<Agent>,
    layout: KvLayout,
    cfg: ConnectorConfig,
    side: Option<SocketAddr>,
    st: Mutex<PState>,
    cv: Condvar,
    t0: Instant,
    tel: Telemetry,
}

/// The prefill side. See the module docs.
pub struct Producer {
    sh: Arc<PShared>,
    thread: Option<JoinHandle<()>>,
    /// Regions its `AgentConnector` registered for it: deregistered after the thread has
    /// stopped (fields drop after `Drop::drop`).
    _regs: Option<Registrations>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("agent", &self.sh.agent.name())
            .finish()
    }
}

impl Producer {
    /// This producer, owning the registrations made for it.
    pub(crate) fn owning(mut self, regs: Registrations) -> Producer {
        self._regs = Some(regs);
        self
    }

    /// A producer over `agent`, whose registered cache `layout` describes; `side_channel` is
    /// where consumers reach the agent's [`Agent::listen`] (put into every handoff).
    pub fn new(
        agent: Arc<Agent>,
        layout: KvLayout,
        cfg: ConnectorConfig,
        side_channel: Option<SocketAddr>,
    ) -> Result<Producer> {
        let sh = Arc::new(PShared {
            agent,
            cfg: cfg.clone(),
            layout,
            side: side_channel,
            st: Mutex::new(PState {
                core: ProducerCore::new(cfg.lease, cfg.mode),
                reqs: HashMap::new(),
                freed: Vec::new(),
                stop: false,
            }),
            cv: Condvar::new(),
            t0: Instant::now(),
            tel: Telemetry::new("producer"),
        });
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-producer-{}", sh.agent.name()))
            .spawn(move || producer_loop(&s2))
            .map_err(|e| Error::io("spawning the producer thread", e))?;
        Ok(Producer {
            sh,
            thread: Some(thread),
            _regs: None,
        })
    }

    /// Holds `blocks` of `request` for consumers and returns the handoff to give them.
    /// `layers_done`: how many layers (from layer 0) are already computed: all of them when
    /// prefill finished, 0 to hand over layer by layer with [`Producer::layer_done`].
    pub fn publish(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
    ) -> Result<Handoff> {
        let nl = self.sh.layout.layers.len();
        if request.is_empty() || layers_done > nl {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: layers_done {layers_done} of {nl}"
            )));
        }
        if let Some(&b) = blocks
            .iter()
            .find(|&&b| u64::from(b) >= self.sh.layout.num_blocks)
        {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: block {b} of {}",
                self.sh.layout.num_blocks
            )));
        }
        let now = self.sh.t0.elapsed();
        let mut st = lock(&self.sh.st);
        st.core.publish(
            request,
            blocks.to_vec(),
            self.sh.cfg.readers,
            nl,
            layers_done,
            now,
        );
        st.reqs.insert(
            request.to_string(),
            PReq {
                blocks: blocks.to_vec(),
                pushes: Vec::new(),
                published: Instant::now(),
            },
        );
        drop(st);
        Ok(Handoff {
            request: request.to_string(),
            producer: self.sh.agent.name().to_string(),
            side_channel: self.sh.side,
            blocks: blocks.to_vec(),
            tokens,
            compat: self.sh.layout.compat_hash(),
            kv_heads: self.sh.layout.geometry.kv_heads,
            num_blocks: self.sh.layout.num_blocks,
            layers: self.sh.layout.layers.clone(),
            mode: self.sh.cfg.mode,
            epoch: self.sh.agent.epoch(),
        })
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
        for (to, m) in sends {
            send(&self.sh.agent, &to, &m.encode());
        }
        self.sh.cv.notify_all();
        Ok(())
    }

    /// Gives up a request: its blocks are freed now; consumers that ask get a typed refusal.
    pub fn abort(&self, request: &str) {
        let mut st = lock(&self.sh.st);
        st.reqs.remove(request);
        if let Some(f) = st.core.abort(request) {
            st.freed.push(f);
        }
        drop(st);
        self.sh.cv.notify_all();
    }

    /// Requests whose blocks the engine may reuse now (acknowledged, aborted or expired).
    pub fn take_freed(&self) -> Vec<Freed> {
        std::mem::take(&mut lock(&self.sh.st).freed)
    }

    /// Takes the oldest freed request if `fits` accepts it, waiting up to `timeout` for one.
    /// `Err((name_len, blocks))` when it does not fit (it stays queued); `Ok(None)`: none.
    pub fn take_freed_one(
        &self,
        timeout: Duration,
        fits: impl Fn(&Freed) -> bool,
    ) -> std::result::Result<Option<Freed>, (usize, usize)> {
        wait_until(&self.sh.st, &self.sh.cv, timeout, |st| {
            let f = st.freed.first()?;
            Some(if fits(f) {
                Ok(st.freed.remove(0))
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
            Some(st.freed.remove(i))
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
        self.sh.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn producer_loop(sh: &PShared) {
    loop {
        if lock(&sh.st).stop {
            return;
        }
        let busy = lock(&sh.st).reqs.values().any(|r| !r.pushes.is_empty());
        take_control(&sh.agent, true, busy, |n| producer_msg(sh, n));
        producer_pushes(sh);
        let now = sh.t0.elapsed();
        let mut st = lock(&sh.st);
        let freed = st.core.tick(now);
        if !freed.is_empty() {
            for f in freed {
                st.record_freed(f);
            }
            drop(st);
            sh.cv.notify_all();
        }
    }
}

fn producer_msg(sh: &PShared, n: Notification) {
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
            ProducerAction::Send { to, msg } => out.push((to, msg.encode())),
            ProducerAction::StartPush {
                reader,
                request,
                want,
                lease,
            } => {
                let published = st.reqs.get(&request).map(|r| r.blocks.len());
                let target = published
                    .ok_or_else(|| Error::InvalidArgument("push request: not held".into()))
                    .and_then(|nb| push_target(sh, want, nb));
                match target {
                    Ok(p) => {
                        if let Some(r) = st.reqs.get_mut(&request) {
                            r.pushes.push(Push {
                                reader: reader.clone(),
                                ..p
                            });
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
                st.record_freed(f);
                freed = true;
            }
        }
    }
    drop(st);
    if freed {
        sh.cv.notify_all();
    }
    for (to, m) in out {
        send(&sh.agent, &to, &m);
    }
}

/// Builds a push target from a consumer's "want".
fn push_target(sh: &PShared, want: PushWant, producer_blocks: usize) -> Result<Push> {
    let bad = |w: &str| Error::InvalidArgument(format!("push request: {w}"));
    let PushWant {
        blocks,
        num_blocks: nb,
        layers,
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
    // The producer's driver thread must not block: no room now is a refusal.
    let charge = state_charge(&sh.cfg.budget, descs, "push state", Duration::ZERO)?;
    Ok(Push {
        reader: String::new(),
        skip: producer_blocks - blocks.len(),
        blocks,
        local,
        posted: 0,
        inflight: Vec::new(),
        landed: 0,
        bytes: 0,
        descs: 0,
        post: Duration::ZERO,
        xfer: Duration::ZERO,
        failed: false,
        _charge: charge,
    })
}

/// Posts the ready layers of every push target and collects finished ones.
fn producer_pushes(sh: &PShared) {
    let mut st = lock(&sh.st);
    let mut acks: Vec<(String, String)> = Vec::new();
    // A push that failed is the consumer's to hear at once (else it waits out its lease).
    let mut refusals: Vec<(String, Vec<u8>)> = Vec::new();
    let refusal = |req: &str, e: &Error| ToConsumer::Refused {
        request: req.to_string(),
        kind: None,
        why: format!("the push failed: {e}"),
    };
    let nl = sh.layout.layers.len();
    let heads = 0..sh.layout.geometry.kv_heads;
    let PState { core, reqs, .. } = &mut *st;
    for (req, r) in reqs.iter_mut() {
        let ready = core.ready_layers(req);
        let src_blocks = &r.blocks;
        for p in r.pushes.iter_mut().filter(|p| !p.failed) {
            while p.posted < ready {
                let l = p.posted;
                let res = (|| -> Result<Transfer> {
                    // Whole blocks: one paged entry per tensor of the layer on each side.
                    let ld = sh
                        .layout
                        .paged(&src_blocks[p.skip..], l..l + 1, heads.clone())?;
                    let rd = p.local.paged(&p.blocks, l..l + 1, heads.clone())?;
                    let note = ToConsumer::Layer {
                        request: req.clone(),
                        layer: l,
                    }
                    .encode();
                    sh.agent.transfer_paged(
                        XferOp::Write,
                        &p.reader,
                        &ld,
                        &rd,
                        Some(&note),
                        Some(sh.cfg.lease),
                    )
                })();
                match res {
                    Ok(t) => p.inflight.push((l, t)),
                    Err(e) => {
                        log::warn!("kvxfer producer: push of {req:?} layer {l}: {e}");
                        refusals.push((p.reader.clone(), refusal(req, &e).encode()));
                        p.failed = true;
                        break;
                    }
                }
                p.posted += 1;
            }
            let mut i = 0;
            while i < p.inflight.len() {
                if p.inflight[i].1.is_done() {
                    let (_, t) = p.inflight.swap_remove(i);
                    match t.wait() {
                        Ok(s) => {
                            p.landed += 1;
                            add_stats(&mut p.bytes, &mut p.descs, &mut p.post, &mut p.xfer, &s);
                        }
                        Err(e) => {
                            log::warn!("kvxfer producer: push of {req:?}: {e}");
                            if !p.failed {
                                refusals.push((p.reader.clone(), refusal(req, &e).encode()));
                            }
                            p.failed = true;
                        }
                    }
                } else {
                    i += 1;
                }
            }
            if p.landed == nl && !p.failed {
                acks.push((req.clone(), p.reader.clone()));
                sh.tel.record(&RequestStats {
                    request: req.clone(),
                    bytes_moved: p.bytes,
                    bytes_skipped: p.skip as u64
                        * sh.layout.block_bytes()
                        * (nl * sh.layout.tensors_per_layer()) as u64,
                    descriptors: p.descs,
                    post_time: p.post,
                    transfer_time: p.xfer,
                    handoff_time: r.published.elapsed(),
                });
                p.failed = true; // done: never looked at again
            }
        }
    }
    // The producer saw its writes land: that reader is done with the blocks.
    let now = sh.t0.elapsed();
    let mut any = false;
    for (req, reader) in acks {
        for a in st.core.push_landed(&reader, &req, now) {
            if let ProducerAction::Freed(f) = a {
                st.record_freed(f);
                any = true;
            }
        }
    }
    drop(st);
    for (reader, m) in refusals {
        send(&sh.agent, &reader, &m);
    }
    if any {
        sh.cv.notify_all();
    }
}
