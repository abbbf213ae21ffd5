//! A small paged KV cache in host memory for the suite: tensors that are [`HostBuffer`]s,
//! filled with a seeded pattern, compared block by block and head range by head range.

use crate::connector::api::{CacheTensor, KvCaches, LayerTensors};
use crate::memory::HostBuffer;
use kvxfer_proto::descriptor::Desc;
use kvxfer_proto::error::Result;
use kvxfer_proto::layout::{
    KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking, StatePart, StateShape,
};
use kvxfer_proto::types::{MemKind, RegionId};

/// Layers of the suite's caches.
pub const LAYERS: u64 = 4;
/// KV heads of a producer's cache.
pub const HEADS: u64 = 4;
/// Tokens per block.
pub const BLOCK_TOKENS: u64 = 4;
/// Blocks per tensor.
pub const BLOCKS: u64 = 32;

/// A cache and the memory behind it. Drop every producer and consumer built over it first
/// (declare it before them).
#[derive(Debug)]
pub struct TestCache {
    bufs: Vec<HostBuffer>,
    caches: KvCaches,
    /// The layout with tensor `i` as region `i`, to find bytes.
    view: KvLayout,
}

impl TestCache {
    /// A cache of `heads` heads (HND, separate K and V), zeroed, or filled from `seed`.
    pub fn new(heads: u64, seed: Option<u64>) -> Result<TestCache> {
        TestCache::packed(KvPacking::Separate, heads, seed)
    }

    /// An MLA cache (one 24-wide latent per token and layer, no heads), zeroed or filled from
    /// `seed`.
    pub fn latent(seed: Option<u64>) -> Result<TestCache> {
        TestCache::packed(KvPacking::Latent, 1, seed)
    }

    fn packed(packing: KvPacking, heads: u64, seed: Option<u64>) -> Result<TestCache> {
        let dim = if packing == KvPacking::Latent { 24 } else { 8 };
        TestCache::shaped(packing, heads, dim, seed)
    }

    /// A cache of `heads` heads of `head_dim` packed as `packing`, zeroed or filled from
    /// `seed`.
    pub fn shaped(
        packing: KvPacking,
        heads: u64,
        head_dim: u64,
        seed: Option<u64>,
    ) -> Result<TestCache> {
        TestCache::laid_out(packing, KvOrder::Hnd, heads, head_dim, BLOCK_TOKENS, seed)
    }

    /// A cache of `block_tokens`-token blocks in `order`, zeroed or filled from `seed`.
    pub fn laid_out(
        packing: KvPacking,
        order: KvOrder,
        heads: u64,
        head_dim: u64,
        block_tokens: u64,
        seed: Option<u64>,
    ) -> Result<TestCache> {
        TestCache::typed(
            packing,
            order,
            heads,
            head_dim,
            KvDtype::Bf16,
            block_tokens,
            seed,
        )
    }

    /// A cache of `dtype` elements (FP8 KV, or float32 scales), HND or NHD.
    pub fn typed(
        packing: KvPacking,
        order: KvOrder,
        heads: u64,
        head_dim: u64,
        dtype: KvDtype,
        block_tokens: u64,
        seed: Option<u64>,
    ) -> Result<TestCache> {
        let geometry = KvGeometry {
            name: "conformance".into(),
            layers: LAYERS,
            kv_heads: heads,
            head_dim,
            dtype,
        };
        let probe = KvLayout::contiguous(
            geometry.clone(),
            block_tokens,
            BLOCKS,
            packing,
            order,
            RegionId(0),
        );
        TestCache::from_probe(probe, seed)
    }

    /// An attention cache of `heads` heads (fused K+V, HND) whose every block is followed by
    /// `pad_per_head` bytes a head of padding, as vLLM pads a hybrid model's attention pages
    /// up to its state pages; zeroed (padding included) or filled from `seed`.
    pub fn padded(heads: u64, pad_per_head: u64, seed: Option<u64>) -> Result<TestCache> {
        let geometry = KvGeometry {
            name: "conformance".into(),
            layers: LAYERS,
            kv_heads: heads,
            head_dim: 8,
            dtype: KvDtype::Bf16,
        };
        let mut probe = KvLayout::contiguous(
            geometry,
            BLOCK_TOKENS,
            BLOCKS,
            KvPacking::Fused,
            KvOrder::Hnd,
            RegionId(0),
        );
        probe.pad_per_head = pad_per_head;
        TestCache::from_probe(probe, seed)
    }

    /// A recurrent-state cache of `units` split units a rank (a Mamba2-like page: conv x, B
    /// and C of 3-element channels, then the SSM heads), its page padded by `padding` bytes a unit
    /// (a hybrid model's) or not; zeroed or filled from `seed`.
    pub fn state(units: u64, padding: u64, seed: Option<u64>) -> Result<TestCache> {
        let shape = StateShape {
            parts: vec![
                StatePart {
                    rows: 1,
                    per_unit: vec![4, 1, 1],
                    channel_bytes: 6,
                },
                StatePart {
                    rows: 1,
                    per_unit: vec![1],
                    channel_bytes: 64,
                },
            ],
            padding,
        };
        TestCache::state_shaped(units, shape, seed)
    }

    /// A state cache of pages shaped `shape`, `units` units a rank.
    pub fn state_shaped(units: u64, shape: StateShape, seed: Option<u64>) -> Result<TestCache> {
        let probe =
            KvLayout::state_pages("conformance", LAYERS, units, shape, BLOCKS, RegionId(0))?;
        TestCache::from_probe(probe, seed)
    }

    fn from_probe(probe: KvLayout, seed: Option<u64>) -> Result<TestCache> {
        let (geometry, block_tokens, packing, order) = (
            probe.geometry.clone(),
            probe.block_tokens,
            probe.packing,
            probe.order,
        );
        let len = probe.tensor_bytes() as usize;
        let per_layer = packing.tensors() as u64;
        let mut bufs = Vec::new();
        for i in 0..(LAYERS * per_layer) {
            let mut b = HostBuffer::new(len)?;
            if let Some(seed) = seed {
                fill(b.as_mut_slice(), seed.wrapping_mul(1000).wrapping_add(i));
            }
            bufs.push(b);
        }
        let tensors: Vec<CacheTensor> = bufs
            .iter_mut()
            .map(|b| {
                let s = b.as_mut_slice();
                // SAFETY: the buffer is owned by this `TestCache`, which the suite keeps
                // alive until every producer and consumer over it has dropped; a HostBuffer
                // never moves its memory.
                unsafe { CacheTensor::new(s.as_mut_ptr(), s.len(), MemKind::Host) }
            })
            .collect();
        let caches = KvCaches {
            geometry,
            block_tokens,
            num_blocks: BLOCKS,
            packing,
            order,
            layers: tensors
                .chunks(per_layer as usize)
                .map(|kv| LayerTensors {
                    k: kv[0],
                    v: kv.get(1).copied(),
                })
                .collect(),
            state: probe.state.clone(),
            pad_per_head: probe.pad_per_head,
        };
        let mut i = 0u32;
        let view = caches.layout(|_| {
            i += 1;
            (RegionId(i - 1), 0)
        });
        Ok(TestCache { bufs, caches, view })
    }

    /// What to register.
    pub fn caches(&self) -> &KvCaches {
        &self.caches
    }

    fn bytes(&self, d: &Desc) -> &[u8] {
        let b = self.bufs[d.region.0 as usize].as_slice();
        &b[d.offset as usize..(d.offset + d.len) as usize]
    }

    /// Whether this cache's `blocks` hold `src`'s `src_blocks` (heads `heads` of them) in
    /// `layers`; the first difference as text when not.
    pub fn holds(
        &self,
        blocks: &[u32],
        src: &TestCache,
        src_blocks: &[u32],
        heads: std::ops::Range<u64>,
        layers: std::ops::Range<usize>,
    ) -> std::result::Result<(), String> {
        let all = 0..self.caches.geometry.kv_heads;
        self.holds_in(blocks, all, src, src_blocks, heads, layers)
    }

    /// Whether heads `mine` of this cache's `blocks` hold heads `heads` of `src`'s
    /// `src_blocks` in `layers` (a tensor-parallel slice); the first difference as text.
    pub fn holds_in(
        &self,
        blocks: &[u32],
        mine: std::ops::Range<u64>,
        src: &TestCache,
        src_blocks: &[u32],
        heads: std::ops::Range<u64>,
        layers: std::ops::Range<usize>,
    ) -> std::result::Result<(), String> {
        // Pieces on both sides when either is a slice, so that the two lists pair.
        let split = mine != (0..self.caches.geometry.kv_heads)
            || heads != (0..src.caches.geometry.kv_heads);
        let mine = self
            .view
            .descs_split(blocks, layers.clone(), mine, split)
            .map_err(|e| e.to_string())?;
        let theirs = src
            .view
            .descs_split(src_blocks, layers, heads, split)
            .map_err(|e| e.to_string())?;
        if mine.len() != theirs.len() {
            return Err(format!(
                "{} descriptors against {}",
                mine.len(),
                theirs.len()
            ));
        }
        for (a, b) in mine.iter().zip(&theirs) {
            if self.bytes(a) != src.bytes(b) {
                return Err(format!(
                    "tensor {} at {} differs from the producer's tensor {} at {}",
                    a.region.0, a.offset, b.region.0, b.offset
                ));
            }
        }
        Ok(())
    }

    /// The layout with tensor `i` as region `i` (what [`TestCache::same_bytes`] reads).
    pub fn view(&self) -> &KvLayout {
        &self.view
    }

    /// Whether this cache's bytes under `mine` equal `src`'s under `theirs`, descriptor by
    /// descriptor (both built over the two caches' [`TestCache::view`]s).
    pub fn same_bytes(
        &self,
        mine: &[Desc],
        src: &TestCache,
        theirs: &[Desc],
    ) -> std::result::Result<(), String> {
        if mine.len() != theirs.len() {
            return Err(format!(
                "{} descriptors against {}",
                mine.len(),
                theirs.len()
            ));
        }
        for (a, b) in mine.iter().zip(theirs) {
            if a.len != b.len || self.bytes(a) != src.bytes(b) {
                return Err(format!(
                    "tensor {} at {} (+{}) differs from the producer's tensor {} at {} (+{})",
                    a.region.0, a.offset, a.len, b.region.0, b.offset, b.len
                ));
            }
        }
        Ok(())
    }

    /// Whether every block's padding ([`KvLayout::pad_per_head`]) is still zero: a load moves
    /// a block's data, never the padding after it (a cache without padding passes).
    pub fn padding_untouched(&self) -> std::result::Result<(), String> {
        let (data, stride) = (self.view.block_bytes(), self.view.block_stride());
        for (i, b) in self.bufs.iter().enumerate() {
            for (block, page) in b.as_slice().chunks(stride as usize).enumerate() {
                if page[data as usize..].iter().any(|&x| x != 0) {
                    return Err(format!(
                        "tensor {i}: the padding after block {block} was written"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether `blocks` are all zero in `layers`.
    pub fn zeroed(&self, blocks: &[u32], layers: std::ops::Range<usize>) -> bool {
        self.view
            .descs(blocks, layers, 0..self.caches.geometry.kv_heads)
            .map(|ds| ds.iter().all(|d| self.bytes(d).iter().all(|&x| x == 0)))
            .unwrap_or(false)
    }

    /// Bytes of one block in every layer (K and V, or the latent, or a state page).
    pub fn request_block_bytes(&self) -> u64 {
        self.view.block_bytes() * LAYERS * self.view.tensors_per_layer() as u64
    }

    /// Bytes one head (a state page's unit) of one block moves in every layer when a load
    /// takes a slice: a state page's padding is not data and moves only with a whole page.
    pub fn slice_bytes_per_head(&self) -> u64 {
        let heads = self.caches.geometry.kv_heads;
        let pad = self
            .view
            .state
            .as_ref()
            .map_or(0, |s| s.padding * heads * LAYERS);
        (self.request_block_bytes() - pad) / heads
    }
}

/// A xorshift pattern: different per tensor, never all zero.
fn fill(b: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for c in b.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = x.to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}
