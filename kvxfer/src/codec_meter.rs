//! What the lane's codec achieved in this process: its ratio, encode and decode rates
//! (exponentially weighted, for the compression policy) and its totals (for the caller).

use std::sync::Mutex;
use std::time::Instant;

use kvxfer_proto::compress::codec::{decode_frame, CodecTally, Decoder, Encoder};
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::compress::policy::{blend, CodecRates};

/// Everything this agent's lanes encoded and decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodecTotals {
    /// Frames this agent coded (as a sender).
    pub encoded: CodecTally,
    /// Frames this agent decoded (as a receiver).
    pub decoded: CodecTally,
}

#[derive(Debug, Default)]
struct Meter {
    ratio: Option<f64>,
    encode: Option<f64>,
    decode: Option<f64>,
    totals: CodecTotals,
}

/// The agent's codec measurements, shared by its initiator links and its lane target.
#[derive(Debug, Default)]
pub(crate) struct CodecMeter {
    m: Mutex<Meter>,
}

impl CodecMeter {
    fn with<R>(&self, f: impl FnOnce(&mut Meter) -> R) -> R {
        f(&mut self.m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Frames this side coded.
    pub(crate) fn encoded(&self, t: &CodecTally) {
        self.with(|m| {
            m.totals.encoded.add(t);
            if t.raw > 0 {
                m.ratio = Some(blend(m.ratio, t.ratio()));
            }
            if let Some(r) = t.rate() {
                m.encode = Some(blend(m.encode, r));
            }
        })
    }

    /// Frames this side decoded.
    pub(crate) fn decoded(&self, t: &CodecTally) {
        self.with(|m| {
            m.totals.decoded.add(t);
            if t.raw > 0 {
                m.ratio = Some(blend(m.ratio, t.ratio()));
            }
            if let Some(r) = t.rate() {
                m.decode = Some(blend(m.decode, r));
            }
        })
    }

    /// The rates, once ratio, encode and decode have all been measured.
    pub(crate) fn rates(&self) -> Option<CodecRates> {
        self.with(|m| match (m.ratio, m.encode, m.decode) {
            (Some(ratio), Some(encode), Some(decode)) => Some(CodecRates {
                ratio,
                encode,
                decode,
            }),
            _ => None,
        })
    }

    pub(crate) fn totals(&self) -> CodecTotals {
        self.with(|m| m.totals)
    }

    /// Codes `sample` (real data of a transfer) and decodes it back, to measure the codec
    /// before any frame moved; the totals are not touched. Returns the rates measured.
    pub(crate) fn calibrate(&self, t: Transform, sample: &[u8]) -> Option<CodecRates> {
        let mut e = Encoder::new(t).ok()?;
        let mut d = Decoder::new().ok()?;
        let mut wire = Vec::new();
        for c in sample.chunks(kvxfer_proto::compress::frame::CHUNK) {
            e.encode(c, &mut wire).ok()?;
        }
        let t0 = Instant::now();
        let mut at = 0;
        let mut left = sample.len() as u64;
        while at < wire.len() {
            let (out, n) = decode_frame(&mut d, &wire[at..], left).ok()?;
            left -= out.len() as u64;
            at += n;
        }
        let dec = CodecTally {
            busy: t0.elapsed(),
            ..e.tally
        };
        self.with(|m| {
            m.ratio = Some(blend(m.ratio, e.tally.ratio()));
            m.encode = e.tally.rate().map(|r| blend(m.encode, r)).or(m.encode);
            m.decode = dec.rate().map(|r| blend(m.decode, r)).or(m.decode);
        });
        self.rates()
    }
}
