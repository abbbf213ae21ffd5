//! KV cache geometry: how many bytes a token's KV takes in a model, from presets or a Hugging
//! Face `config.json`, and how a prompt maps to paged blocks. Pure: no I/O, no unsafe.
#![forbid(unsafe_code)]

use crate::error::{Error, Result};

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
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
}
