//! A chunk to a frame and back: the planes of [`super::planes`], each coded with zstd where
//! that makes it smaller, and the CRC-32 of the chunk checked after decoding.

use std::time::{Duration, Instant};

use super::frame::{FrameError, FrameHeader, CODED_A, CODED_B, HEADER_LEN};
use super::planes::{join, split, Transform};

/// zstd level of the coded planes, with Huffman-coded literals forced on. The exponent plane
/// has few repeated strings and a skewed byte distribution: what pays is the entropy coding of
/// its literals, not match finding. On the bench's synthetic KV (16 MiB, exponent plane only,
/// one thread): level 1 codes 2.54x at 305 MB/s, level 3 2.28x at 135 MB/s, level -200 with
/// Huffman literals 2.64x at 1,030 MB/s (level -100000: the same ratio, no faster).
pub const LEVEL: i32 = -200;
/// A plane that saved less than this fraction is stored from then on (retried every
/// [`RETRY_EVERY`] chunks: data changes).
const MIN_SAVING: f64 = 0.03;
const RETRY_EVERY: u32 = 16;

/// Bytes and time of frames encoded or decoded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CodecTally {
    /// Raw bytes.
    pub raw: u64,
    /// Bytes on the wire, headers included.
    pub wire: u64,
    /// Time spent coding (this thread).
    pub busy: Duration,
    /// Frames.
    pub frames: u64,
}

impl CodecTally {
    /// Adds `o`.
    pub fn add(&mut self, o: &CodecTally) {
        self.raw += o.raw;
        self.wire += o.wire;
        self.busy += o.busy;
        self.frames += o.frames;
    }

    /// Raw bytes per wire byte (1.0 when nothing moved).
    pub fn ratio(&self) -> f64 {
        if self.wire == 0 {
            1.0
        } else {
            self.raw as f64 / self.wire as f64
        }
    }

    /// Raw bytes per second of coding time.
    pub fn rate(&self) -> Option<f64> {
        let s = self.busy.as_secs_f64();
        (s > 0.0 && self.raw > 0).then(|| self.raw as f64 / s)
    }
}

/// Per plane: whether coding it pays, from what the last attempts saved.
#[derive(Debug, Default)]
struct PlaneState {
    stored_since: Option<u32>,
}

/// Encodes chunks into frames; holds the zstd context and the plane buffers between chunks.
pub struct Encoder {
    transform: Transform,
    zstd: zstd::bulk::Compressor<'static>,
    a: Vec<u8>,
    b: Vec<u8>,
    z: Vec<u8>,
    state: [PlaneState; 2],
    /// What this encoder did.
    pub tally: CodecTally,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("transform", &self.transform)
            .field("tally", &self.tally)
            .finish_non_exhaustive()
    }
}

impl Encoder {
    /// An encoder splitting chunks with `transform`.
    pub fn new(transform: Transform) -> std::io::Result<Encoder> {
        Ok(Encoder {
            transform,
            zstd: {
                let mut z = zstd::bulk::Compressor::new(LEVEL)?;
                // Negative levels turn literal compression off by default: on, explicitly.
                z.set_parameter(zstd::zstd_safe::CParameter::LiteralCompressionMode(
                    zstd::zstd_safe::ParamSwitch::Enable,
                ))?;
                z
            },
            a: Vec::new(),
            b: Vec::new(),
            z: Vec::new(),
            state: Default::default(),
            tally: CodecTally::default(),
        })
    }

    /// Appends the frame of `raw` (1..=[`super::frame::MAX_RAW`] bytes) to `out`.
    pub fn encode(&mut self, raw: &[u8], out: &mut Vec<u8>) -> std::io::Result<()> {
        let t0 = Instant::now();
        let start = out.len();
        split(self.transform, raw, &mut self.a, &mut self.b);
        out.resize(start + HEADER_LEN, 0);
        let mut coding = 0u8;
        let mut lens = [0usize; 2];
        let frames = self.tally.frames as u32;
        for (i, bit) in [(0usize, CODED_A), (1, CODED_B)] {
            let plane = if i == 0 { &self.a } else { &self.b };
            if plane.is_empty() {
                continue;
            }
            let st = &mut self.state[i];
            let try_code = match st.stored_since {
                None => true,
                Some(f) => frames.wrapping_sub(f) >= RETRY_EVERY,
            };
            if try_code {
                // zstd writes from the start of a Vec: into the scratch, then appended.
                self.z.clear();
                self.z.reserve(super::frame::zstd_bound(plane.len()));
                let n = self
                    .zstd
                    .compress_to_buffer(plane.as_slice(), &mut self.z)?;
                if (n as f64) < plane.len() as f64 * (1.0 - MIN_SAVING) {
                    st.stored_since = None;
                    coding |= bit;
                    lens[i] = n;
                    out.extend_from_slice(&self.z);
                    continue;
                }
                st.stored_since = Some(frames);
            }
            out.extend_from_slice(plane);
            lens[i] = plane.len();
        }
        let mut h = Vec::with_capacity(HEADER_LEN);
        FrameHeader {
            transform: self.transform,
            coding,
            raw_len: raw.len(),
            len_a: lens[0],
            len_b: lens[1],
            crc: crc32fast::hash(raw),
        }
        .encode(&mut h);
        out[start..start + HEADER_LEN].copy_from_slice(&h);
        self.tally.add(&CodecTally {
            raw: raw.len() as u64,
            wire: (out.len() - start) as u64,
            busy: t0.elapsed(),
            frames: 1,
        });
        Ok(())
    }
}

/// Decodes frames; holds the zstd context and the plane buffers between frames.
pub struct Decoder {
    zstd: zstd::bulk::Decompressor<'static>,
    a: Vec<u8>,
    b: Vec<u8>,
    /// What this decoder did.
    pub tally: CodecTally,
}

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decoder")
            .field("tally", &self.tally)
            .finish_non_exhaustive()
    }
}

impl Decoder {
    /// A decoder.
    pub fn new() -> std::io::Result<Decoder> {
        Ok(Decoder {
            zstd: zstd::bulk::Decompressor::new()?,
            a: Vec::new(),
            b: Vec::new(),
            tally: CodecTally::default(),
        })
    }

    /// Decodes the planes `payload` of frame `h` into `out` (exactly `h.raw_len` bytes) and
    /// checks its CRC. On error `out` holds garbage that must not be used.
    pub fn decode(
        &mut self,
        h: &FrameHeader,
        payload: &[u8],
        out: &mut [u8],
    ) -> Result<(), FrameError> {
        let t0 = Instant::now();
        if payload.len() != h.payload_len() {
            return Err(FrameError::Truncated {
                got: payload.len(),
                needed: h.payload_len(),
            });
        }
        if out.len() != h.raw_len {
            return Err(FrameError::Invalid {
                field: "raw_len",
                why: format!("{} bytes into a chunk of {}", h.raw_len, out.len()),
            });
        }
        let (pa, pb) = h.transform.plane_sizes(h.raw_len);
        let (ca, cb) = payload.split_at(h.len_a);
        let a: &[u8] = if h.coding & CODED_A != 0 {
            unplane(&mut self.zstd, ca, pa, &mut self.a, 'A')?;
            &self.a
        } else {
            ca
        };
        let b: &[u8] = if h.coding & CODED_B != 0 {
            unplane(&mut self.zstd, cb, pb, &mut self.b, 'B')?;
            &self.b
        } else {
            cb
        };
        join(h.transform, a, b, out).ok_or_else(|| FrameError::Invalid {
            field: "planes",
            why: "plane sizes do not match the transform".into(),
        })?;
        let found = crc32fast::hash(out);
        if found != h.crc {
            return Err(FrameError::Checksum {
                expected: h.crc,
                found,
            });
        }
        self.tally.add(&CodecTally {
            raw: h.raw_len as u64,
            wire: (HEADER_LEN + payload.len()) as u64,
            busy: t0.elapsed(),
            frames: 1,
        });
        Ok(())
    }
}

/// Decodes a zstd plane of exactly `size` bytes into `buf`.
fn unplane(
    z: &mut zstd::bulk::Decompressor<'static>,
    coded: &[u8],
    size: usize,
    buf: &mut Vec<u8>,
    plane: char,
) -> Result<(), FrameError> {
    buf.clear();
    buf.reserve(size);
    // Capacity `size`: a plane that would decode to more is refused, not grown.
    let n = z
        .decompress_to_buffer(coded, buf)
        .map_err(|e| FrameError::Corrupt {
            plane,
            why: e.to_string(),
        })?;
    if n != size {
        return Err(FrameError::Corrupt {
            plane,
            why: format!("{n} bytes, the frame says {size}"),
        });
    }
    Ok(())
}

/// Decodes a whole frame (header and payload) from `bytes` into `out` (exactly its raw
/// length): what a reader does frame by frame, in one call (tests, fuzzing, benchmarks).
pub fn decode_frame(
    d: &mut Decoder,
    bytes: &[u8],
    left: u64,
) -> Result<(Vec<u8>, usize), FrameError> {
    let hb: &[u8; HEADER_LEN] = bytes
        .get(..HEADER_LEN)
        .and_then(|b| b.try_into().ok())
        .ok_or(FrameError::Truncated {
            got: bytes.len(),
            needed: HEADER_LEN,
        })?;
    let h = FrameHeader::decode(hb, left)?;
    let end = HEADER_LEN + h.payload_len();
    let payload = bytes.get(HEADER_LEN..end).ok_or(FrameError::Truncated {
        got: bytes.len(),
        needed: end,
    })?;
    let mut out = vec![0u8; h.raw_len];
    d.decode(&h, payload, &mut out)?;
    Ok((out, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// bf16 values of a normal-ish distribution at a few scales (what KV looks like to the
    /// exponent plane), from a fixed xorshift stream.
    fn bf16_data(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = Vec::with_capacity(2 * n);
        for i in 0..n {
            // Sum of 4 uniforms: roughly normal.
            let u: f32 = (0..4)
                .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32)
                .sum::<f32>()
                - 2.0;
            let v = u * [0.1f32, 1.0, 4.0][i % 3];
            out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
        out
    }

    fn roundtrip(t: Transform, raw: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let mut e = Encoder::new(t).unwrap();
        let mut wire = Vec::new();
        for c in raw.chunks(super::super::frame::CHUNK) {
            e.encode(c, &mut wire).unwrap();
        }
        let mut d = Decoder::new().unwrap();
        let mut back = Vec::new();
        let mut at = 0;
        while at < wire.len() {
            let (chunk, n) =
                decode_frame(&mut d, &wire[at..], (raw.len() - back.len()) as u64).unwrap();
            back.extend_from_slice(&chunk);
            at += n;
        }
        (wire, back)
    }

    #[test]
    #[cfg_attr(miri, ignore = "zstd is C")]
    fn float_data_compresses_and_comes_back_identical() {
        let raw = bf16_data(1 << 20, 7);
        let (wire, back) = roundtrip(Transform::Bf16, &raw);
        assert_eq!(back, raw);
        let ratio = raw.len() as f64 / wire.len() as f64;
        assert!(ratio > 1.2, "ratio {ratio:.3} on bf16 data");
    }

    #[test]
    #[cfg_attr(miri, ignore = "zstd is C")]
    fn random_bytes_cost_at_most_the_headers() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let raw: Vec<u8> = (0..3 * super::super::frame::CHUNK + 5)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        let (wire, back) = roundtrip(Transform::Bf16, &raw);
        assert_eq!(back, raw);
        assert_eq!(wire.len(), raw.len() + 4 * HEADER_LEN);
    }

    #[test]
    #[cfg_attr(miri, ignore = "zstd is C")]
    fn every_flipped_byte_or_cut_is_an_error_never_other_data() {
        let raw = bf16_data(4096, 3);
        let mut e = Encoder::new(Transform::Bf16).unwrap();
        let mut wire = Vec::new();
        e.encode(&raw, &mut wire).unwrap();
        let mut d = Decoder::new().unwrap();
        for i in 0..wire.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut w = wire.clone();
                w[i] ^= flip;
                match decode_frame(&mut d, &w, raw.len() as u64) {
                    Err(_) => {}
                    Ok((out, _)) => {
                        assert_eq!(out, raw, "byte {i} ^ {flip:#x} decoded to other data")
                    }
                }
            }
        }
        for cut in 0..wire.len() {
            assert!(
                decode_frame(&mut d, &wire[..cut], raw.len() as u64).is_err(),
                "cut at {cut}"
            );
        }
    }

    proptest! {
        #[test]
        #[cfg_attr(miri, ignore = "zstd is C")]
        fn any_bytes_roundtrip(raw in proptest::collection::vec(any::<u8>(), 1..5000), t in 0u8..3) {
            let (_, back) = roundtrip(Transform::from_code(t).unwrap(), &raw);
            prop_assert_eq!(back, raw);
        }

        #[test]
        #[cfg_attr(miri, ignore = "zstd is C")]
        fn float_data_roundtrips(n in 1usize..20_000, seed in any::<u64>(), t in 0u8..3) {
            let raw = bf16_data(n, seed);
            let (_, back) = roundtrip(Transform::from_code(t).unwrap(), &raw);
            prop_assert_eq!(back, raw);
        }
    }
}
