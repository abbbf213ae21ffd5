//! The connector's protocol as two pure state machines with the clock passed in (`now`, time
//! since the owner's start), in the manner of quinn-proto: [`ProducerCore`] decides what a
//! producer answers to heartbeats, push requests and acknowledgements, and when blocks are
//! freed; [`LoadProtocol`] tracks one consumer load (lease, ready layers, landed layers,
//! heartbeats due, refusals). The `kvxfer` connector is their I/O shell: it moves the bytes,
//! sends the messages these return, and feeds back what arrives. Tested here without a
//! network, a thread or a sleep.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::layout::{KvGeometry, KvLayout, KvOrder};
use crate::lifecycle::{Freed, LeaseError, Ledger, PeerHold, PeerShare};
use crate::tp::HeadMap;
use crate::wire::connector::Grant;
use crate::wire::connector::{Handoff, Mode, PushWant, Refusal, ToConsumer, ToProducer};

/// A consumer that hears "not held" this soon after starting keeps asking: the handoff may
/// reach it before the producer's worker has published the request.
pub const UNKNOWN_GRACE: Duration = Duration::from_secs(10);

/// What the producer's shell does after [`ProducerCore::handle`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProducerAction {
    /// Send `msg` to the consumer `to`.
    Send {
        /// The consumer.
        to: String,
        /// The message.
        msg: ToConsumer,
    },
    /// A push consumer not seen before: build its push target (which may be refused, e.g.
    /// for budget); on success call [`ProducerCore::push_accepted`] and send `lease`, else
    /// send a [`ToConsumer::Refused`] without a kind.
    StartPush {
        /// The consumer.
        reader: String,
        /// The request.
        request: String,
        /// Its blocks.
        want: PushWant,
        /// The answer once the push is accepted.
        lease: ToConsumer,
    },
    /// A pull reader presented the grant and gets its first lease (sent right after): open
    /// the request's blocks to it (the shell's grant table, which the lanes check).
    Open {
        /// The reader.
        reader: String,
        /// The request.
        request: String,
    },
    /// The request's blocks may be reused.
    Freed(Freed),
}

/// Why [`ProducerCore::layer_done`] failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerError {
    /// The producer does not hold the request.
    NotHeld,
    /// The layer is past the layout's layers (their count is given).
    NoSuchLayer(usize),
}

#[derive(Debug)]
struct Held {
    /// Per layer: computed.
    ready: Vec<bool>,
    /// Consumers that heartbeated (they are told of new layers), in the order they came, and
    /// the same as a set (a message's membership check costs the same whatever came before;
    /// the ledger bounds them by the request's readers).
    holders: Vec<String>,
    holder_set: HashSet<String>,
    /// Push consumers whose target is built.
    pushers: HashSet<String>,
    /// The handoff's grant: every call about the request must carry it.
    grant: Option<Grant>,
}

impl Held {
    fn ready_layers(&self) -> usize {
        self.ready.iter().take_while(|&&r| r).count()
    }
}

/// The producer's protocol: leases (a [`Ledger`]), computed layers, who holds what.
#[derive(Debug)]
pub struct ProducerCore {
    ledger: Ledger,
    mode: Mode,
    held: HashMap<String, Held>,
}

impl ProducerCore {
    /// A producer whose leases last `lease`, moving bytes by `mode`.
    pub fn new(lease: Duration, mode: Mode) -> ProducerCore {
        ProducerCore {
            ledger: Ledger::new(lease),
            mode,
            held: HashMap::new(),
        }
    }

    /// This producer with a ceiling on how long any request is held, whatever the
    /// heartbeats ([`Ledger::with_max_hold`]).
    pub fn with_max_hold(mut self, max_hold: Duration) -> ProducerCore {
        let lease = self.ledger.lease();
        self.ledger =
            std::mem::replace(&mut self.ledger, Ledger::new(lease)).with_max_hold(max_hold);
        self
    }

    /// This producer with `share` as each reader's share of its cache ([`PeerShare`]).
    pub fn with_share(mut self, share: PeerShare) -> ProducerCore {
        let lease = self.ledger.lease();
        self.ledger = std::mem::replace(&mut self.ledger, Ledger::new(lease)).with_share(share);
        self
    }

    /// What `reader` keeps held now.
    pub fn peer_hold(&self, reader: &str) -> PeerHold {
        self.ledger.peer_hold(reader)
    }

    /// The readers whose hold changed since the last call, with what they hold now
    /// ([`Ledger::take_hold_changes`]).
    pub fn take_hold_changes(&mut self) -> Vec<(String, PeerHold)> {
        self.ledger.take_hold_changes()
    }

    /// Holds `blocks` of `request` for `readers` consumers from `now`; `layers_done` of its
    /// `layers` are computed already. With a `grant`, only calls that carry it are answered
    /// (others are refused with [`LeaseError::NotGranted`] and change nothing).
    #[allow(clippy::too_many_arguments)]
    pub fn publish(
        &mut self,
        request: &str,
        blocks: Vec<u32>,
        readers: usize,
        layers: usize,
        layers_done: usize,
        grant: Option<Grant>,
        now: Duration,
    ) {
        self.ledger.hold(request, blocks, readers, now);
        self.held.insert(
            request.to_string(),
            Held {
                ready: (0..layers).map(|l| l < layers_done).collect(),
                holders: Vec::new(),
                holder_set: HashSet::new(),
                pushers: HashSet::new(),
                grant,
            },
        );
    }

    /// Layer `layer` of `request` is computed. Returns the messages for pull consumers
    /// (every holder learns the new count of ready layers); push shells read
    /// [`ProducerCore::ready_layers`].
    pub fn layer_done(
        &mut self,
        request: &str,
        layer: usize,
    ) -> Result<Vec<(String, ToConsumer)>, LayerError> {
        let h = self.held.get_mut(request).ok_or(LayerError::NotHeld)?;
        let n = h.ready.len();
        *h.ready.get_mut(layer).ok_or(LayerError::NoSuchLayer(n))? = true;
        if self.mode == Mode::Push {
            return Ok(Vec::new());
        }
        let ready = h.ready_layers();
        Ok(h.holders
            .iter()
            .map(|c| {
                (
                    c.clone(),
                    ToConsumer::Ready {
                        request: request.to_string(),
                        ready,
                    },
                )
            })
            .collect())
    }

    /// Layers of `request` computed, from layer 0 (0 when not held).
    pub fn ready_layers(&self, request: &str) -> usize {
        self.held.get(request).map_or(0, Held::ready_layers)
    }

    /// Whether `request` is held.
    pub fn is_held(&self, request: &str) -> bool {
        self.held.contains_key(request)
    }

    /// Gives `request` up: its blocks are freed now.
    pub fn abort(&mut self, request: &str) -> Option<Freed> {
        self.held.remove(request);
        self.ledger.abort(request)
    }

    /// A message from consumer `from` at `now`.
    pub fn handle(&mut self, from: &str, msg: ToProducer, now: Duration) -> Vec<ProducerAction> {
        let request = msg.request().to_string();
        // Checked first: a call without the grant declares, renews and frees nothing.
        if let Some(g) = self.held.get(&request).and_then(|h| h.grant.as_ref()) {
            if !msg.grant().is_some_and(|m| m.matches(g)) {
                let e = LeaseError::NotGranted {
                    request: request.clone(),
                    reader: from.to_string(),
                };
                return self.refuse(from, request, &e);
            }
        }
        self.apply(from, msg, now)
    }

    /// A call that passed the grant check (or the producer's own record), applied.
    fn apply(&mut self, from: &str, msg: ToProducer, now: Duration) -> Vec<ProducerAction> {
        let request = msg.request().to_string();
        if let Some(n) = msg.readers() {
            if let Err(e) = self.ledger.declare(&request, from, n as usize, now) {
                return self.refuse(from, request, &e);
            }
        }
        match msg {
            ToProducer::Heartbeat { .. } | ToProducer::Want { .. } => {
                match self.ledger.heartbeat(&request, from, now) {
                    Ok(left) => {
                        let Some(h) = self.held.get_mut(&request) else {
                            return self.freed_now();
                        };
                        let mut out = Vec::new();
                        if h.holder_set.insert(from.to_string()) {
                            h.holders.push(from.to_string());
                            // A new pull reader: its blocks open to it before its lease goes.
                            if self.mode == Mode::Pull {
                                out.push(ProducerAction::Open {
                                    reader: from.to_string(),
                                    request: request.clone(),
                                });
                            }
                        }
                        let lease = ToConsumer::Lease {
                            request: request.clone(),
                            ms: left.as_millis() as u64,
                            ready: h.ready_layers(),
                        };
                        out.push(match msg {
                            ToProducer::Want { want, .. } if !h.pushers.contains(from) => {
                                ProducerAction::StartPush {
                                    reader: from.to_string(),
                                    request,
                                    want,
                                    lease,
                                }
                            }
                            _ => ProducerAction::Send {
                                to: from.to_string(),
                                msg: lease,
                            },
                        });
                        out
                    }
                    Err(e) => self.refuse(from, request, &e),
                }
            }
            ToProducer::Ack { .. } => match self.ledger.ack(&request, from, now) {
                Ok(Some(f)) => {
                    self.held.remove(&request);
                    let mut out = self.freed_now();
                    out.push(ProducerAction::Freed(f));
                    out
                }
                Ok(None) => Vec::new(),
                // An ack for something not held (expired, duplicate): nothing to free.
                Err(_) => self.freed_now(),
            },
        }
    }

    /// Push: `reader`'s writes of `request` have landed, which is its acknowledgement.
    pub fn push_landed(
        &mut self,
        reader: &str,
        request: &str,
        now: Duration,
    ) -> Vec<ProducerAction> {
        // The producer's own record of the landing: no call to check.
        let ack = ToProducer::Ack {
            request: request.to_string(),
            readers: None,
            grant: None,
        };
        self.apply(reader, ack, now)
    }

    /// Expiries noticed, then a typed refusal of `request` to `to`.
    fn refuse(&mut self, to: &str, request: String, e: &LeaseError) -> Vec<ProducerAction> {
        let mut out = self.freed_now();
        out.push(ProducerAction::Send {
            to: to.to_string(),
            msg: ToConsumer::Refused {
                request,
                kind: Some(Refusal::of(e)),
                why: e.to_string(),
            },
        });
        out
    }

    /// The push target of `reader` for `request` is built (it is not asked for again).
    pub fn push_accepted(&mut self, request: &str, reader: &str) {
        if let Some(h) = self.held.get_mut(request) {
            h.pushers.insert(reader.to_string());
        }
    }

    /// Frees every request whose lease ended by `now`.
    pub fn tick(&mut self, now: Duration) -> Vec<Freed> {
        let mut freed = self.ledger.tick(now);
        freed.extend(self.ledger.take_pending());
        for f in &freed {
            self.held.remove(&f.request);
        }
        freed
    }

    /// The earliest lease end, for scheduling the next tick.
    pub fn next_expiry(&self) -> Option<Duration> {
        self.ledger.next_expiry()
    }

    /// Requests held now.
    pub fn held(&self) -> usize {
        self.ledger.held()
    }

    /// Expiries the ledger noticed while answering, as actions.
    fn freed_now(&mut self) -> Vec<ProducerAction> {
        let freed = self.ledger.take_pending();
        freed
            .into_iter()
            .map(|f| {
                self.held.remove(&f.request);
                ProducerAction::Freed(f)
            })
            .collect()
    }
}

/// What a message did to a load ([`LoadProtocol::handle`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadEvent {
    /// Nothing changed (a foreign sender, a refusal inside the grace period, a duplicate).
    Ignored,
    /// The lease or the count of ready layers changed: more layers may be read now.
    Progress,
    /// Push: this layer's data has landed.
    Landed(usize),
    /// The producer refused: the load has failed, for this reason.
    Failed(String),
}

/// One consumer load's protocol state.
#[derive(Clone, Debug)]
pub struct LoadProtocol {
    request: String,
    producer: String,
    mode: Mode,
    /// Push: the blocks to send until the producer answers.
    want: Option<PushWant>,
    /// Until when reads are safe (the producer's lease less a margin).
    lease_until: Option<Duration>,
    ready: usize,
    loaded: Vec<bool>,
    started: Duration,
    last_hb: Duration,
    /// Readers declared to the producer in every message (the tensor-parallel plan's count).
    readers: Option<u32>,
    /// The producer's incarnation that published the handoff (0: unknown).
    epoch: u64,
    /// The handoff's grant, presented in every message.
    grant: Option<Grant>,
}

impl LoadProtocol {
    /// A load of `request` from `producer` into `layers` layers, started at `now`, with the
    /// first message to send. `want`: push mode's blocks (ignored for pull). `nothing`: no
    /// block moves (a fully cached prompt): the load is complete and the message an
    /// acknowledgement.
    pub fn start(
        request: &str,
        producer: &str,
        mode: Mode,
        layers: usize,
        want: Option<PushWant>,
        nothing: bool,
        now: Duration,
    ) -> (LoadProtocol, ToProducer) {
        let p = LoadProtocol::new(request, producer, mode, layers, want, nothing, now);
        let first = p.opening();
        (p, first)
    }

    /// [`LoadProtocol::start`] without the first message (see [`LoadProtocol::opening`]).
    pub fn new(
        request: &str,
        producer: &str,
        mode: Mode,
        layers: usize,
        want: Option<PushWant>,
        nothing: bool,
        now: Duration,
    ) -> LoadProtocol {
        LoadProtocol {
            request: request.to_string(),
            producer: producer.to_string(),
            mode,
            want: if mode == Mode::Push { want } else { None },
            lease_until: None,
            ready: 0,
            loaded: vec![nothing; layers],
            started: now,
            last_hb: now,
            readers: None,
            epoch: 0,
            grant: None,
        }
    }

    /// Presents `grant` (the handoff's [`Handoff::grant`]) in every message.
    pub fn granted(mut self, grant: Option<Grant>) -> LoadProtocol {
        self.grant = grant;
        self
    }

    /// The load reads what incarnation `epoch` of the producer published (the handoff's
    /// [`Handoff::epoch`]; 0: unknown, never checked).
    pub fn of_incarnation(mut self, epoch: u64) -> LoadProtocol {
        self.epoch = epoch;
        self
    }

    /// Why the load cannot complete when `loaded` is the producer's incarnation the agent
    /// knows now: another one than the handoff's means the producer restarted and the blocks
    /// it held are gone, whatever the lease or a "not held" answer would say. `None` while
    /// either is unknown (0) or they agree.
    pub fn restarted(&self, loaded: u64) -> Option<String> {
        (self.epoch != 0 && loaded != 0 && loaded != self.epoch && !self.complete()).then(|| {
            format!(
                "the producer restarted (epoch {:#018x} published it, {loaded:#018x} runs now): \
                 its blocks are gone",
                self.epoch
            )
        })
    }

    /// Declares `readers` (when `Some`) to the producer in every message: how many consumer
    /// ranks read this request ([`crate::tp::TpRead::readers`]).
    pub fn declaring(mut self, readers: Option<u32>) -> LoadProtocol {
        self.readers = readers;
        self
    }

    /// The first message to send: an acknowledgement when nothing moves, else the first
    /// heartbeat (or push request).
    pub fn opening(&self) -> ToProducer {
        if self.complete() {
            self.ack()
        } else {
            self.renewal()
        }
    }

    /// The producer.
    pub fn producer(&self) -> &str {
        &self.producer
    }

    /// Pull or push.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Until when reads are safe, once a lease came.
    pub fn lease_until(&self) -> Option<Duration> {
        self.lease_until
    }

    /// Layers the producer has computed.
    pub fn ready(&self) -> usize {
        self.ready
    }

    /// Whether layer `layer` is in local memory.
    pub fn loaded(&self, layer: usize) -> bool {
        self.loaded.get(layer).copied().unwrap_or(false)
    }

    /// Whether every layer is in local memory.
    pub fn complete(&self) -> bool {
        self.loaded.iter().all(|&x| x)
    }

    /// Whether the lease ran out at `now` with the load incomplete: the producer stopped
    /// answering heartbeats (gone or stalled), so the load must fail rather than wait forever.
    pub fn lapsed(&self, now: Duration) -> bool {
        self.lease_until.is_some_and(|u| now >= u) && !self.complete()
    }

    /// Whether no lease has come by `now`, [`UNKNOWN_GRACE`] after the start, with the load
    /// incomplete: this consumer's messages or the producer's answers do not get through (a
    /// cut link, a connection that has not come back, a stalled producer), so the load must
    /// fail rather than wait forever ([`LoadProtocol::lapsed`] takes over once a lease came).
    pub fn unanswered(&self, now: Duration) -> bool {
        self.lease_until.is_none()
            && !self.complete()
            && now.saturating_sub(self.started) >= UNKNOWN_GRACE
    }

    /// Why the load must fail at `now` for want of the producer's answers
    /// ([`LoadProtocol::lapsed`], [`LoadProtocol::unanswered`]); `None` while it may wait.
    pub fn silent(&self, now: Duration) -> Option<String> {
        if self.lapsed(now) {
            return Some("the producer stopped renewing the lease (it is gone or stalled)".into());
        }
        self.unanswered(now).then(|| {
            format!(
                "the producer has not answered in {} s (unreachable, stalled or gone)",
                UNKNOWN_GRACE.as_secs()
            )
        })
    }

    /// Pull: the read of `layer` has completed.
    pub fn mark_loaded(&mut self, layer: usize) {
        if let Some(s) = self.loaded.get_mut(layer) {
            *s = true;
        }
    }

    /// The acknowledgement that releases the producer's blocks for this reader.
    pub fn ack(&self) -> ToProducer {
        ToProducer::Ack {
            request: self.request.clone(),
            readers: self.readers,
            grant: self.grant,
        }
    }

    /// A message from `from` about this load, at `now`.
    pub fn handle(&mut self, from: &str, msg: &ToConsumer, now: Duration) -> LoadEvent {
        if from != self.producer || msg.request() != self.request {
            return LoadEvent::Ignored;
        }
        match msg {
            ToConsumer::Lease { ms, ready, .. } => {
                // Keep a margin so a read bounded by the lease ends before the producer frees.
                let margin = (ms / 10).clamp(1, 500);
                self.lease_until = Some(now + Duration::from_millis(ms.saturating_sub(margin)));
                self.ready = self.ready.max(*ready);
                LoadEvent::Progress
            }
            ToConsumer::Ready { ready, .. } => {
                self.ready = self.ready.max(*ready);
                LoadEvent::Progress
            }
            ToConsumer::Layer { layer, .. } => match self.loaded.get_mut(*layer) {
                Some(s) if !*s => {
                    *s = true;
                    LoadEvent::Landed(*layer)
                }
                _ => LoadEvent::Ignored,
            },
            ToConsumer::Refused { kind, why, .. } => {
                if *kind == Some(Refusal::Unknown)
                    && self.lease_until.is_none()
                    && now.saturating_sub(self.started) < UNKNOWN_GRACE
                {
                    // Not published yet: the next heartbeat asks again.
                    return LoadEvent::Ignored;
                }
                LoadEvent::Failed(why.clone())
            }
        }
    }

    /// The heartbeat to send at `now`, if `period` has passed since the last one: a push load
    /// repeats its blocks until the producer has answered.
    pub fn heartbeat_due(&mut self, now: Duration, period: Duration) -> Option<ToProducer> {
        if now.saturating_sub(self.last_hb) < period {
            return None;
        }
        self.last_hb = now;
        Some(self.renewal())
    }

    fn renewal(&self) -> ToProducer {
        match (&self.want, self.lease_until) {
            (Some(want), None) => ToProducer::Want {
                request: self.request.clone(),
                want: want.clone(),
                readers: self.readers,
                grant: self.grant,
            },
            _ => ToProducer::Heartbeat {
                request: self.request.clone(),
                readers: self.readers,
                grant: self.grant,
            },
        }
    }
}

/// The descriptors of one load's `layers`, local and remote, pairing index by index: heads
/// `heads.local` of `local`'s `local_blocks` and heads `heads.remote` of `remote`'s
/// `remote_blocks`. A head slice of a cache in NHD order is one descriptor per token, so when
/// either side is a slice both sides are split per token.
pub fn load_descs(
    local: &KvLayout,
    remote: &KvLayout,
    heads: &HeadMap,
    local_blocks: &[u32],
    remote_blocks: &[u32],
    layers: std::ops::Range<usize>,
) -> Result<(Vec<crate::descriptor::Desc>, Vec<crate::descriptor::Desc>)> {
    let slice = heads.local != (0..local.geometry.kv_heads)
        || heads.remote != (0..remote.geometry.kv_heads);
    let l = local.descs_split(local_blocks, layers.clone(), heads.local.clone(), slice)?;
    let r = remote.descs_split(remote_blocks, layers, heads.remote.clone(), slice)?;
    Ok((l, r))
}

/// [`load_descs`] in the paged form ([`crate::paged`]): one entry per layer and tensor on each
/// side. `None` where a head slice in NHD order needs one piece per token (use
/// [`load_descs`] then).
pub fn load_paged(
    local: &KvLayout,
    remote: &KvLayout,
    heads: &HeadMap,
    local_blocks: &[u32],
    remote_blocks: &[u32],
    layers: std::ops::Range<usize>,
) -> Result<Option<(Vec<crate::paged::Paged>, Vec<crate::paged::Paged>)>> {
    let slice = heads.local != (0..local.geometry.kv_heads)
        || heads.remote != (0..remote.geometry.kv_heads);
    if slice
        && (local.order == KvOrder::Nhd
            || remote.order == KvOrder::Nhd
            || local.packing == crate::layout::KvPacking::State)
    {
        return Ok(None);
    }
    let l = local.paged(local_blocks, layers.clone(), heads.local.clone())?;
    let r = remote.paged(remote_blocks, layers, heads.remote.clone())?;
    Ok(Some((l, r)))
}

/// What a consumer checks before it loads `h` into `local_blocks` of its cache `local`,
/// moving the producer's heads `heads.remote` into its heads `heads.local` (every head into
/// every head when `None`): the same layout but for the head count (compat hash), head ranges
/// of equal width inside both caches, blocks inside both caches. Returns the producer's layout
/// as the handoff describes it.
pub fn check_load(
    local: &KvLayout,
    heads: Option<&HeadMap>,
    h: &Handoff,
    local_blocks: &[u32],
) -> Result<KvLayout> {
    let want = KvLayout {
        geometry: KvGeometry {
            kv_heads: h.kv_heads,
            ..local.geometry.clone()
        },
        ..local.clone()
    };
    if want.compat_hash() != h.compat {
        return Err(Error::Handoff {
            request: h.request.clone(),
            why: format!(
                "the producer's KV layout (layers, head size, dtype, block size, packing, \
                 order) differs from this consumer's ({} layers of {} heads x {}, {:?}, {} \
                 tokens a block, {:?}, {:?})",
                local.geometry.layers,
                local.geometry.kv_heads,
                local.geometry.head_dim,
                local.geometry.dtype,
                local.block_tokens,
                local.packing,
                local.order
            ),
        });
    }
    want.check_packing().map_err(|e| Error::Handoff {
        request: h.request.clone(),
        why: format!("the producer's layout: {e}"),
    })?;
    let all = HeadMap::all(h.kv_heads);
    let m = heads.unwrap_or(&all);
    let lh = local.geometry.kv_heads;
    let (r, l) = (&m.remote, &m.local);
    // Nothing moves (a cached prompt, or a replica only acknowledged): no heads to check.
    if !local_blocks.is_empty()
        && (r.start >= r.end
            || r.end > h.kv_heads
            || l.start >= l.end
            || l.end > lh
            || r.end - r.start != l.end - l.start
            || (heads.is_none() && h.kv_heads != lh))
    {
        return Err(Error::Handoff {
            request: h.request.clone(),
            why: format!(
                "reading heads {r:?} of the producer's {} into heads {l:?} of a cache of {lh} \
                 heads",
                h.kv_heads
            ),
        });
    }
    if local_blocks.len() > h.blocks.len() || h.layers.len() != local.layers.len() {
        return Err(Error::InvalidArgument(format!(
            "load {:?}: {} local blocks for {} published, {} layers for {}",
            h.request,
            local_blocks.len(),
            h.blocks.len(),
            local.layers.len(),
            h.layers.len()
        )));
    }
    if let Some(&b) = local_blocks
        .iter()
        .find(|&&b| u64::from(b) >= local.num_blocks)
    {
        return Err(Error::InvalidArgument(format!(
            "load {:?}: local block {b} of {}",
            h.request, local.num_blocks
        )));
    }
    Ok(KvLayout {
        geometry: want.geometry,
        num_blocks: h.num_blocks,
        layers: h.layers.clone(),
        ..local.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::FreeReason;

    const LEASE: Duration = Duration::from_secs(2);
    const HB: Duration = Duration::from_millis(500);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A producer and its consumers wired in memory, with simulated time (quinn's `Pair`):
    /// messages go through queues, every step advances the clock, nothing sleeps.
    struct Pair {
        now: Duration,
        producer: ProducerCore,
        loads: Vec<(String, LoadProtocol)>,
        to_producer: Vec<(String, ToProducer)>,
        to_consumers: Vec<(String, ToConsumer)>,
        freed: Vec<Freed>,
        events: Vec<(String, LoadEvent)>,
        /// Push targets the shell refuses (e.g. no budget).
        refuse_pushes: bool,
        /// Consumers that have stopped (died): their heartbeats no longer go out.
        dead: Vec<String>,
        /// `ProducerAction::Open`s, in order: (reader, request).
        opened: Vec<(String, String)>,
    }

    impl Pair {
        fn new(mode: Mode) -> Pair {
            Pair {
                now: Duration::ZERO,
                producer: ProducerCore::new(LEASE, mode),
                loads: Vec::new(),
                to_producer: Vec::new(),
                to_consumers: Vec::new(),
                freed: Vec::new(),
                events: Vec::new(),
                refuse_pushes: false,
                dead: Vec::new(),
                opened: Vec::new(),
            }
        }

        fn start(&mut self, consumer: &str, request: &str, mode: Mode, want: Option<PushWant>) {
            let (p, first) =
                LoadProtocol::start(request, "prefill", mode, 2, want, false, self.now);
            self.to_producer.push((consumer.to_string(), first));
            self.loads.push((consumer.to_string(), p));
        }

        fn load(&self, consumer: &str) -> &LoadProtocol {
            &self.loads.iter().find(|(c, _)| c == consumer).unwrap().1
        }

        /// Delivers every queued message, then advances time by `dt` and runs timers.
        fn step(&mut self, dt: Duration) {
            while !self.to_producer.is_empty() || !self.to_consumers.is_empty() {
                for (from, m) in std::mem::take(&mut self.to_producer) {
                    for a in self.producer.handle(&from, m, self.now) {
                        match a {
                            ProducerAction::Send { to, msg } => self.to_consumers.push((to, msg)),
                            ProducerAction::StartPush {
                                reader,
                                request,
                                lease,
                                ..
                            } => {
                                if self.refuse_pushes {
                                    self.to_consumers.push((
                                        reader,
                                        ToConsumer::Refused {
                                            request,
                                            kind: None,
                                            why: "no budget".into(),
                                        },
                                    ));
                                } else {
                                    self.producer.push_accepted(&request, &reader);
                                    self.to_consumers.push((reader, lease));
                                }
                            }
                            ProducerAction::Open { reader, request } => {
                                self.opened.push((reader, request))
                            }
                            ProducerAction::Freed(f) => self.freed.push(f),
                        }
                    }
                }
                for (to, m) in std::mem::take(&mut self.to_consumers) {
                    if let Some((_, l)) = self.loads.iter_mut().find(|(c, _)| *c == to) {
                        let e = l.handle("prefill", &m, self.now);
                        self.events.push((to, e));
                    }
                }
            }
            self.now += dt;
            self.freed.extend(self.producer.tick(self.now));
            for (c, l) in &mut self.loads {
                if self.dead.contains(c) {
                    continue;
                }
                if let Some(m) = l.heartbeat_due(self.now, HB) {
                    self.to_producer.push((c.clone(), m));
                }
            }
        }

        fn drive(&mut self, total: Duration, dt: Duration) {
            let end = self.now + total;
            while self.now < end {
                self.step(dt);
            }
        }
    }

    #[test]
    fn heartbeats_keep_the_lease_and_the_ack_frees() {
        let mut p = Pair::new(Mode::Pull);
        p.producer.publish("r1", vec![1, 2], 1, 2, 2, None, p.now);
        p.start("decode", "r1", Mode::Pull, None);
        p.step(ms(1));
        let l = p.load("decode");
        assert_eq!(l.ready(), 2);
        // The margin: 2000 ms less 200 ms.
        assert_eq!(l.lease_until(), Some(ms(1800)));
        // Ten lease lengths of simulated time: heartbeats keep it held.
        p.drive(LEASE * 10, ms(100));
        assert!(p.freed.is_empty(), "{:?}", p.freed);
        assert_eq!(p.producer.held(), 1);
        assert!(p.load("decode").lease_until().unwrap() > LEASE * 10);
        let ack = p.load("decode").ack();
        p.to_producer.push(("decode".into(), ack));
        p.step(ms(1));
        assert_eq!(p.freed.len(), 1);
        assert_eq!(p.freed[0].reason, FreeReason::Acked);
        assert_eq!(p.freed[0].blocks, vec![1, 2]);
        assert_eq!(p.producer.held(), 0);
    }

    #[test]
    fn a_call_without_the_grant_declares_renews_and_frees_nothing() {
        let g = Grant([9; crate::wire::connector::GRANT_LEN]);
        let mut p = Pair::new(Mode::Pull);
        p.producer
            .publish("r1", vec![1, 2], 1, 2, 2, Some(g), p.now);
        // A peer that never saw the handoff: no grant, or a guessed one, in each kind of call.
        for grant in [None, Some(Grant([8; crate::wire::connector::GRANT_LEN]))] {
            let calls = [
                ToProducer::Ack {
                    request: "r1".into(),
                    readers: Some(4),
                    grant,
                },
                ToProducer::Heartbeat {
                    request: "r1".into(),
                    readers: None,
                    grant,
                },
            ];
            for m in calls {
                let out = p.producer.handle("intruder", m, p.now);
                assert!(
                    matches!(&out[..], [ProducerAction::Send { to, msg: ToConsumer::Refused {
                        kind: Some(Refusal::Grant), .. } }] if to == "intruder"),
                    "{out:?}"
                );
            }
        }
        assert_eq!(p.producer.held(), 1);
        assert!(
            p.opened.is_empty(),
            "blocks opened to the intruder: {:?}",
            p.opened
        );
        // The reader with the handoff's grant reads, and its declaration of one reader stands
        // (the intruder's "4" was not taken): its ack alone frees.
        let l = LoadProtocol::new("r1", "prefill", Mode::Pull, 2, None, false, p.now)
            .declaring(Some(1))
            .granted(Some(g));
        p.to_producer.push(("decode".into(), l.opening()));
        p.loads.push(("decode".into(), l));
        p.step(ms(1));
        assert_eq!(p.load("decode").ready(), 2);
        // Opened once, to the reader, however many heartbeats renew its lease.
        p.drive(LEASE * 2, ms(100));
        assert_eq!(p.opened, vec![("decode".to_string(), "r1".to_string())]);
        let ack = p.load("decode").ack();
        p.to_producer.push(("decode".into(), ack));
        p.step(ms(1));
        assert_eq!(p.freed.len(), 1, "{:?}", p.events);
        assert_eq!(p.freed[0].reason, FreeReason::Acked);
    }

    #[test]
    fn consumer_ranks_declare_their_readers_and_the_last_ack_frees() {
        // Published for one reader (the prefill side does not know the decode TP); two decode
        // ranks each read half the heads and declare two readers.
        let mut p = Pair::new(Mode::Pull);
        p.producer.publish("r1", vec![1, 2], 1, 2, 2, None, p.now);
        for c in ["rank0", "rank1"] {
            let l = LoadProtocol::new("r1", "prefill", Mode::Pull, 2, None, false, p.now)
                .declaring(Some(2));
            p.to_producer.push((c.into(), l.opening()));
            p.loads.push((c.into(), l));
        }
        p.step(ms(1));
        assert!(p.load("rank1").lease_until().is_some());
        let ack = p.load("rank0").ack();
        p.to_producer.push(("rank0".into(), ack));
        p.step(ms(1));
        assert!(p.freed.is_empty(), "freed after one of two: {:?}", p.freed);
        let ack = p.load("rank1").ack();
        p.to_producer.push(("rank1".into(), ack));
        p.step(ms(1));
        assert_eq!(p.freed.len(), 1);
        assert_eq!(p.freed[0].reason, FreeReason::Acked);
        // A third rank whose plan counts otherwise is refused, typed.
        p.producer.publish("r2", vec![3], 1, 2, 2, None, p.now);
        for (c, n) in [("rank0", 2), ("rank9", 3)] {
            let l = LoadProtocol::new("r2", "prefill", Mode::Pull, 2, None, false, p.now)
                .declaring(Some(n));
            p.to_producer.push((c.into(), l.opening()));
            p.loads.retain(|(x, _)| x != c);
            p.loads.push((c.into(), l));
        }
        p.step(ms(1));
        assert!(p
            .events
            .iter()
            .any(|(c, e)| c == "rank9"
                && matches!(e, LoadEvent::Failed(w) if w.contains("declares 3"))));
    }

    #[test]
    fn a_silent_consumer_s_lease_expires_at_the_lease_length() {
        let mut p = Pair::new(Mode::Pull);
        p.producer.publish("r1", vec![7], 1, 2, 2, None, p.now);
        p.start("decode", "r1", Mode::Pull, None);
        p.step(ms(10));
        p.dead.push("decode".into());
        // Last renewal at t=0; expiry exactly at the lease length, not before.
        p.drive(LEASE - ms(20), ms(10));
        assert!(p.freed.is_empty());
        p.drive(ms(20), ms(10));
        assert_eq!(p.freed.len(), 1, "{:?}", p.freed);
        assert_eq!(p.freed[0].reason, FreeReason::Expired);
        // A late heartbeat is refused with the reason, and the load fails.
        p.dead.clear();
        p.drive(HB, ms(10));
        assert!(
            p.events
                .iter()
                .any(|(_, e)| matches!(e, LoadEvent::Failed(w) if w.contains("expired"))),
            "{:?}",
            p.events
        );
    }

    #[test]
    fn layers_computed_later_reach_every_holder() {
        let mut p = Pair::new(Mode::Pull);
        p.producer.publish("r1", vec![1], 2, 2, 0, None, p.now);
        p.start("d0", "r1", Mode::Pull, None);
        p.start("d1", "r1", Mode::Pull, None);
        p.step(ms(1));
        assert_eq!(p.load("d0").ready(), 0);
        for (to, m) in p.producer.layer_done("r1", 0).unwrap() {
            p.to_consumers.push((to, m));
        }
        p.step(ms(1));
        assert_eq!((p.load("d0").ready(), p.load("d1").ready()), (1, 1));
        assert_eq!(
            p.producer.layer_done("r1", 5),
            Err(LayerError::NoSuchLayer(2))
        );
        assert_eq!(p.producer.layer_done("r9", 0), Err(LayerError::NotHeld));
        // A third reader is one too many.
        p.start("d2", "r1", Mode::Pull, None);
        p.step(ms(1));
        assert!(p
            .events
            .iter()
            .any(|(c, e)| c == "d2" && matches!(e, LoadEvent::Failed(_))));
        // Both acks are needed to free.
        for c in ["d0", "d1"] {
            let ack = p.load(c).ack();
            p.to_producer.push((c.into(), ack));
            p.step(ms(1));
        }
        assert_eq!(p.freed.len(), 1);
    }

    #[test]
    fn a_restarted_producer_fails_the_load_at_once() {
        let (p, _) = LoadProtocol::start("r", "p", Mode::Pull, 2, None, false, ms(0));
        let p = p.of_incarnation(0xaa);
        assert_eq!(p.restarted(0xaa), None);
        assert_eq!(p.restarted(0), None, "unknown now: no verdict");
        let why = p.restarted(0xbb).unwrap();
        assert!(
            why.contains("restarted") && why.contains("0x00000000000000bb"),
            "{why}"
        );
        // A handoff without an epoch is never judged by it.
        let (q, _) = LoadProtocol::start("r", "p", Mode::Pull, 2, None, false, ms(0));
        assert_eq!(q.restarted(0xbb), None);
        // Nor a load already complete.
        let (mut c, _) = LoadProtocol::start("r", "p", Mode::Pull, 1, None, false, ms(0));
        c = c.of_incarnation(0xaa);
        c.mark_loaded(0);
        assert_eq!(c.restarted(0xbb), None);
    }

    #[test]
    fn a_load_never_answered_fails_at_the_grace_and_one_with_a_lease_does_not() {
        for mode in [Mode::Pull, Mode::Push] {
            // Nothing gets through: no lease, no refusal.
            let (p, _) = LoadProtocol::start("r", "p", mode, 2, None, false, ms(1000));
            assert!(!p.unanswered(ms(1000) + UNKNOWN_GRACE - ms(1)), "{mode:?}");
            assert!(p.unanswered(ms(1000) + UNKNOWN_GRACE), "{mode:?}");
            // A lease came: the lease decides (`lapsed`), not the grace.
            let (mut q, _) = LoadProtocol::start("r", "p", mode, 2, None, false, ms(0));
            let lease = ToConsumer::Lease {
                request: "r".into(),
                ms: 60_000,
                ready: 0,
            };
            assert_eq!(q.handle("p", &lease, ms(5)), LoadEvent::Progress);
            assert!(!q.unanswered(UNKNOWN_GRACE * 2), "{mode:?}");
            assert!(!q.lapsed(UNKNOWN_GRACE * 2), "{mode:?}");
            // Nothing to move: complete, never waiting.
            let (c, _) = LoadProtocol::start("r", "p", mode, 2, None, true, ms(0));
            assert!(!c.unanswered(UNKNOWN_GRACE * 2), "{mode:?}");
            assert_eq!(c.silent(UNKNOWN_GRACE * 2), None, "{mode:?}");
            assert!(p
                .silent(ms(1000) + UNKNOWN_GRACE)
                .is_some_and(|w| w.contains("has not answered")));
            assert!(q
                .silent(ms(5) + Duration::from_millis(60_000))
                .is_some_and(|w| w.contains("stopped renewing")));
        }
    }

    #[test]
    fn unknown_is_retried_within_the_grace_then_fails() {
        let mut p = Pair::new(Mode::Pull);
        p.start("decode", "r1", Mode::Pull, None);
        p.step(ms(1));
        assert!(p.events.iter().all(|(_, e)| *e == LoadEvent::Ignored));
        // Published late (the handoff overtook the producer's worker): the next heartbeat
        // gets the lease.
        p.producer.publish("r1", vec![3], 1, 2, 2, None, p.now);
        p.drive(HB, ms(50));
        p.step(ms(1));
        assert!(p.load("decode").lease_until().is_some());
        // Never published: after the grace, the refusal is final.
        let mut q = Pair::new(Mode::Pull);
        q.start("decode", "r2", Mode::Pull, None);
        q.drive(UNKNOWN_GRACE + HB, ms(100));
        assert!(q
            .events
            .iter()
            .any(|(_, e)| matches!(e, LoadEvent::Failed(w) if w.contains("r2"))));
    }

    #[test]
    fn push_wants_repeat_until_answered_and_a_refused_push_fails_the_load() {
        let want = PushWant {
            blocks: vec![4, 5],
            num_blocks: 8,
            layers: Vec::new(),
            block_tokens: None,
            more: Vec::new(),
        };
        let mut p = Pair::new(Mode::Push);
        p.start("decode", "r1", Mode::Push, Some(want.clone()));
        // Not published yet: the want is repeated with each heartbeat.
        p.drive(HB * 2, ms(50));
        assert!(p.load("decode").lease_until().is_none());
        p.producer.publish("r1", vec![1, 2], 1, 2, 2, None, p.now);
        p.drive(HB, ms(50));
        p.step(ms(1));
        assert!(p.load("decode").lease_until().is_some());
        // Answered: plain heartbeats from now on, and no second push target.
        let mut l = p.load("decode").clone();
        assert!(matches!(
            l.heartbeat_due(p.now + HB, HB),
            Some(ToProducer::Heartbeat { .. })
        ));
        let again = p.producer.handle(
            "decode",
            ToProducer::Want {
                request: "r1".into(),
                want: want.clone(),
                readers: None,
                grant: None,
            },
            p.now,
        );
        assert!(
            matches!(again[..], [ProducerAction::Send { .. }]),
            "{again:?}"
        );
        // Layers land out of order, and a duplicate changes nothing.
        let landed = |l: usize| ToConsumer::Layer {
            request: "r1".into(),
            layer: l,
        };
        let mut l = p.load("decode").clone();
        assert_eq!(l.handle("prefill", &landed(1), p.now), LoadEvent::Landed(1));
        assert!(!l.complete());
        assert_eq!(l.handle("prefill", &landed(1), p.now), LoadEvent::Ignored);
        assert_eq!(l.handle("prefill", &landed(0), p.now), LoadEvent::Landed(0));
        assert!(l.complete());
        // A refused push target fails the load.
        let mut q = Pair::new(Mode::Push);
        q.refuse_pushes = true;
        q.producer.publish("r1", vec![1, 2], 1, 2, 2, None, q.now);
        q.start("decode", "r1", Mode::Push, Some(want));
        q.step(ms(1));
        assert!(q
            .events
            .iter()
            .any(|(_, e)| *e == LoadEvent::Failed("no budget".into())));
    }

    #[test]
    fn messages_from_others_or_about_other_requests_are_ignored() {
        let (mut l, first) =
            LoadProtocol::start("r1", "prefill", Mode::Pull, 1, None, false, ms(0));
        assert_eq!(
            first,
            ToProducer::Heartbeat {
                request: "r1".into(),
                readers: None,
                grant: None,
            }
        );
        let lease = ToConsumer::Lease {
            request: "r1".into(),
            ms: 1000,
            ready: 1,
        };
        assert_eq!(l.handle("mallory", &lease, ms(0)), LoadEvent::Ignored);
        let other = ToConsumer::Lease {
            request: "r2".into(),
            ms: 1000,
            ready: 1,
        };
        assert_eq!(l.handle("prefill", &other, ms(0)), LoadEvent::Ignored);
        assert_eq!(l.lease_until(), None);
        // Ready before the lease (reordered): counted, and the lease keeps the larger count.
        let ready = ToConsumer::Ready {
            request: "r1".into(),
            ready: 1,
        };
        assert_eq!(l.handle("prefill", &ready, ms(0)), LoadEvent::Progress);
        let stale = ToConsumer::Lease {
            request: "r1".into(),
            ms: 1000,
            ready: 0,
        };
        l.handle("prefill", &stale, ms(5));
        assert_eq!(l.ready(), 1);
        assert_eq!(l.lease_until(), Some(ms(5 + 900)));
        // A fully cached prompt: nothing moves, the first message is the ack.
        let (l, first) = LoadProtocol::start("r3", "prefill", Mode::Pull, 2, None, true, ms(0));
        assert!(l.complete());
        assert_eq!(
            first,
            ToProducer::Ack {
                request: "r3".into(),
                readers: None,
                grant: None,
            }
        );
    }

    #[test]
    fn abort_frees_and_refuses_later_heartbeats() {
        let mut c = ProducerCore::new(LEASE, Mode::Pull);
        c.publish("r1", vec![1], 1, 1, 1, None, ms(0));
        let f = c.abort("r1").unwrap();
        assert_eq!(f.reason, FreeReason::Aborted);
        let out = c.handle(
            "d",
            ToProducer::Heartbeat {
                request: "r1".into(),
                readers: None,
                grant: None,
            },
            ms(1),
        );
        assert!(
            matches!(
                &out[..],
                [ProducerAction::Send {
                    msg: ToConsumer::Refused {
                        kind: Some(Refusal::Aborted),
                        ..
                    },
                    ..
                }]
            ),
            "{out:?}"
        );
        assert!(c
            .handle(
                "d",
                ToProducer::Ack {
                    request: "r1".into(),
                    readers: None,
                    grant: None,
                },
                ms(2)
            )
            .is_empty());
    }

    #[test]
    fn check_load_places_a_head_slice_and_refuses_what_does_not_fit() {
        use crate::layout::{KvDtype, KvOrder, KvPacking};
        use crate::types::RegionId;
        let layout = |heads| {
            let g = KvGeometry {
                name: "t".into(),
                layers: 2,
                kv_heads: heads,
                head_dim: 8,
                dtype: KvDtype::Bf16,
            };
            KvLayout::contiguous(g, 4, 16, KvPacking::Fused, KvOrder::Hnd, RegionId(0))
        };
        // A producer rank of 2 heads, read into heads 2..4 of a 4-head consumer (TP 2 -> 1).
        let producer = layout(2);
        let h = Handoff {
            request: "r".into(),
            producer: "p".into(),
            side_channel: None,
            blocks: vec![1, 2],
            tokens: 8,
            compat: producer.compat_hash(),
            kv_heads: 2,
            num_blocks: 16,
            layers: producer.layers.clone(),
            mode: Mode::Pull,
            epoch: 7,
            grant: None,
            seal: None,
            groups: Vec::new(),
        };
        let local = layout(4);
        let m = |r: std::ops::Range<u64>, l: std::ops::Range<u64>| HeadMap {
            remote: r,
            local: l,
        };
        let remote = check_load(&local, Some(&m(0..2, 2..4)), &h, &[5, 6]).unwrap();
        assert_eq!(remote.geometry.kv_heads, 2);
        for bad in [m(0..2, 3..5), m(0..3, 1..4), m(0..1, 0..2), m(1..1, 1..1)] {
            let e = check_load(&local, Some(&bad), &h, &[5, 6]).unwrap_err();
            assert!(e.to_string().contains("into heads"), "{bad:?}: {e}");
        }
        // Paired descriptors of equal lengths, in NHD as in HND (a 2-head rank into half of a
        // 4-head cache: NHD splits both sides per token).
        for order in [KvOrder::Nhd, KvOrder::Hnd] {
            let (mut lo, mut re) = (local.clone(), remote.clone());
            lo.order = order;
            re.order = order;
            let (a, b) = load_descs(&lo, &re, &m(0..2, 2..4), &[5, 6], &[1, 2], 0..2).unwrap();
            assert_eq!(a.len(), b.len(), "{order:?}");
            assert!(a.iter().zip(&b).all(|(x, y)| x.len == y.len), "{order:?}");
            let per_block = if order == KvOrder::Nhd { 4 } else { 1 };
            assert_eq!(a.len(), 2 * 2 * per_block, "{order:?}");
        }
        // Every head into every head needs equal counts, unless nothing moves.
        assert!(check_load(&local, None, &h, &[5, 6]).is_err());
        assert!(check_load(&local, None, &h, &[]).is_ok());
        // Another layout (NHD here) is refused, naming this side's shape.
        let mut nhd = layout(4);
        nhd.order = KvOrder::Nhd;
        let e = check_load(&nhd, Some(&m(0..2, 0..2)), &h, &[5]).unwrap_err();
        assert!(e.to_string().contains("Nhd"), "{e}");
    }
}
