//! KV cache geometry: how many bytes a token's KV takes in a model, from presets or a Hugging
//! Face `config.json`, and how a prompt maps to paged blocks. Pure: no I/O, no unsafe.

use crate::error::{Error, Result};
pub use crate::state::{StatePart, StateShape};

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvDtype {
    /// 4 bytes.
    F32,
    /// 2 bytes.
    F16,
    /// 2 bytes.
    Bf16,
    /// 1 byte (fp8 e4m3 / e5m2 KV cache).
    Fp8,
}

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Fp8 => 1,
        }
    }

    /// Parses `float32`, `float16`, `bfloat16`, `fp8` and common aliases.
    pub fn parse(s: &str) -> Result<KvDtype> {
        match s.to_ascii_lowercase().as_str() {
            "float32" | "f32" | "fp32" => Ok(KvDtype::F32),
            "float16" | "f16" | "fp16" | "half" => Ok(KvDtype::F16),
            "bfloat16" | "bf16" => Ok(KvDtype::Bf16),
            "fp8" | "fp8_e4m3" | "fp8_e5m2" | "float8_e4m3fn" | "float8_e5m2" => Ok(KvDtype::Fp8),
            other => Err(Error::InvalidArgument(format!(
                "unknown KV dtype {other:?}"
            ))),
        }
    }
}

/// The KV geometry of a model (standard multi-head / grouped-query attention).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Model name, for reports.
    pub name: String,
    /// Attention layers.
    pub layers: u64,
    /// KV heads per layer.
    pub kv_heads: u64,
    /// Dimension of one head.
    pub head_dim: u64,
    /// Element type.
    pub dtype: KvDtype,
}

/// Model presets: `(name, layers, kv_heads, head_dim)`, all bf16. Values from each model's
/// published `config.json`.
pub const PRESETS: &[(&str, u64, u64, u64)] = &[
    ("qwen3-0.6b", 28, 8, 128),
    ("qwen3-8b", 36, 8, 128),
    ("qwen3-32b", 64, 8, 128),
    ("llama-3-8b", 32, 8, 128),
    ("llama-3-70b", 80, 8, 128),
    ("mistral-7b", 32, 8, 128),
];

impl KvGeometry {
    /// A preset by name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Result<KvGeometry> {
        let n = name.to_ascii_lowercase();
        PRESETS
            .iter()
            .find(|p| p.0 == n)
            .map(|&(name, layers, kv_heads, head_dim)| KvGeometry {
                name: name.to_string(),
                layers,
                kv_heads,
                head_dim,
                dtype: KvDtype::Bf16,
            })
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown model preset {name:?}; known: {}",
                    PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", ")
                ))
            })
    }

    /// From a Hugging Face `config.json`: `num_hidden_layers`, `num_key_value_heads` (default
    /// `num_attention_heads`), `head_dim` (default `hidden_size / num_attention_heads`),
    /// `torch_dtype` (default bfloat16). Multimodal configs with a `text_config` use that.
    pub fn from_hf_config(name: &str, json: &str) -> Result<KvGeometry> {
        let v: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| Error::InvalidArgument(format!("config.json of {name}: {e}")))?;
        let c = v.get("text_config").unwrap_or(&v);
        let num = |k: &str| c.get(k).and_then(serde_json::Value::as_u64);
        let need = |k: &str| {
            num(k).filter(|&x| x > 0).ok_or_else(|| {
                Error::InvalidArgument(format!("config.json of {name}: no positive {k:?}"))
            })
        };
        let layers = need("num_hidden_layers")?;
        let heads = need("num_attention_heads")?;
        let kv_heads = num("num_key_value_heads").unwrap_or(heads);
        let head_dim = match num("head_dim") {
            Some(d) => d,
            None => {
                let hidden = need("hidden_size")?;
                if hidden % heads != 0 {
                    return Err(Error::InvalidArgument(format!(
                        "config.json of {name}: hidden_size {hidden} is not a multiple of {heads} heads"
                    )));
                }
                hidden / heads
            }
        };
        if kv_heads == 0 || head_dim == 0 {
            return Err(Error::InvalidArgument(format!(
                "config.json of {name}: zero KV heads or head_dim"
            )));
        }
        let dtype = match c.get("torch_dtype").or_else(|| v.get("torch_dtype")) {
            Some(serde_json::Value::String(s)) => KvDtype::parse(s)?,
            _ => KvDtype::Bf16,
        };
        Ok(KvGeometry {
            name: name.to_string(),
            layers,
            kv_heads,
            head_dim,
            dtype,
        })
    }

    /// KV bytes of one token: `layers x 2 x kv_heads x head_dim x dtype`.
    pub fn bytes_per_token(&self) -> u64 {
        self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.bytes()
    }

    /// Bytes of one block of `block_tokens` tokens of one layer's K (or V): what one
    /// descriptor moves in vLLM's paged layout with K and V in separate blocks.
    pub fn block_bytes(&self, block_tokens: u64) -> u64 {
        block_tokens * self.kv_heads * self.head_dim * self.dtype.bytes()
    }

    /// Paged blocks for `tokens` (rounded up).
    pub fn blocks(&self, tokens: u64, block_tokens: u64) -> u64 {
        tokens.div_ceil(block_tokens.max(1))
    }

    /// Descriptors of one request when every layer's K and V block is its own region.
    pub fn descriptors(&self, tokens: u64, block_tokens: u64) -> u64 {
        self.blocks(tokens, block_tokens) * self.layers * 2
    }
}

/// K or V (or both, for a fused layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kv {
    /// Keys.
    K,
    /// Values.
    V,
}

/// Physical order of one block's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvOrder {
    /// Tokens outer, heads inner: `(block_tokens, kv_heads, dim)` (vLLM's default).
    Nhd,
    /// Heads outer: `(kv_heads, block_tokens, dim)`; a range of heads is contiguous, which is
    /// what heterogeneous tensor parallelism (a rank reading half the heads) needs.
    Hnd,
}

/// How K and V are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvPacking {
    /// One tensor per layer for K and one for V, each `(num_blocks, <order>, head_dim)`.
    Separate,
    /// vLLM 0.33: one tensor per layer, `(num_blocks, <order>, 2 * head_dim)`: every head's K
    /// then V for a token sit side by side.
    Fused,
    /// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): one tensor per layer,
    /// `(num_blocks, block_tokens, head_dim)`, with no head dimension (`kv_heads` is 1) and no
    /// separate K and V (`head_dim` is the latent width, `kv_lora_rank + qk_rope_head_dim`).
    /// Every tensor-parallel rank holds all of it, so [`crate::tp::plan`] has each decode rank
    /// read it whole from one prefill rank.
    Latent,
    /// Per-request recurrent state (Mamba, GDN): one page per layer and block, shaped by
    /// [`KvLayout::state`] ([`crate::state`]); `kv_heads` counts the page's split units per
    /// rank. Every block holds no tokens and moves whole or by units.
    State,
}

impl KvPacking {
    /// Tensors per layer: 2 for separate K and V, else 1.
    pub fn tensors(self) -> usize {
        match self {
            KvPacking::Separate => 2,
            KvPacking::Fused | KvPacking::Latent | KvPacking::State => 1,
        }
    }

    /// Elements of one head and token in a tensor, in units of `head_dim`: 2 where K and V
    /// share the tensor, else 1.
    fn per_head(self) -> u64 {
        match self {
            KvPacking::Fused => 2,
            KvPacking::Separate | KvPacking::Latent | KvPacking::State => 1,
        }
    }
}

/// Where a layer's tensors live: a registered region and the byte offset of block 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LayerBase {
    /// K (or the fused tensor).
    pub k: (crate::types::RegionId, u64),
    /// V (`None` for a fused layout).
    pub v: Option<(crate::types::RegionId, u64)>,
}

/// A paged KV cache's layout in registered memory: maps (layer, K|V, block, heads) to
/// descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// The model's KV geometry.
    pub geometry: KvGeometry,
    /// Tokens per block.
    pub block_tokens: u64,
    /// Blocks in each layer's tensor.
    pub num_blocks: u64,
    /// Separate or fused K/V.
    pub packing: KvPacking,
    /// Element order inside a block.
    pub order: KvOrder,
    /// Per layer: where its tensors are.
    pub layers: Vec<LayerBase>,
    /// The page of a [`KvPacking::State`] cache (`None` for every other packing).
    pub state: Option<crate::state::StateShape>,
    /// Bytes after each block of each tensor, per KV head of this cache: vLLM pads a hybrid
    /// model's attention (or MLA) page up to its state page (`page_size_padded`). Both pages
    /// shrink alike with the TP size, so the padding per head, not a rank's padding, is what
    /// peers of any TP size share. 0 for compact blocks (and for a state cache, whose page
    /// has its own padding).
    pub pad_per_head: u64,
}

impl KvLayout {
    /// A layout whose layers' tensors are laid out back to back in one region, starting at
    /// offset 0: the K tensors of all layers, then the V tensors (separate); or one fused
    /// tensor per layer. [`KvLayout::region_bytes`] is what the region must hold.
    pub fn contiguous(
        geometry: KvGeometry,
        block_tokens: u64,
        num_blocks: u64,
        packing: KvPacking,
        order: KvOrder,
        region: crate::types::RegionId,
    ) -> KvLayout {
        let mut l = KvLayout {
            geometry,
            block_tokens,
            num_blocks,
            packing,
            order,
            layers: Vec::new(),
            state: None,
            pad_per_head: 0,
        };
        let t = l.tensor_bytes();
        let n = l.geometry.layers;
        l.layers = (0..n)
            .map(|i| match packing {
                KvPacking::Fused | KvPacking::Latent | KvPacking::State => LayerBase {
                    k: (region, i * t),
                    v: None,
                },
                KvPacking::Separate => LayerBase {
                    k: (region, i * t),
                    v: Some((region, (n + i) * t)),
                },
            })
            .collect();
        l
    }

    /// A state cache of `layers` layers whose pages of `units` split units each lie back to
    /// back in one region, `num_blocks` pages per layer from offset 0 (what
    /// [`KvLayout::region_bytes`] says the region must hold).
    pub fn state_pages(
        name: &str,
        layers: u64,
        units: u64,
        shape: StateShape,
        num_blocks: u64,
        region: crate::types::RegionId,
    ) -> Result<KvLayout> {
        shape.check(units)?;
        let geometry = KvGeometry {
            name: name.into(),
            layers,
            kv_heads: units,
            head_dim: 1,
            dtype: KvDtype::Fp8,
        };
        let mut l = KvLayout::contiguous(geometry, 1, 0, KvPacking::State, KvOrder::Nhd, region);
        l.state = Some(shape);
        l.num_blocks = num_blocks;
        let t = l.tensor_bytes();
        for (i, base) in l.layers.iter_mut().enumerate() {
            base.k = (region, i as u64 * t);
        }
        Ok(l)
    }

    /// Bytes of one block of one tensor (K, V, the fused K+V, or the latent).
    pub fn block_bytes(&self) -> u64 {
        if let Some(s) = self
            .state
            .as_ref()
            .filter(|_| self.packing == KvPacking::State)
        {
            return s.page_bytes(self.geometry.kv_heads);
        }
        let per = self.block_tokens * self.geometry.kv_heads * self.geometry.head_dim;
        per * self.geometry.dtype.bytes() * self.packing.per_head()
    }

    /// Bytes of one block id in every tensor of every layer: what a cached block spares.
    pub fn block_bytes_all_layers(&self) -> u64 {
        self.block_bytes() * self.tensors_per_layer() as u64 * self.layers.len() as u64
    }

    /// Bytes from one block of a tensor to the next: the block and its padding
    /// ([`KvLayout::pad_per_head`]).
    pub fn block_stride(&self) -> u64 {
        self.block_bytes() + self.pad_per_head * self.geometry.kv_heads
    }

    /// Bytes of one layer's tensor (K, V, or fused).
    pub fn tensor_bytes(&self) -> u64 {
        self.block_stride() * self.num_blocks
    }

    /// Bytes a region needs for [`KvLayout::contiguous`].
    pub fn region_bytes(&self) -> u64 {
        self.tensor_bytes() * self.geometry.layers * self.packing.tensors() as u64
    }

    /// Tensors per layer (2 separate, 1 fused or latent).
    pub fn tensors_per_layer(&self) -> usize {
        self.packing.tensors()
    }

    /// Checks what the packing asks of the geometry: a latent cache has one head (MLA keeps
    /// no head dimension; a layout claiming more would slice the latent as if it had).
    pub fn check_packing(&self) -> Result<()> {
        if self.packing == KvPacking::Latent && self.geometry.kv_heads != 1 {
            return Err(Error::InvalidArgument(format!(
                "a latent (MLA) cache has no head dimension: kv_heads must be 1, not {}",
                self.geometry.kv_heads
            )));
        }
        match (self.packing, &self.state) {
            (KvPacking::State, Some(s)) => s.check(self.geometry.kv_heads)?,
            (KvPacking::State, None) => {
                return Err(Error::InvalidArgument(
                    "a state cache needs its page's shape".into(),
                ))
            }
            (_, Some(_)) => {
                return Err(Error::InvalidArgument(format!(
                    "a state page's shape given for a {:?} cache",
                    self.packing
                )))
            }
            _ => {}
        }
        if self.pad_per_head != 0 && self.packing == KvPacking::State {
            return Err(Error::InvalidArgument(
                "a state cache pads its page in its shape, not per head".into(),
            ));
        }
        // Every size below is computed unchecked from here on: a caller's counts (a padding
        // is any u64) must not wrap one into a small figure that passes a length check.
        let g = &self.geometry;
        let block = [
            g.kv_heads,
            g.head_dim,
            g.dtype.bytes(),
            self.packing.per_head(),
        ]
        .into_iter()
        .try_fold(self.block_tokens, u64::checked_mul);
        let tensor = block
            .zip(g.kv_heads.checked_mul(self.pad_per_head))
            .and_then(|(b, p)| b.checked_add(p))
            .and_then(|s| s.checked_mul(self.num_blocks))
            .and_then(|t| t.checked_mul(g.layers.max(1)))
            .and_then(|t| t.checked_mul(self.packing.tensors() as u64));
        if tensor.is_none() {
            return Err(Error::InvalidArgument(format!(
                "a cache of {} blocks of {} tokens x {} heads x {} (padding {} a head) \
                 overflows 64 bits",
                self.num_blocks, self.block_tokens, g.kv_heads, g.head_dim, self.pad_per_head
            )));
        }
        Ok(())
    }

    /// Hash of everything peers must agree on to exchange blocks (not the block count or the
    /// regions): feed it to `AgentConfig::compat`.
    pub fn compat_hash(&self) -> u64 {
        let g = &self.geometry;
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut feed = |x: u64| {
            for b in x.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        if let (KvPacking::State, Some(s)) = (self.packing, &self.state) {
            // A state block holds no tokens and no heads: the page's shape is what agrees.
            [
                u64::from(crate::wire::metadata::WIRE_VERSION),
                g.layers,
                self.packing as u64,
            ]
            .into_iter()
            .for_each(&mut feed);
            s.hash_into(&mut feed);
            return h;
        }
        for x in [
            u64::from(crate::wire::metadata::WIRE_VERSION),
            g.layers,
            g.kv_heads,
            g.head_dim,
            g.dtype.bytes(),
            self.block_tokens,
            self.packing as u64,
            self.order as u64,
        ] {
            feed(x);
        }
        // Only where there is padding: compact layouts keep the hash they had.
        if self.pad_per_head != 0 {
            feed(self.pad_per_head);
        }
        h
    }

    /// Descriptors for heads `heads` of block `block` of tensor `kv` in `layer`, appended to
    /// `out`. A fused layout takes `Kv::K` for its single tensor. Whole blocks and head ranges
    /// in HND order are one descriptor; a head range in NHD order is one per token.
    pub fn block_descs(
        &self,
        layer: usize,
        kv: Kv,
        block: u32,
        heads: std::ops::Range<u64>,
        out: &mut Vec<crate::descriptor::Desc>,
    ) -> Result<()> {
        self.block_descs_split(layer, kv, block, heads, false, out)
    }

    /// [`KvLayout::block_descs`], one descriptor per token in NHD order when `per_token`,
    /// even for every head: what pairs with a head slice of another cache in NHD order.
    pub fn block_descs_split(
        &self,
        layer: usize,
        kv: Kv,
        block: u32,
        heads: std::ops::Range<u64>,
        per_token: bool,
        out: &mut Vec<crate::descriptor::Desc>,
    ) -> Result<()> {
        let g = &self.geometry;
        let base = self.layers.get(layer).ok_or_else(|| {
            Error::InvalidArgument(format!("layer {layer} of {}", self.layers.len()))
        })?;
        let (region, off) = match (kv, base.v) {
            (Kv::K, _) => base.k,
            (Kv::V, Some(v)) => v,
            (Kv::V, None) => {
                return Err(Error::InvalidArgument(
                    "a fused layout has no separate V tensor".into(),
                ))
            }
        };
        if u64::from(block) >= self.num_blocks {
            return Err(Error::InvalidArgument(format!(
                "block {block} of {}",
                self.num_blocks
            )));
        }
        if heads.start >= heads.end || heads.end > g.kv_heads {
            return Err(Error::InvalidArgument(format!(
                "heads {heads:?} of {}",
                g.kv_heads
            )));
        }
        let bb = self.block_bytes();
        let start = off + u64::from(block) * self.block_stride();
        if let Some(s) = &self.state {
            s.block_descs(g.kv_heads, region, start, heads, per_token, out);
            return Ok(());
        }
        // Bytes of one head's elements for one token (K and V for a fused layout).
        let head_tok = bb / (self.block_tokens * g.kv_heads);
        let split = per_token && self.order == KvOrder::Nhd;
        if heads.start == 0 && heads.end == g.kv_heads && !split {
            out.push(crate::descriptor::Desc::new(region, start, bb));
            return Ok(());
        }
        let nh = heads.end - heads.start;
        match self.order {
            KvOrder::Hnd => out.push(crate::descriptor::Desc::new(
                region,
                start + heads.start * self.block_tokens * head_tok,
                nh * self.block_tokens * head_tok,
            )),
            KvOrder::Nhd => {
                for t in 0..self.block_tokens {
                    out.push(crate::descriptor::Desc::new(
                        region,
                        start + (t * g.kv_heads + heads.start) * head_tok,
                        nh * head_tok,
                    ));
                }
            }
        }
        Ok(())
    }

    /// Descriptors for `blocks` in `layers`, layer by layer (K then V), block by block, for
    /// heads `heads`. Lists built the same way on two sides pair up index by index; runs of
    /// consecutive blocks on both sides coalesce into single operations when transferred.
    pub fn descs(
        &self,
        blocks: &[u32],
        layers: std::ops::Range<usize>,
        heads: std::ops::Range<u64>,
    ) -> Result<Vec<crate::descriptor::Desc>> {
        self.descs_split(blocks, layers, heads, false)
    }

    /// [`KvLayout::descs`] in the paged form ([`crate::paged`]): one entry per layer and tensor
    /// (K then V) holding all of `blocks`, whole blocks or, in HND order, heads `heads` of
    /// each. A head range in NHD order is one piece per token, not per block: use
    /// [`KvLayout::descs_split`] for it.
    pub fn paged(
        &self,
        blocks: &[u32],
        layers: std::ops::Range<usize>,
        heads: std::ops::Range<u64>,
    ) -> Result<Vec<crate::paged::Paged>> {
        let g = &self.geometry;
        if heads.start >= heads.end || heads.end > g.kv_heads {
            return Err(Error::InvalidArgument(format!(
                "heads {heads:?} of {}",
                g.kv_heads
            )));
        }
        if let Some(&b) = blocks.iter().find(|&&b| u64::from(b) >= self.num_blocks) {
            return Err(Error::InvalidArgument(format!(
                "block {b} of {}",
                self.num_blocks
            )));
        }
        let bb = self.block_bytes();
        let head_tok = bb / (self.block_tokens * g.kv_heads);
        let whole = heads.start == 0 && heads.end == g.kv_heads;
        let (skip, len) = match (whole, self.order) {
            (true, _) => (0, bb),
            (false, _) if self.packing == KvPacking::State => {
                return Err(Error::InvalidArgument(
                    "units of a state page are pieces of each part: use descs_split".into(),
                ))
            }
            (false, KvOrder::Hnd) => (
                heads.start * self.block_tokens * head_tok,
                (heads.end - heads.start) * self.block_tokens * head_tok,
            ),
            (false, KvOrder::Nhd) => {
                return Err(Error::InvalidArgument(
                    "a head range in NHD order is one piece per token: use descs_split".into(),
                ))
            }
        };
        let blocks: std::sync::Arc<[u32]> = blocks.into();
        let mut out = Vec::with_capacity(layers.len() * self.tensors_per_layer());
        for layer in layers {
            let base = self.layers.get(layer).ok_or_else(|| {
                Error::InvalidArgument(format!("layer {layer} of {}", self.layers.len()))
            })?;
            for (region, off) in std::iter::once(base.k).chain(base.v) {
                out.push(crate::paged::Paged {
                    region,
                    offset: off + skip,
                    block_len: len,
                    stride: self.block_stride(),
                    blocks: blocks.clone(),
                });
            }
        }
        Ok(out)
    }

    /// [`KvLayout::descs`], one descriptor per token in NHD order when `per_token` (see
    /// [`KvLayout::block_descs_split`]).
    pub fn descs_split(
        &self,
        blocks: &[u32],
        layers: std::ops::Range<usize>,
        heads: std::ops::Range<u64>,
        per_token: bool,
    ) -> Result<Vec<crate::descriptor::Desc>> {
        let mut out = Vec::with_capacity(blocks.len() * layers.len() * 2);
        let kvs: &[Kv] = match self.packing {
            KvPacking::Separate => &[Kv::K, Kv::V],
            KvPacking::Fused | KvPacking::Latent | KvPacking::State => &[Kv::K],
        };
        for layer in layers {
            for &kv in kvs {
                for &b in blocks {
                    self.block_descs_split(layer, kv, b, heads.clone(), per_token, &mut out)?;
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_matches_the_measured_deployment() {
        let g = KvGeometry::preset("qwen3-0.6b").unwrap();
        assert_eq!(g.bytes_per_token(), 114_688);
        assert_eq!(g.bytes_per_token() * 2371, 271_925_248);
        assert_eq!(g.blocks(2371, 16), 149);
        assert_eq!(g.descriptors(2371, 16), 8344);
        assert_eq!(g.block_bytes(16), 32 * 1024);
    }

    #[test]
    fn llama_presets() {
        assert_eq!(
            KvGeometry::preset("llama-3-8b").unwrap().bytes_per_token(),
            131_072
        );
        assert_eq!(
            KvGeometry::preset("LLAMA-3-70B").unwrap().bytes_per_token(),
            327_680
        );
        assert!(KvGeometry::preset("gpt-9").is_err());
    }

    fn qwen_layout(packing: KvPacking, order: KvOrder) -> KvLayout {
        KvLayout::contiguous(
            KvGeometry::preset("qwen3-0.6b").unwrap(),
            16,
            200,
            packing,
            order,
            crate::types::RegionId(3),
        )
    }

    #[test]
    fn qwen_request_is_8344_blocks_of_32k_or_4172_fused() {
        let blocks: Vec<u32> = (0..149).collect();
        let l = qwen_layout(KvPacking::Separate, KvOrder::Nhd);
        let d = l.descs(&blocks, 0..28, 0..8).unwrap();
        assert_eq!(d.len(), 8344);
        assert!(d.iter().all(|d| d.len == 32768));
        let f = qwen_layout(KvPacking::Fused, KvOrder::Nhd);
        let d = f.descs(&blocks, 0..28, 0..8).unwrap();
        assert_eq!(d.len(), 4172);
        assert_eq!(d.iter().map(|d| d.len).sum::<u64>(), 273_416_192);
        assert_ne!(l.compat_hash(), f.compat_hash());
        assert!(l.block_descs(28, Kv::K, 0, 0..8, &mut vec![]).is_err());
        assert!(l.block_descs(0, Kv::K, 200, 0..8, &mut vec![]).is_err());
        assert!(l.block_descs(0, Kv::K, 0, 4..9, &mut vec![]).is_err());
        assert!(f.block_descs(0, Kv::V, 0, 0..8, &mut vec![]).is_err());
    }

    /// Naive reference: byte offset of element (layer, kv, block, token, head, d) from the
    /// tensor shapes, written out independently of the implementation.
    fn naive(l: &KvLayout, layer: u64, kv: u64, block: u64, tok: u64, head: u64, d: u64) -> u64 {
        let g = &l.geometry;
        let (h, bt, hd, e) = (g.kv_heads, l.block_tokens, g.head_dim, g.dtype.bytes());
        let n = g.layers;
        let tensor =
            l.num_blocks * bt * h * hd * e * if l.packing == KvPacking::Fused { 2 } else { 1 };
        match l.packing {
            KvPacking::Latent => {
                assert_eq!((h, kv), (1, 0));
                layer * tensor + ((block * bt + tok) * hd + d) * e
            }
            KvPacking::Separate => {
                let base = (kv * n + layer) * tensor;
                let idx = match l.order {
                    KvOrder::Nhd => ((block * bt + tok) * h + head) * hd + d,
                    KvOrder::Hnd => ((block * h + head) * bt + tok) * hd + d,
                };
                base + idx * e
            }
            KvPacking::Fused => {
                let base = layer * tensor;
                let idx = match l.order {
                    KvOrder::Nhd => ((block * bt + tok) * h + head) * 2 * hd + kv * hd + d,
                    KvOrder::Hnd => ((block * h + head) * bt + tok) * 2 * hd + kv * hd + d,
                };
                base + idx * e
            }
            KvPacking::State => unreachable!("state pages are checked in crate::state"),
        }
    }

    proptest::proptest! {
        #[test]
        fn descs_cover_exactly_the_elements(
            layers in 1u64..4, heads in 1u64..5, hd in 1u64..6, bt in 1u64..5,
            nb in 1u64..6, dt in 0usize..3, pk in 0usize..3, hnd: bool,
            sel in proptest::collection::vec(0u32..6, 0..5), h0 in 0u64..5, hn in 1u64..5,
        ) {
            let dtype = [KvDtype::Fp8, KvDtype::Bf16, KvDtype::F32][dt];
            let packing = [KvPacking::Separate, KvPacking::Fused, KvPacking::Latent][pk];
            // A latent cache has one head and one tensor (no K and V).
            let heads = if packing == KvPacking::Latent { 1 } else { heads };
            let kvs = if packing == KvPacking::Latent { 1 } else { 2 };
            let g = KvGeometry { name: "t".into(), layers, kv_heads: heads, head_dim: hd, dtype };
            let l = KvLayout::contiguous(
                g, bt, nb, packing,
                if hnd { KvOrder::Hnd } else { KvOrder::Nhd },
                crate::types::RegionId(0),
            );
            proptest::prop_assert!(l.check_packing().is_ok());
            let blocks: Vec<u32> = sel.iter().map(|b| b % nb as u32).collect();
            let h0 = h0 % heads;
            let h1 = (h0 + hn).min(heads);
            let d = l.descs(&blocks, 0..layers as usize, h0..h1).unwrap();
            let mut got: Vec<u64> = d.iter().flat_map(|d| d.offset..d.offset + d.len).collect();
            let mut want = Vec::new();
            let e = l.geometry.dtype.bytes();
            for layer in 0..layers {
                for kv in 0..kvs {
                    for &b in &blocks {
                        for t in 0..bt {
                            for h in h0..h1 {
                                for x in 0..hd {
                                    let o = naive(&l, layer, kv, u64::from(b), t, h, x);
                                    want.extend(o..o + e);
                                }
                            }
                        }
                    }
                }
            }
            got.sort_unstable();
            want.sort_unstable();
            proptest::prop_assert_eq!(got.len(), want.len());
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert!(d.iter().all(|d| d.offset + d.len <= l.region_bytes()));
        }
    }

    /// DeepSeek-V3's MLA cache: 61 layers of one 576-wide latent (512 + 64 rope), bf16, 64
    /// tokens a block: a block of a layer is 73,728 bytes, one tensor, no head slicing.
    #[test]
    fn a_latent_cache_is_one_headless_tensor_per_layer() {
        let g = KvGeometry {
            name: "deepseek-v3".into(),
            layers: 61,
            kv_heads: 1,
            head_dim: 576,
            dtype: KvDtype::Bf16,
        };
        let rid = crate::types::RegionId(0);
        let l = KvLayout::contiguous(g.clone(), 64, 100, KvPacking::Latent, KvOrder::Nhd, rid);
        assert_eq!(l.block_bytes(), 73_728);
        assert_eq!(l.tensors_per_layer(), 1);
        assert_eq!(l.region_bytes(), 73_728 * 100 * 61);
        assert!(l.layers.iter().all(|b| b.v.is_none()));
        let d = l.descs(&[3, 4, 9], 0..61, 0..1).unwrap();
        assert_eq!(d.len(), 3 * 61);
        assert!(d.iter().all(|d| d.len == 73_728));
        assert!(l.block_descs(0, Kv::V, 0, 0..1, &mut vec![]).is_err());
        assert!(l.block_descs(0, Kv::K, 0, 0..2, &mut vec![]).is_err());
        // Not interchangeable with a one-head fused cache of half the width.
        let f = KvLayout::contiguous(
            KvGeometry {
                head_dim: 288,
                ..g.clone()
            },
            64,
            100,
            KvPacking::Fused,
            KvOrder::Nhd,
            rid,
        );
        assert_eq!(f.block_bytes(), l.block_bytes());
        assert_ne!(f.compat_hash(), l.compat_hash());
        let two = KvLayout::contiguous(
            KvGeometry { kv_heads: 2, ..g },
            64,
            100,
            KvPacking::Latent,
            KvOrder::Nhd,
            rid,
        );
        let e = two.check_packing().unwrap_err().to_string();
        assert!(e.contains("kv_heads must be 1, not 2"), "{e}");
    }

    #[test]
    fn hf_config() {
        // Qwen3-0.6B's config.json (fields that matter).
        let q = r#"{"architectures":["Qwen3ForCausalLM"],"head_dim":128,"hidden_size":1024,
            "num_attention_heads":16,"num_hidden_layers":28,"num_key_value_heads":8,
            "torch_dtype":"bfloat16"}"#;
        let g = KvGeometry::from_hf_config("q", q).unwrap();
        assert_eq!(g.bytes_per_token(), 114_688);
        // No head_dim, no KV heads (MHA), float16.
        let m = r#"{"hidden_size":4096,"num_attention_heads":32,"num_hidden_layers":32,
            "torch_dtype":"float16"}"#;
        let g = KvGeometry::from_hf_config("m", m).unwrap();
        assert_eq!((g.kv_heads, g.head_dim, g.dtype), (32, 128, KvDtype::F16));
        let nested = r#"{"text_config":{"head_dim":128,"num_attention_heads":32,
            "num_hidden_layers":48,"num_key_value_heads":8}}"#;
        assert_eq!(KvGeometry::from_hf_config("n", nested).unwrap().layers, 48);
        assert!(KvGeometry::from_hf_config("bad", "{").is_err());
        assert!(KvGeometry::from_hf_config("bad", r#"{"num_hidden_layers":0}"#).is_err());
        assert!(KvGeometry::from_hf_config(
            "bad",
            r#"{"num_hidden_layers":2,"num_attention_heads":3,"hidden_size":10}"#
        )
        .is_err());
    }
    /// The paged form describes the same bytes as the flat descriptors, in the same order.
    #[test]
    fn paged_form_is_the_flat_form_per_layer() {
        let blocks: Vec<u32> = vec![7, 3, 150, 0, 199];
        for (packing, order, heads) in [
            (KvPacking::Separate, KvOrder::Nhd, 0..8),
            (KvPacking::Fused, KvOrder::Nhd, 0..8),
            (KvPacking::Separate, KvOrder::Hnd, 2..6),
            (KvPacking::Fused, KvOrder::Hnd, 4..8),
        ] {
            let l = qwen_layout(packing, order);
            let flat = l.descs(&blocks, 3..9, heads.clone()).unwrap();
            let paged = l.paged(&blocks, 3..9, heads.clone()).unwrap();
            assert_eq!(paged.len(), 6 * l.tensors_per_layer());
            let expanded: Vec<crate::descriptor::Desc> = paged
                .iter()
                .flat_map(|p| {
                    p.blocks.iter().map(move |&b| {
                        crate::descriptor::Desc::new(
                            p.region,
                            p.offset + u64::from(b) * p.stride,
                            p.block_len,
                        )
                    })
                })
                .collect();
            assert_eq!(expanded, flat, "{packing:?} {order:?} {heads:?}");
        }
        let l = qwen_layout(KvPacking::Separate, KvOrder::Nhd);
        assert!(l.paged(&blocks, 0..1, 2..6).is_err()); // NHD head slice: per token
        assert!(l.paged(&[200], 0..1, 0..8).is_err());
        assert!(l.paged(&blocks, 27..29, 0..8).is_err());
    }
    #[test]
    fn a_state_cache_moves_pages_whole_or_by_units() {
        let rid = crate::types::RegionId(2);
        let l = KvLayout::state_pages("m", 3, 4, crate::state::tests::mamba2(), 10, rid).unwrap();
        let page = crate::state::tests::mamba2().page_bytes(4);
        assert_eq!((l.block_bytes(), l.region_bytes()), (page, 30 * page));
        l.check_packing().unwrap();
        let whole = l.descs(&[7], 1..2, 0..4).unwrap();
        assert_eq!(
            (whole.len(), whole[0].offset, whole[0].len),
            (1, 10 * page + 7 * page, page)
        );
        // Units 1..3: four pieces a page, inside page 7 of layer 1.
        let part = l.descs(&[7], 1..2, 1..3).unwrap();
        assert_eq!(part.len(), 4);
        assert!(part
            .iter()
            .all(|d| d.offset >= 17 * page && d.offset + d.len <= 18 * page));
        assert!(l.paged(&[7], 1..2, 1..3).is_err());
        // The units (a TP size) are not in the hash; the shape is.
        let mut other = l.clone();
        other.geometry.kv_heads = 2;
        assert_eq!(l.compat_hash(), other.compat_hash());
        other.state.as_mut().unwrap().parts[0].per_unit[1] = 3;
        assert_ne!(l.compat_hash(), other.compat_hash());
        let mut lost = l.clone();
        lost.state = None;
        assert!(lost.check_packing().is_err());
        let mut stray = l.clone();
        stray.packing = KvPacking::Fused;
        assert!(stray.check_packing().is_err());
    }

    #[test]
    fn padded_blocks_step_over_their_padding_and_say_so_in_the_hash() {
        let compact = qwen_layout(KvPacking::Fused, KvOrder::Hnd);
        let mut l = compact.clone();
        l.pad_per_head = 512;
        let bb = compact.block_bytes();
        assert_eq!(l.block_bytes(), bb, "padding is not data");
        assert_eq!(l.block_stride(), bb + 8 * 512);
        assert_eq!(l.tensor_bytes(), 200 * (bb + 8 * 512));
        // Block 3, whole and heads 2..4: from the padded stride, never into the padding.
        let d = l.descs(&[3], 0..1, 0..8).unwrap();
        assert_eq!((d[0].offset, d[0].len), (3 * l.block_stride(), bb));
        let d = l.descs(&[3], 0..1, 2..4).unwrap();
        assert_eq!(d[0].offset, 3 * l.block_stride() + 2 * bb / 8);
        let p = l.paged(&[3, 4], 0..1, 0..8).unwrap();
        assert_eq!((p[0].stride, p[0].block_len), (l.block_stride(), bb));
        // Peers must pad alike; a compact layout keeps the hash it had before padding existed.
        assert_ne!(l.compat_hash(), compact.compat_hash());
        let mut other = l.clone();
        other.pad_per_head = 256;
        assert_ne!(other.compat_hash(), l.compat_hash());
        l.check_packing().unwrap();
        // A state page pads in its own shape.
        let shape = StateShape {
            parts: vec![StatePart {
                rows: 1,
                per_unit: vec![4],
                channel_bytes: 2,
            }],
            padding: 0,
        };
        let mut st = KvLayout::state_pages("s", 2, 4, shape, 8, crate::types::RegionId(0)).unwrap();
        st.pad_per_head = 8;
        assert!(st.check_packing().is_err());
        // A padding that would wrap the sizes round to small ones.
        let mut huge = compact.clone();
        huge.pad_per_head = u64::MAX / 8 + 1;
        let e = huge.check_packing().unwrap_err().to_string();
        assert!(e.contains("overflows 64 bits"), "{e}");
    }
}
