//! The connector's messages: the [`Handoff`] a producer gives the engine's router, and the
//! typed control messages producer and consumer exchange as kvxfer notifications (a 4-byte
//! tag, [`TAG_TO_PRODUCER`] or [`TAG_TO_CONSUMER`], then a JSON object whose `"t"` names the
//! kind). Each has a paired encoder and decoder; JSON keys are written in sorted order, as the
//! first release wrote them.

use std::net::SocketAddr;

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};
use crate::layout::LayerBase;
use crate::lifecycle::LeaseError;
use crate::types::RegionId;
use crate::wire::notify::{TAG_TO_CONSUMER, TAG_TO_PRODUCER};
use crate::wire::{hex, unhex};

/// Largest handoff accepted.
pub const MAX_HANDOFF: usize = 16 << 20;
/// Handoff format version.
pub const HANDOFF_VERSION: u64 = 1;
/// The version of a handoff of several cache groups ([`Handoff::groups`]): a reader that knows
/// only version 1 refuses it rather than load the first group alone.
pub const HANDOFF_VERSION_GROUPS: u64 = 2;

/// Bytes of a [`Grant`].
pub const GRANT_LEN: usize = 16;
/// Bytes of a seal (HMAC-SHA256).
pub const SEAL_LEN: usize = 32;

/// The capability of one published request: a consumer's lease calls must carry it
/// ([`crate::handoff_seal`] says why).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Grant(pub [u8; GRANT_LEN]);

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A grant is a bearer capability: logs never show it.
        f.write_str("Grant(..)")
    }
}

impl Grant {
    /// Lowercase hex, as the wire carries it.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses [`Grant::to_hex`]'s output.
    pub fn from_hex(s: &str) -> Option<Grant> {
        unhex::<GRANT_LEN>(s).map(Grant)
    }

    /// The key under which a request's cache group `g` is opened to a peer: the grant itself
    /// for group 0, a distinct one for each other group (a grant table keeps one opening per
    /// key; the request's groups are separate tensors). Revoking a request revokes each.
    pub fn for_group(&self, g: usize) -> Grant {
        let mut k = self.0;
        for (i, b) in (g as u64).to_le_bytes().iter().enumerate() {
            k[GRANT_LEN - 1 - i] ^= b;
        }
        Grant(k)
    }

    /// Whether `other` is this grant, in time independent of where they differ.
    pub fn matches(&self, other: &Grant) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// Who moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Mode {
    /// The consumer READs from the producer.
    Pull,
    /// The producer WRITEs into the consumer's blocks.
    Push,
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
    /// The producer's [`crate::layout::KvLayout::compat_hash`].
    pub compat: u64,
    /// The producer's KV heads.
    pub kv_heads: u64,
    /// Blocks per layer tensor on the producer.
    pub num_blocks: u64,
    /// The producer's per-layer tensors.
    pub layers: Vec<LayerBase>,
    /// Pull or push.
    pub mode: Mode,
    /// The producer agent's incarnation ([`crate::wire::metadata::Metadata::epoch`]; 0:
    /// unknown, as in handoffs written before it was carried). A consumer that finds another
    /// incarnation of the producer loaded knows at once the blocks are gone (a restart).
    pub epoch: u64,
    /// The request's capability: the producer serves lease calls that carry it (`None`: a
    /// handoff of a producer before grants, or one an engine wrote without them).
    pub grant: Option<Grant>,
    /// The producer's seal over every other field ([`crate::handoff_seal::HandoffKey`]);
    /// a consumer with a secret loads nothing without it.
    pub seal: Option<[u8; SEAL_LEN]>,
    /// The request's cache groups after the first ([`crate::groups`]; the fields above are
    /// the first's): empty for a cache of one group.
    pub groups: Vec<HandoffGroup>,
}

/// One cache group of a handoff: its blocks and the producer's layout of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HandoffGroup {
    /// The producer's blocks of this group, in token order ([`crate::groups::NO_BLOCK`]
    /// where it holds none).
    pub blocks: Vec<u32>,
    /// The producer's [`crate::layout::KvLayout::compat_hash`] of this group.
    pub compat: u64,
    /// The producer's KV heads in this group.
    pub kv_heads: u64,
    /// Blocks per layer tensor of this group on the producer.
    pub num_blocks: u64,
    /// The producer's per-layer tensors of this group.
    pub layers: Vec<LayerBase>,
}

impl Handoff {
    /// Cache groups: 1 and [`Handoff::groups`].
    pub fn group_count(&self) -> usize {
        1 + self.groups.len()
    }

    /// Group `g` (0: the handoff's own fields).
    pub fn group(&self, g: usize) -> Option<HandoffGroup> {
        if g == 0 {
            return Some(HandoffGroup {
                blocks: self.blocks.clone(),
                compat: self.compat,
                kv_heads: self.kv_heads,
                num_blocks: self.num_blocks,
                layers: self.layers.clone(),
            });
        }
        self.groups.get(g - 1).cloned()
    }

    /// The handoff as if the request had group `g` alone: what a check of one group's load
    /// takes.
    pub fn of_group(&self, g: usize) -> Option<Handoff> {
        let p = self.group(g)?;
        Some(Handoff {
            blocks: p.blocks,
            compat: p.compat,
            kv_heads: p.kv_heads,
            num_blocks: p.num_blocks,
            layers: p.layers,
            groups: Vec::new(),
            ..self.clone_head()
        })
    }

    /// Every field but the groups' (blocks and layers left empty).
    fn clone_head(&self) -> Handoff {
        Handoff {
            request: self.request.clone(),
            producer: self.producer.clone(),
            side_channel: self.side_channel,
            blocks: Vec::new(),
            tokens: self.tokens,
            compat: self.compat,
            kv_heads: self.kv_heads,
            num_blocks: self.num_blocks,
            layers: Vec::new(),
            mode: self.mode,
            epoch: self.epoch,
            grant: self.grant,
            seal: self.seal,
            groups: Vec::new(),
        }
    }
}

fn group_json(g: &HandoffGroup) -> Value {
    json!({
        "blocks": g.blocks,
        "compat": format!("{:016x}", g.compat),
        "kv_heads": g.kv_heads,
        "num_blocks": g.num_blocks,
        "layers": g.layers.iter().map(base_json).collect::<Vec<_>>(),
    })
}

fn group_from(v: &Value) -> Option<HandoffGroup> {
    Some(HandoffGroup {
        blocks: u32_list(&v["blocks"])?,
        compat: u64::from_str_radix(v["compat"].as_str()?, 16).ok()?,
        kv_heads: v["kv_heads"].as_u64()?,
        num_blocks: v["num_blocks"].as_u64()?,
        layers: bases_from(&v["layers"])?,
    })
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

fn bases_from(v: &Value) -> Option<Vec<LayerBase>> {
    v.as_array()?.iter().map(base_from).collect()
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
        let version = if self.groups.is_empty() {
            HANDOFF_VERSION
        } else {
            HANDOFF_VERSION_GROUPS
        };
        let mut v = json!({
            "v": version,
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
            "epoch": format!("{:016x}", self.epoch),
        });
        if let Value::Object(m) = &mut v {
            if let Some(g) = &self.grant {
                m.insert("grant".into(), g.to_hex().into());
            }
            if let Some(s) = &self.seal {
                m.insert("seal".into(), hex(s).into());
            }
            if !self.groups.is_empty() {
                let g: Vec<Value> = self.groups.iter().map(group_json).collect();
                m.insert("groups".into(), g.into());
            }
        }
        v.to_string().into_bytes()
    }

    /// Parses and checks [`Handoff::encode`]'s output.
    pub fn decode(b: &[u8]) -> Result<Handoff> {
        let bad = |why: &str| Error::InvalidArgument(format!("handoff: {why}"));
        if b.len() > MAX_HANDOFF {
            return Err(bad("larger than 16 MiB"));
        }
        let v: Value = serde_json::from_slice(b).map_err(|e| bad(&e.to_string()))?;
        let groups = match (&v["v"], &v["groups"]) {
            (n, Value::Null) if *n == HANDOFF_VERSION => Vec::new(),
            (n, Value::Array(gs)) if *n == HANDOFF_VERSION_GROUPS => {
                if gs.is_empty() || gs.len() >= crate::groups::MAX_GROUPS {
                    return Err(bad("groups: 1 to 63 after the first"));
                }
                gs.iter()
                    .map(group_from)
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("groups"))?
            }
            (n, _) if *n == HANDOFF_VERSION || *n == HANDOFF_VERSION_GROUPS => {
                return Err(bad("groups (version 2 has them, version 1 not)"))
            }
            _ => return Err(bad("unknown version")),
        };
        let s = |k: &str| v[k].as_str().map(str::to_string).ok_or_else(|| bad(k));
        let n = |k: &str| v[k].as_u64().ok_or_else(|| bad(k));
        let side_channel = match &v["side_channel"] {
            Value::Null => None,
            Value::String(a) => Some(a.parse().map_err(|_| bad("side_channel"))?),
            _ => return Err(bad("side_channel")),
        };
        let layers = bases_from(&v["layers"]).ok_or_else(|| bad("layers"))?;
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
            epoch: match &v["epoch"] {
                Value::Null => 0,
                Value::String(e) => u64::from_str_radix(e, 16).map_err(|_| bad("epoch"))?,
                _ => return Err(bad("epoch")),
            },
            grant: match &v["grant"] {
                Value::Null => None,
                Value::String(g) => Some(Grant::from_hex(g).ok_or_else(|| bad("grant"))?),
                _ => return Err(bad("grant")),
            },
            seal: match &v["seal"] {
                Value::Null => None,
                Value::String(s) => Some(unhex::<SEAL_LEN>(s).ok_or_else(|| bad("seal"))?),
                _ => return Err(bad("seal")),
            },
            groups,
        })
    }
}

/// A push consumer's blocks: where the producer WRITEs each layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushWant {
    /// The consumer's blocks, paired with the producer's last `blocks.len()`.
    pub blocks: Vec<u32>,
    /// Blocks per layer tensor on the consumer.
    pub num_blocks: u64,
    /// The consumer's per-layer tensors.
    pub layers: Vec<LayerBase>,
    /// The block size, in tokens, `blocks` and `num_blocks` count in (`"bt"`), where it is
    /// not the producer's: a consumer of another block size names its blocks in the smaller
    /// of the two sizes ([`crate::block_size`]). Absent, the producer's.
    pub block_tokens: Option<u64>,
    /// The same for each cache group after the first ([`crate::groups`]; each with no
    /// `more` of its own).
    pub more: Vec<PushWant>,
}

fn want_json(w: &PushWant) -> Value {
    let mut v = json!({
        "blocks": w.blocks,
        "nb": w.num_blocks,
        "layers": w.layers.iter().map(base_json).collect::<Vec<_>>(),
    });
    // Only where the sizes differ: a producer of the first release reads the rest as before.
    if let Some(bt) = w.block_tokens {
        v["bt"] = bt.into();
    }
    v
}

fn want_from(v: &Value) -> std::result::Result<PushWant, String> {
    Ok(PushWant {
        blocks: u32_list(&v["blocks"]).ok_or("want: blocks")?,
        num_blocks: v["nb"].as_u64().ok_or("want: nb")?,
        layers: bases_from(&v["layers"]).ok_or("want: layers")?,
        block_tokens: match &v["bt"] {
            Value::Null => None,
            bt => Some(bt.as_u64().ok_or("want: bt")?),
        },
        more: Vec::new(),
    })
}

/// Messages to a producer. Each may carry `readers` (`"n"`): how many consumer ranks will
/// read the request, as the consumer's tensor-parallel plan counts them
/// ([`crate::tp::plan`]). Absent, the producer keeps the count it published with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToProducer {
    /// "Still reading `request`": renews the reader's lease (`hb`).
    Heartbeat {
        /// The request.
        request: String,
        /// Readers the consumer declares.
        readers: Option<u32>,
        /// The handoff's grant ([`Handoff::grant`]): a producer that granted the request
        /// answers only calls that carry it (`"g"`).
        grant: Option<Grant>,
    },
    /// A push consumer's first message, repeated until a lease comes back: its blocks
    /// (`want`). Renews the lease as a heartbeat does.
    Want {
        /// The request.
        request: String,
        /// Where to write.
        want: PushWant,
        /// Readers the consumer declares.
        readers: Option<u32>,
        /// The handoff's grant ([`Handoff::grant`]): a producer that granted the request
        /// answers only calls that carry it (`"g"`).
        grant: Option<Grant>,
    },
    /// "Done with `request`'s blocks" (`ack`): the last reader's frees them.
    Ack {
        /// The request.
        request: String,
        /// Readers the consumer declares.
        readers: Option<u32>,
        /// The handoff's grant ([`Handoff::grant`]): a producer that granted the request
        /// answers only calls that carry it (`"g"`).
        grant: Option<Grant>,
    },
}

/// Why a producer refused a consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The producer holds no such request (maybe not published yet).
    Unknown,
    /// The lease ran out and the blocks were freed.
    Expired,
    /// The producer aborted the request.
    Aborted,
    /// More readers than the request was published for.
    Readers,
    /// The call did not carry the request's grant.
    Grant,
    /// The reader already holds its share of the producer's cache.
    Share,
}

impl Refusal {
    /// The refusal a lease error means.
    pub fn of(e: &LeaseError) -> Refusal {
        match e {
            LeaseError::Unknown(_) => Refusal::Unknown,
            LeaseError::Expired(_) => Refusal::Expired,
            LeaseError::Aborted(_) => Refusal::Aborted,
            LeaseError::TooManyReaders { .. }
            | LeaseError::ReadersMismatch { .. }
            | LeaseError::TooManyDeclared { .. } => Refusal::Readers,
            LeaseError::NotGranted { .. } => Refusal::Grant,
            LeaseError::PeerShare { .. } => Refusal::Share,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Refusal::Unknown => "unknown",
            Refusal::Expired => "expired",
            Refusal::Aborted => "aborted",
            Refusal::Readers => "readers",
            Refusal::Grant => "grant",
            Refusal::Share => "share",
        }
    }

    fn parse(s: &str) -> Option<Refusal> {
        [
            Refusal::Unknown,
            Refusal::Expired,
            Refusal::Aborted,
            Refusal::Readers,
            Refusal::Grant,
            Refusal::Share,
        ]
        .into_iter()
        .find(|r| r.name() == s)
    }
}

/// Messages to a consumer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToConsumer {
    /// The reader's lease: valid `ms` from now; `ready` layers are computed (`lease`).
    Lease {
        /// The request.
        request: String,
        /// Milliseconds left.
        ms: u64,
        /// Layers computed, from layer 0.
        ready: usize,
    },
    /// More layers are computed (`ready`).
    Ready {
        /// The request.
        request: String,
        /// Layers computed, from layer 0.
        ready: usize,
    },
    /// Push: layer `layer` has landed in the consumer's blocks (`layer`; sent as the
    /// notification of that layer's WRITE, so it arrives after the data).
    Layer {
        /// The request.
        request: String,
        /// The layer.
        layer: usize,
    },
    /// The producer will not serve the request (`refused`).
    Refused {
        /// The request.
        request: String,
        /// Why, where it is a lease matter (none: the push request itself was refused).
        kind: Option<Refusal>,
        /// The producer's words.
        why: String,
    },
}

impl ToProducer {
    /// The request the message is about.
    pub fn request(&self) -> &str {
        match self {
            ToProducer::Heartbeat { request, .. }
            | ToProducer::Want { request, .. }
            | ToProducer::Ack { request, .. } => request,
        }
    }

    /// The readers the consumer declares, if it does.
    pub fn readers(&self) -> Option<u32> {
        match self {
            ToProducer::Heartbeat { readers, .. }
            | ToProducer::Want { readers, .. }
            | ToProducer::Ack { readers, .. } => *readers,
        }
    }

    /// The grant the consumer presents, if it does.
    pub fn grant(&self) -> Option<&Grant> {
        match self {
            ToProducer::Heartbeat { grant, .. }
            | ToProducer::Want { grant, .. }
            | ToProducer::Ack { grant, .. } => grant.as_ref(),
        }
    }

    /// The notification payload: tag and JSON.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = match self {
            ToProducer::Heartbeat { request, .. } => json!({"t": "hb", "r": request}),
            ToProducer::Ack { request, .. } => json!({"t": "ack", "r": request}),
            ToProducer::Want { request, want, .. } => {
                let mut v = want_json(want);
                v["t"] = "want".into();
                v["r"] = request.as_str().into();
                if !want.more.is_empty() {
                    v["more"] = want.more.iter().map(want_json).collect::<Vec<_>>().into();
                }
                v
            }
        };
        if let Value::Object(m) = &mut v {
            if let Some(n) = self.readers() {
                m.insert("n".into(), n.into());
            }
            if let Some(g) = self.grant() {
                m.insert("g".into(), g.to_hex().into());
            }
        }
        tagged(TAG_TO_PRODUCER, &v)
    }

    /// Parses a notification payload; `Err` says what is malformed.
    pub fn decode(payload: &[u8]) -> std::result::Result<ToProducer, String> {
        let (kind, request, v) = untag(TAG_TO_PRODUCER, payload)?;
        let readers = match &v["n"] {
            Value::Null => None,
            n => Some(
                n.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or(format!("{kind}: readers"))?,
            ),
        };
        let grant = match &v["g"] {
            Value::Null => None,
            g => Some(
                g.as_str()
                    .and_then(Grant::from_hex)
                    .ok_or(format!("{kind}: grant"))?,
            ),
        };
        match kind.as_str() {
            "hb" => Ok(ToProducer::Heartbeat {
                request,
                readers,
                grant,
            }),
            "ack" => Ok(ToProducer::Ack {
                request,
                readers,
                grant,
            }),
            "want" => {
                let mut want = want_from(&v)?;
                want.more = match &v["more"] {
                    Value::Null => Vec::new(),
                    Value::Array(gs) if gs.len() < crate::groups::MAX_GROUPS => gs
                        .iter()
                        .map(want_from)
                        .collect::<std::result::Result<_, _>>()?,
                    _ => return Err("want: more".into()),
                };
                Ok(ToProducer::Want {
                    request,
                    want,
                    readers,
                    grant,
                })
            }
            other => Err(format!("unknown message {other:?} to a producer")),
        }
    }
}

impl ToConsumer {
    /// The request the message is about.
    pub fn request(&self) -> &str {
        match self {
            ToConsumer::Lease { request, .. }
            | ToConsumer::Ready { request, .. }
            | ToConsumer::Layer { request, .. }
            | ToConsumer::Refused { request, .. } => request,
        }
    }

    /// The notification payload: tag and JSON.
    pub fn encode(&self) -> Vec<u8> {
        let v = match self {
            ToConsumer::Lease { request, ms, ready } => {
                json!({"t": "lease", "r": request, "ms": ms, "n": ready})
            }
            ToConsumer::Ready { request, ready } => json!({"t": "ready", "r": request, "n": ready}),
            ToConsumer::Layer { request, layer } => json!({"t": "layer", "r": request, "l": layer}),
            ToConsumer::Refused { request, kind, why } => {
                let mut m = Map::new();
                m.insert("t".into(), "refused".into());
                m.insert("r".into(), request.as_str().into());
                if let Some(k) = kind {
                    m.insert("kind".into(), k.name().into());
                }
                m.insert("why".into(), why.as_str().into());
                Value::Object(m)
            }
        };
        tagged(TAG_TO_CONSUMER, &v)
    }

    /// Parses a notification payload; `Err` says what is malformed.
    pub fn decode(payload: &[u8]) -> std::result::Result<ToConsumer, String> {
        let (kind, request, v) = untag(TAG_TO_CONSUMER, payload)?;
        let count = |k: &str| {
            v[k].as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or(format!("{kind}: {k}"))
        };
        match kind.as_str() {
            "lease" => Ok(ToConsumer::Lease {
                request,
                ms: v["ms"].as_u64().ok_or("lease: ms")?,
                ready: count("n")?,
            }),
            "ready" => Ok(ToConsumer::Ready {
                request,
                ready: count("n")?,
            }),
            "layer" => Ok(ToConsumer::Layer {
                request,
                layer: count("l")?,
            }),
            "refused" => Ok(ToConsumer::Refused {
                request,
                kind: match &v["kind"] {
                    Value::Null => None,
                    Value::String(s) => Some(Refusal::parse(s).ok_or("refused: kind")?),
                    _ => return Err("refused: kind".into()),
                },
                why: v["why"].as_str().unwrap_or("refused").to_string(),
            }),
            other => Err(format!("unknown message {other:?} to a consumer")),
        }
    }
}

fn tagged(tag: &[u8; 4], v: &Value) -> Vec<u8> {
    let mut b = tag.to_vec();
    b.extend_from_slice(v.to_string().as_bytes());
    b
}

/// The kind, the request and the object of a tagged message.
fn untag(tag: &[u8; 4], payload: &[u8]) -> std::result::Result<(String, String, Value), String> {
    let body = payload.strip_prefix(tag).ok_or("wrong tag")?;
    let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let kind = v["t"].as_str().ok_or("no message kind")?.to_string();
    let request = v["r"].as_str().ok_or("no request")?.to_string();
    Ok((kind, request, v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bases() -> impl Strategy<Value = Vec<LayerBase>> {
        proptest::collection::vec(
            (
                any::<u32>(),
                any::<u64>(),
                proptest::option::of((any::<u32>(), any::<u64>())),
            ),
            0..4,
        )
        .prop_map(|v| {
            v.into_iter()
                .map(|(k, ko, vv)| LayerBase {
                    k: (RegionId(k), ko),
                    v: vv.map(|(r, o)| (RegionId(r), o)),
                })
                .collect()
        })
    }

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
            epoch: 0x1234_5678_9abc_def0,
            grant: Some(Grant([0x5a; GRANT_LEN])),
            seal: Some([0xc3; SEAL_LEN]),
            groups: Vec::new(),
        };
        assert_eq!(Handoff::decode(&h.encode()).unwrap(), h);
        // A handoff of the first format (no epoch) decodes as epoch 0: unknown.
        let mut old: Value = serde_json::from_slice(&h.encode()).unwrap();
        old.as_object_mut().unwrap().remove("epoch");
        let old = Handoff::decode(old.to_string().as_bytes()).unwrap();
        assert_eq!(
            old,
            Handoff {
                epoch: 0,
                ..h.clone()
            }
        );
        let mut bad: Value = serde_json::from_slice(&h.encode()).unwrap();
        bad["epoch"] = json!("not hex");
        assert!(Handoff::decode(bad.to_string().as_bytes()).is_err());
        assert!(Handoff::decode(b"{").is_err());
        assert!(Handoff::decode(b"{\"v\":2}").is_err());
        let mut j: Value = serde_json::from_slice(&h.encode()).unwrap();
        j["blocks"] = json!([1, -1]);
        assert!(Handoff::decode(j.to_string().as_bytes()).is_err());
        j["blocks"] = json!([1, 5_000_000_000u64]);
        assert!(Handoff::decode(j.to_string().as_bytes()).is_err());
        // Without grant and seal (a producer before them): both absent.
        let mut j: Value = serde_json::from_slice(&h.encode()).unwrap();
        j.as_object_mut().unwrap().remove("grant");
        j.as_object_mut().unwrap().remove("seal");
        let plain = Handoff::decode(j.to_string().as_bytes()).unwrap();
        assert_eq!((plain.grant, plain.seal), (None, None));
        for (k, v) in [
            ("grant", json!("abc")),
            ("grant", json!(5)),
            ("seal", json!("00")),
            ("seal", json!(["x"])),
        ] {
            let mut j: Value = serde_json::from_slice(&h.encode()).unwrap();
            j[k] = v;
            assert!(Handoff::decode(j.to_string().as_bytes()).is_err(), "{k}");
        }
    }

    /// A handoff of several cache groups is version 2 and names every group; a version 1
    /// reader refuses it, and neither version is taken with the other's groups.
    #[test]
    fn a_handoff_of_groups_roundtrips_and_is_refused_where_it_does_not_fit() {
        let one = Handoff::decode(
            br#"{"v":1,"request":"r","producer":"p","side_channel":null,"blocks":[1,2],
            "tokens":20,"compat":"00000000000000aa","kv_heads":2,"num_blocks":8,
            "layers":[[0,0]],"mode":"pull"}"#,
        )
        .unwrap();
        let mut h = one.clone();
        h.groups.push(HandoffGroup {
            blocks: vec![crate::groups::NO_BLOCK, 7],
            compat: 0xbb,
            kv_heads: 1,
            num_blocks: 4,
            layers: vec![LayerBase {
                k: (RegionId(3), 64),
                v: None,
            }],
        });
        let b = h.encode();
        let j: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(j["v"], 2);
        assert_eq!(Handoff::decode(&b).unwrap(), h);
        assert_eq!(h.group_count(), 2);
        let g1 = h.of_group(1).unwrap();
        assert_eq!(
            (g1.blocks, g1.compat, g1.groups.len()),
            (vec![u32::MAX, 7], 0xbb, 0)
        );
        assert_eq!(h.of_group(0).unwrap(), one);
        assert!(h.group(2).is_none());
        for (what, edit) in [
            ("v1 with groups", json!({"v": 1})),
            ("v2 without groups", json!({"groups": null})),
            ("empty groups", json!({"groups": []})),
            (
                "a group without blocks",
                json!({"groups": [{"compat": "1"}]}),
            ),
        ] {
            let mut j = j.clone();
            for (k, v) in edit.as_object().unwrap() {
                j[k] = v.clone();
            }
            assert!(Handoff::decode(j.to_string().as_bytes()).is_err(), "{what}");
        }
        let mut many = j.clone();
        many["groups"] = Value::Array(vec![j["groups"][0].clone(); crate::groups::MAX_GROUPS]);
        assert!(Handoff::decode(many.to_string().as_bytes()).is_err());
        // A push consumer's blocks of every group.
        let want = PushWant {
            blocks: vec![1],
            num_blocks: 8,
            layers: Vec::new(),
            block_tokens: None,
            more: vec![PushWant {
                blocks: vec![2, 3],
                num_blocks: 4,
                layers: Vec::new(),
                block_tokens: Some(8),
                more: Vec::new(),
            }],
        };
        let m = ToProducer::Want {
            request: "r".into(),
            want,
            readers: None,
            grant: None,
        };
        assert_eq!(ToProducer::decode(&m.encode()).unwrap(), m);
        // A block size that is not a number is refused, not read as absent.
        let mut j: Value = serde_json::from_slice(&m.encode()[4..]).unwrap();
        j["bt"] = "16".into();
        let mut bytes = m.encode()[..4].to_vec();
        bytes.extend_from_slice(j.to_string().as_bytes());
        assert_eq!(
            ToProducer::decode(&bytes),
            Err("want: bt".to_string()),
            "{j}"
        );
    }

    #[test]
    fn the_bytes_are_the_first_release_s() {
        // What the untyped encoder of the first release put on the wire.
        let hb = ToProducer::Heartbeat {
            request: "r1".into(),
            readers: None,
            grant: None,
        };
        assert_eq!(hb.encode(), b"KXCP{\"r\":\"r1\",\"t\":\"hb\"}");
        // A declared reader count is one more key; decoders of the first release ignore it.
        let hb = ToProducer::Heartbeat {
            request: "r1".into(),
            readers: Some(2),
            grant: None,
        };
        assert_eq!(hb.encode(), b"KXCP{\"n\":2,\"r\":\"r1\",\"t\":\"hb\"}");
        let lease = ToConsumer::Lease {
            request: "r1".into(),
            ms: 250,
            ready: 3,
        };
        assert_eq!(
            lease.encode(),
            b"KXCC{\"ms\":250,\"n\":3,\"r\":\"r1\",\"t\":\"lease\"}"
        );
        let refused = ToConsumer::Refused {
            request: "r1".into(),
            kind: Some(Refusal::Expired),
            why: "w".into(),
        };
        assert_eq!(
            refused.encode(),
            b"KXCC{\"kind\":\"expired\",\"r\":\"r1\",\"t\":\"refused\",\"why\":\"w\"}"
        );
    }

    #[test]
    fn foreign_and_malformed_messages_are_errors() {
        assert!(ToProducer::decode(b"KXCC{\"t\":\"hb\",\"r\":\"x\"}").is_err());
        assert!(ToProducer::decode(b"KXCP{\"t\":\"lease\",\"r\":\"x\"}").is_err());
        assert!(ToProducer::decode(b"KXCP{\"t\":\"hb\"}").is_err());
        assert!(ToProducer::decode(b"KXCP{\"t\":\"hb\",\"r\":\"x\",\"n\":0}").is_err());
        assert!(ToProducer::decode(b"KXCP{\"t\":\"ack\",\"r\":\"x\",\"n\":\"2\"}").is_err());
        assert!(ToProducer::decode(b"KXCP{\"t\":\"want\",\"r\":\"x\",\"blocks\":[-1]}").is_err());
        assert!(ToProducer::decode(b"KXCP{\"t\":\"ack\",\"r\":\"x\",\"g\":\"0a\"}").is_err());
        assert!(ToProducer::decode(b"KXCP{\"t\":\"hb\",\"r\":\"x\",\"g\":7}").is_err());
        assert!(ToConsumer::decode(b"KXCC{\"t\":\"lease\",\"r\":\"x\"}").is_err());
        assert!(
            ToConsumer::decode(b"KXCC{\"t\":\"refused\",\"r\":\"x\",\"kind\":\"odd\"}").is_err()
        );
        assert!(ToConsumer::decode(b"KXCC[").is_err());
    }

    proptest! {
        #[test]
        fn to_producer_roundtrip(request in ".{1,16}", kind in 0..3u8,
                                 blocks in proptest::collection::vec(any::<u32>(), 0..8),
                                 num_blocks in any::<u64>(), layers in bases(),
                                 block_tokens in proptest::option::of(any::<u64>()),
                                 readers in proptest::option::of(1u32..),
                                 grant in proptest::option::of(any::<[u8; 16]>())) {
            let grant = grant.map(Grant);
            let m = match kind {
                0 => ToProducer::Heartbeat { request, readers, grant },
                1 => ToProducer::Ack { request, readers, grant },
                _ => ToProducer::Want {
                    request, want: PushWant { blocks, num_blocks, layers, block_tokens, more: Vec::new() },
                    readers, grant,
                },
            };
            prop_assert_eq!(ToProducer::decode(&m.encode()), Ok(m));
        }

        #[test]
        fn to_consumer_roundtrip(request in ".{1,16}", kind in 0..6u8, n in any::<u32>(),
                                 ms in any::<u64>(), why in ".{0,16}") {
            let n = n as usize;
            let m = match kind {
                0 => ToConsumer::Lease { request, ms, ready: n },
                1 => ToConsumer::Ready { request, ready: n },
                2 => ToConsumer::Layer { request, layer: n },
                3 => ToConsumer::Refused { request, kind: None, why },
                4 => ToConsumer::Refused { request, kind: Some(Refusal::Readers), why },
                _ => ToConsumer::Refused { request, kind: Some(Refusal::Grant), why },
            };
            prop_assert_eq!(ToConsumer::decode(&m.encode()), Ok(m));
        }

        #[test]
        fn decoders_never_panic(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ToProducer::decode(&b);
            let _ = ToConsumer::decode(&b);
            let _ = Handoff::decode(&b);
        }
    }

    #[test]
    fn hex_round_trips_and_refuses_what_is_not_hex() {
        let g = Grant([0xab; GRANT_LEN]);
        assert_eq!(Grant::from_hex(&g.to_hex()), Some(g));
        assert_eq!(Grant::from_hex(&g.to_hex().to_uppercase()), Some(g));
        assert_eq!(Grant::from_hex("ab"), None);
        assert_eq!(Grant::from_hex(&"zz".repeat(GRANT_LEN)), None);
        assert_eq!(Grant::from_hex(&"é".repeat(GRANT_LEN)), None);
        assert!(g.matches(&g) && !g.matches(&Grant([0; GRANT_LEN])));
        assert_eq!(format!("{g:?}"), "Grant(..)");
    }
}
