//! One frame of compressed data on the wire, with its paired encoder and decoder.
//!
//! ```text
//! frame  magic u8 (0xF5) | transform u8 | coding u8 (bit 0: plane A is zstd, bit 1: plane B)
//!        | reserved u8 (0) | raw_len u32 | len_a u32 | len_b u32 | crc32 u32 (of the raw bytes)
//!        | plane A's len_a bytes | plane B's len_b bytes
//! ```
//!
//! A stored plane is as long as the transform says; a coded plane is at most zstd's bound for
//! that size. The decoder checks all of it before a byte is read past the header, so that a
//! peer cannot make the reader allocate or wait for more than one frame's bound.

use super::planes::Transform;

/// First byte of every frame.
pub const MAGIC: u8 = 0xF5;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 20;
/// Raw bytes per frame that an encoder produces (the pipeline's unit).
pub const CHUNK: usize = 1 << 20;
/// Most raw bytes a decoder accepts in one frame.
pub const MAX_RAW: usize = CHUNK;
/// Coding bit: plane A is a zstd frame.
pub const CODED_A: u8 = 1;
/// Coding bit: plane B is a zstd frame.
pub const CODED_B: u8 = 2;

/// Why a frame was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Not a frame: the stream is out of step or not compressed.
    #[error("bad frame magic {found:#04x}")]
    BadMagic {
        /// The byte found.
        found: u8,
    },
    /// A header field holds a value no encoder writes.
    #[error("invalid frame {field}: {why}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// Why.
        why: String,
    },
    /// The frame holds more raw bytes than the transfer has left.
    #[error("frame of {raw_len} raw bytes, {left} left in the transfer")]
    Overrun {
        /// Raw bytes the frame claims.
        raw_len: usize,
        /// Raw bytes the transfer still expects.
        left: u64,
    },
    /// A plane did not decode to its size.
    #[error("plane {plane} does not decode: {why}")]
    Corrupt {
        /// 'A' or 'B'.
        plane: char,
        /// What the decoder said.
        why: String,
    },
    /// The decoded bytes are not the bytes that were sent.
    #[error("checksum mismatch: frame says {expected:#010x}, data gives {found:#010x}")]
    Checksum {
        /// The frame's CRC-32.
        expected: u32,
        /// The CRC-32 of what decoded.
        found: u32,
    },
    /// The stream ended inside a frame.
    #[error("truncated frame: {got} of {needed} bytes")]
    Truncated {
        /// Bytes that arrived.
        got: usize,
        /// Bytes the frame needs.
        needed: usize,
    },
}

/// A frame's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// How the chunk was split.
    pub transform: Transform,
    /// [`CODED_A`] and [`CODED_B`] bits.
    pub coding: u8,
    /// Raw bytes the frame decodes to.
    pub raw_len: usize,
    /// Bytes of plane A on the wire.
    pub len_a: usize,
    /// Bytes of plane B on the wire.
    pub len_b: usize,
    /// CRC-32 of the raw bytes.
    pub crc: u32,
}

/// The most bytes zstd writes for `n` input bytes (its `ZSTD_COMPRESSBOUND`).
pub const fn zstd_bound(n: usize) -> usize {
    n + (n >> 8)
        + if n < (128 << 10) {
            ((128 << 10) - n) >> 11
        } else {
            0
        }
}

impl FrameHeader {
    /// Bytes of the planes that follow the header.
    pub fn payload_len(&self) -> usize {
        self.len_a + self.len_b
    }

    /// Appends the header's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(MAGIC);
        out.push(self.transform.code());
        out.push(self.coding);
        out.push(0);
        out.extend_from_slice(&(self.raw_len as u32).to_le_bytes());
        out.extend_from_slice(&(self.len_a as u32).to_le_bytes());
        out.extend_from_slice(&(self.len_b as u32).to_le_bytes());
        out.extend_from_slice(&self.crc.to_le_bytes());
    }

    /// Parses and checks a header; `left` is the raw bytes the transfer still expects.
    pub fn decode(h: &[u8; HEADER_LEN], left: u64) -> Result<FrameHeader, FrameError> {
        if h[0] != MAGIC {
            return Err(FrameError::BadMagic { found: h[0] });
        }
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize;
        let transform = Transform::from_code(h[1]).ok_or_else(|| FrameError::Invalid {
            field: "transform",
            why: format!("unknown code {}", h[1]),
        })?;
        let coding = h[2];
        if coding & !(CODED_A | CODED_B) != 0 || h[3] != 0 {
            return Err(FrameError::Invalid {
                field: "coding",
                why: format!("bits {coding:#04x}, reserved {:#04x}", h[3]),
            });
        }
        let (raw_len, len_a, len_b) = (u32_at(4), u32_at(8), u32_at(12));
        if raw_len == 0 || raw_len > MAX_RAW {
            return Err(FrameError::Invalid {
                field: "raw_len",
                why: format!("{raw_len} bytes, limit {MAX_RAW}"),
            });
        }
        if raw_len as u64 > left {
            return Err(FrameError::Overrun { raw_len, left });
        }
        let (pa, pb) = transform.plane_sizes(raw_len);
        for (plane, len, size, bit) in [('A', len_a, pa, CODED_A), ('B', len_b, pb, CODED_B)] {
            let ok = if coding & bit == 0 {
                len == size
            } else {
                size > 0 && len > 0 && len <= zstd_bound(size)
            };
            if !ok {
                return Err(FrameError::Invalid {
                    field: "plane length",
                    why: format!(
                        "plane {plane}: {len} bytes {} for {size} raw",
                        if coding & bit == 0 { "stored" } else { "coded" }
                    ),
                });
            }
        }
        Ok(FrameHeader {
            transform,
            coding,
            raw_len,
            len_a,
            len_b,
            crc: u32_at(16) as u32,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(coding: u8, raw_len: usize) -> FrameHeader {
        let (a, b) = Transform::Bf16.plane_sizes(raw_len);
        FrameHeader {
            transform: Transform::Bf16,
            coding,
            raw_len,
            len_a: if coding & CODED_A != 0 { a / 3 + 1 } else { a },
            len_b: b,
            crc: 0xdead_beef,
        }
    }

    #[test]
    fn refusals_name_the_field() {
        let mut b = Vec::new();
        header(CODED_A, 1000).encode(&mut b);
        let h: [u8; HEADER_LEN] = b.as_slice().try_into().unwrap();
        assert!(FrameHeader::decode(&h, 1000).is_ok());
        assert_eq!(
            FrameHeader::decode(&h, 999),
            Err(FrameError::Overrun {
                raw_len: 1000,
                left: 999
            })
        );
        let mut bad = h;
        bad[0] = 0;
        assert!(matches!(
            FrameHeader::decode(&bad, 1000),
            Err(FrameError::BadMagic { .. })
        ));
        let mut bad = h;
        bad[1] = 9;
        assert!(matches!(
            FrameHeader::decode(&bad, 1000),
            Err(FrameError::Invalid {
                field: "transform",
                ..
            })
        ));
        let mut bad = h;
        bad[2] = 4;
        assert!(matches!(
            FrameHeader::decode(&bad, 1000),
            Err(FrameError::Invalid {
                field: "coding",
                ..
            })
        ));
        let mut bad = h;
        bad[4..8].copy_from_slice(&((MAX_RAW + 1) as u32).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&bad, u64::MAX),
            Err(FrameError::Invalid {
                field: "raw_len",
                ..
            })
        ));
        // A stored plane of another length, a coded plane above zstd's bound.
        let mut bad = h;
        bad[12..16].copy_from_slice(&7u32.to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&bad, 1000),
            Err(FrameError::Invalid {
                field: "plane length",
                ..
            })
        ));
        let mut bad = h;
        bad[8..12].copy_from_slice(&(zstd_bound(500) as u32 + 1).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&bad, 1000),
            Err(FrameError::Invalid {
                field: "plane length",
                ..
            })
        ));
    }

    proptest! {
        #[test]
        fn header_roundtrip(coding in 0u8..4, raw_len in 2usize..=MAX_RAW, crc in any::<u32>()) {
            let h = FrameHeader { crc, ..header(coding, raw_len) };
            let mut b = Vec::new();
            h.encode(&mut b);
            prop_assert_eq!(b.len(), HEADER_LEN);
            let a: [u8; HEADER_LEN] = b.as_slice().try_into().unwrap();
            prop_assert_eq!(FrameHeader::decode(&a, raw_len as u64), Ok(h));
        }
    }
}
