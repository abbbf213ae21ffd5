//! `auto` compression measured on the data: FP8-quantized KV (1-byte e4m3 values of a
//! Gaussian, as an FP8 cache holds) does not compress enough to pay and goes raw on a gigabit
//! link; bf16 KV of the same values does compress there. The codec's ratio is measured by
//! coding the data as the lane does (the bf16 plane split), not read off a dtype name.

use kvxfer_proto::compress::codec::Encoder;
use kvxfer_proto::compress::frame::CHUNK;
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::{decide, CodecRates, Compression, Decision, Estimates};

/// A seeded standard normal sample (Box-Muller over xorshift), KV-like magnitudes.
fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u, v) = (next(), next());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        })
        .collect()
}

/// `v` as float8 e4m3fn (bias 7, no infinities), rounded to nearest: what an FP8 KV cache
/// stores after its per-tensor or per-token-head scale.
fn e4m3(v: f32) -> u8 {
    let s = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs().min(448.0);
    if a < 2f32.powi(-9) {
        return s;
    }
    let e = a.log2().floor().max(-6.0) as i32;
    let m = ((a / 2f32.powi(e)
        - if e > -6 || a >= 2f32.powi(-6) {
            1.0
        } else {
            0.0
        })
        * 8.0)
        .round() as i32;
    let (e, m) = if m == 8 { (e + 1, 0) } else { (e, m) };
    let biased = if a < 2f32.powi(-6) { 0 } else { e + 7 };
    s | ((biased.clamp(0, 15) as u8) << 3) | (m.clamp(0, 7) as u8)
}

fn bf16(v: f32) -> [u8; 2] {
    let b = v.to_bits();
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    (r as u16).to_le_bytes()
}

/// The ratio the lane's codec achieves on `data`.
fn ratio(data: &[u8]) -> f64 {
    let mut enc = Encoder::new(Transform::Bf16).expect("encoder");
    let mut out = Vec::new();
    for c in data.chunks(CHUNK) {
        enc.encode(c, &mut out).expect("encode");
    }
    data.len() as f64 / out.len() as f64
}

#[test]
#[cfg_attr(miri, ignore = "codes 8 MiB: hours under Miri")]
fn quantized_kv_goes_raw_and_bf16_kv_compresses_on_a_gigabit_link() {
    // 4 MiB of values; KV scaled per head to a few units, as attention's K and V are.
    let v = gaussian(4 << 20, 7);
    let bf: Vec<u8> = v[..2 << 20].iter().flat_map(|&x| bf16(x * 3.0)).collect();
    let r16 = ratio(&bf);
    let at = |r: f64| Estimates {
        link: Some(117e6),
        codec: Some(CodecRates {
            ratio: r,
            encode: 800e6,
            decode: 1600e6,
        }),
        since_raw: 0,
    };
    let bytes = 273_000_000;
    // Whatever the quantization scale spreads the values over.
    for s in [2.0f32, 8.0, 24.0, 64.0, 110.0] {
        let fp8: Vec<u8> = v.iter().map(|&x| e4m3(x * s)).collect();
        let r8 = ratio(&fp8);
        println!("measured ratio: fp8 (scale {s}) {r8:.3}");
        let (d8, why) = decide(Compression::Auto, bytes, &at(r8));
        assert_eq!(d8, Decision::Raw, "fp8 at ratio {r8:.3}: {why}");
    }
    println!("measured ratio: bf16 {r16:.3}");
    let (d16, why) = decide(Compression::Auto, bytes, &at(r16));
    assert_eq!(d16, Decision::Compress, "bf16 at ratio {r16:.3}: {why}");
}
