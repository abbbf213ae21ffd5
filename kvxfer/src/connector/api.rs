//! The engine-facing interface: what a prefill worker and a decode worker call, as traits an
//! engine binds to (and mocks in its own tests), with kvxfer's implementations behind them.
//!
//! Shaped after what engines do at the handoff, not after kvxfer's internals:
//!
//! | engine | vLLM `KVConnectorBase_V1` | SGLang disaggregation | trait call |
//! |---|---|---|---|
//! | worker start | `register_kv_caches` | `KVManager` with `kv_data_ptrs` | [`KvConnector::producer`] / [`KvConnector::consumer`] with [`KvCaches`] |
//! | prefill ends, or starts for layer-wise | `request_finished` → `kv_transfer_params` | `KVSender.init` | [`KvProducer::publish`] → [`Handoff`] |
//! | a layer computed | `save_kv_layer` | (per-layer send) | [`KvProducer::layer_done`] |
//! | request cancelled | `request_finished` (no transfer) | `KVSender.failure_exception` | [`KvProducer::abort`] |
//! | blocks may be freed | `get_finished` (sending) | `KVPoll.Success` on the sender | [`KvProducer::next_freed`] |
//! | decode admits the request | `start_load_kv` | `KVReceiver.init` + `send_metadata` | [`KvConsumer::start_load`] |
//! | attention of a layer | `wait_for_layer_load` | (whole request) | [`KvConsumer::wait_layer`], [`KvConsumer::wait`] |
//! | load outcome | `get_finished` (receiving), `get_block_ids_with_load_errors` | `KVPoll.Success` / `Failed` | [`KvConsumer::next_finished`], [`KvConsumer::next_failed`] |
//!
//! Everything here is object-safe (`Box<dyn KvConnector>`, `Box<dyn KvProducer>`,
//! `Box<dyn KvConsumer>`), errors are kvxfer's typed [`Error`], and no engine type leaks in:
//! caches are memory plus a [`KvLayout`]-shaped description, requests are strings, blocks are
//! `u32` indices into the engine's own paged cache.

use std::fmt::Debug;
use std::time::Duration;

use crate::telemetry::{RequestStats, Telemetry};
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::layout::{KvGeometry, KvLayout, KvOrder, KvPacking, LayerBase};
use kvxfer_proto::lifecycle::Freed;
use kvxfer_proto::tp::{HeadMap, TpRead};
use kvxfer_proto::types::{MemKind, RegionId};
use kvxfer_proto::wire::connector::Grant;
use kvxfer_proto::wire::connector::Handoff;

use super::config::ConnectorConfig;

/// One tensor of an engine's KV cache: memory the engine owns (host or device), `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheTensor {
    addr: usize,
    len: usize,
    kind: MemKind,
}

impl CacheTensor {
    /// A tensor at `ptr`, `len` bytes of memory of kind `kind`.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` is memory of kind `kind`, valid for reads and writes by this process
    /// and by peers' transfers, and not freed or remapped while any producer or consumer built
    /// from a [`KvCaches`] naming it lives. Blocks the engine hands to a producer or a consumer
    /// are not written by the engine until the connector gives them back (freed, loaded or
    /// failed).
    pub unsafe fn new(ptr: *mut u8, len: usize, kind: MemKind) -> CacheTensor {
        CacheTensor {
            addr: ptr as usize,
            len,
            kind,
        }
    }

    /// Its address.
    pub fn ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Host or device memory.
    pub fn kind(&self) -> MemKind {
        self.kind
    }
}

/// One layer's tensors: K and V, or one fused tensor holding both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerTensors {
    /// K (or K and V, for a fused layout).
    pub k: CacheTensor,
    /// V, for a separate layout.
    pub v: Option<CacheTensor>,
}

/// An engine's paged KV cache as it registers it: the shape of every layer's tensors and
/// where they are. Each tensor starts at block 0 and holds `num_blocks` blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvCaches {
    /// Model geometry (layers, heads, head size, dtype).
    pub geometry: KvGeometry,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Blocks per tensor.
    pub num_blocks: u64,
    /// K and V fused in one tensor per layer, or separate.
    pub packing: KvPacking,
    /// Token-major (NHD) or head-major (HND) inside a block.
    pub order: KvOrder,
    /// Per layer, its tensors.
    pub layers: Vec<LayerTensors>,
    /// The page of a [`KvPacking::State`] cache (recurrent state: `geometry.kv_heads` counts
    /// its split units per rank); `None` for attention and MLA caches.
    pub state: Option<kvxfer_proto::state::StateShape>,
    /// Bytes after each block of each tensor, per KV head ([`KvLayout::pad_per_head`]:
    /// vLLM's padded attention pages in a hybrid model); 0 for compact blocks.
    pub pad_per_head: u64,
}

impl KvCaches {
    /// The layout of these caches with each tensor's `(region, offset)` given by `base`.
    pub fn layout(&self, mut base: impl FnMut(&CacheTensor) -> (RegionId, u64)) -> KvLayout {
        KvLayout {
            geometry: self.geometry.clone(),
            block_tokens: self.block_tokens,
            num_blocks: self.num_blocks,
            packing: self.packing,
            order: self.order,
            layers: self
                .layers
                .iter()
                .map(|l| LayerBase {
                    k: base(&l.k),
                    v: l.v.as_ref().map(&mut base),
                })
                .collect(),
            state: self.state.clone(),
            pad_per_head: self.pad_per_head,
        }
    }

    /// Every tensor, K before V, layer by layer.
    pub fn tensors(&self) -> impl Iterator<Item = &CacheTensor> {
        self.layers
            .iter()
            .flat_map(|l| std::iter::once(&l.k).chain(l.v.as_ref()))
    }

    /// Checks the description against itself: a layer count that matches the geometry, the
    /// packing that matches the tensors given, every tensor at least as large as its blocks.
    pub fn validate(&self) -> Result<()> {
        let bad = |w: String| Err(Error::InvalidArgument(format!("KV caches: {w}")));
        if self.layers.is_empty() || self.layers.len() as u64 != self.geometry.layers {
            return bad(format!(
                "{} layers of tensors for a geometry of {} layers",
                self.layers.len(),
                self.geometry.layers
            ));
        }
        if self.block_tokens == 0 || self.num_blocks == 0 {
            return bad("zero tokens per block or zero blocks".into());
        }
        let probe = self.layout(|_| (RegionId(0), 0));
        probe
            .check_packing()
            .map_err(|e| Error::InvalidArgument(format!("KV caches: {e}")))?;
        let need = probe.tensor_bytes();
        for (i, l) in self.layers.iter().enumerate() {
            if l.v.is_some() != (self.packing == KvPacking::Separate) {
                return bad(format!(
                    "layer {i}: a {:?} layout with{} a V tensor",
                    self.packing,
                    if l.v.is_some() { "" } else { "out" }
                ));
            }
            for t in std::iter::once(&l.k).chain(l.v.as_ref()) {
                if (t.len as u64) < need || t.addr == 0 {
                    return bad(format!(
                        "layer {i}: a tensor of {} bytes at {:#x}, {need} needed",
                        t.len, t.addr
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Where a connector implementation is made: it registers an engine's caches and returns the
/// prefill side or the decode side over them. kvxfer's own are
/// [`AgentConnector`](super::AgentConnector) (an [`Agent`](crate::Agent): UCX and kvxfer's
/// lanes, across processes and hosts) and [`InProcessConnector`](super::InProcessConnector)
/// (memcpy between caches of one process, no network).
pub trait KvConnector: Send + Sync + Debug {
    /// Registers `caches` and returns the prefill side over them.
    fn producer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvProducer>> {
        self.producer_groups(std::slice::from_ref(caches), cfg)
    }

    /// Registers `caches` and returns the decode side over them.
    fn consumer(&self, caches: &KvCaches, cfg: &ConnectorConfig) -> Result<Box<dyn KvConsumer>> {
        self.consumer_groups(std::slice::from_ref(caches), cfg)
    }

    /// [`KvConnector::producer`] for a cache of several groups (vLLM's KV cache groups: a
    /// sliding-window group beside a full-attention one, a hybrid model's state): one
    /// [`KvCaches`] each, in the engine's order. Groups may share tensors (vLLM's hybrid
    /// allocator lays one group's layer over another's memory); each has its own block ids.
    fn producer_groups(
        &self,
        groups: &[KvCaches],
        cfg: &ConnectorConfig,
    ) -> Result<Box<dyn KvProducer>>;

    /// [`KvConnector::consumer`] for a cache of several groups.
    fn consumer_groups(
        &self,
        groups: &[KvCaches],
        cfg: &ConnectorConfig,
    ) -> Result<Box<dyn KvConsumer>>;
}

/// The prefill side: holds published requests' blocks for consumers until each is freed.
pub trait KvProducer: Send + Sync + Debug {
    /// Holds `blocks` of `request` for consumers and returns the handoff to give them.
    /// `tokens`: the prompt's length. `layers_done`: layers (from layer 0) already computed:
    /// all of them when prefill finished, 0 to hand over layer by layer with
    /// [`KvProducer::layer_done`].
    fn publish(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
    ) -> Result<Handoff> {
        self.publish_groups(request, &[blocks], tokens, layers_done, None)
    }

    /// [`KvProducer::publish`] under `grant`, chosen by the caller: for an engine whose
    /// scheduler writes the handoff its clients see and puts the same grant into it.
    fn publish_granted(
        &self,
        request: &str,
        blocks: &[u32],
        tokens: u64,
        layers_done: usize,
        grant: Grant,
    ) -> Result<Handoff> {
        self.publish_groups(request, &[blocks], tokens, layers_done, Some(grant))
    }

    /// [`KvProducer::publish`] for a cache of several groups: `blocks[g]` are group `g`'s
    /// ([`NO_BLOCK`](kvxfer_proto::groups::NO_BLOCK) where it holds none: a sliding
    /// window's blocks before the window, vLLM's null block); layers are numbered across
    /// groups, group 0's first. Under `grant`, or a fresh one when `None`.
    fn publish_groups(
        &self,
        request: &str,
        blocks: &[&[u32]],
        tokens: u64,
        layers_done: usize,
        grant: Option<Grant>,
    ) -> Result<Handoff>;

    /// Layer `layer` of `request` is computed: consumers may take it now.
    fn layer_done(&self, request: &str, layer: usize) -> Result<()>;

    /// Gives `request` up: its blocks are freed now (reported by
    /// [`KvProducer::next_freed`]); consumers that ask get a typed refusal.
    fn abort(&self, request: &str);

    /// The oldest request whose blocks the engine may reuse now (every reader acknowledged,
    /// aborted, or lease expired), waiting up to `timeout` for one.
    fn next_freed(&self, timeout: Duration) -> Option<Freed>;

    /// Waits up to `timeout` until `request`'s blocks are freed; returns how.
    fn wait_freed(&self, request: &str, timeout: Duration) -> Result<Freed>;

    /// Requests held now.
    fn held(&self) -> usize;

    /// Aggregate figures (push mode records per-request figures here).
    fn telemetry(&self) -> &Telemetry;
}

/// A load that failed, and the local blocks that do not hold valid KV because of it.
#[derive(Debug)]
pub struct LoadFailure {
    /// The request.
    pub request: String,
    /// Why.
    pub error: Error,
    /// Local blocks whose content is invalid (the ones that were to be loaded; blocks of a
    /// cached prefix stay valid), every group's.
    pub invalid_blocks: Vec<u32>,
    /// The same per cache group (one list for a cache of one group).
    pub invalid_groups: Vec<Vec<u32>>,
}

/// How one load moves its blocks, beyond which blocks: the heads (tensor parallelism) and the
/// readers the consumer's side declares. The default moves what the consumer's
/// [`ConnectorConfig::heads`] says (every head, unless set) into every local head.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadSpec {
    /// The producer's heads to read and the local heads they go to; `None`: the config's.
    pub heads: Option<HeadMap>,
    /// Consumer ranks that read this request from this producer, declared to it (it frees the
    /// blocks after that many acknowledgements); `None`: the count the producer published.
    pub readers: Option<u32>,
}

impl LoadSpec {
    /// The load a tensor-parallel plan ([`kvxfer_proto::tp::plan`]) asks for from one
    /// producer rank. A read with no heads moves nothing (empty head ranges): load it with no
    /// local blocks; it acknowledges and counts nothing as moved or skipped.
    pub fn from_tp(read: &TpRead) -> LoadSpec {
        LoadSpec {
            heads: Some(read.heads.clone().unwrap_or(HeadMap {
                remote: 0..0,
                local: 0..0,
            })),
            readers: u32::try_from(read.readers).ok(),
        }
    }
}

/// The decode side: loads handoffs into the engine's blocks.
pub trait KvConsumer: Send + Sync + Debug {
    /// Starts loading `handoff` into `local_blocks`. `local_blocks` pairs with the *last*
    /// `local_blocks.len()` of the producer's blocks: the consumer already holds the blocks
    /// before them (a cached prefix) and only these move; all of them to load everything.
    /// Empty: nothing moves, the producer is only told it may free its blocks. Waits for
    /// budget (backpressure) up to the config's `budget_wait`.
    fn start_load(&self, handoff: &Handoff, local_blocks: &[u32]) -> Result<()> {
        self.start_load_with(handoff, local_blocks, &LoadSpec::default())
    }

    /// [`KvConsumer::start_load`] with the heads and readers of `spec`: a decode rank of
    /// another tensor-parallel size than the prefill side makes one such load per producer
    /// rank its plan names, each with its own handoff (the request as that rank published it).
    /// Head slices need [`Mode::Pull`](super::Mode::Pull): a push producer writes whole blocks.
    fn start_load_with(
        &self,
        handoff: &Handoff,
        local_blocks: &[u32],
        spec: &LoadSpec,
    ) -> Result<()> {
        self.start_load_groups(handoff, &[local_blocks], spec)
    }

    /// [`KvConsumer::start_load_with`] for a cache of several groups: `local_blocks[g]`
    /// pairs with the last `local_blocks[g].len()` of the handoff's group `g`, each group
    /// with its own cached prefix; a pair with
    /// [`NO_BLOCK`](kvxfer_proto::groups::NO_BLOCK) on either side moves nothing (a sliding
    /// window's blocks outside it). A latent (MLA) group reads whole whatever `spec`'s heads.
    fn start_load_groups(
        &self,
        handoff: &Handoff,
        local_blocks: &[&[u32]],
        spec: &LoadSpec,
    ) -> Result<()>;

    /// Waits until layer `layer` of `request` is in local memory.
    fn wait_layer(&self, request: &str, layer: usize, timeout: Duration) -> Result<()>;

    /// Waits until `request` is loaded completely.
    fn wait(&self, request: &str, timeout: Duration) -> Result<()>;

    /// The oldest load that completed and was not taken yet, with its figures.
    fn next_finished(&self) -> Option<RequestStats>;

    /// The oldest load that failed and was not taken yet, with the local blocks it left
    /// invalid.
    fn next_failed(&self) -> Option<LoadFailure>;

    /// Loads in progress.
    fn in_progress(&self) -> usize;

    /// Aggregate figures.
    fn telemetry(&self) -> &Telemetry;
}

/// The error of a failed load of `request`, from why it failed: a reason that already names
/// the request (the lifecycle's own words) is not wrapped in a second mention of it.
pub(crate) fn load_failed(request: &str, why: String) -> Error {
    let own = format!("handoff of request {request:?}");
    let why = match why.strip_prefix(&own) {
        Some(rest) => rest.trim_start_matches(':').trim_start().to_string(),
        None => why,
    };
    Error::Handoff {
        request: request.to_string(),
        why,
    }
}

/// What a failed load is remembered by for a later `wait`: its reason without the request's
/// name (the error `wait` returns names it).
pub(crate) fn failure_reason(e: &Error) -> String {
    match e {
        Error::Handoff { why, .. } => why.clone(),
        e => e.to_string(),
    }
}
