//! The in-process decode side: loads run by a thread that feeds the producer's answers to each
//! load's protocol, copies pull layers once leased and ready, and sends heartbeats.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::copy::{copy, Caches};
use super::hub::{ConsumerEnd, Hub};
use crate::budget::Charge;
use crate::connector::api::{failure_reason, load_failed, KvConsumer, LoadFailure, LoadSpec};
use crate::connector::config::ConnectorConfig;
use crate::connector::consumer::lapsed;
use crate::connector::shell::{load_plan, lock, state_charge, wait_until};
use crate::telemetry::{RequestStats, Telemetry};
use kvxfer_proto::connector::{load_descs, LoadEvent, LoadProtocol};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::tp::HeadMap;
use kvxfer_proto::wire::connector::{Handoff, Mode, PushWant, ToConsumer, ToProducer};

struct Load {
    h: Handoff,
    remote: KvLayout,
    /// The producer's heads read, and the local heads they land in.
    heads: HeadMap,
    local_blocks: Vec<u32>,
    skip: usize,
    proto: LoadProtocol,
    started: Instant,
    bytes: u64,
    descs: u64,
    xfer: Duration,
    _charge: Charge,
}

/// How many ended loads are remembered for `wait`.
const ENDED_MEMORY: usize = 4096;

#[derive(Default)]
struct CState {
    inbox: VecDeque<(String, ToConsumer)>,
    loads: HashMap<String, Load>,
    finished: VecDeque<RequestStats>,
    failed: VecDeque<LoadFailure>,
    ended: HashMap<String, Option<String>>,
    ended_order: VecDeque<String>,
    stop: bool,
}

impl CState {
    fn remember(&mut self, req: &str, failed: Option<String>) {
        self.ended.insert(req.to_string(), failed);
        self.ended_order.push_back(req.to_string());
        while self.ended_order.len() > ENDED_MEMORY {
            if let Some(old) = self.ended_order.pop_front() {
                self.ended.remove(&old);
            }
        }
    }
}

/// What the hub and producers reach of a consumer.
struct ConsumerShared {
    name: String,
    hub: Arc<Hub>,
    mem: Caches,
    cfg: ConnectorConfig,
    t0: Instant,
    st: Mutex<CState>,
    cv: Condvar,
    tel: Telemetry,
}

impl ConsumerEnd for ConsumerShared {
    fn deliver(&self, from: &str, msg: ToConsumer) {
        self.deliver_msg(from, msg);
    }
    fn mem(&self) -> &Caches {
        &self.mem
    }
}

impl ConsumerShared {
    /// A control message from producer `from`, handled by the consumer's thread.
    fn deliver_msg(&self, from: &str, msg: ToConsumer) {
        lock(&self.st).inbox.push_back((from.to_string(), msg));
        self.cv.notify_all();
    }

    fn finish(&self, st: &mut CState, req: &str) {
        let Some(l) = st.loads.remove(req) else {
            return;
        };
        let layout = &self.mem.layout;
        let per_block =
            layout.block_bytes() * (layout.layers.len() * layout.tensors_per_layer()) as u64;
        let s = RequestStats {
            request: req.to_string(),
            bytes_moved: l.bytes,
            // A head slice skips its share of each cached block.
            bytes_skipped: l.skip as u64 * per_block * l.heads.width()
                / layout.geometry.kv_heads.max(1),
            descriptors: l.descs,
            post_time: Duration::ZERO,
            transfer_time: l.xfer,
            handoff_time: l.started.elapsed(),
        };
        self.tel.record(&s);
        st.finished.push_back(s);
        st.remember(req, None);
    }

    /// Fails a load; returns the acknowledgement that releases the producer's blocks (pull).
    fn fail(&self, st: &mut CState, req: &str, e: Error) -> Option<(String, ToProducer)> {
        let l = st.loads.remove(req)?;
        log::warn!("kvxfer in-process consumer: load of {req:?} failed: {e}");
        self.tel.failed();
        st.remember(req, Some(failure_reason(&e)));
        st.failed.push_back(LoadFailure {
            request: req.to_string(),
            error: e,
            invalid_blocks: l.local_blocks,
        });
        (l.h.mode == Mode::Pull).then(|| (l.h.producer.clone(), l.proto.ack()))
    }
}

/// The in-process decode side.
pub(super) struct InProcessConsumer {
    sh: Arc<ConsumerShared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for InProcessConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessConsumer")
            .field("name", &self.sh.name)
            .finish()
    }
}

impl InProcessConsumer {
    pub(super) fn new(
        hub: &Arc<Hub>,
        name: String,
        mem: Caches,
        cfg: ConnectorConfig,
    ) -> Result<InProcessConsumer> {
        let sh = Arc::new(ConsumerShared {
            name: name.clone(),
            hub: hub.clone(),
            mem,
            cfg,
            t0: Instant::now(),
            st: Mutex::new(CState::default()),
            cv: Condvar::new(),
            tel: Telemetry::new("consumer"),
        });
        lock(&hub.consumers).insert(
            name.clone(),
            Arc::downgrade(&(sh.clone() as Arc<dyn ConsumerEnd>)),
        );
        let s2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvxfer-{name}"))
            .spawn(move || consumer_loop(&s2))
            .map_err(|e| Error::io("spawning the consumer thread", e))?;
        Ok(InProcessConsumer {
            sh,
            thread: Some(thread),
        })
    }

    fn wait_until(
        &self,
        request: &str,
        timeout: Duration,
        done: impl Fn(&Load) -> bool,
    ) -> Result<()> {
        wait_until(&self.sh.st, &self.sh.cv, timeout, |st| {
            match (st.loads.get(request), st.ended.get(request)) {
                (Some(l), _) if done(l) => Some(Ok(())),
                (Some(_), _) => None,
                (None, Some(None)) => Some(Ok(())),
                (None, Some(Some(why))) => Some(Err(Error::Handoff {
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
}

impl KvConsumer for InProcessConsumer {
    fn start_load_with(&self, h: &Handoff, local_blocks: &[u32], spec: &LoadSpec) -> Result<()> {
        let sh = &self.sh;
        let (remote, heads) = load_plan(&sh.mem.layout, &sh.cfg, spec, h, local_blocks)?;
        if lock(&sh.st).loads.contains_key(&h.request) {
            return Err(Error::InvalidArgument(format!(
                "load {:?} is already in progress",
                h.request
            )));
        }
        if sh.hub.producer(&h.producer).is_none() {
            return Err(Error::UnknownPeer {
                agent: h.producer.clone(),
            });
        }
        let layout = &sh.mem.layout;
        let descs = (local_blocks.len() * layout.layers.len() * layout.tensors_per_layer()) as u64;
        let charge = state_charge(&sh.cfg.budget, descs, "load state", sh.cfg.budget_wait)?;
        let want = PushWant {
            blocks: local_blocks.to_vec(),
            num_blocks: layout.num_blocks,
            layers: layout.layers.clone(),
        };
        let proto = LoadProtocol::new(
            &h.request,
            &h.producer,
            h.mode,
            layout.layers.len(),
            Some(want),
            local_blocks.is_empty(),
            sh.t0.elapsed(),
        )
        .declaring(spec.readers);
        let first = proto.opening();
        let load = Load {
            h: h.clone(),
            remote,
            heads,
            local_blocks: local_blocks.to_vec(),
            skip: h.blocks.len() - local_blocks.len(),
            proto,
            started: Instant::now(),
            bytes: 0,
            descs: 0,
            xfer: Duration::ZERO,
            _charge: charge,
        };
        {
            let mut st = lock(&sh.st);
            if st.loads.contains_key(&h.request) {
                return Err(Error::InvalidArgument(format!(
                    "load {:?} is already in progress",
                    h.request
                )));
            }
            st.ended.remove(&h.request);
            st.loads.insert(h.request.clone(), load);
        }
        if !sh.hub.to_producer(&h.producer, &sh.name, first) {
            let mut st = lock(&sh.st);
            sh.fail(
                &mut st,
                &h.request,
                Error::UnknownPeer {
                    agent: h.producer.clone(),
                },
            );
            drop(st);
            sh.cv.notify_all();
            return Ok(());
        }
        if local_blocks.is_empty() {
            sh.finish(&mut lock(&sh.st), &h.request);
        }
        sh.cv.notify_all();
        Ok(())
    }

    fn wait_layer(&self, request: &str, layer: usize, timeout: Duration) -> Result<()> {
        self.wait_until(request, timeout, |l| l.proto.loaded(layer))
    }

    fn wait(&self, request: &str, timeout: Duration) -> Result<()> {
        self.wait_until(request, timeout, |_| false)
    }

    fn next_finished(&self) -> Option<RequestStats> {
        lock(&self.sh.st).finished.pop_front()
    }

    fn next_failed(&self) -> Option<LoadFailure> {
        lock(&self.sh.st).failed.pop_front()
    }

    fn in_progress(&self) -> usize {
        lock(&self.sh.st).loads.len()
    }

    fn telemetry(&self) -> &Telemetry {
        &self.sh.tel
    }
}

impl Drop for InProcessConsumer {
    fn drop(&mut self) {
        lock(&self.sh.hub.consumers).remove(&self.sh.name);
        lock(&self.sh.st).stop = true;
        self.sh.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.sh.mem.retire();
    }
}

/// A pull layer to copy, taken out of the lock.
struct Job {
    request: String,
    layer: usize,
    src: Vec<kvxfer_proto::descriptor::Desc>,
    dst: Vec<kvxfer_proto::descriptor::Desc>,
    producer: String,
}

fn consumer_loop(sh: &ConsumerShared) {
    loop {
        let mut out: Vec<(String, ToProducer)> = Vec::new();
        let mut jobs: Vec<Job> = Vec::new();
        // A load landed or failed: callers in `wait` are woken.
        let mut ended = false;
        {
            let mut st = lock(&sh.st);
            if st.stop {
                return;
            }
            let now = sh.t0.elapsed();
            while let Some((from, m)) = st.inbox.pop_front() {
                let req = m.request().to_string();
                let Some(l) = st.loads.get_mut(&req) else {
                    continue;
                };
                match l.proto.handle(&from, &m, now) {
                    LoadEvent::Ignored | LoadEvent::Progress => {}
                    LoadEvent::Landed(_) => {
                        let layout = &sh.mem.layout;
                        let per_layer = l.local_blocks.len() * layout.tensors_per_layer();
                        l.descs += per_layer as u64;
                        l.bytes += per_layer as u64 * layout.block_bytes();
                        ended = true;
                        if l.proto.complete() {
                            sh.finish(&mut st, &req);
                        }
                    }
                    LoadEvent::Failed(why) => {
                        ended = true;
                        let e = load_failed(&req, why);
                        out.extend(sh.fail(&mut st, &req, e));
                    }
                }
            }
            let mut failures: Vec<(String, Error)> = Vec::new();
            for (req, l) in st.loads.iter_mut() {
                if let Some(m) = l.proto.heartbeat_due(now, sh.cfg.heartbeat) {
                    out.push((l.h.producer.clone(), m));
                }
                if l.proto.lapsed(now) {
                    failures.push((req.clone(), lapsed(req)));
                    continue;
                }
                if l.h.mode != Mode::Pull {
                    continue;
                }
                let Some(until) = l.proto.lease_until() else {
                    continue;
                };
                // The next layer not loaded yet, if the producer has it ready.
                let Some(layer) = (0..l.proto.ready()).find(|&x| !l.proto.loaded(x)) else {
                    continue;
                };
                if now >= until {
                    let why = "the lease ran out before the read could start".into();
                    failures.push((
                        req.clone(),
                        Error::Handoff {
                            request: req.clone(),
                            why,
                        },
                    ));
                    continue;
                }
                let descs = load_descs(
                    &sh.mem.layout,
                    &l.remote,
                    &l.heads,
                    &l.local_blocks,
                    &l.h.blocks[l.skip..],
                    layer..layer + 1,
                )
                .map(|(dst, src)| (src, dst));
                match descs {
                    Ok((src, dst)) => jobs.push(Job {
                        request: req.clone(),
                        layer,
                        src,
                        dst,
                        producer: l.h.producer.clone(),
                    }),
                    Err(e) => failures.push((req.clone(), e)),
                }
            }
            for (req, e) in failures {
                out.extend(sh.fail(&mut st, &req, e));
            }
        }
        let mut changed = ended || !out.is_empty();
        // Copies outside the lock: the engine's calls do not wait for a memcpy.
        let mut results: Vec<(Job, Result<u64>, Duration)> = Vec::new();
        for j in jobs {
            let t = Instant::now();
            let r = match sh.hub.producer(&j.producer) {
                Some(p) => copy(p.mem(), &j.src, &sh.mem, &j.dst),
                None => Err(Error::Handoff {
                    request: j.request.clone(),
                    why: format!("the producer {:?} is gone", j.producer),
                }),
            };
            results.push((j, r, t.elapsed()));
        }
        if !results.is_empty() {
            changed = true;
            let mut st = lock(&sh.st);
            for (j, r, took) in results {
                let Some(l) = st.loads.get_mut(&j.request) else {
                    continue;
                };
                match r {
                    Ok(n) => {
                        l.proto.mark_loaded(j.layer);
                        l.bytes += n;
                        l.descs += j.src.len() as u64;
                        l.xfer += took;
                        if l.proto.complete() {
                            out.push((l.h.producer.clone(), l.proto.ack()));
                            sh.finish(&mut st, &j.request);
                        }
                    }
                    Err(e) => {
                        let e = match e {
                            Error::Handoff { why, .. } => Error::Handoff {
                                request: j.request.clone(),
                                why,
                            },
                            e => e,
                        };
                        out.extend(sh.fail(&mut st, &j.request, e));
                    }
                }
            }
        }
        let mut gone: Vec<(String, String)> = Vec::new();
        for (to, m) in out {
            let req = m.request().to_string();
            let ack = matches!(m, ToProducer::Ack { .. });
            // An acknowledgement to a producer that is gone frees nothing (its blocks went
            // with it); a heartbeat that finds none ends the load.
            if !sh.hub.to_producer(&to, &sh.name, m) && !ack {
                gone.push((req, to));
            }
        }
        if !gone.is_empty() {
            let mut st = lock(&sh.st);
            for (req, p) in gone {
                let why = format!("the producer {p:?} is gone");
                sh.fail(
                    &mut st,
                    &req,
                    Error::Handoff {
                        request: req.clone(),
                        why,
                    },
                );
            }
        }
        if changed {
            sh.cv.notify_all();
        }
        let st = lock(&sh.st);
        if st.stop || !st.inbox.is_empty() {
            continue;
        }
        let busy = st.loads.values().any(|l| {
            l.h.mode == Mode::Pull
                && l.proto.lease_until().is_some()
                && (0..l.proto.ready()).any(|x| !l.proto.loaded(x))
        });
        let wait = if busy {
            Duration::ZERO
        } else if st.loads.is_empty() {
            Duration::from_millis(50)
        } else {
            Duration::from_millis(5)
        };
        if !wait.is_zero() {
            drop(
                sh.cv
                    .wait_timeout(st, wait)
                    .unwrap_or_else(|e| e.into_inner()),
            );
        }
    }
}
