//! Whether a transfer travels compressed: the link rate against what the codec does on this
//! host and this data. Pure: the shell passes in what it measured.
//!
//! A compressed transfer is a pipeline: the sender codes chunk k+1 while chunk k is on the
//! wire and the receiver decodes chunk k-1. Its time is that of its slowest stage, plus one
//! chunk's coding to fill it:
//!
//! ```text
//! raw        = bytes / link
//! compressed = bytes * max(1 / (ratio * link), 1 / encode, 1 / decode) + CHUNK / encode + CHUNK / decode
//! ```
//!
//! `auto` compresses when `compressed` is below `raw` by [`MARGIN`], and only transfers of at
//! least [`MIN_BYTES`]. Until the link rate and the codec are measured it sends raw, and the
//! shell measures: the link from raw transfers, the codec by coding a sample of the data
//! (see [`Decision::Calibrate`]).

use std::time::Duration;

use super::frame::CHUNK;

/// Smaller transfers go raw: their time is the link's latency, not its rate.
pub const MIN_BYTES: u64 = 4 << 20;
/// Compress only when the prediction saves at least this fraction of the raw time.
pub const MARGIN: f64 = 0.10;
/// In `auto`, data whose measured ratio is below this goes raw whatever the link: quantized
/// KV (FP8, 1-byte values) codes to about 1.22x (`tests/quantized_compression.rs`), a saving
/// under a fifth of the link time for a core's coding at each end; bf16 KV codes to 1.4-1.5x.
pub const MIN_RATIO: f64 = 1.3;
/// In `auto`, one large transfer in this many goes raw while compressing, to re-measure the
/// link (a compressed transfer measures the codec, and a link faster than it looks slower).
pub const REPROBE_EVERY: u32 = 32;

/// Whether transfers to a peer are compressed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Compression {
    /// Never.
    Off,
    /// Always (transfers of at least [`MIN_BYTES`]).
    On,
    /// Where the prediction says it is faster.
    #[default]
    Auto,
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Compression::Off),
            "on" => Ok(Compression::On),
            "auto" => Ok(Compression::Auto),
            _ => Err(format!("compression {s:?}: off, on or auto")),
        }
    }
}

/// What the codec achieved on this host and this kind of data (exponentially weighted).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CodecRates {
    /// Raw bytes per wire byte.
    pub ratio: f64,
    /// Raw bytes per second encoded by one thread.
    pub encode: f64,
    /// Raw bytes per second decoded by one thread.
    pub decode: f64,
}

/// The measurements that [`decide`] weighs, with how they were obtained.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimates {
    /// Bytes per second of the link to this peer (configured or measured).
    pub link: Option<f64>,
    /// The codec's rates, once measured.
    pub codec: Option<CodecRates>,
    /// Compressed large transfers since the link was last measured raw.
    pub since_raw: u32,
}

/// How long `bytes` take raw and compressed, under `e`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// Raw.
    pub raw: Duration,
    /// Compressed.
    pub compressed: Duration,
}

/// The prediction for `bytes` over a link of `link` bytes/s with codec `c`.
pub fn predict(bytes: u64, link: f64, c: &CodecRates) -> Prediction {
    let b = bytes as f64;
    let per_byte = (1.0 / (c.ratio.max(1e-3) * link))
        .max(1.0 / c.encode.max(1.0))
        .max(1.0 / c.decode.max(1.0));
    let fill = (CHUNK as f64).min(b) * (1.0 / c.encode.max(1.0) + 1.0 / c.decode.max(1.0));
    Prediction {
        raw: Duration::from_secs_f64(b / link.max(1.0)),
        compressed: Duration::from_secs_f64(b * per_byte + fill),
    }
}

/// What to do with one transfer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    /// Send it raw.
    Raw,
    /// Send it raw, then code a sample of its data to measure the codec (auto, with the link
    /// known to be slow enough that compression might pay, and no codec measurement yet).
    Calibrate,
    /// Send it compressed.
    Compress,
}

/// The decision for a transfer of `bytes` under `mode` and `e`, with the reason (for logs).
pub fn decide(mode: Compression, bytes: u64, e: &Estimates) -> (Decision, &'static str) {
    if bytes < MIN_BYTES {
        return (Decision::Raw, "small transfer");
    }
    match mode {
        Compression::Off => (Decision::Raw, "compression off"),
        Compression::On => (Decision::Compress, "compression on"),
        Compression::Auto => {
            let Some(link) = e.link else {
                return (Decision::Raw, "link rate not measured yet");
            };
            let Some(c) = e.codec else {
                return (Decision::Calibrate, "codec not measured yet");
            };
            if e.since_raw >= REPROBE_EVERY {
                return (Decision::Raw, "re-measuring the link");
            }
            if c.ratio < MIN_RATIO {
                return (
                    Decision::Raw,
                    "the data does not compress enough (quantized KV?)",
                );
            }
            let p = predict(bytes, link, &c);
            if p.compressed.as_secs_f64() < p.raw.as_secs_f64() * (1.0 - MARGIN) {
                (Decision::Compress, "predicted faster compressed")
            } else {
                (Decision::Raw, "predicted faster raw")
            }
        }
    }
}

/// `old` moved towards `new` (weight 1/4), or `new` where there was none.
pub fn blend(old: Option<f64>, new: f64) -> f64 {
    match old {
        Some(o) if o.is_finite() && o > 0.0 => 0.75 * o + 0.25 * new,
        _ => new,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: f64 = 1e6;
    const KV: u64 = 273_000_000;

    fn codec() -> CodecRates {
        CodecRates {
            ratio: 1.4,
            encode: 600.0 * MB,
            decode: 1200.0 * MB,
        }
    }

    #[test]
    fn a_gigabit_link_is_compressed_and_loopback_is_not() {
        let gbe = Estimates {
            link: Some(117.0 * MB),
            codec: Some(codec()),
            since_raw: 0,
        };
        assert_eq!(decide(Compression::Auto, KV, &gbe).0, Decision::Compress);
        let p = predict(KV, 117.0 * MB, &codec());
        // Link-bound: the ratio's gain, less the fill.
        let gain = p.raw.as_secs_f64() / p.compressed.as_secs_f64();
        assert!(gain > 1.35 && gain < 1.4, "{gain}");
        let lo = Estimates {
            link: Some(3000.0 * MB),
            ..gbe
        };
        assert_eq!(decide(Compression::Auto, KV, &lo).0, Decision::Raw);
        // On and off do as they say; small transfers go raw.
        assert_eq!(decide(Compression::On, KV, &lo).0, Decision::Compress);
        assert_eq!(decide(Compression::Off, KV, &gbe).0, Decision::Raw);
        assert_eq!(
            decide(Compression::On, MIN_BYTES - 1, &gbe).0,
            Decision::Raw
        );
    }

    #[test]
    fn auto_measures_before_it_compresses() {
        let mut e = Estimates::default();
        assert_eq!(decide(Compression::Auto, KV, &e).0, Decision::Raw);
        e.link = Some(117.0 * MB);
        assert_eq!(decide(Compression::Auto, KV, &e).0, Decision::Calibrate);
        e.codec = Some(codec());
        assert_eq!(decide(Compression::Auto, KV, &e).0, Decision::Compress);
        e.since_raw = REPROBE_EVERY;
        assert_eq!(decide(Compression::Auto, KV, &e).0, Decision::Raw);
    }

    #[test]
    fn incompressible_data_or_a_slow_codec_goes_raw() {
        let e = |c: CodecRates| Estimates {
            link: Some(117.0 * MB),
            codec: Some(c),
            since_raw: 0,
        };
        let flat = CodecRates {
            ratio: 1.02,
            ..codec()
        };
        assert_eq!(decide(Compression::Auto, KV, &e(flat)).0, Decision::Raw);
        let slow = CodecRates {
            encode: 100.0 * MB,
            ..codec()
        };
        assert_eq!(decide(Compression::Auto, KV, &e(slow)).0, Decision::Raw);
        // FP8's 1.22x would save 18% on this link: below MIN_RATIO, raw all the same.
        let fp8 = CodecRates {
            ratio: 1.22,
            ..codec()
        };
        let p = predict(KV, 117.0 * MB, &fp8);
        assert!(p.compressed.as_secs_f64() < p.raw.as_secs_f64() * (1.0 - MARGIN));
        assert_eq!(decide(Compression::Auto, KV, &e(fp8)).0, Decision::Raw);
    }

    #[test]
    fn blend_moves_a_quarter_of_the_way() {
        assert_eq!(blend(None, 8.0), 8.0);
        assert_eq!(blend(Some(4.0), 8.0), 5.0);
        assert_eq!(blend(Some(f64::NAN), 8.0), 8.0);
    }
}
