//! KV-cache content for measuring compression where no model runs: bf16 keys and values
//! drawn from a generative model shaped after published observations of real KV caches,
//! deterministic per (seed, block) so that both processes compute the same bytes.
//!
//! No model's weights can be had on this machine (no Hugging Face access; no package on the
//! registries ships an LLM's weights), so the data is synthetic. It follows, per layer and KV
//! head, what the literature reports about KV caches:
//!
//! - keys have per-channel scales (channels differ by an order of magnitude) and a few
//!   outlier channels with large magnitudes and a non-zero mean, fixed across tokens (KIVI,
//!   arXiv 2402.02750, section 3; KVQuant, arXiv 2401.18079, section 3.1: pre-RoPE keys);
//! - keys are then rotated by RoPE with Qwen3's base (10^6), pairing channel i with i + 64;
//! - values have no outlier channels; their magnitude varies per token (KIVI: "per-token
//!   quantization" for values) and per head;
//! - magnitudes grow with depth.
//!
//! The draws are Irwin-Hall(4) normals scaled by log-normal factors. What the codec achieves
//! on this data is reported as measured on it, never taken as a property of real KV.
//!
//! Layout: blocks of 16 tokens x 8 KV heads x 128 channels (NHD, bf16 = 32 KiB) as vLLM
//! pages Qwen3-0.6B; block k of a request is token block `k % 149` of K (`(k / 149) % 2 ==
//! 0`) or V of layer `(k / 298) % 28` (the request of 2,371 tokens the bench moves).

const HEADS: usize = 8;
const DIM: usize = 128;
const TOKENS: usize = 16;
const TOKEN_BLOCKS: u64 = 149;
const LAYERS: u64 = 28;
const ROPE_BASE: f32 = 1.0e6;

/// A 64-bit mixer (splitmix64's finaliser): per-channel parameters from their coordinates.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A standard normal, approximately (Irwin-Hall of four 16-bit uniforms, unit variance).
fn normal(r: u64) -> f32 {
    let u = |s: u32| ((r >> s) & 0xffff) as f32 / 65536.0;
    (u(0) + u(16) + u(32) + u(48) - 2.0) * 1.732_050_8
}

/// The xorshift stream of one block.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn bf16(x: f32) -> [u8; 2] {
    // Round to nearest even, as a GPU's conversion does.
    let b = x.to_bits();
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1));
    ((r >> 16) as u16).to_le_bytes()
}

/// Fills `out` with block `k` of the request for data seed `seed` (bf16 values; a block of
/// another size repeats the token-head-channel walk).
pub(crate) fn kv_block(seed: u64, k: u64, out: &mut [u8]) {
    let tb = k % TOKEN_BLOCKS;
    let is_v = (k / TOKEN_BLOCKS) % 2 == 1;
    let layer = (k / (2 * TOKEN_BLOCKS)) % LAYERS;
    let depth = 0.5 + layer as f32 / LAYERS as f32; // magnitudes grow with depth
    let mut rng = Rng(mix(seed ^ mix(k)) | 1);
    // Per (layer, head, channel): scale and mean, fixed across tokens.
    let param = |h: usize, d: usize, what: u64| {
        mix(seed ^ (layer << 40) ^ ((h as u64) << 32) ^ ((d as u64) << 8) ^ what)
    };
    let mut vec = [0f32; DIM];
    let mut i = 0usize; // element index in the block
    let elems = out.len() / 2;
    while i < elems {
        let t = (i / (HEADS * DIM)) % TOKENS;
        let h = (i / DIM) % HEADS;
        let pos = (tb as usize * TOKENS + t) as f32;
        if is_v {
            let head = (normal(param(h, 0, 1)) * 0.5 - 1.0).exp() * depth;
            let tok = (normal(rng.next()) * 0.25).exp();
            for v in vec.iter_mut() {
                *v = normal(rng.next()) * head * tok;
            }
        } else {
            for (d, v) in vec.iter_mut().enumerate() {
                let p = param(h, d, 2);
                let mut sigma = (normal(p) * 0.6).exp() * depth;
                let mut mean = 0.0;
                // 4 outlier channel pairs per head, in the slowly rotating half.
                if (d % 64) >= 48 && p % 4 == 0 {
                    sigma *= 6.0;
                    mean = if p & 8 == 0 { 2.0 } else { -2.0 } * sigma;
                }
                *v = mean + sigma * normal(rng.next());
            }
            // RoPE: channel i with i + 64, angle pos * base^(-2i/128).
            for d in 0..DIM / 2 {
                let theta = pos * ROPE_BASE.powf(-2.0 * d as f32 / DIM as f32);
                let (s, c) = theta.sin_cos();
                let (a, b) = (vec[d], vec[d + DIM / 2]);
                vec[d] = a * c - b * s;
                vec[d + DIM / 2] = a * s + b * c;
            }
        }
        for v in vec.iter() {
            if i >= elems {
                break;
            }
            out[2 * i..2 * i + 2].copy_from_slice(&bf16(*v));
            i += 1;
        }
    }
    if out.len() % 2 == 1 {
        if let Some(last) = out.last_mut() {
            *last = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_deterministic_and_differ() {
        let (mut a, mut b, mut c) = (vec![0u8; 32768], vec![0u8; 32768], vec![0u8; 32768]);
        kv_block(1, 5, &mut a);
        kv_block(1, 5, &mut b);
        kv_block(1, 200, &mut c);
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Finite values, no NaN or infinity (exponent 0xff).
        for w in a.chunks_exact(2).chain(c.chunks_exact(2)) {
            let v = u16::from_le_bytes([w[0], w[1]]);
            assert_ne!((v >> 7) & 0xff, 0xff);
        }
    }
}
