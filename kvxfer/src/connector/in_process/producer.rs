//! The in-process prefill side: the producer core behind a lock, a thread for lease expiry
//! and push copies.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::copy::{copy, Caches};
use super::hub::{Hub, ProducerEnd};
use crate::budget::Charge;
use crate::connector::api::KvProducer;
use crate::connector::config::ConnectorConfig;
use crate::connector::shell::{lock, state_charge, wait_until};
use crate::telemetry::{RequestStats, Telemetry};
use kvxfer_proto::connector::{LayerError, ProducerAction, ProducerCore};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::lifecycle::Freed;
use kvxfer_proto::wire::connector::{Handoff, ToConsumer, ToProducer};

/// One push consumer's progress through a request.
struct Push {
    reader: String,
    blocks: Vec<u32>,
    skip: usize,
    copied: usize,
    bytes: u64,
    descs: u64,
    xfer: Duration,
    _charge: Charge,
}

struct PReq {
    blocks: Vec<u32>,
    pushes: Vec<Push>,
    published: Instant,
}

struct PState {
    core: ProducerCore,
    reqs: HashMap<String, PReq>,
    freed: VecDeque<Freed>,
    stop: bool,
}

impl PState {
    fn record_freed(&mut self, f: Freed) {
        self.reqs.remove(&f.request);
        self.freed.push_back(f);
    }
}

/// What the hub and consumers reach of a producer.
struct ProducerShared {
    name: String,
    hub: Arc<Hub>,
    mem: Caches,
    cfg: ConnectorConfig,
    t0: Instant,
    st: Mutex<PState>,
    cv: Condvar,
    tel: Telemetry,
}

impl std::fmt::Debug for ProducerShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProducerShared")
            .field("name", &self.name)
            .finish()
    }
}

impl ProducerEnd for ProducerShared {
    fn deliver(&self, from: &str, msg: ToProducer) {
        self.deliver_msg(from, msg);
    }
    fn mem(&self) -> &Caches {
        &self.mem
    }
}

impl ProducerShared {
    /// A control message from consumer `from`.
    fn deliver_msg(&self, from: &str, msg: ToProducer) {
        let now = self.t0.elapsed();
        let mut st = lock(&self.st);
        let actions = st.core.handle(from, msg, now);
        let mut out: Vec<(String, ToConsumer)> = Vec::new();
        for a in actions {
            match a {
                ProducerAction::Send { to, msg } => out.push((to, msg)),
                ProducerAction::StartPush {
                    reader,
                    request,
                    want,
                    lease,
                } => {
                    let nb = st.reqs.get(&request).map_or(0, |r| r.blocks.len());
                    let target = if want.blocks.len() > nb {
                        Err(Error::InvalidArgument(format!(
                            "push request: {} blocks, {nb} published",
                            want.blocks.len()
                        )))
                    } else {
                        let descs = (want.blocks.len()
                            * self.mem.layout.layers.len()
                            * self.mem.layout.tensors_per_layer())
                            as u64;
                        state_charge(&self.cfg.budget, descs, "push state", Duration::ZERO)
                    };
                    match target {
                        Ok(charge) => {
                            if let Some(r) = st.reqs.get_mut(&request) {
                                r.pushes.push(Push {
                                    reader: reader.clone(),
                                    skip: nb - want.blocks.len(),
                                    blocks: want.blocks,
                                    copied: 0,
                                    bytes: 0,
                                    descs: 0,
                                    xfer: Duration::ZERO,
                                    _charge: charge,
                                });
                            }
                            st.core.push_accepted(&request, &reader);
                            out.push((reader, lease));
                        }
                        Err(e) => out.push((
                            reader,
                            ToConsumer::Refused {
                                request,
                                kind: None,
                                why: e.to_string(),
                            },
                        )),
                    }
                }
                ProducerAction::Freed(f) => st.record_freed(f),
            }
        }
        drop(st);
        self.cv.notify_all();
        for (to, m) in out {
            self.hub.to_consumer(&to, &self.name, m);
        }
    }
}

/// The in-process prefill side.
pub(super) struct InProcessProducer {
    sh: Arc<ProducerShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for InProcessProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessProducer")
            .field("name", &self.sh.name)
            .finish()
    }
}

impl InProcessProducer {
    pub(super) fn new(
        hub: &Arc<Hub>,
        name: String,
        mem: Caches,
        cfg: ConnectorConfig,
    ) -> Result<InProcessProducer> {
        let sh = Arc::new(ProducerShared {
            name: name.clone(),
            hub: hub.clone(),
            mem,
            t0: Instant::now(),
            st: Mutex::new(PState {
                core: ProducerCore::new(cfg.lease, cfg.mode),
                reqs: HashMap::new(),
                freed: VecDeque::new(),
                stop: false,
            }),
            cfg,
            cv: Condvar::new(),
            tel: Telemetry::new("producer"),
        });
        lock(&hub.producers).insert(
            name.clone(),
            Arc::downgrade(&(sh.clone() as Arc<dyn ProducerEnd>)),
        );
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-{name}"))
            .spawn(move || producer_loop(&s2))
            .map_err(|e| Error::io("spawning the producer thread", e))?;
        Ok(InProcessProducer {
            sh,
            thread: Some(thread),
        })
    }
}

impl KvProducer for InProcessProducer {
    fn publish(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
    ) -> Result<Handoff> {
        let layout = &self.sh.mem.layout;
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
        self.sh.cv.notify_all();
        Ok(Handoff {
            request: request.to_string(),
            producer: self.sh.name.clone(),
            side_channel: None,
            blocks: blocks.to_vec(),
            tokens,
            compat: layout.compat_hash(),
            kv_heads: layout.geometry.kv_heads,
            num_blocks: layout.num_blocks,
            layers: layout.layers.clone(),
            mode: self.sh.cfg.mode,
            epoch: 0,
        })
    }

    fn layer_done(&self, request: &str, layer: usize) -> Result<()> {
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
            self.sh.hub.to_consumer(&to, &self.sh.name, m);
        }
        Ok(())
    }

    fn abort(&self, request: &str) {
        let mut st = lock(&self.sh.st);
        st.reqs.remove(request);
        if let Some(f) = st.core.abort(request) {
            st.freed.push_back(f);
        }
        drop(st);
        self.sh.cv.notify_all();
    }

    fn next_freed(&self, timeout: Duration) -> Option<Freed> {
        wait_until(&self.sh.st, &self.sh.cv, timeout, |st| st.freed.pop_front())
    }

    fn wait_freed(&self, request: &str, timeout: Duration) -> Result<Freed> {
        wait_until(&self.sh.st, &self.sh.cv, timeout, |st| {
            let i = st.freed.iter().position(|f| f.request == request)?;
            st.freed.remove(i)
        })
        .ok_or(Error::WaitTimeout(timeout))
    }

    fn held(&self) -> usize {
        lock(&self.sh.st).core.held()
    }

    fn telemetry(&self) -> &Telemetry {
        &self.sh.tel
    }
}

impl Drop for InProcessProducer {
    fn drop(&mut self) {
        lock(&self.sh.hub.producers).remove(&self.sh.name);
        lock(&self.sh.st).stop = true;
        self.sh.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Consumers may still hold the shared state: none reads the engine's memory after this.
        self.sh.mem.retire();
    }
}

fn producer_loop(sh: &ProducerShared) {
    loop {
        let mut st = lock(&sh.st);
        if st.stop {
            return;
        }
        let freed = st.core.tick(sh.t0.elapsed());
        let any_freed = !freed.is_empty();
        for f in freed {
            st.record_freed(f);
        }
        let busy = st.reqs.values().any(|r| !r.pushes.is_empty());
        let wait = if busy {
            Duration::from_millis(1)
        } else {
            st.core
                .next_expiry()
                .map_or(Duration::from_millis(50), |e| {
                    e.saturating_sub(sh.t0.elapsed())
                        .clamp(Duration::from_millis(1), Duration::from_millis(50))
                })
        };
        drop(st);
        if any_freed {
            sh.cv.notify_all();
        }
        if busy {
            pushes(sh);
        }
        let st = lock(&sh.st);
        if st.stop {
            return;
        }
        drop(
            sh.cv
                .wait_timeout(st, wait)
                .unwrap_or_else(|e| e.into_inner()),
        );
    }
}

/// Copies every ready layer of every push target, tells the consumer after each, and then
/// counts a target whose layers all landed as that reader's acknowledgement.
fn pushes(sh: &ProducerShared) {
    let layout = &sh.mem.layout;
    let nl = layout.layers.len();
    let heads = 0..layout.geometry.kv_heads;
    let mut st = lock(&sh.st);
    let mut notes: Vec<(String, ToConsumer)> = Vec::new();
    let mut acks: Vec<(String, String)> = Vec::new();
    let mut failed: Vec<(String, String, String)> = Vec::new();
    let PState { core, reqs, .. } = &mut *st;
    for (req, r) in reqs.iter_mut() {
        let ready = core.ready_layers(req);
        for p in &mut r.pushes {
            while p.copied < ready {
                let l = p.copied;
                let t = Instant::now();
                let res = sh
                    .hub
                    .consumer(&p.reader)
                    .ok_or_else(|| Error::UnknownPeer {
                        agent: p.reader.clone(),
                    })
                    .and_then(|c| {
                        let src = layout.descs(&r.blocks[p.skip..], l..l + 1, heads.clone())?;
                        let dst = c.mem().layout.descs(&p.blocks, l..l + 1, heads.clone())?;
                        let n = copy(&sh.mem, &src, c.mem(), &dst)?;
                        Ok((n, src.len()))
                    });
                match res {
                    Ok((n, d)) => {
                        p.bytes += n;
                        p.descs += d as u64;
                        p.xfer += t.elapsed();
                        p.copied += 1;
                        notes.push((
                            p.reader.clone(),
                            ToConsumer::Layer {
                                request: req.clone(),
                                layer: l,
                            },
                        ));
                    }
                    Err(e) => {
                        failed.push((req.clone(), p.reader.clone(), e.to_string()));
                        break;
                    }
                }
            }
            if p.copied == nl {
                acks.push((req.clone(), p.reader.clone()));
                sh.tel.record(&RequestStats {
                    request: req.clone(),
                    bytes_moved: p.bytes,
                    bytes_skipped: p.skip as u64
                        * layout.block_bytes()
                        * (nl * layout.tensors_per_layer()) as u64,
                    descriptors: p.descs,
                    post_time: Duration::ZERO,
                    transfer_time: p.xfer,
                    handoff_time: r.published.elapsed(),
                });
            }
        }
        r.pushes
            .retain(|p| p.copied < nl && !failed.iter().any(|f| f.0 == *req && f.1 == p.reader));
    }
    for (req, reader, why) in failed {
        log::warn!("kvxfer in-process producer: push of {req:?} to {reader:?}: {why}");
        notes.push((
            reader,
            ToConsumer::Refused {
                request: req,
                kind: None,
                why: format!("push failed: {why}"),
            },
        ));
    }
    drop(st);
    // The consumer hears of its layers before the blocks are freed: a heartbeat the producer
    // answers after the free ("not held") then reaches a load that has already completed.
    for (to, m) in notes {
        sh.hub.to_consumer(&to, &sh.name, m);
    }
    // The producer saw its copies land: that reader is done with the blocks. (The lock is
    // taken again only then: this runs every millisecond while pushes are in progress.)
    if !acks.is_empty() {
        let now = sh.t0.elapsed();
        let mut st = lock(&sh.st);
        for (req, reader) in acks {
            for a in st.core.push_landed(&reader, &req, now) {
                if let ProducerAction::Freed(f) = a {
                    st.record_freed(f);
                }
            }
        }
    }
    sh.cv.notify_all();
}
