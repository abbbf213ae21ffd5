//! The side channel's frames.
//!
//! Each side first sends [`PREAMBLE`] (the magic `KVXF`, a version, CRLF), so a peer that is
//! not a kvxfer side channel (an HTTP server on that port, say) is named as such. Then frames
//! are `u32 length (LE) | u8 kind | payload`, at most [`MAX_FRAME`] bytes, where the
//! length counts the kind byte and the payload. With a shared secret a Noise handshake
//! ([`crate::session`]) comes first and every later payload is sealed under it:
//!
//! ```text
//! client: NOISE1(psk, e)            server: NOISE2(e, ee)   (or a plain ERROR, and close)
//! client: HELLO(sealed metadata)    server: META(sealed metadata) or ERROR(sealed text)
//! ```
//!
//! Without a secret, HELLO, META and ERROR travel in the clear: a trusted network only.

use std::io::Read;

use crate::error::{Error, Result};
use crate::session::sealed_len;
use crate::wire::metadata;

/// Largest side-channel frame (the kind byte and the largest metadata, sealed).
pub const MAX_FRAME: usize = sealed_len(metadata::MAX_ENCODED) + 1;
/// Bytes of a frame's length field.
pub const LEN_BYTES: usize = 4;
/// Bytes before a frame's payload: the length and the kind.
pub const FRAME_HEADER_LEN: usize = LEN_BYTES + 1;
/// The client's metadata (sealed, with a secret).
pub const HELLO: u8 = 1;
/// The listener's metadata (sealed, with a secret).
pub const META: u8 = 2;
/// A refusal, with its reason as text (sealed once a session exists).
pub const ERROR: u8 = 3;
/// The client's Noise handshake message (with a secret).
pub const NOISE1: u8 = 6;
/// The listener's Noise handshake answer.
pub const NOISE2: u8 = 7;
/// After the handshake, either end's metadata again (sealed, with a secret): its regions
/// changed ([`crate::updates`]).
pub const UPDATE: u8 = 8;
/// After the handshake: the sender deregisters a region (its id, u32 little-endian; sealed
/// with a secret). The receiver refuses new transfers touching it, waits for those in flight
/// to it to end, and answers [`GONE_ACK`] ([`crate::updates`]).
pub const GONE: u8 = 9;
/// After the handshake: nothing of the receiver's touches the region any more (its id).
pub const GONE_ACK: u8 = 10;

/// What each side sends first: the magic `KVXF`, the version (big-endian u16) and CRLF. The
/// line end makes a line-based server on the other end (HTTP) answer at once, so that its
/// answer is named at its first bytes instead of waiting out the handshake's time-out.
pub const PREAMBLE: [u8; 8] = *b"KVXF\x00\x03\r\n";

/// Version 1's preamble (before the line end), recognised to name the version.
const PREAMBLE_V1: [u8; 8] = *b"KVXFSC\x00\x01";

/// Checks the other side's preamble: a stream that does not start with the magic is not a
/// kvxfer side channel (what it sent is shown, printable bytes only); another version is
/// named with both.
pub fn check_preamble(got: &[u8; 8], who: &str) -> Result<()> {
    let ours = u16::from_be_bytes([PREAMBLE[4], PREAMBLE[5]]);
    let version = |theirs: u16| Error::Protocol {
        peer: who.to_string(),
        why: format!("side-channel version {theirs}; this kvxfer speaks version {ours}"),
    };
    if *got == PREAMBLE_V1 {
        return Err(version(1));
    }
    if got[..4] != PREAMBLE[..4] || got[6..] != PREAMBLE[6..] {
        let shown: String = got
            .iter()
            .map(|&b| {
                if (0x20..0x7f).contains(&b) {
                    b as char
                } else {
                    '.'
                }
            })
            .collect();
        return Err(Error::Protocol {
            peer: who.to_string(),
            why: format!(
                "not a kvxfer side channel: it sent {shown:?} where a kvxfer agent sends \
                 \"KVXF\" (is this the address of an agent's listen?)"
            ),
        });
    }
    let theirs = u16::from_be_bytes([got[4], got[5]]);
    if theirs != ours {
        return Err(version(theirs));
    }
    Ok(())
}

/// The frame's bytes.
pub fn encode_frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
    b.extend_from_slice(&((payload.len() + 1) as u32).to_le_bytes());
    b.push(kind);
    b.extend_from_slice(payload);
    b
}

/// Reads one side-channel frame from any byte stream; refuses empty and oversized frames
/// before allocating.
pub fn read_frame<R: Read>(s: &mut R, who: &str) -> Result<(u8, Vec<u8>)> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    s.read_exact(&mut h)
        .map_err(|e| Error::io(format!("reading a frame header from {who}"), e))?;
    let (kind, n) = frame_header(&h, who)?;
    let mut payload = vec![0u8; n];
    s.read_exact(&mut payload)
        .map_err(|e| Error::io(format!("reading a {n}-byte frame payload from {who}"), e))?;
    Ok((kind, payload))
}

/// A frame header's kind and payload length, checked against [`MAX_FRAME`] before anything
/// is sized from it.
pub fn frame_header(h: &[u8; FRAME_HEADER_LEN], who: &str) -> Result<(u8, usize)> {
    let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(Error::Protocol {
            peer: who.to_string(),
            why: format!("frame of {len} bytes (limit {MAX_FRAME})"),
        });
    }
    Ok((h[LEN_BYTES], len - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_empty_and_oversized_frames() {
        let mut empty: &[u8] = &[0, 0, 0, 0, HELLO];
        assert!(matches!(
            read_frame(&mut empty, "t"),
            Err(Error::Protocol { .. })
        ));
        let big = ((MAX_FRAME + 1) as u32).to_le_bytes();
        let mut b: &[u8] = &[big[0], big[1], big[2], big[3], HELLO];
        assert!(matches!(
            read_frame(&mut b, "t"),
            Err(Error::Protocol { .. })
        ));
        let mut short: &[u8] = &[9, 0, 0, 0, HELLO, 1];
        assert!(matches!(read_frame(&mut short, "t"), Err(Error::Io { .. })));
    }

    proptest! {
        #[test]
        fn frame_roundtrip(kind in any::<u8>(), payload in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let b = encode_frame(kind, &payload);
            let mut r: &[u8] = &b;
            prop_assert_eq!(read_frame(&mut r, "t").unwrap(), (kind, payload));
            prop_assert!(r.is_empty());
        }
    }
}

#[cfg(test)]
mod preamble_tests {
    use super::*;

    #[test]
    fn a_foreign_stream_is_named_and_a_version_mismatch_gives_both() {
        assert!(check_preamble(&PREAMBLE, "p").is_ok());
        let e = check_preamble(b"HTTP/1.1", "p").unwrap_err().to_string();
        assert!(
            e.contains("not a kvxfer side channel") && e.contains("HTTP/1.1"),
            "{e}"
        );
        let mut v = PREAMBLE;
        v[5] = 9;
        let e = check_preamble(&v, "p").unwrap_err().to_string();
        assert!(e.contains("version 9") && e.contains("version 3"), "{e}");
        let e = check_preamble(b"KVXFSC\x00\x01", "p")
            .unwrap_err()
            .to_string();
        assert!(e.contains("version 1") && e.contains("version 3"), "{e}");
        // A line-based server sees one line and answers.
        assert!(PREAMBLE.ends_with(b"\r\n") && !PREAMBLE[..6].contains(&b'\n'));
    }
}
