//! The TCP stream lane's messages, each with a paired encoder and decoder and named sizes.
//!
//! ```text
//! hello    initiator → target  "KVXT" | version u16 | name_len u16 | name | secret [16]
//! welcome  target → initiator  status u8 | msg_len u16 | msg
//! request  initiator → target  kind u8 (1 write, 2 read; bits 4-5: the data as frames, see
//!                              below) | id u64 | nsegs u32 | notif_len u32
//!                              | { region u32 | offset u64 | len u64 }*nsegs
//!                              | write: the data, then the notification
//!                              | read:  the notification
//! reply    target → initiator  kind u8 (3 ack, 4 data) | id u64 | status u8 | msg_len u16 | msg
//!                              | data (read, status 0): the requested bytes in order
//! ```
//!
//! Bits 4-5 of a request's kind: 0, the data travels as it is; 1-3, as the frames of
//! [`crate::compress::frame`] (both ways: a write's data from the initiator, a read's data
//! from the target), split by transform none, bf16 or bytes2 respectively. Bits 6-7 are 0.

use crate::compress::planes::Transform;
use crate::wire::metadata::MAX_NAME;
use crate::wire::notify;

/// First bytes of a hello.
pub const MAGIC: &[u8; 4] = b"KVXT";
/// Lane protocol version.
pub const VERSION: u16 = 1;
/// Request kind: the data follows the segment table.
pub const K_WRITE: u8 = 1;
/// Request kind: the target sends the data after its reply.
pub const K_READ: u8 = 2;
/// Reply kind to a write.
pub const K_ACK: u8 = 3;
/// Reply kind to a read (the data follows when the status is 0).
pub const K_DATA: u8 = 4;
/// Bytes of a hello before the name: magic, version, name length.
pub const HELLO_FIXED_LEN: usize = 4 + 2 + 2;
/// Bytes of the lane secret.
pub const SECRET_LEN: usize = 16;
/// Bytes of a welcome before its message: status, message length.
pub const WELCOME_FIXED_LEN: usize = 1 + 2;
/// Bytes of a request header: kind, id, segment count, notification length.
pub const HEADER_LEN: usize = 1 + 8 + 4 + 4;
/// Bytes of one segment: region, offset, length.
pub const SEG_LEN: usize = 4 + 8 + 8;
/// Bytes of a reply before its message: kind, id, status, message length.
pub const REPLY_FIXED_LEN: usize = 1 + 8 + 1 + 2;
/// Most segments in one request (20 MiB of header).
pub const MAX_SEGS: usize = 1 << 20;
/// Longest notification a request carries (an encoded notification).
pub const MAX_NOTIF_LEN: usize = notify::MAX_ENCODED;

/// A parsed request header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// 1 write, 2 read.
    pub kind: u8,
    /// Initiator's transfer id.
    pub id: u64,
    /// Segments that follow.
    pub nsegs: usize,
    /// Notification bytes that follow.
    pub notif_len: usize,
    /// The data travels as frames split by this transform (None: raw).
    pub frames: Option<Transform>,
}

impl RequestHeader {
    /// Appends the header's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let f = self.frames.map_or(0, |t| t.code() + 1);
        out.push(self.kind | (f << 4));
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&(self.nsegs as u32).to_le_bytes());
        out.extend_from_slice(&(self.notif_len as u32).to_le_bytes());
    }
}

/// Parses and bounds-checks a request header.
pub fn parse_request_header(hdr: &[u8; HEADER_LEN]) -> std::result::Result<RequestHeader, String> {
    let kind = hdr[0] & 0x0f;
    let frames = match (hdr[0] >> 4) & 0x03 {
        0 => None,
        f => Transform::from_code(f - 1),
    };
    let id = request_id(hdr);
    let nsegs = u32::from_le_bytes([hdr[9], hdr[10], hdr[11], hdr[12]]) as usize;
    let nlen = u32::from_le_bytes([hdr[13], hdr[14], hdr[15], hdr[16]]) as usize;
    if (kind != K_WRITE && kind != K_READ)
        || hdr[0] & 0xc0 != 0
        || nsegs > MAX_SEGS
        || nlen > MAX_NOTIF_LEN
    {
        return Err(format!(
            "malformed request kind {:#04x} nsegs {nsegs} notification {nlen}",
            hdr[0]
        ));
    }
    Ok(RequestHeader {
        kind,
        id,
        nsegs,
        notif_len: nlen,
        frames,
    })
}

/// The transfer id of a request header, valid or not (for the refusal's reply).
pub fn request_id(hdr: &[u8; HEADER_LEN]) -> u64 {
    let mut id = [0u8; 8];
    id.copy_from_slice(&hdr[1..9]);
    u64::from_le_bytes(id)
}

/// One segment of a request: a piece of one of the target's regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The target's region id.
    pub region: u32,
    /// Byte offset in the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Segment {
    /// Appends the segment's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.region.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }

    /// Reads one segment from exactly [`SEG_LEN`] bytes.
    pub fn read(s: &[u8; SEG_LEN]) -> Segment {
        let mut r = [0u8; 4];
        let mut o = [0u8; 8];
        let mut l = [0u8; 8];
        r.copy_from_slice(&s[0..4]);
        o.copy_from_slice(&s[4..12]);
        l.copy_from_slice(&s[12..20]);
        Segment {
            region: u32::from_le_bytes(r),
            offset: u64::from_le_bytes(o),
            len: u64::from_le_bytes(l),
        }
    }
}

/// Parses a segment table: `(region, offset, len)` per [`SEG_LEN`] bytes; trailing bytes are
/// an error.
pub fn parse_segments(raw: &[u8]) -> std::result::Result<Vec<(u32, u64, u64)>, String> {
    segments(raw).map(|v| v.map(|s| (s.region, s.offset, s.len)).collect())
}

/// The segments of a table, or an error for a length that is not a whole number of them.
pub fn segments(raw: &[u8]) -> std::result::Result<impl Iterator<Item = Segment> + '_, String> {
    if !raw.len().is_multiple_of(SEG_LEN) {
        return Err(format!("segment table of {} bytes", raw.len()));
    }
    Ok(raw.chunks_exact(SEG_LEN).map(|s| {
        let mut a = [0u8; SEG_LEN];
        a.copy_from_slice(s);
        Segment::read(&a)
    }))
}

/// An initiator's hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello<'a> {
    /// The initiator agent's name.
    pub name: &'a str,
    /// The target's lane secret, from its metadata.
    pub secret: [u8; SECRET_LEN],
}

impl Hello<'_> {
    /// The hello's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(HELLO_FIXED_LEN + self.name.len() + SECRET_LEN);
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        h.extend_from_slice(self.name.as_bytes());
        h.extend_from_slice(&self.secret);
        h
    }
}

/// Parses the fixed part of a hello: the name length that follows, if valid.
pub fn parse_hello(h: &[u8; HELLO_FIXED_LEN]) -> std::result::Result<usize, String> {
    let name_len = u16::from_le_bytes([h[6], h[7]]) as usize;
    if &h[..4] != MAGIC || u16::from_le_bytes([h[4], h[5]]) != VERSION {
        return Err("bad magic or version".into());
    }
    if name_len == 0 || name_len > MAX_NAME {
        return Err(format!("name of {name_len} bytes"));
    }
    Ok(name_len)
}

/// Splits the rest of a hello (`name_len` bytes of name, then the secret) into the name and
/// the secret; `rest` has exactly `name_len + SECRET_LEN` bytes.
pub fn parse_hello_rest(rest: &[u8], name_len: usize) -> Option<(String, [u8; SECRET_LEN])> {
    if rest.len() != name_len + SECRET_LEN {
        return None;
    }
    let mut secret = [0u8; SECRET_LEN];
    secret.copy_from_slice(&rest[name_len..]);
    Some((
        String::from_utf8_lossy(&rest[..name_len]).into_owned(),
        secret,
    ))
}

/// A target's answer to a hello (0: accepted), or a reply's status with its message.
pub fn encode_welcome(status: u8, msg: &str) -> Vec<u8> {
    let msg = clip(msg);
    let mut b = Vec::with_capacity(WELCOME_FIXED_LEN + msg.len());
    b.push(status);
    b.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    b.extend_from_slice(msg);
    b
}

/// The status and message length of a welcome.
pub fn parse_welcome(w: &[u8; WELCOME_FIXED_LEN]) -> (u8, usize) {
    (w[0], u16::from_le_bytes([w[1], w[2]]) as usize)
}

/// The fixed part of a target's reply to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyHeader {
    /// [`K_ACK`] or [`K_DATA`].
    pub kind: u8,
    /// The request's transfer id.
    pub id: u64,
    /// 0: done (write) or data follows (read); else refused, the message says why.
    pub status: u8,
    /// Message bytes that follow.
    pub msg_len: usize,
}

impl ReplyHeader {
    /// Reads the fixed part of a reply.
    pub fn read(h: &[u8; REPLY_FIXED_LEN]) -> ReplyHeader {
        let mut id = [0u8; 8];
        id.copy_from_slice(&h[1..9]);
        ReplyHeader {
            kind: h[0],
            id: u64::from_le_bytes(id),
            status: h[9],
            msg_len: u16::from_le_bytes([h[10], h[11]]) as usize,
        }
    }
}

/// A reply's bytes (its message clipped to what the length field holds).
pub fn encode_reply(kind: u8, id: u64, status: u8, msg: &str) -> Vec<u8> {
    let msg = clip(msg);
    let mut b = Vec::with_capacity(REPLY_FIXED_LEN + msg.len());
    b.push(kind);
    b.extend_from_slice(&id.to_le_bytes());
    b.push(status);
    b.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    b.extend_from_slice(msg);
    b
}

fn clip(msg: &str) -> &[u8] {
    &msg.as_bytes()[..msg.len().min(u16::MAX as usize)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn sizes_match_the_encoders() {
        let mut b = Vec::new();
        RequestHeader {
            kind: K_WRITE,
            id: 1,
            nsegs: 2,
            notif_len: 3,
            frames: None,
        }
        .encode(&mut b);
        assert_eq!(b.len(), HEADER_LEN);
        b.clear();
        Segment {
            region: 1,
            offset: 2,
            len: 3,
        }
        .encode(&mut b);
        assert_eq!(b.len(), SEG_LEN);
        assert_eq!(encode_reply(K_ACK, 1, 0, "").len(), REPLY_FIXED_LEN);
        assert_eq!(encode_welcome(0, "").len(), WELCOME_FIXED_LEN);
        let h = Hello {
            name: "a",
            secret: [7; SECRET_LEN],
        }
        .encode();
        assert_eq!(h.len(), HELLO_FIXED_LEN + 1 + SECRET_LEN);
    }

    #[test]
    fn refusals() {
        let mut h = [0u8; HEADER_LEN];
        h[0] = 9;
        assert!(parse_request_header(&h).is_err());
        h[0] = K_WRITE | 0x40;
        assert!(parse_request_header(&h).is_err(), "reserved bits");
        h[0] = K_READ;
        h[9..13].copy_from_slice(&((MAX_SEGS + 1) as u32).to_le_bytes());
        assert!(parse_request_header(&h).is_err());
        assert!(parse_segments(&[0u8; SEG_LEN + 1]).is_err());
        let mut hello = [0u8; HELLO_FIXED_LEN];
        hello[..4].copy_from_slice(MAGIC);
        hello[4..6].copy_from_slice(&VERSION.to_le_bytes());
        assert!(parse_hello(&hello).is_err(), "empty name");
        hello[6..8].copy_from_slice(&((MAX_NAME + 1) as u16).to_le_bytes());
        assert!(parse_hello(&hello).is_err(), "name too long");
        hello[0] = b'X';
        assert!(parse_hello(&hello).is_err(), "magic");
    }

    #[test]
    fn long_messages_are_clipped_to_the_length_field() {
        let m = "x".repeat(70_000);
        let b = encode_reply(K_DATA, 5, 1, &m);
        let mut f = [0u8; REPLY_FIXED_LEN];
        f.copy_from_slice(&b[..REPLY_FIXED_LEN]);
        let r = ReplyHeader::read(&f);
        assert_eq!(r.msg_len, u16::MAX as usize);
        assert_eq!(b.len(), REPLY_FIXED_LEN + r.msg_len);
    }

    proptest! {
        #[test]
        fn request_roundtrip(write in any::<bool>(), id in any::<u64>(), nsegs in 0..=MAX_SEGS,
                             notif_len in 0..=MAX_NOTIF_LEN, f in 0u8..4) {
            let frames = f.checked_sub(1).and_then(Transform::from_code);
            let h = RequestHeader { kind: if write { K_WRITE } else { K_READ }, id, nsegs, notif_len, frames };
            let mut b = Vec::new();
            h.encode(&mut b);
            let a: [u8; HEADER_LEN] = b.as_slice().try_into().unwrap();
            prop_assert_eq!(parse_request_header(&a), Ok(h));
        }

        #[test]
        fn segments_roundtrip(segs in proptest::collection::vec((any::<u32>(), any::<u64>(), any::<u64>()), 0..64)) {
            let mut b = Vec::new();
            for &(region, offset, len) in &segs {
                Segment { region, offset, len }.encode(&mut b);
            }
            prop_assert_eq!(b.len(), segs.len() * SEG_LEN);
            prop_assert_eq!(parse_segments(&b), Ok(segs));
        }

        #[test]
        fn hello_roundtrip(name in "[a-z0-9-]{1,255}", secret in any::<[u8; SECRET_LEN]>()) {
            let b = Hello { name: &name, secret }.encode();
            let fixed: [u8; HELLO_FIXED_LEN] = b[..HELLO_FIXED_LEN].try_into().unwrap();
            let n = parse_hello(&fixed).unwrap();
            prop_assert_eq!(parse_hello_rest(&b[HELLO_FIXED_LEN..], n), Some((name, secret)));
        }

        #[test]
        fn reply_roundtrip(data in any::<bool>(), id in any::<u64>(), status in any::<u8>(), msg in ".{0,64}") {
            let kind = if data { K_DATA } else { K_ACK };
            let b = encode_reply(kind, id, status, &msg);
            let f: [u8; REPLY_FIXED_LEN] = b[..REPLY_FIXED_LEN].try_into().unwrap();
            let r = ReplyHeader::read(&f);
            prop_assert_eq!(r, ReplyHeader { kind, id, status, msg_len: msg.len() });
            prop_assert_eq!(&b[REPLY_FIXED_LEN..], msg.as_bytes());
        }

        #[test]
        fn welcome_roundtrip(status in any::<u8>(), msg in ".{0,64}") {
            let b = encode_welcome(status, &msg);
            let f: [u8; WELCOME_FIXED_LEN] = b[..WELCOME_FIXED_LEN].try_into().unwrap();
            prop_assert_eq!(parse_welcome(&f), (status, msg.len()));
        }
    }
}
