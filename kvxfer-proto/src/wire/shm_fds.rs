//! The shared-memory lane's hand-over: a same-host peer connects to the agent's Unix socket
//! ([`super::lane_entries::ShmLaneInfo`]), presents the token from the agent's metadata, and
//! is handed the agent's memory files (memfds) with `SCM_RIGHTS`, never told a pid and a
//! descriptor number to open through `/proc`. The socket checks the asker's user with
//! `SO_PEERCRED`; the asker checks the socket's owner is the pid the metadata names.
//!
//! On the wire (little endian):
//! - the ask: `magic "KVXS" | version u8 | token [32]`;
//! - the answer, frames until [`FdFrame::End`] or [`FdFrame::Refused`]:
//!   `kind u8 | count u16 | body`. A batch (kind 1) carries `count` entries of
//!   `region u32 | len u64` and, attached to its first byte, exactly `count` descriptors in
//!   the same order; the end (kind 2) has `count` 0 and no body; a refusal (kind 3) has
//!   `count` bytes of UTF-8 reason.
//!
//! The device lane's socket answers the same ask with device batches (kind 4): `count`
//! entries of `region u32 | len u64 | offset u64 | size u64 | handle kind u8 | handle [64]`
//! ([`DeviceEntry`]), one descriptor attached per entry whose handle is a file
//! ([`DeviceHandle::File`]), in entry order.
//!
//! The first entry handed over is the agent's registration page ([`CONTROL_REGION`]): a
//! memfd of [`CONTROL_WORDS`] words the owner writes and peers map read-only. Word
//! [`control_slot`]`(id)` holds [`alive_word`]`(id)` while region `id` is registered, and
//! anything else once it is deregistered, so that a peer refuses a transfer into a region
//! its owner gave up (before it starts, and once it ends if that happened meanwhile).

/// The ask's first bytes.
pub const MAGIC: &[u8; 4] = b"KVXS";
/// This build's version of the hand-over.
pub const VERSION: u8 = 1;
/// The ask's length.
pub const ASK_LEN: usize = 4 + 1 + 32;
/// A frame's header: kind and count.
pub const HEADER_LEN: usize = 3;
/// One batch entry: region id and length.
pub const ENTRY_LEN: usize = 4 + 8;
/// Descriptors in one batch at most (the kernel's `SCM_MAX_FD` is 253).
pub const MAX_BATCH: usize = 250;
/// Longest refusal reason.
pub const MAX_REASON: usize = 512;
/// The region id under which the registration page is handed over.
pub const CONTROL_REGION: u32 = u32::MAX;
/// Words in the registration page (8 bytes each: 512 KiB, sparse until written).
pub const CONTROL_WORDS: usize = 1 << 16;

/// The word of the registration page that speaks for region `id`.
pub fn control_slot(id: u32) -> usize {
    id as usize % CONTROL_WORDS
}

/// What that word holds while region `id` is registered: its id and a set low bit, so that a
/// later region sharing the word never speaks for an earlier one.
pub fn alive_word(id: u32) -> u64 {
    (u64::from(id) << 1) | 1
}

const BATCH: u8 = 1;
const END: u8 = 2;
const REFUSED: u8 = 3;
const DEVICES: u8 = 4;
/// One device entry: region, length, offset, allocation size, handle kind and handle.
pub const DEVICE_ENTRY_LEN: usize = 4 + 8 + 8 + 8 + 1 + IPC_HANDLE_LEN;
/// A CUDA IPC memory handle's bytes (`CUipcMemHandle`).
pub const IPC_HANDLE_LEN: usize = 64;
/// Device entries in one batch at most (every one may carry a descriptor).
pub const MAX_DEVICE_BATCH: usize = 250;

/// The ask: the token the agent's metadata carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdAsk {
    /// The token, as the agent's shm lane entry gives it.
    pub token: [u8; 32],
}

impl FdAsk {
    /// The ask on the wire.
    pub fn encode(&self) -> [u8; ASK_LEN] {
        let mut b = [0u8; ASK_LEN];
        b[..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[5..].copy_from_slice(&self.token);
        b
    }

    /// The ask from its bytes: magic and version checked.
    pub fn decode(b: &[u8; ASK_LEN]) -> Result<FdAsk, String> {
        if &b[..4] != MAGIC {
            return Err("not a kvxfer shm hand-over ask (magic)".into());
        }
        if b[4] != VERSION {
            return Err(format!(
                "hand-over version {}, this build speaks {VERSION}",
                b[4]
            ));
        }
        let mut token = [0u8; 32];
        token.copy_from_slice(&b[5..]);
        Ok(FdAsk { token })
    }
}

/// One handed-over region: its id in the agent's table and its length (its descriptor
/// travels beside the frame).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdEntry {
    /// The region's id.
    pub region: u32,
    /// Its length in bytes.
    pub len: u64,
}

/// How a peer opens an exported device allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceHandle {
    /// The descriptor attached to the frame: a CUDA virtual-memory allocation exported as a
    /// POSIX file descriptor (`cuMemExportToShareableHandle`), or a simulated device's memory
    /// file.
    File,
    /// A legacy CUDA IPC handle (`cuIpcGetMemHandle`, for `cuMemAlloc` memory).
    Ipc([u8; IPC_HANDLE_LEN]),
}

/// One exported device region: the allocation it lies in (handle and size) and where in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceEntry {
    /// The region's id.
    pub region: u32,
    /// Its length in bytes.
    pub len: u64,
    /// Its offset in the exported allocation.
    pub offset: u64,
    /// The allocation's size: `offset + len` lies within it.
    pub size: u64,
    /// How to open the allocation.
    pub handle: DeviceHandle,
}

/// One frame of the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FdFrame {
    /// Regions whose descriptors are attached, in this order (at most [`MAX_BATCH`]).
    Batch(Vec<FdEntry>),
    /// Exported device regions (the device lane's socket; at most [`MAX_DEVICE_BATCH`]), a
    /// descriptor attached for each [`DeviceHandle::File`] among them, in order.
    Devices(Vec<DeviceEntry>),
    /// Nothing more follows.
    End,
    /// The ask was refused, and why.
    Refused(String),
}

/// A frame's header, decoded: what body follows and how many descriptors come with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHead {
    kind: u8,
    count: u16,
}

impl FrameHead {
    /// The header from its bytes: a known kind and a count within its bound.
    pub fn decode(b: [u8; HEADER_LEN]) -> Result<FrameHead, String> {
        let (kind, count) = (b[0], u16::from_le_bytes([b[1], b[2]]));
        let ok = match kind {
            BATCH => (1..=MAX_BATCH).contains(&usize::from(count)),
            DEVICES => (1..=MAX_DEVICE_BATCH).contains(&usize::from(count)),
            END => count == 0,
            REFUSED => usize::from(count) <= MAX_REASON,
            _ => return Err(format!("hand-over frame kind {kind}")),
        };
        if !ok {
            return Err(format!("hand-over frame kind {kind} with count {count}"));
        }
        Ok(FrameHead { kind, count })
    }

    /// The body's length.
    pub fn body_len(&self) -> usize {
        match self.kind {
            BATCH => usize::from(self.count) * ENTRY_LEN,
            DEVICES => usize::from(self.count) * DEVICE_ENTRY_LEN,
            END => 0,
            _ => usize::from(self.count),
        }
    }

    /// Descriptors a frame of this kind carries at most (a device batch: those of its
    /// entries that are files; [`FdFrame::fds`] says how many exactly).
    pub fn max_fds(&self) -> usize {
        if matches!(self.kind, BATCH | DEVICES) {
            usize::from(self.count)
        } else {
            0
        }
    }
}

impl FdFrame {
    /// Descriptors that must have come with the frame.
    pub fn fds(&self) -> usize {
        match self {
            FdFrame::Batch(e) => e.len(),
            FdFrame::Devices(e) => e.iter().filter(|d| d.handle == DeviceHandle::File).count(),
            _ => 0,
        }
    }

    /// The frame on the wire: header and body. A batch longer than [`MAX_BATCH`] or a longer
    /// reason is the caller's bug; the reason is cut at [`MAX_REASON`] bytes on a character
    /// boundary.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            FdFrame::Batch(entries) => {
                debug_assert!(!entries.is_empty() && entries.len() <= MAX_BATCH);
                b.push(BATCH);
                b.extend_from_slice(&(entries.len() as u16).to_le_bytes());
                for e in entries {
                    b.extend_from_slice(&e.region.to_le_bytes());
                    b.extend_from_slice(&e.len.to_le_bytes());
                }
            }
            FdFrame::Devices(entries) => {
                debug_assert!(!entries.is_empty() && entries.len() <= MAX_DEVICE_BATCH);
                b.push(DEVICES);
                b.extend_from_slice(&(entries.len() as u16).to_le_bytes());
                for e in entries {
                    b.extend_from_slice(&e.region.to_le_bytes());
                    b.extend_from_slice(&e.len.to_le_bytes());
                    b.extend_from_slice(&e.offset.to_le_bytes());
                    b.extend_from_slice(&e.size.to_le_bytes());
                    match &e.handle {
                        DeviceHandle::File => {
                            b.push(1);
                            b.extend_from_slice(&[0; IPC_HANDLE_LEN]);
                        }
                        DeviceHandle::Ipc(h) => {
                            b.push(2);
                            b.extend_from_slice(h);
                        }
                    }
                }
            }
            FdFrame::End => b.extend_from_slice(&[END, 0, 0]),
            FdFrame::Refused(why) => {
                let mut cut = why.len().min(MAX_REASON);
                while !why.is_char_boundary(cut) {
                    cut -= 1;
                }
                b.push(REFUSED);
                b.extend_from_slice(&(cut as u16).to_le_bytes());
                b.extend_from_slice(&why.as_bytes()[..cut]);
            }
        }
        b
    }

    /// The frame from its header and exactly [`FrameHead::body_len`] bytes of body.
    pub fn decode(head: FrameHead, body: &[u8]) -> Result<FdFrame, String> {
        if body.len() != head.body_len() {
            return Err(format!(
                "hand-over frame body of {} bytes, expected {}",
                body.len(),
                head.body_len()
            ));
        }
        Ok(match head.kind {
            BATCH => FdFrame::Batch(
                body.chunks_exact(ENTRY_LEN)
                    .map(|c| {
                        let mut r = [0u8; 4];
                        r.copy_from_slice(&c[..4]);
                        let mut l = [0u8; 8];
                        l.copy_from_slice(&c[4..]);
                        FdEntry {
                            region: u32::from_le_bytes(r),
                            len: u64::from_le_bytes(l),
                        }
                    })
                    .collect(),
            ),
            DEVICES => FdFrame::Devices(
                body.chunks_exact(DEVICE_ENTRY_LEN)
                    .map(device_entry)
                    .collect::<Result<_, _>>()?,
            ),
            END => FdFrame::End,
            _ => FdFrame::Refused(String::from_utf8_lossy(body).into_owned()),
        })
    }
}

/// One device entry from its [`DEVICE_ENTRY_LEN`] bytes: a known handle kind, the region
/// within the allocation.
fn device_entry(c: &[u8]) -> Result<DeviceEntry, String> {
    let u64_at = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&c[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let mut r = [0u8; 4];
    r.copy_from_slice(&c[..4]);
    let (region, len, offset, size) = (u32::from_le_bytes(r), u64_at(4), u64_at(12), u64_at(20));
    let mut h = [0u8; IPC_HANDLE_LEN];
    h.copy_from_slice(&c[29..]);
    let handle = match c[28] {
        // A file travels as its descriptor: the handle's bytes are zero (one encoding each).
        1 if h == [0; IPC_HANDLE_LEN] => DeviceHandle::File,
        2 => DeviceHandle::Ipc(h),
        k => return Err(format!("device region {region}: handle kind {k}")),
    };
    if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(format!(
            "device region {region}: {len} bytes at {offset} of an allocation of {size}"
        ));
    }
    Ok(DeviceEntry {
        region,
        len,
        offset,
        size,
        handle,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(f: &FdFrame) -> FdFrame {
        let b = f.encode();
        let head = FrameHead::decode([b[0], b[1], b[2]]).unwrap();
        assert_eq!(head.body_len(), b.len() - HEADER_LEN);
        FdFrame::decode(head, &b[HEADER_LEN..]).unwrap()
    }

    #[test]
    fn asks_and_frames_round_trip() {
        let ask = FdAsk { token: [5; 32] };
        assert_eq!(FdAsk::decode(&ask.encode()), Ok(ask));
        let batch = FdFrame::Batch(vec![
            FdEntry {
                region: 1,
                len: 4096,
            },
            FdEntry {
                region: u32::MAX,
                len: u64::MAX,
            },
        ]);
        assert_eq!(round(&batch), batch);
        assert_eq!(round(&FdFrame::End), FdFrame::End);
        let no = FdFrame::Refused("wrong token".into());
        assert_eq!(round(&no), no);
        let b = batch.encode();
        assert_eq!(FrameHead::decode([b[0], b[1], b[2]]).unwrap().max_fds(), 2);
        assert_eq!(batch.fds(), 2);
        let devices = FdFrame::Devices(vec![
            DeviceEntry {
                region: 3,
                len: 1 << 20,
                offset: 4096,
                size: 2 << 20,
                handle: DeviceHandle::File,
            },
            DeviceEntry {
                region: 4,
                len: 64,
                offset: 0,
                size: 64,
                handle: DeviceHandle::Ipc([7; IPC_HANDLE_LEN]),
            },
        ]);
        assert_eq!(round(&devices), devices);
        assert_eq!(devices.fds(), 1, "only the file travels as a descriptor");
    }

    #[test]
    fn a_device_entry_outside_its_allocation_is_refused() {
        let entry = |len: u64, offset: u64, size: u64, kind: u8| {
            let mut b = vec![DEVICES, 1, 0];
            b.extend_from_slice(&9u32.to_le_bytes());
            for w in [len, offset, size] {
                b.extend_from_slice(&w.to_le_bytes());
            }
            b.push(kind);
            b.extend_from_slice(&[0; IPC_HANDLE_LEN]);
            let head = FrameHead::decode([b[0], b[1], b[2]]).unwrap();
            FdFrame::decode(head, &b[HEADER_LEN..])
        };
        assert!(entry(10, 0, 10, 1).is_ok());
        assert!(entry(10, 1, 10, 1).unwrap_err().contains("10 bytes at 1"));
        assert!(entry(1, u64::MAX, u64::MAX, 2).is_err(), "wraps");
        assert!(entry(0, 0, 10, 1).is_err(), "empty");
        assert!(entry(10, 0, 10, 3).unwrap_err().contains("handle kind 3"));
        let mut b = FdFrame::Devices(vec![DeviceEntry {
            region: 1,
            len: 1,
            offset: 0,
            size: 1,
            handle: DeviceHandle::File,
        }])
        .encode();
        *b.last_mut().unwrap() = 1;
        let head = FrameHead::decode([b[0], b[1], b[2]]).unwrap();
        assert!(
            FdFrame::decode(head, &b[HEADER_LEN..]).is_err(),
            "a file handle with bytes"
        );
    }

    #[test]
    fn bad_asks_and_headers_are_refused() {
        let mut ask = FdAsk { token: [5; 32] }.encode();
        ask[0] = b'X';
        assert!(FdAsk::decode(&ask).is_err());
        let mut ask = FdAsk { token: [5; 32] }.encode();
        ask[4] = 9;
        assert!(FdAsk::decode(&ask).unwrap_err().contains("version 9"));
        assert!(FrameHead::decode([9, 0, 0]).is_err(), "kind");
        assert!(FrameHead::decode([BATCH, 0, 0]).is_err(), "empty batch");
        let over = (MAX_BATCH as u16 + 1).to_le_bytes();
        assert!(FrameHead::decode([BATCH, over[0], over[1]]).is_err());
        assert!(FrameHead::decode([END, 1, 0]).is_err());
        let long = (MAX_REASON as u16 + 1).to_le_bytes();
        assert!(FrameHead::decode([REFUSED, long[0], long[1]]).is_err());
        let head = FrameHead::decode([BATCH, 1, 0]).unwrap();
        assert!(
            FdFrame::decode(head, &[0; ENTRY_LEN - 1]).is_err(),
            "short body"
        );
    }

    #[test]
    fn a_control_word_speaks_for_one_region_only() {
        let (a, b) = (7u32, 7 + CONTROL_WORDS as u32);
        assert_eq!(control_slot(a), control_slot(b));
        assert_ne!(alive_word(a), alive_word(b));
        assert_ne!(alive_word(0), 0, "a zeroed page says nothing is registered");
        assert!(control_slot(CONTROL_REGION - 1) < CONTROL_WORDS);
    }

    #[test]
    fn a_long_reason_is_cut_on_a_character() {
        let why = "é".repeat(MAX_REASON);
        match round(&FdFrame::Refused(why)) {
            FdFrame::Refused(r) => assert_eq!(r.len(), MAX_REASON),
            f => panic!("{f:?}"),
        }
    }
}
