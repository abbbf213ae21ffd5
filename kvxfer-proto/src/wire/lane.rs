//! The TCP stream lane's messages, each with a paired encoder and decoder and named sizes.
//!
//! ```text
//! hello    initiator → target  "KVXT" | version u16 | name_len u16 | name | secret [16]
//!                              | epoch u64
//! welcome  target → initiator  status u8 | epoch u64 | msg_len u16 | msg
//! request  initiator → target  kind u8 (1 write, 2 read; bits 4-5: the data as frames, see
//!                              below; bit 6: a paged table) | id u64 | nsegs u32 | notif_len u32
//!                              | { region u32 | offset u64 | len u64 }*nsegs
//!                                (paged: the paged table below, of nsegs bytes)
//!                              | write: the data, then the notification
//!                              | read:  the notification
//! reply    target → initiator  kind u8 (3 ack, 4 data) | id u64 | status u8 | msg_len u16 | msg
//!                              | data (read, status 0): the requested bytes in order
//! ```
//!
//! With a shared secret the lane is sealed ([`crate::lane_seal`]): the initiator opens with
//! `"KVXN" | Noise handshake` (PSK from the secret and the target's lane credential), the
//! target answers with its handshake message, and every message above then travels inside
//! records `len u32 | sealed bytes` of at most [`RECORD_PLAIN`] plaintext bytes. The first
//! record is `mode u8 | hello`; the mode says whether the blocks' bytes (a write's data, a
//! read's data, their frames) travel sealed too or as they are, between the records.
//!
//! Bits 4-5 of a request's kind: 0, the data travels as it is; 1-3, as the frames of
//! [`crate::compress::frame`] (both ways: a write's data from the initiator, a read's data
//! from the target), split by transform none, bf16 or bytes2 respectively. Bit 6 ([`K_PAGED`]):
//! the blocks are described in the paged form ([`crate::paged`]) instead of one segment each:
//!
//! ```text
//! paged table  total u64 | nlists u32 | nentries u32
//!              | { count u32 | block u32 * count } * nlists
//!              | { region u32 | offset u64 | block_len u64 | stride u64 | list u32 } * nentries
//! ```
//!
//! Entry e moves the blocks of list `list`, in order, block b being the `block_len` bytes at
//! `offset + b * stride` of `region`; the entries share their lists (a request's block indices
//! travel once, not once per layer); `total` is the sum of the entries' bytes, which a target
//! that refuses the request drains without decoding the rest. The data of a paged request moves
//! in windows ([`crate::paged::Windows`]) cut at the same blocks on both ends. Bit 7 is 0.
//!
//! The epochs fence a writer ([`W_FENCED`]): the target counts the fences of each initiator
//! name; a hello names the count the initiator last learned when its transfer was queued, and
//! one that names fewer than the target's count is refused with the count, which the
//! initiator learns for the transfers it queues after. A transfer queued before the initiator
//! learned of a fence is so refused, however late its connection opens.

use std::collections::HashMap;
use std::sync::Arc;

use crate::compress::planes::Transform;
use crate::paged::Paged;
use crate::types::RegionId;
use crate::wire::metadata::MAX_NAME;
use crate::wire::notify;

/// First bytes of a hello.
pub const MAGIC: &[u8; 4] = b"KVXT";
/// Lane protocol version (2: the fence epochs in the hello and the welcome).
pub const VERSION: u16 = 2;
/// First bytes of a sealed lane (a target with a shared secret takes no other): the
/// initiator's Noise handshake message follows ([`crate::lane_seal`]).
pub const SEALED_MAGIC: &[u8; 4] = b"KVXN";
/// Bytes of a sealed record's length prefix (`u32` LE, the sealed bytes that follow).
pub const RECORD_LEN_BYTES: usize = 4;
/// Most plaintext bytes of one sealed record.
pub const RECORD_PLAIN: usize = 1 << 20;
/// Data mode of a sealed lane (the first byte of its first record): the blocks' bytes travel
/// as they are; every control byte is sealed.
pub const MODE_CLEAR_DATA: u8 = 0;
/// Data mode of a sealed lane: the blocks' bytes travel sealed too.
pub const MODE_SEALED_DATA: u8 = 1;
/// Data mode of a sealed lane between two processes of one host: the blocks' bytes go
/// through a shared window the target offers after its welcome ([`super::lane_window`]), or
/// as they are on the socket where it offers none or the initiator declines it.
pub const MODE_WINDOW_DATA: u8 = 2;

/// How a sealed lane connection moves the blocks' bytes (its opening's first byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataMode {
    /// On the socket, as they are ([`MODE_CLEAR_DATA`]).
    Clear,
    /// On the socket, sealed ([`MODE_SEALED_DATA`]).
    Sealed,
    /// Through a shared window where one is taken ([`MODE_WINDOW_DATA`]).
    Window,
}

impl DataMode {
    /// The mode's byte.
    pub fn byte(self) -> u8 {
        match self {
            DataMode::Clear => MODE_CLEAR_DATA,
            DataMode::Sealed => MODE_SEALED_DATA,
            DataMode::Window => MODE_WINDOW_DATA,
        }
    }

    /// The mode of a byte, if known.
    pub fn of(b: u8) -> Option<DataMode> {
        match b {
            MODE_CLEAR_DATA => Some(DataMode::Clear),
            MODE_SEALED_DATA => Some(DataMode::Sealed),
            MODE_WINDOW_DATA => Some(DataMode::Window),
            _ => None,
        }
    }
}
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
/// Bytes of a hello's epoch (after its secret).
pub const EPOCH_LEN: usize = 8;
/// Bytes of a welcome before its message: status, epoch, message length.
pub const WELCOME_FIXED_LEN: usize = 1 + 8 + 2;
/// Welcome status: accepted.
pub const W_OK: u8 = 0;
/// Welcome status: refused (a bad hello, a wrong secret); the message says why.
pub const W_REFUSED: u8 = 1;
/// Welcome status: the initiator was fenced after the epoch its hello named; the welcome's
/// epoch is the target's count now.
pub const W_FENCED: u8 = 2;
/// Bytes of a request header: kind, id, segment count, notification length.
pub const HEADER_LEN: usize = 1 + 8 + 4 + 4;
/// Bytes of one segment: region, offset, length.
pub const SEG_LEN: usize = 4 + 8 + 8;
/// Bytes of a reply before its message: kind, id, status, message length.
pub const REPLY_FIXED_LEN: usize = 1 + 8 + 1 + 2;
/// Most segments in one request (20 MiB of header).
pub const MAX_SEGS: usize = 1 << 20;
/// Request kind bit: the segment table is a paged table of `nsegs` bytes.
pub const K_PAGED: u8 = 0x40;
/// Most bytes of a paged table (the flat table's limit).
pub const MAX_PAGED_TABLE: usize = MAX_SEGS * SEG_LEN;
/// Bytes of a paged table before its lists: total, list count, entry count.
pub const PAGED_FIXED_LEN: usize = 8 + 4 + 4;
/// Bytes of one paged entry: region, offset, block length, stride, list.
pub const PAGED_ENTRY_LEN: usize = 4 + 8 + 8 + 8 + 4;
/// Longest notification a request carries (an encoded notification).
pub const MAX_NOTIF_LEN: usize = notify::MAX_ENCODED;

/// A parsed request header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// 1 write, 2 read.
    pub kind: u8,
    /// Initiator's transfer id.
    pub id: u64,
    /// Segments that follow (paged: bytes of the paged table).
    pub nsegs: usize,
    /// Notification bytes that follow.
    pub notif_len: usize,
    /// The data travels as frames split by this transform (None: raw).
    pub frames: Option<Transform>,
    /// The table is a paged table ([`encode_paged`]) of `nsegs` bytes.
    pub paged: bool,
}

impl RequestHeader {
    /// Bytes of the table that follows the header.
    pub fn table_len(&self) -> usize {
        if self.paged {
            self.nsegs
        } else {
            self.nsegs * SEG_LEN
        }
    }

    /// Appends the header's bytes to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let f = self.frames.map_or(0, |t| t.code() + 1);
        let p = if self.paged { K_PAGED } else { 0 };
        out.push(self.kind | (f << 4) | p);
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
    let paged = hdr[0] & K_PAGED != 0;
    let table_ok = if paged {
        (PAGED_FIXED_LEN..=MAX_PAGED_TABLE).contains(&nsegs)
    } else {
        nsegs <= MAX_SEGS
    };
    if (kind != K_WRITE && kind != K_READ)
        || hdr[0] & 0x80 != 0
        || !table_ok
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
        paged,
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

/// What a request's table describes: one segment per piece, or the paged form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Table {
    /// One segment per piece.
    Flat(Vec<Segment>),
    /// Entries of blocks ([`parse_paged`]).
    Paged(PagedTable),
}

impl Table {
    /// The bytes the table moves.
    pub fn total(&self) -> u64 {
        match self {
            Table::Flat(segs) => segs.iter().fold(0u64, |a, s| a.saturating_add(s.len)),
            Table::Paged(p) => p.total,
        }
    }
}

/// A parsed paged table: the entries (regions of the target), their lists shared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PagedTable {
    /// The bytes of all entries.
    pub total: u64,
    /// The entries, in transfer order.
    pub entries: Vec<Paged>,
}

/// Bytes of the paged table of `entries` ([`encode_paged`]).
pub fn paged_table_len(entries: &[Paged]) -> usize {
    let mut lists = Lists::default();
    let mut len = PAGED_FIXED_LEN + entries.len() * PAGED_ENTRY_LEN;
    for e in entries {
        if let (_, true) = lists.index(&e.blocks) {
            len += 4 + 4 * e.blocks.len();
        }
    }
    len
}

/// The distinct block lists of a table, in order of first use (the same `Arc` is one list).
#[derive(Default)]
struct Lists<'a> {
    seen: HashMap<(*const u32, usize), u32>,
    order: Vec<&'a Arc<[u32]>>,
}

impl<'a> Lists<'a> {
    /// The list's index, and whether it is new.
    fn index(&mut self, b: &'a Arc<[u32]>) -> (u32, bool) {
        let key = (b.as_ptr(), b.len());
        if let Some(&i) = self.seen.get(&key) {
            return (i, false);
        }
        let i = self.order.len() as u32;
        self.seen.insert(key, i);
        self.order.push(b);
        (i, true)
    }
}

/// Appends the paged table of `entries` to `out` (its length: [`paged_table_len`]).
pub fn encode_paged(entries: &[Paged], out: &mut Vec<u8>) {
    let mut lists = Lists::default();
    let idx: Vec<u32> = entries.iter().map(|e| lists.index(&e.blocks).0).collect();
    let total = entries
        .iter()
        .fold(0u64, |a, e| a.saturating_add(e.bytes()));
    out.extend_from_slice(&total.to_le_bytes());
    out.extend_from_slice(&(lists.order.len() as u32).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for l in &lists.order {
        out.extend_from_slice(&(l.len() as u32).to_le_bytes());
        for b in l.iter() {
            out.extend_from_slice(&b.to_le_bytes());
        }
    }
    for (e, i) in entries.iter().zip(idx) {
        out.extend_from_slice(&e.region.0.to_le_bytes());
        out.extend_from_slice(&e.offset.to_le_bytes());
        out.extend_from_slice(&e.block_len.to_le_bytes());
        out.extend_from_slice(&e.stride.to_le_bytes());
        out.extend_from_slice(&i.to_le_bytes());
    }
}

/// The `total` a paged table starts with (what a refused write's data adds up to).
pub fn paged_total(prefix: &[u8; 8]) -> u64 {
    u64::from_le_bytes(*prefix)
}

/// A little-endian reader over a table that fails, with what it was reading, past the end.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(format!("paged table ends inside {what}"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4, what)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }
}

/// Parses a paged table: every list inside the table, every entry naming a list, no trailing
/// bytes, and `total` equal to the entries' bytes. The bounds of each entry against the
/// target's regions are the target's to check ([`crate::paged::resolve_paged`]).
pub fn parse_paged(raw: &[u8]) -> std::result::Result<PagedTable, String> {
    let mut r = Reader { b: raw };
    let total = r.u64("the total")?;
    let nlists = r.u32("the list count")? as usize;
    let nentries = r.u32("the entry count")? as usize;
    // Every list takes 4 bytes at least, every entry its size: no count can promise more
    // than the table holds.
    if nlists.saturating_mul(4) > r.b.len() || nentries.saturating_mul(PAGED_ENTRY_LEN) > r.b.len()
    {
        return Err(format!(
            "paged table of {} bytes claims {nlists} lists and {nentries} entries",
            raw.len()
        ));
    }
    // encode_paged sends each list once and only when an entry uses it: a list no entry uses
    // is refused, so that a table cannot hold more lists than entries (a list in memory costs
    // several times its 4 bytes on the wire; the charge, `table_bytes`, counts on it).
    if nlists > nentries {
        return Err(format!(
            "paged table of {nlists} lists for {nentries} entries: a list no entry uses"
        ));
    }
    let mut used = vec![false; nlists];
    let mut lists: Vec<Arc<[u32]>> = Vec::with_capacity(nlists);
    for k in 0..nlists {
        let n = r.u32("a list's length")? as usize;
        let b = r.take(n.saturating_mul(4), "a list")?;
        if b.len() != n * 4 {
            return Err(format!("list #{k} of {n} blocks overflows"));
        }
        lists.push(
            b.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
    }
    let mut entries = Vec::with_capacity(nentries);
    let mut sum = 0u64;
    for k in 0..nentries {
        let region = r.u32("an entry")?;
        let offset = r.u64("an entry")?;
        let block_len = r.u64("an entry")?;
        let stride = r.u64("an entry")?;
        let list = r.u32("an entry")? as usize;
        let blocks = lists
            .get(list)
            .ok_or_else(|| format!("entry #{k} names list {list} of {nlists}"))?
            .clone();
        used[list] = true;
        sum = (blocks.len() as u64)
            .checked_mul(block_len)
            .and_then(|b| sum.checked_add(b))
            .ok_or_else(|| format!("entry #{k}: the table's bytes overflow"))?;
        entries.push(Paged {
            region: RegionId(region),
            offset,
            block_len,
            stride,
            blocks,
        });
    }
    if !r.b.is_empty() {
        return Err(format!("{} bytes after the paged table", r.b.len()));
    }
    if let Some(k) = used.iter().position(|u| !u) {
        return Err(format!("list #{k} of the paged table is used by no entry"));
    }
    if sum != total {
        return Err(format!("paged table says {total} bytes, its entries {sum}"));
    }
    Ok(PagedTable { total, entries })
}

/// An initiator's hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello<'a> {
    /// The initiator agent's name.
    pub name: &'a str,
    /// The target's lane secret, from its metadata.
    pub secret: [u8; SECRET_LEN],
    /// The target's fence count for this initiator, as the initiator last learned it.
    pub epoch: u64,
}

/// The part of a hello after its fixed part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloRest {
    /// The initiator agent's name.
    pub name: String,
    /// The lane secret it presents.
    pub secret: [u8; SECRET_LEN],
    /// The fence count it last learned.
    pub epoch: u64,
}

impl Hello<'_> {
    /// The hello's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(HELLO_FIXED_LEN + self.name.len() + SECRET_LEN + EPOCH_LEN);
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        h.extend_from_slice(self.name.as_bytes());
        h.extend_from_slice(&self.secret);
        h.extend_from_slice(&self.epoch.to_le_bytes());
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

/// Bytes of a hello after its fixed part, for a name of `name_len` bytes.
pub const fn hello_rest_len(name_len: usize) -> usize {
    name_len + SECRET_LEN + EPOCH_LEN
}

/// Parses the rest of a hello (`name_len` bytes of name, the secret, the epoch); `rest` has
/// exactly [`hello_rest_len`] bytes.
pub fn parse_hello_rest(rest: &[u8], name_len: usize) -> Option<HelloRest> {
    if rest.len() != hello_rest_len(name_len) {
        return None;
    }
    let mut secret = [0u8; SECRET_LEN];
    secret.copy_from_slice(&rest[name_len..name_len + SECRET_LEN]);
    let mut epoch = [0u8; EPOCH_LEN];
    epoch.copy_from_slice(&rest[name_len + SECRET_LEN..]);
    Some(HelloRest {
        name: String::from_utf8_lossy(&rest[..name_len]).into_owned(),
        secret,
        epoch: u64::from_le_bytes(epoch),
    })
}

/// A target's answer to a hello ([`W_OK`], [`W_REFUSED`], [`W_FENCED`]) with the epoch it
/// tells and its message.
pub fn encode_welcome(status: u8, epoch: u64, msg: &str) -> Vec<u8> {
    let msg = clip(msg);
    let mut b = Vec::with_capacity(WELCOME_FIXED_LEN + msg.len());
    b.push(status);
    b.extend_from_slice(&epoch.to_le_bytes());
    b.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    b.extend_from_slice(msg);
    b
}

/// The status, epoch and message length of a welcome.
pub fn parse_welcome(w: &[u8; WELCOME_FIXED_LEN]) -> (u8, u64, usize) {
    let mut epoch = [0u8; 8];
    epoch.copy_from_slice(&w[1..9]);
    (
        w[0],
        u64::from_le_bytes(epoch),
        u16::from_le_bytes([w[9], w[10]]) as usize,
    )
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
            paged: false,
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
        assert_eq!(encode_welcome(W_OK, 0, "").len(), WELCOME_FIXED_LEN);
        let h = Hello {
            name: "a",
            secret: [7; SECRET_LEN],
            epoch: 3,
        }
        .encode();
        assert_eq!(h.len(), HELLO_FIXED_LEN + hello_rest_len(1));
    }

    #[test]
    fn refusals() {
        let mut h = [0u8; HEADER_LEN];
        h[0] = 9;
        assert!(parse_request_header(&h).is_err());
        h[0] = K_WRITE | 0x80;
        assert!(parse_request_header(&h).is_err(), "reserved bits");
        h[0] = K_WRITE | K_PAGED;
        h[9..13].copy_from_slice(&((PAGED_FIXED_LEN - 1) as u32).to_le_bytes());
        assert!(
            parse_request_header(&h).is_err(),
            "paged table shorter than its fixed part"
        );
        h[9..13].copy_from_slice(&((MAX_PAGED_TABLE + 1) as u32).to_le_bytes());
        assert!(parse_request_header(&h).is_err(), "paged table too long");
        h[9..13].copy_from_slice(&(PAGED_FIXED_LEN as u32).to_le_bytes());
        assert!(parse_request_header(&h).unwrap().paged);
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
        fn request_roundtrip(write in any::<bool>(), id in any::<u64>(), nsegs in PAGED_FIXED_LEN..=MAX_SEGS,
                             notif_len in 0..=MAX_NOTIF_LEN, f in 0u8..4, paged in any::<bool>()) {
            let frames = f.checked_sub(1).and_then(Transform::from_code);
            let h = RequestHeader { kind: if write { K_WRITE } else { K_READ }, id, nsegs, notif_len, frames, paged };
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
        fn paged_roundtrip(lists in proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..40), 1..4),
                           entries in proptest::collection::vec((any::<u32>(), any::<u64>(), 1u64..1 << 20, any::<u64>(), any::<usize>()), 0..24)) {
            let lists: Vec<Arc<[u32]>> = lists.into_iter().map(Into::into).collect();
            let entries: Vec<Paged> = entries.into_iter().map(|(region, offset, block_len, stride, l)| Paged {
                region: RegionId(region), offset, block_len, stride, blocks: lists[l % lists.len()].clone(),
            }).collect();
            let mut b = Vec::new();
            encode_paged(&entries, &mut b);
            prop_assert_eq!(b.len(), paged_table_len(&entries));
            let t = parse_paged(&b).unwrap();
            prop_assert_eq!(t.total, entries.iter().map(Paged::bytes).sum::<u64>());
            prop_assert_eq!(paged_total(b[..8].try_into().unwrap()), t.total);
            prop_assert_eq!(&t.entries, &entries);
            // Every cut and every flipped byte is an error or a table that says what it holds.
            // Under Miri (~1000x slower) every 97th cut.
            for cut in (0..b.len()).step_by(if cfg!(miri) { 97 } else { 1 }) {
                prop_assert!(parse_paged(&b[..cut]).is_err());
            }
            let mut longer = b.clone();
            longer.push(0);
            prop_assert!(parse_paged(&longer).is_err());
        }

        #[test]
        fn paged_tables_from_anywhere_parse_or_fail_typed(raw in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(t) = parse_paged(&raw) {
                prop_assert_eq!(t.total, t.entries.iter().map(Paged::bytes).sum::<u64>());
            }
        }

        #[test]
        fn hello_roundtrip(name in "[a-z0-9-]{1,255}", secret in any::<[u8; SECRET_LEN]>(), epoch in any::<u64>()) {
            let b = Hello { name: &name, secret, epoch }.encode();
            let fixed: [u8; HELLO_FIXED_LEN] = b[..HELLO_FIXED_LEN].try_into().unwrap();
            let n = parse_hello(&fixed).unwrap();
            prop_assert_eq!(b.len(), HELLO_FIXED_LEN + hello_rest_len(n));
            prop_assert_eq!(parse_hello_rest(&b[HELLO_FIXED_LEN..], n), Some(HelloRest { name, secret, epoch }));
            prop_assert_eq!(parse_hello_rest(&b[HELLO_FIXED_LEN..b.len() - 1], n), None);
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
        fn welcome_roundtrip(status in any::<u8>(), epoch in any::<u64>(), msg in ".{0,64}") {
            let b = encode_welcome(status, epoch, &msg);
            let f: [u8; WELCOME_FIXED_LEN] = b[..WELCOME_FIXED_LEN].try_into().unwrap();
            prop_assert_eq!(parse_welcome(&f), (status, epoch, msg.len()));
            prop_assert_eq!(&b[WELCOME_FIXED_LEN..], msg.as_bytes());
        }
    }
}
