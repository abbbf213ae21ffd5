//! The prefill side's shell, one for every carrier: publishing and the control-message thread
//! (a push producer's writes are `push.rs`'s). The protocol's decisions are
//! [`ProducerCore`]'s; every byte leaves through the [`Carrier`].
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::agent_carrier::AgentCarrier;
use super::api::KvProducer;
use super::carrier::{Carrier, Role};
use super::config::ConnectorConfig;
use super::producer_state::{
    revoke_groups, HeldRequest, ProducerShared, ProducerState, PushTarget,
};
use super::push::{producer_pushes, push_target};
use super::shell::{join_thread, lock, spawn_thread, take_control, wait_until};
use crate::agent::Agent;
use crate::random;
use crate::telemetry::{PeerHeld, Telemetry};
use kvxfer_proto::connector::{LayerError, ProducerAction, ProducerCore};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::groups::{held, CacheGroups};
use kvxfer_proto::layout::KvLayout;
use kvxfer_proto::lifecycle::{Freed, PeerShare};
use kvxfer_proto::wire::connector::{
    Grant, Handoff, HandoffGroup, Refusal, ToConsumer, ToProducer,
};
use kvxfer_proto::wire::notify::Notification;

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
        Producer::with_groups(agent, vec![layout], cfg, side_channel)
    }

    /// [`Producer::new`] for a cache of several groups ([`kvxfer_proto::groups`]), one
    /// layout each, in the order the engine numbers them.
    pub fn with_groups(
        agent: Arc<Agent>,
        groups: Vec<KvLayout>,
        cfg: ConnectorConfig,
        side_channel: Option<SocketAddr>,
    ) -> Result<Producer> {
        let carrier = AgentCarrier::new(agent, Role::Producer, side_channel, None);
        Producer::over(Box::new(carrier), CacheGroups::new(groups)?, cfg)
    }

    /// A producer whose messages and blocks `carrier` moves; `groups` describes its cache.
    pub(crate) fn over(
        carrier: Box<dyn Carrier>,
        groups: CacheGroups,
        cfg: ConnectorConfig,
    ) -> Result<Producer> {
        let name = format!("kvxfer-producer-{}", carrier.name());
        // Peers read the cache only inside the leases they were granted.
        for l in groups.layouts() {
            carrier.restrict(l, true);
        }
        let share = peer_share(&cfg, &groups);
        let sh = Arc::new(ProducerShared {
            carrier,
            groups,
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
        self.publish_groups(request, &[blocks], tokens, layers_done, None)
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
        self.publish_groups(request, &[blocks], tokens, layers_done, Some(grant))
    }

    /// [`Producer::publish`] for a cache of several groups: `blocks[g]` are group `g`'s
    /// ([`NO_BLOCK`](kvxfer_proto::groups::NO_BLOCK) where it holds none, as a sliding window's blocks before it);
    /// `layers_done` counts layers across groups, group 0's first. Under `grant`, or a fresh
    /// one when `None`.
    pub fn publish_groups(
        &self,
        request: &str,
        blocks: &[&[u32]],
        tokens: u64,
        layers_done: usize,
        grant: Option<Grant>,
    ) -> Result<Handoff> {
        let groups = &self.sh.groups;
        let nl = groups.total_layers();
        if request.is_empty() || layers_done > nl {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: layers_done {layers_done} of {nl}"
            )));
        }
        if blocks.len() != groups.len() {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: blocks of {} cache groups for a cache of {}",
                blocks.len(),
                groups.len()
            )));
        }
        for (g, (b, l)) in blocks.iter().zip(groups.layouts()).enumerate() {
            if let Some(b) = held(b).find(|&b| u64::from(b) >= l.num_blocks) {
                let group = if groups.len() > 1 {
                    format!("group {g} ")
                } else {
                    String::new()
                };
                return Err(Error::InvalidArgument(format!(
                    "publish {request:?}: {group}block {b} of {}",
                    l.num_blocks
                )));
            }
        }
        let grant = match grant {
            Some(g) => g,
            None => Grant(random::bytes()?),
        };
        let now = self.sh.t0.elapsed();
        let mut st = lock(&self.sh.st);
        if st.core.is_held(request) {
            return Err(Error::InvalidArgument(format!(
                "publish {request:?}: already held"
            )));
        }
        // The lease counts every group's blocks toward a reader's share.
        let all: Vec<u32> = blocks.iter().flat_map(|b| held(b)).collect();
        st.core.publish(
            request,
            all,
            self.sh.cfg.readers,
            nl,
            layers_done,
            Some(grant),
            now,
        );
        st.requests.insert(
            request.to_string(),
            HeldRequest {
                blocks: blocks.iter().map(|b| b.to_vec()).collect(),
                tokens,
                pushes: Vec::new(),
                published: Instant::now(),
                grant,
            },
        );
        drop(st);
        self.sh.cv.notify_all();
        let carrier = &self.sh.carrier;
        let first = &groups.layouts()[0];
        let mut h = Handoff {
            request: request.to_string(),
            producer: carrier.name().to_string(),
            side_channel: carrier.side_channel(),
            blocks: blocks[0].to_vec(),
            tokens,
            compat: first.compat_hash(),
            kv_heads: first.geometry.kv_heads,
            num_blocks: first.num_blocks,
            layers: first.layers.clone(),
            mode: self.sh.cfg.mode,
            epoch: carrier.epoch(),
            grant: Some(grant),
            seal: None,
            groups: groups.layouts()[1..]
                .iter()
                .zip(&blocks[1..])
                .map(|(l, b)| HandoffGroup {
                    blocks: b.to_vec(),
                    compat: l.compat_hash(),
                    kv_heads: l.geometry.kv_heads,
                    num_blocks: l.num_blocks,
                    layers: l.layers.clone(),
                })
                .collect(),
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
            revoke_groups(&*self.sh.carrier, &r.grant, r.blocks.len());
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
                revoke_groups(&**carrier, &r.grant, r.blocks.len());
                r.pushes
            })
            .collect();
        for (_, t) in pushes.into_iter().flat_map(|p| p.inflight) {
            t.cancel();
        }
        for l in self.sh.groups.layouts() {
            self.sh.carrier.restrict(l, false);
        }
        self.sh.carrier.close();
    }
}

/// Each reader's share of the cache in blocks: `cfg`'s bytes over the bytes of a block in
/// every layer (a hard limit), or by default half the cache as a fair share (it binds only
/// while another reader holds blocks too).
fn peer_share(cfg: &ConnectorConfig, groups: &CacheGroups) -> PeerShare {
    let block = block_bytes(groups).max(1);
    let (blocks, fair) = match cfg.peer_bytes {
        Some(b) => (b / block, false),
        None => (groups.layouts()[0].num_blocks / 2, true),
    };
    PeerShare {
        requests: cfg.peer_requests.max(1),
        blocks: blocks.max(1),
        fair,
    }
}

/// The bytes one block id stands for: its tensors in every layer of its group, in the group
/// where that is most (a share counts blocks of every group alike, so it errs on the safe
/// side for the others).
fn block_bytes(groups: &CacheGroups) -> u64 {
    (0..groups.len())
        .map(|g| groups.block_bytes_all_layers(g))
        .max()
        .unwrap_or(0)
}

/// Readers' holds that changed, into the metrics.
fn publish_holds(st: &mut ProducerState, sh: &ProducerShared) {
    let block = block_bytes(&sh.groups);
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
                    if let Err(e) = grant_groups(sh, &r.grant, &reader, &r.blocks) {
                        revoke_groups(&*sh.carrier, &r.grant, r.blocks.len());
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
                let target = match st.requests.get(&request) {
                    Some(r) => push_target(sh, reader.clone(), want, &r.blocks, r.tokens),
                    None => Err(Error::InvalidArgument("push request: not held".into())),
                };
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

/// Opens `blocks` (per group) of the cache to `reader` for reading, under `grant`'s key for
/// each group.
fn grant_groups(
    sh: &ProducerShared,
    grant: &Grant,
    reader: &str,
    blocks: &[Vec<u32>],
) -> Result<()> {
    for (g, (l, b)) in sh.groups.layouts().iter().zip(blocks).enumerate() {
        let b: Vec<u32> = held(b).collect();
        sh.carrier.grant(grant.for_group(g), reader, false, l, &b)?;
    }
    Ok(())
}

impl KvProducer for Producer {
    fn publish_groups(
        &self,
        request: &str,
        blocks: &[&[u32]],
        tokens: u64,
        layers_done: usize,
        grant: Option<Grant>,
    ) -> Result<Handoff> {
        Producer::publish_groups(self, request, blocks, tokens, layers_done, grant)
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
