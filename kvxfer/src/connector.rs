//! The connector engines call: a prefill worker's [`Producer`] hands a request's KV over, a
//! decode worker's [`Consumer`] takes it in. Shaped after vLLM's `KVConnectorBase_V1` worker
//! side, engine-agnostic:
//!
//! | vLLM | kvxfer |
//! |---|---|
//! | `register_kv_caches` | register the cache with the [`Agent`], describe it with a [`KvLayout`] |
//! | `request_finished` → `kv_transfer_params` | [`Producer::publish`] → [`Handoff`] (bytes) |
//! | `save_kv_layer` | [`Producer::layer_done`] |
//! | `get_finished` (sending) | [`Producer::take_freed`] |
//! | `start_load_kv` | [`Consumer::start_load`] |
//! | `wait_for_layer_load` | [`Consumer::wait_layer`] |
//! | `get_finished` (receiving), `get_block_ids_with_load_errors` | [`Consumer::take_finished`], [`Consumer::take_failed`] |
//!
//! **Pull** (default, as vLLM's NixlConnector): the consumer asks for a lease, READs the blocks
//! it lacks layer by layer as the producer reports them done, and acknowledges. **Push**: the
//! consumer names its blocks and the producer WRITEs each layer into them as soon as it is
//! done; each layer's notification arrives after its data. Either way only the blocks the
//! consumer lacks move (a cached prefix stays), and a producer frees blocks on the last
//! reader's acknowledgement, on abort or on lease expiry ([`kvxfer_proto::lifecycle`]). A pull
//! consumer bounds each read by the lease it was granted, so it never reads freed blocks: an
//! expired handoff fails with [`Error::Handoff`].
//!
//! Control messages travel as kvxfer notifications (JSON after a `KXC1` tag) on a queue of
//! their own: the agent's notifications stay the user's.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::agent::Agent;
use crate::budget::{Charge, MemoryBudget};
use crate::telemetry::{RequestStats, Telemetry};
use crate::transfer::{Transfer, XferStats};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::layout::{KvLayout, LayerBase};
use kvxfer_proto::lifecycle::{Freed, Ledger};
use kvxfer_proto::types::{RegionId, XferOp};
use kvxfer_proto::wire::notify::{Notification, TAG_TO_CONSUMER, TAG_TO_PRODUCER};

/// A consumer that hears "not held" this soon after starting keeps asking: the handoff may
/// reach it before the producer's worker has published the request.
const UNKNOWN_GRACE: Duration = Duration::from_secs(10);
/// Bytes charged to the budget per descriptor of a request's state (lists, plans).
const STATE_BYTES_PER_DESC: u64 = 160;
/// Fixed bytes charged per request.
const STATE_BYTES_FIXED: u64 = 4096;

/// Who moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The consumer READs from the producer.
    Pull,
    /// The producer WRITEs into the consumer's blocks.
    Push,
}

/// Connector settings.
#[derive(Clone, Debug)]
pub struct ConnectorConfig {
    /// Pull or push.
    pub mode: Mode,
    /// Producer: how long blocks stay held without a heartbeat.
    pub lease: Duration,
    /// Consumer: how often it renews the lease while loading.
    pub heartbeat: Duration,
    /// Producer: readers per request (2 for two decode ranks each reading half the heads).
    pub readers: usize,
    /// Consumer: which of the producer's KV heads it reads (default: all). Its own layout
    /// holds exactly that many heads; the producer's layout must be HND for a strict subset to
    /// be one descriptor per block.
    pub heads: Option<Range<u64>>,
    /// Every byte of request state and lists is charged here.
    pub budget: MemoryBudget,
    /// How long a request waits for budget before it fails.
    pub budget_wait: Duration,
}

impl Default for ConnectorConfig {
    fn default() -> Self {
        ConnectorConfig {
            mode: Mode::Pull,
            lease: Duration::from_secs(30),
            heartbeat: Duration::from_secs(1),
            readers: 1,
            heads: None,
            budget: MemoryBudget::unlimited(),
            budget_wait: Duration::from_secs(60),
        }
    }
}

/// What a consumer needs to load a request: vLLM's `kv_transfer_params`. Travels through the
/// engine's router as bytes ([`Handoff::encode`], JSON).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handoff {
    /// The request.
    pub request: String,
    /// The producer's agent name.
    pub producer: String,
    /// The producer's side channel, to exchange metadata if not done yet.
    pub side_channel: Option<SocketAddr>,
    /// The producer's blocks holding the prompt's KV, in token order.
    pub blocks: Vec<u32>,
    /// Prompt tokens.
    pub tokens: u64,
    /// The producer's [`KvLayout::compat_hash`].
    pub compat: u64,
    /// The producer's KV heads.
    pub kv_heads: u64,
    /// Blocks per layer tensor on the producer.
    pub num_blocks: u64,
    /// The producer's per-layer tensors.
    pub layers: Vec<LayerBase>,
    /// Pull or push.
    pub mode: Mode,
}

fn base_json(b: &LayerBase) -> Value {
    match b.v {
        Some(v) => json!([b.k.0 .0, b.k.1, v.0 .0, v.1]),
        None => json!([b.k.0 .0, b.k.1]),
    }
}

fn base_from(v: &Value) -> Option<LayerBase> {
    let a = v.as_array()?;
    let u = |i: usize| a.get(i).and_then(Value::as_u64);
    let k = (RegionId(u32::try_from(u(0)?).ok()?), u(1)?);
    let v = match a.len() {
        2 => None,
        4 => Some((RegionId(u32::try_from(u(2)?).ok()?), u(3)?)),
        _ => return None,
    };
    Some(LayerBase { k, v })
}

fn u32_list(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?
        .iter()
        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
        .collect()
}

impl Handoff {
    /// JSON bytes.
    pub fn encode(&self) -> Vec<u8> {
        json!({
            "v": 1,
            "request": self.request,
            "producer": self.producer,
            "side_channel": self.side_channel.map(|a| a.to_string()),
            "blocks": self.blocks,
            "tokens": self.tokens,
            "compat": format!("{:016x}", self.compat),
            "kv_heads": self.kv_heads,
            "num_blocks": self.num_blocks,
            "layers": self.layers.iter().map(base_json).collect::<Vec<_>>(),
            "mode": if self.mode == Mode::Pull { "pull" } else { "push" },
        })
        .to_string()
        .into_bytes()
    }

    /// Parses and checks [`Handoff::encode`]'s output.
    pub fn decode(b: &[u8]) -> Result<Handoff> {
        let bad = |why: &str| Error::InvalidArgument(format!("handoff: {why}"));
        if b.len() > 16 << 20 {
            return Err(bad("larger than 16 MiB"));
        }
        let v: Value = serde_json::from_slice(b).map_err(|e| bad(&e.to_string()))?;
        if v["v"] != 1 {
            return Err(bad("unknown version"));
        }
        let s = |k: &str| v[k].as_str().map(str::to_string).ok_or_else(|| bad(k));
        let n = |k: &str| v[k].as_u64().ok_or_else(|| bad(k));
        let side_channel = match &v["side_channel"] {
            Value::Null => None,
            Value::String(a) => Some(a.parse().map_err(|_| bad("side_channel"))?),
            _ => return Err(bad("side_channel")),
        };
        let layers = v["layers"]
            .as_array()
            .ok_or_else(|| bad("layers"))?
            .iter()
            .map(|x| base_from(x).ok_or_else(|| bad("layers")))
            .collect::<Result<Vec<_>>>()?;
        let request = s("request")?;
        let producer = s("producer")?;
        if request.is_empty() || producer.is_empty() {
            return Err(bad("empty request or producer"));
        }
        Ok(Handoff {
            request,
            producer,
            side_channel,
            blocks: u32_list(&v["blocks"]).ok_or_else(|| bad("blocks"))?,
            tokens: n("tokens")?,
            compat: u64::from_str_radix(&s("compat")?, 16).map_err(|_| bad("compat"))?,
            kv_heads: n("kv_heads")?,
            num_blocks: n("num_blocks")?,
            layers,
            mode: match s("mode")?.as_str() {
                "pull" => Mode::Pull,
                "push" => Mode::Push,
                _ => return Err(bad("mode")),
            },
        })
    }
}

fn msg(v: Value) -> Vec<u8> {
    let to_producer = matches!(v["t"].as_str(), Some("hb" | "ack" | "want"));
    let mut b = if to_producer {
        TAG_TO_PRODUCER.to_vec()
    } else {
        TAG_TO_CONSUMER.to_vec()
    };
    b.extend_from_slice(v.to_string().as_bytes());
    b
}

fn parse(n: &Notification) -> Option<Value> {
    let body = n
        .payload
        .strip_prefix(TAG_TO_PRODUCER)
        .or_else(|| n.payload.strip_prefix(TAG_TO_CONSUMER))?;
    serde_json::from_slice(body).ok()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends a control message; failures are logged (the peer's lease logic covers lost ones).
fn send(agent: &Agent, peer: &str, v: Value) {
    match agent.notify(peer, &msg(v)) {
        Ok(t) => drop(t), // completes on its own
        Err(e) => log::warn!("kvxfer connector: message to {peer:?} not sent: {e}"),
    }
}

fn state_charge(budget: &MemoryBudget, descs: u64, what: &str, wait: Duration) -> Result<Charge> {
    budget.charge(STATE_BYTES_FIXED + descs * STATE_BYTES_PER_DESC, what, wait)
}

// ---------------------------------------------------------------------------------------------
// Producer
// ---------------------------------------------------------------------------------------------

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

struct PReq {
    blocks: Vec<u32>,
    ready: Vec<bool>,
    holders: Vec<String>,
    pushes: Vec<Push>,
    published: Instant,
}

impl PReq {
    fn ready_layers(&self) -> usize {
        self.ready.iter().take_while(|&&r| r).count()
    }
}

struct PState {
    ledger: Ledger,
    reqs: HashMap<String, PReq>,
    freed: Vec<Freed>,
    stop: bool,
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
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("agent", &self.sh.agent.name())
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
        let sh = Arc::new(PShared {
            agent,
            cfg: cfg.clone(),
            layout,
            side: side_channel,
            st: Mutex::new(PState {
                ledger: Ledger::new(cfg.lease),
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
        st.ledger
            .hold(request, blocks.to_vec(), self.sh.cfg.readers, now);
        st.reqs.insert(
            request.to_string(),
            PReq {
                blocks: blocks.to_vec(),
                ready: (0..nl).map(|l| l < layers_done).collect(),
                holders: Vec::new(),
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
        })
    }

    /// Layer `layer` of `request` is computed: consumers may take it now.
    pub fn layer_done(&self, request: &str, layer: usize) -> Result<()> {
        let mut st = lock(&self.sh.st);
        let r = st.reqs.get_mut(request).ok_or_else(|| Error::Handoff {
            request: request.to_string(),
            why: "not held by this producer".into(),
        })?;
        let slot = r.ready.get_mut(layer).ok_or_else(|| {
            Error::InvalidArgument(format!("layer {layer} of {}", self.sh.layout.layers.len()))
        })?;
        *slot = true;
        let ready = r.ready_layers();
        let holders = r.holders.clone();
        drop(st);
        if self.sh.cfg.mode == Mode::Pull {
            for h in holders {
                send(
                    &self.sh.agent,
                    &h,
                    json!({"t": "ready", "r": request, "n": ready}),
                );
            }
        }
        self.sh.cv.notify_all();
        Ok(())
    }

    /// Gives up a request: its blocks are freed now; consumers that ask get a typed refusal.
    pub fn abort(&self, request: &str) {
        let mut st = lock(&self.sh.st);
        st.reqs.remove(request);
        if let Some(f) = st.ledger.abort(request) {
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
        let end = Instant::now() + timeout;
        let mut st = lock(&self.sh.st);
        loop {
            if let Some(f) = st.freed.first() {
                if !fits(f) {
                    return Err((f.request.len(), f.blocks.len()));
                }
                return Ok(Some(st.freed.remove(0)));
            }
            let now = Instant::now();
            if now >= end {
                return Ok(None);
            }
            st = self
                .sh
                .cv
                .wait_timeout(st, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits up to `timeout` until `request`'s blocks are freed; returns how.
    pub fn wait_freed(&self, request: &str, timeout: Duration) -> Result<Freed> {
        let end = Instant::now() + timeout;
        let mut st = lock(&self.sh.st);
        loop {
            if let Some(i) = st.freed.iter().position(|f| f.request == request) {
                return Ok(st.freed.remove(i));
            }
            let now = Instant::now();
            if now >= end {
                return Err(Error::WaitTimeout(timeout));
            }
            st = self
                .sh
                .cv
                .wait_timeout(st, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Requests held now.
    pub fn held(&self) -> usize {
        lock(&self.sh.st).ledger.held()
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
        let wait = if lock(&sh.st).reqs.values().any(|r| !r.pushes.is_empty()) {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(10)
        };
        if let Ok(n) = sh.agent.wait_control(true, wait) {
            producer_msg(sh, n);
            while let Some(n) = sh.agent.try_control(true) {
                producer_msg(sh, n);
            }
        }
        producer_pushes(sh);
        let now = sh.t0.elapsed();
        let mut st = lock(&sh.st);
        let mut freed = st.ledger.tick(now);
        freed.extend(st.ledger.take_pending());
        if !freed.is_empty() {
            for f in &freed {
                st.reqs.remove(&f.request);
            }
            st.freed.extend(freed);
            drop(st);
            sh.cv.notify_all();
        }
    }
}

fn producer_msg(sh: &PShared, n: Notification) {
    let Some(v) = parse(&n) else {
        log::warn!(
            "kvxfer connector: malformed control message from {:?}",
            n.from
        );
        return;
    };
    let from = n.from.clone();
    let Some(req) = v["r"].as_str().map(str::to_string) else {
        return;
    };
    let now = sh.t0.elapsed();
    match v["t"].as_str() {
        Some("hb") | Some("want") => {
            let mut st = lock(&sh.st);
            match st.ledger.heartbeat(&req, &from, now) {
                Ok(left) => {
                    let Some(r) = st.reqs.get_mut(&req) else {
                        return;
                    };
                    if !r.holders.contains(&from) {
                        r.holders.push(from.clone());
                    }
                    let ready = r.ready_layers();
                    if v["t"] == "want" && !r.pushes.iter().any(|p| p.reader == from) {
                        match push_target(sh, &v, r.blocks.len()) {
                            Ok(p) => r.pushes.push(Push {
                                reader: from.clone(),
                                ..p
                            }),
                            Err(e) => {
                                drop(st);
                                send(
                                    &sh.agent,
                                    &from,
                                    json!({"t": "refused", "r": req, "why": e.to_string()}),
                                );
                                return;
                            }
                        }
                    }
                    drop(st);
                    send(
                        &sh.agent,
                        &from,
                        json!({"t": "lease", "r": req, "ms": left.as_millis() as u64, "n": ready}),
                    );
                }
                Err(e) => {
                    drop(st);
                    let kind = match e {
                        kvxfer_proto::lifecycle::LeaseError::Unknown(_) => "unknown",
                        kvxfer_proto::lifecycle::LeaseError::Expired(_) => "expired",
                        kvxfer_proto::lifecycle::LeaseError::Aborted(_) => "aborted",
                        kvxfer_proto::lifecycle::LeaseError::TooManyReaders { .. } => "readers",
                    };
                    send(
                        &sh.agent,
                        &from,
                        json!({"t": "refused", "r": req, "kind": kind, "why": e.to_string()}),
                    );
                }
            }
        }
        Some("ack") => {
            let mut st = lock(&sh.st);
            match st.ledger.ack(&req, &from, now) {
                Ok(Some(f)) => {
                    st.reqs.remove(&req);
                    st.freed.push(f);
                    drop(st);
                    sh.cv.notify_all();
                }
                Ok(None) => {}
                Err(e) => log::info!("kvxfer producer: ack from {from:?}: {e}"),
            }
        }
        other => log::warn!("kvxfer producer: unknown message {other:?} from {from:?}"),
    }
}

/// Builds a push target from a consumer's "want".
fn push_target(sh: &PShared, v: &Value, producer_blocks: usize) -> Result<Push> {
    let bad = |w: &str| Error::InvalidArgument(format!("push request: {w}"));
    let blocks = u32_list(&v["blocks"]).ok_or_else(|| bad("blocks"))?;
    let nb = v["nb"].as_u64().ok_or_else(|| bad("nb"))?;
    let layers = v["layers"]
        .as_array()
        .ok_or_else(|| bad("layers"))?
        .iter()
        .map(|x| base_from(x).ok_or_else(|| bad("layers")))
        .collect::<Result<Vec<_>>>()?;
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
    let nl = sh.layout.layers.len();
    let heads = 0..sh.layout.geometry.kv_heads;
    for (req, r) in st.reqs.iter_mut() {
        let ready = r.ready_layers();
        let src_blocks = &r.blocks;
        for p in r.pushes.iter_mut().filter(|p| !p.failed) {
            while p.posted < ready {
                let l = p.posted;
                let res = (|| -> Result<Transfer> {
                    let ld = sh
                        .layout
                        .descs(&src_blocks[p.skip..], l..l + 1, heads.clone())?;
                    let rd = p.local.descs(&p.blocks, l..l + 1, heads.clone())?;
                    let lp = sh.agent.prep_local(&ld)?;
                    let rp = sh.agent.prep_remote(&p.reader, &rd)?;
                    let note = msg(json!({"t": "layer", "r": req, "l": l}));
                    sh.agent
                        .transfer_all(XferOp::Write, &lp, &rp, Some(&note), Some(sh.cfg.lease))
                })();
                match res {
                    Ok(t) => p.inflight.push((l, t)),
                    Err(e) => {
                        log::warn!("kvxfer producer: push of {req:?} layer {l}: {e}");
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
        if let Ok(Some(f)) = st.ledger.ack(&req, &reader, now) {
            st.reqs.remove(&req);
            st.freed.push(f);
            any = true;
        }
    }
    drop(st);
    if any {
        sh.cv.notify_all();
    }
}

fn add_stats(
    bytes: &mut u64,
    descs: &mut u64,
    post: &mut Duration,
    xfer: &mut Duration,
    s: &XferStats,
) {
    *bytes += s.bytes;
    *descs += s.descs as u64;
    *post += s.post_time;
    *xfer += s.duration;
}

// ---------------------------------------------------------------------------------------------
// Consumer
// ---------------------------------------------------------------------------------------------

/// A load that failed, and the local blocks that do not hold valid KV because of it.
#[derive(Debug)]
pub struct LoadFailure {
    /// The request.
    pub request: String,
    /// Why.
    pub error: Error,
    /// Local blocks whose content is invalid (the ones that were to be loaded; blocks of a
    /// cached prefix stay valid).
    pub invalid_blocks: Vec<u32>,
}

struct Load {
    h: Handoff,
    remote: KvLayout,
    local_blocks: Vec<u32>,
    skip: usize,
    ready: usize,
    posted: usize,
    loaded: Vec<bool>,
    inflight: Vec<(usize, Transfer)>,
    lease_until: Option<Instant>,
    last_hb: Instant,
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
    stop: bool,
}

struct CShared {
    agent: Arc<Agent>,
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
}

impl std::fmt::Debug for Consumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("agent", &self.sh.agent.name())
            .finish()
    }
}

impl Consumer {
    /// A consumer over `agent`, whose registered cache `layout` describes.
    pub fn new(agent: Arc<Agent>, layout: KvLayout, cfg: ConnectorConfig) -> Result<Consumer> {
        let sh = Arc::new(CShared {
            agent,
            layout,
            cfg,
            st: Mutex::new(CState {
                loads: HashMap::new(),
                finished: Vec::new(),
                failed: Vec::new(),
                ended: HashMap::new(),
                ended_order: Default::default(),
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
        })
    }

    /// Starts loading `handoff` into `local_blocks`. `local_blocks` pairs with the *last*
    /// `local_blocks.len()` of the producer's blocks: the consumer already holds the blocks
    /// before them (a cached prefix) and only these move. Empty: nothing moves, the producer
    /// is only told it may free its blocks. Waits for budget (backpressure) up to
    /// `budget_wait`.
    pub fn start_load(&self, h: &Handoff, local_blocks: &[u32]) -> Result<()> {
        let sh = &self.sh;
        let heads = sh.cfg.heads.clone().unwrap_or(0..h.kv_heads);
        let want_layout = KvLayout {
            geometry: kvxfer_proto::layout::KvGeometry {
                kv_heads: h.kv_heads,
                ..sh.layout.geometry.clone()
            },
            ..sh.layout.clone()
        };
        if want_layout.compat_hash() != h.compat {
            return Err(Error::Handoff {
                request: h.request.clone(),
                why: "the producer's KV layout (layers, head size, dtype, block size, packing, \
                      order) differs from this consumer's"
                    .into(),
            });
        }
        if heads.start >= heads.end
            || heads.end > h.kv_heads
            || heads.end - heads.start != sh.layout.geometry.kv_heads
        {
            return Err(Error::Handoff {
                request: h.request.clone(),
                why: format!(
                    "reading heads {heads:?} of the producer's {} into a cache of {} heads",
                    h.kv_heads, sh.layout.geometry.kv_heads
                ),
            });
        }
        if local_blocks.len() > h.blocks.len() || h.layers.len() != sh.layout.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "load {:?}: {} local blocks for {} published, {} layers for {}",
                h.request,
                local_blocks.len(),
                h.blocks.len(),
                sh.layout.layers.len(),
                h.layers.len()
            )));
        }
        if let Some(&b) = local_blocks
            .iter()
            .find(|&&b| u64::from(b) >= sh.layout.num_blocks)
        {
            return Err(Error::InvalidArgument(format!(
                "load {:?}: local block {b} of {}",
                h.request, sh.layout.num_blocks
            )));
        }
        if lock(&sh.st).loads.contains_key(&h.request) {
            return Err(Error::InvalidArgument(format!(
                "load {:?} is already in progress",
                h.request
            )));
        }
        if sh.agent.peer_info(&h.producer).is_err() {
            let addr = h.side_channel.ok_or_else(|| Error::UnknownPeer {
                agent: h.producer.clone(),
            })?;
            let got = sh.agent.connect(addr)?;
            if got != h.producer {
                return Err(Error::Handoff {
                    request: h.request.clone(),
                    why: format!("{addr} is {got:?}, not the producer {:?}", h.producer),
                });
            }
        }
        let nl = sh.layout.layers.len();
        let descs = (local_blocks.len() * nl * sh.layout.tensors_per_layer()) as u64;
        let charge = state_charge(&sh.cfg.budget, descs, "load state", sh.cfg.budget_wait)?;
        let skip = h.blocks.len() - local_blocks.len();
        let remote = KvLayout {
            geometry: want_layout.geometry.clone(),
            num_blocks: h.num_blocks,
            layers: h.layers.clone(),
            ..sh.layout.clone()
        };
        let load = Load {
            h: h.clone(),
            remote,
            local_blocks: local_blocks.to_vec(),
            skip,
            ready: 0,
            posted: 0,
            loaded: vec![local_blocks.is_empty(); nl],
            inflight: Vec::new(),
            lease_until: None,
            last_hb: Instant::now(),
            started: Instant::now(),
            bytes: 0,
            descs: 0,
            post: Duration::ZERO,
            xfer: Duration::ZERO,
            _charge: charge,
        };
        lock(&sh.st).loads.insert(h.request.clone(), load);
        if local_blocks.is_empty() {
            send(&sh.agent, &h.producer, json!({"t": "ack", "r": h.request}));
            let mut st = lock(&sh.st);
            finish(sh, &mut st, &h.request);
            drop(st);
            sh.cv.notify_all();
            return Ok(());
        }
        match h.mode {
            Mode::Pull => send(&sh.agent, &h.producer, json!({"t": "hb", "r": h.request})),
            Mode::Push => send(
                &sh.agent,
                &h.producer,
                want_msg(&sh.layout, &h.request, local_blocks),
            ),
        }
        Ok(())
    }

    /// Waits until layer `layer` of `request` is in local memory.
    pub fn wait_layer(&self, request: &str, layer: usize, timeout: Duration) -> Result<()> {
        self.wait_until(request, timeout, |l| {
            l.loaded.get(layer).copied().unwrap_or(false)
        })
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
        let end = Instant::now() + timeout;
        let mut st = lock(&self.sh.st);
        loop {
            match (st.loads.get(request), st.ended.get(request)) {
                (Some(l), _) if f(l) => return Ok(()),
                (Some(_), _) => {}
                (None, Some(Ended::Ok)) => return Ok(()),
                (None, Some(Ended::Failed(why))) => {
                    return Err(Error::Handoff {
                        request: request.to_string(),
                        why: why.clone(),
                    })
                }
                (None, None) => {
                    return Err(Error::Handoff {
                        request: request.to_string(),
                        why: "no load of this request was started".into(),
                    })
                }
            }
            let now = Instant::now();
            if now >= end {
                return Err(Error::WaitTimeout(timeout));
            }
            st = self
                .sh
                .cv
                .wait_timeout(st, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
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
        lock(&self.sh.st).loads.len()
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
    }
}

const ENDED_MEMORY: usize = 4096;

fn want_msg(layout: &KvLayout, req: &str, local_blocks: &[u32]) -> Value {
    json!({
        "t": "want", "r": req, "blocks": local_blocks,
        "nb": layout.num_blocks,
        "layers": layout.layers.iter().map(base_json).collect::<Vec<_>>(),
    })
}

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
        bytes_skipped: l.skip as u64 * per_block,
        descriptors: l.descs,
        post_time: l.post,
        transfer_time: l.xfer,
        handoff_time: l.started.elapsed(),
    };
    sh.tel.record(&s);
    st.finished.push(s);
    remember(st, req, Ended::Ok);
}

fn fail(sh: &CShared, st: &mut CState, req: &str, e: Error) {
    let Some(l) = st.loads.remove(req) else {
        return;
    };
    log::warn!("kvxfer consumer: load of {req:?} failed: {e}");
    sh.tel.failed();
    // Tell the producer this reader is done with its blocks (it frees them on the last one).
    if l.h.mode == Mode::Pull {
        send(&sh.agent, &l.h.producer, json!({"t": "ack", "r": req}));
    }
    remember(st, req, Ended::Failed(e.to_string()));
    st.failed.push(LoadFailure {
        request: req.to_string(),
        error: e,
        invalid_blocks: l.local_blocks,
    });
}

fn consumer_loop(sh: &CShared) {
    loop {
        if lock(&sh.st).stop {
            return;
        }
        let busy = lock(&sh.st).loads.values().any(|l| !l.inflight.is_empty());
        let wait = if busy {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(10)
        };
        if let Ok(n) = sh.agent.wait_control(false, wait) {
            consumer_msg(sh, n);
            while let Some(n) = sh.agent.try_control(false) {
                consumer_msg(sh, n);
            }
        }
        consumer_progress(sh);
    }
}

fn consumer_msg(sh: &CShared, n: Notification) {
    let Some(v) = parse(&n) else {
        log::warn!(
            "kvxfer connector: malformed control message from {:?}",
            n.from
        );
        return;
    };
    let Some(req) = v["r"].as_str().map(str::to_string) else {
        return;
    };
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
    match v["t"].as_str() {
        Some("lease") => {
            let ms = v["ms"].as_u64().unwrap_or(0);
            // Keep a margin so a read bounded by the lease ends before the producer frees.
            let margin = (ms / 10).clamp(1, 500);
            l.lease_until = Some(Instant::now() + Duration::from_millis(ms.saturating_sub(margin)));
            l.ready = l.ready.max(v["n"].as_u64().unwrap_or(0) as usize);
        }
        Some("ready") => {
            l.ready = l.ready.max(v["n"].as_u64().unwrap_or(0) as usize);
        }
        Some("layer") => {
            // Push: this layer's data landed before this message.
            if let Some(slot) = v["l"].as_u64().and_then(|x| l.loaded.get_mut(x as usize)) {
                *slot = true;
            }
            l.descs += (l.local_blocks.len() * sh.layout.tensors_per_layer()) as u64;
            l.bytes += l.local_blocks.len() as u64
                * sh.layout.block_bytes()
                * sh.layout.tensors_per_layer() as u64;
            if l.loaded.iter().all(|&x| x) {
                finish(sh, &mut st, &req);
            }
            drop(st);
            sh.cv.notify_all();
        }
        Some("refused") => {
            if v["kind"] == "unknown"
                && l.lease_until.is_none()
                && l.started.elapsed() < UNKNOWN_GRACE
            {
                // Not published yet: the next heartbeat asks again.
                return;
            }
            let why = v["why"].as_str().unwrap_or("refused").to_string();
            let e = Error::Handoff {
                request: req.clone(),
                why,
            };
            fail(sh, &mut st, &req, e);
            drop(st);
            sh.cv.notify_all();
        }
        other => log::warn!("kvxfer consumer: unknown message {other:?}"),
    }
}

fn consumer_progress(sh: &CShared) {
    let mut st = lock(&sh.st);
    let mut changed = false;
    let mut hbs: Vec<(String, Value)> = Vec::new();
    let mut failures: Vec<(String, Error)> = Vec::new();
    let mut done: Vec<String> = Vec::new();
    let local_heads = 0..sh.layout.geometry.kv_heads;
    for (req, l) in st.loads.iter_mut() {
        if l.last_hb.elapsed() >= sh.cfg.heartbeat {
            l.last_hb = Instant::now();
            let m = if l.h.mode == Mode::Push && l.lease_until.is_none() {
                // Until the producer has taken the push request, repeat it.
                want_msg(&sh.layout, req, &l.local_blocks)
            } else {
                json!({"t": "hb", "r": req})
            };
            hbs.push((l.h.producer.clone(), m));
        }
        if l.h.mode == Mode::Pull {
            if let Some(until) = l.lease_until {
                while l.posted < l.ready {
                    let now = Instant::now();
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
                    let heads = sh.cfg.heads.clone().unwrap_or(0..l.h.kv_heads);
                    let r = (|| -> Result<Transfer> {
                        let ld = sh.layout.descs(
                            &l.local_blocks,
                            layer..layer + 1,
                            local_heads.clone(),
                        )?;
                        let rd = l
                            .remote
                            .descs(&l.h.blocks[l.skip..], layer..layer + 1, heads)?;
                        let lp = sh.agent.prep_local(&ld)?;
                        let rp = sh.agent.prep_remote(&l.h.producer, &rd)?;
                        // Bounded by the lease: never read blocks the producer may have freed.
                        sh.agent
                            .transfer_all(XferOp::Read, &lp, &rp, None, Some(until - now))
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
                        l.loaded[layer] = true;
                        add_stats(&mut l.bytes, &mut l.descs, &mut l.post, &mut l.xfer, &s);
                        changed = true;
                    }
                    Err(e) => failures.push((req.clone(), e)),
                }
            } else {
                i += 1;
            }
        }
        if l.h.mode == Mode::Pull && l.loaded.iter().all(|&x| x) && l.inflight.is_empty() {
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
            send(&sh.agent, &p, json!({"t": "ack", "r": req}));
        }
        finish(sh, &mut st, &req);
        changed = true;
    }
    drop(st);
    for (p, m) in hbs {
        send(&sh.agent, &p, m);
    }
    if changed {
        sh.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoff_roundtrip_and_refusals() {
        let h = Handoff {
            request: "req-1".into(),
            producer: "prefill-0".into(),
            side_channel: Some("198.18.0.1:4000".parse().unwrap()),
            blocks: vec![5, 9, 2],
            tokens: 40,
            compat: 0xdead_beef_0000_0001,
            kv_heads: 8,
            num_blocks: 100,
            layers: vec![
                LayerBase {
                    k: (RegionId(1), 0),
                    v: Some((RegionId(1), 4096)),
                },
                LayerBase {
                    k: (RegionId(2), 8),
                    v: None,
                },
            ],
            mode: Mode::Push,
        };
        assert_eq!(Handoff::decode(&h.encode()).unwrap(), h);
        assert!(Handoff::decode(b"{").is_err());
        assert!(Handoff::decode(b"{\"v\":2}").is_err());
        let mut j: Value = serde_json::from_slice(&h.encode()).unwrap();
        j["blocks"] = json!([1, -1]);
        assert!(Handoff::decode(j.to_string().as_bytes()).is_err());
        j["blocks"] = json!([1, 5_000_000_000u64]);
        assert!(Handoff::decode(j.to_string().as_bytes()).is_err());
    }
}
