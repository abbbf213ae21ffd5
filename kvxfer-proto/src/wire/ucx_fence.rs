//! The UCX fence's messages: active messages between two agents' UCX engines that let an
//! owner's deregistration reach every peer whose UCX operations touch its memory, however the
//! peer loaded its metadata (side channel, by hand, etcd). UCX's emulated RMA checks no key
//! on the target, so only the initiator can stop its own puts and gets:
//!
//! ```text
//! initiator -> owner: HELLO(token, name, host, worker)     before its first RMA to the owner
//! owner -> initiator: WELCOME(token, ack, gone regions)      the initiator posts from now on
//! owner -> initiator: GONE(token, region)                    on deregistration
//! initiator -> owner: GONE_ACK(ack, region)                  nothing of it touches the region
//! initiator -> owner: BYE(ack)                               it closed its endpoint, idle
//! owner -> initiator: REFUSED(token, why)                    the HELLO was not taken in
//! ```
//!
//! An initiator that announces itself while a deregistration is under way is told of it
//! (GONE) before its WELCOME, so that nothing it queued meanwhile lands unfenced; the WELCOME
//! lists the regions deregistered or being deregistered (ranges of ids: an owner never reuses
//! one), so that what it queued for a region that went before it announced itself is
//! refused, never posted. (Gone, not live: a region registered after the WELCOME is live.)
//! An owner that cannot take an initiator in (its table full, or short of descriptors) says
//! REFUSED where it can, so that the initiator's transfers fail typed at once, not at their
//! deadline; the initiator announces itself again with its next transfer.
//!
//! `token` is drawn at random by the initiator for one owner and `ack` by the owner for one
//! initiator: a GONE or GONE_ACK is believed only with the token its receiver drew, never by a
//! name in the payload. Frames are `magic "KF" | u8 kind | fields`, little-endian, exact
//! lengths; the decoder refuses anything else and never panics.

use crate::types::HostInfo;
use crate::wire::metadata::{MAX_NAME, MAX_REGIONS, MAX_WORKER_ADDR};

const MAGIC: [u8; 2] = *b"KF";
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const GONE: u8 = 3;
const GONE_ACK: u8 = 4;
const BYE: u8 = 5;
const REFUSED: u8 = 6;
const HOST_LEN: usize = 16 + 8 + 4;
/// Most ranges of gone regions a WELCOME lists.
pub const MAX_RANGES: usize = MAX_REGIONS;
/// Longest encoded message (a WELCOME with the most ranges; a HELLO is shorter).
pub const MAX_ENCODED: usize = 3 + 16 + 4 + 8 * MAX_RANGES;
const _: () = assert!(3 + 8 + 1 + MAX_NAME + 1 + HOST_LEN + 4 + MAX_WORKER_ADDR <= MAX_ENCODED);

/// One message of the UCX fence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FenceMsg {
    /// An initiator announces itself before its first RMA to the owner: the owner makes an
    /// endpoint back to `worker` and answers [`FenceMsg::Welcome`].
    Hello {
        /// Drawn by the initiator for this owner; every GONE for it carries it.
        token: u64,
        /// The initiator's agent name, as it says: for the owner's logs and its count of the
        /// peers that did not answer, never for a decision.
        name: String,
        /// The initiator's host and process, so that an owner on the same host notices its
        /// death where UCX does not (shared memory).
        host: Option<HostInfo>,
        /// The initiator's UCX worker address.
        worker: Vec<u8>,
    },
    /// The owner took the initiator in; `ack` (drawn by the owner) goes with its answers.
    Welcome {
        /// The initiator's token, as its HELLO gave it.
        token: u64,
        /// Drawn by the owner for this initiator.
        ack: u64,
        /// The owner's regions deregistered or being deregistered, as sorted, apart
        /// `(first id, count)` ranges ([`id_ranges`]).
        gone: Vec<(u32, u32)>,
    },
    /// The owner deregisters `region`: refuse it from now on and answer once nothing touches it.
    Gone {
        /// The initiator's token.
        token: u64,
        /// The region's id.
        region: u32,
    },
    /// Nothing of the initiator's touches `region` any more.
    GoneAck {
        /// The owner's token for this initiator.
        ack: u64,
        /// The region's id.
        region: u32,
    },
    /// The initiator closed its endpoint to the owner with nothing in flight: forget it.
    Bye {
        /// The owner's token for this initiator.
        ack: u64,
    },
    /// The owner did not take the initiator in: nothing may be posted to it.
    Refused {
        /// The initiator's token, as its HELLO gave it.
        token: u64,
        /// Why.
        why: Refusal,
    },
}

/// Why an owner did not take an initiator in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It keeps as many initiators as it may.
    Full,
    /// Taking it in would open a descriptor (an endpoint back, a pidfd) that the owner's
    /// reserve needs.
    Descriptors,
}

impl Refusal {
    fn code(self) -> u8 {
        match self {
            Refusal::Full => 1,
            Refusal::Descriptors => 2,
        }
    }

    fn of(code: u8) -> Option<Refusal> {
        match code {
            1 => Some(Refusal::Full),
            2 => Some(Refusal::Descriptors),
            _ => None,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refusal::Full => "it keeps as many UCX initiators as it may",
            Refusal::Descriptors => {
                "it is short of file descriptors (it keeps a reserve for its side channel, \
                 lanes and peers)"
            }
        })
    }
}

impl FenceMsg {
    /// The message's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32);
        b.extend_from_slice(&MAGIC);
        match self {
            FenceMsg::Hello {
                token,
                name,
                host,
                worker,
            } => {
                b.push(HELLO);
                b.extend_from_slice(&token.to_le_bytes());
                // A name longer than the limit is cut here (a label only); at a char boundary.
                let mut n = name.len().min(MAX_NAME);
                while !name.is_char_boundary(n) {
                    n -= 1;
                }
                b.push(n as u8);
                b.extend_from_slice(&name.as_bytes()[..n]);
                match host {
                    Some(h) => {
                        b.push(1);
                        b.extend_from_slice(&h.boot_id);
                        b.extend_from_slice(&h.pid_ns.to_le_bytes());
                        b.extend_from_slice(&h.pid.to_le_bytes());
                    }
                    None => b.push(0),
                }
                // A worker address longer than the limit is cut by nobody: the decoder
                // refuses it, as the metadata decoder would.
                b.extend_from_slice(
                    &u32::try_from(worker.len())
                        .unwrap_or(u32::MAX)
                        .to_le_bytes(),
                );
                b.extend_from_slice(worker);
            }
            FenceMsg::Welcome { token, ack, gone } => {
                b.push(WELCOME);
                b.extend_from_slice(&token.to_le_bytes());
                b.extend_from_slice(&ack.to_le_bytes());
                b.extend_from_slice(&u32::try_from(gone.len()).unwrap_or(u32::MAX).to_le_bytes());
                for (first, n) in gone {
                    b.extend_from_slice(&first.to_le_bytes());
                    b.extend_from_slice(&n.to_le_bytes());
                }
            }
            FenceMsg::Gone { token, region } => {
                b.push(GONE);
                b.extend_from_slice(&token.to_le_bytes());
                b.extend_from_slice(&region.to_le_bytes());
            }
            FenceMsg::GoneAck { ack, region } => {
                b.push(GONE_ACK);
                b.extend_from_slice(&ack.to_le_bytes());
                b.extend_from_slice(&region.to_le_bytes());
            }
            FenceMsg::Bye { ack } => {
                b.push(BYE);
                b.extend_from_slice(&ack.to_le_bytes());
            }
            FenceMsg::Refused { token, why } => {
                b.push(REFUSED);
                b.extend_from_slice(&token.to_le_bytes());
                b.push(why.code());
            }
        }
        b
    }

    /// The message in `b`, or `None` for anything but exactly one well-formed message.
    pub fn decode(b: &[u8]) -> Option<FenceMsg> {
        let rest = b.strip_prefix(&MAGIC)?;
        let (&kind, mut r) = rest.split_first()?;
        let msg = match kind {
            HELLO => {
                let token = u64_of(&mut r)?;
                let n = usize::from(take(&mut r, 1)?[0]);
                let name = std::str::from_utf8(take(&mut r, n)?).ok()?.to_string();
                let host = match take(&mut r, 1)?[0] {
                    0 => None,
                    1 => Some(HostInfo {
                        boot_id: take(&mut r, 16)?.try_into().ok()?,
                        pid_ns: u64_of(&mut r)?,
                        pid: u32_of(&mut r)?,
                    }),
                    _ => return None,
                };
                let n = u32_of(&mut r)? as usize;
                if n == 0 || n > MAX_WORKER_ADDR {
                    return None;
                }
                let worker = take(&mut r, n)?.to_vec();
                FenceMsg::Hello {
                    token,
                    name,
                    host,
                    worker,
                }
            }
            WELCOME => {
                let token = u64_of(&mut r)?;
                let ack = u64_of(&mut r)?;
                let n = u32_of(&mut r)? as usize;
                if n > MAX_RANGES || r.len() != 8 * n {
                    return None;
                }
                let mut gone = Vec::with_capacity(n);
                let mut next = 0u64;
                for _ in 0..n {
                    let (first, count) = (u32_of(&mut r)?, u32_of(&mut r)?);
                    // Sorted, apart, none empty, none past u32.
                    if count == 0 || u64::from(first) < next {
                        return None;
                    }
                    next = u64::from(first) + u64::from(count) + 1;
                    if next > u64::from(u32::MAX) + 2 {
                        return None;
                    }
                    gone.push((first, count));
                }
                FenceMsg::Welcome { token, ack, gone }
            }
            GONE => FenceMsg::Gone {
                token: u64_of(&mut r)?,
                region: u32_of(&mut r)?,
            },
            GONE_ACK => FenceMsg::GoneAck {
                ack: u64_of(&mut r)?,
                region: u32_of(&mut r)?,
            },
            BYE => FenceMsg::Bye {
                ack: u64_of(&mut r)?,
            },
            REFUSED => FenceMsg::Refused {
                token: u64_of(&mut r)?,
                why: Refusal::of(take(&mut r, 1)?[0])?,
            },
            _ => return None,
        };
        r.is_empty().then_some(msg)
    }
}

/// `ids` (sorted, no duplicates) as `(first, count)` ranges of consecutive ids.
pub fn id_ranges(ids: impl IntoIterator<Item = u32>) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for id in ids {
        match out.last_mut() {
            Some((first, n)) if u64::from(*first) + u64::from(*n) == u64::from(id) => *n += 1,
            _ => out.push((id, 1)),
        }
    }
    out
}

/// Adds `id` to `ranges` (sorted, apart, as [`id_ranges`] makes them), merging neighbours:
/// the ranges stay as few as the gaps between them.
pub fn add_to_ranges(ranges: &mut Vec<(u32, u32)>, id: u32) {
    let i = ranges.partition_point(|(first, _)| *first <= id);
    let end = |r: &(u32, u32)| u64::from(r.0) + u64::from(r.1);
    if i > 0 && u64::from(id) < end(&ranges[i - 1]) {
        return;
    }
    let joins_left = i > 0 && end(&ranges[i - 1]) == u64::from(id);
    let joins_right = i < ranges.len() && u64::from(id) + 1 == u64::from(ranges[i].0);
    match (joins_left, joins_right) {
        (true, true) => {
            let right = ranges.remove(i);
            ranges[i - 1].1 += 1 + right.1;
        }
        (true, false) => ranges[i - 1].1 += 1,
        (false, true) => ranges[i] = (id, ranges[i].1 + 1),
        (false, false) => ranges.insert(i, (id, 1)),
    }
}

/// Whether `id` lies in one of `ranges` (as [`id_ranges`] makes them).
pub fn in_ranges(ranges: &[(u32, u32)], id: u32) -> bool {
    let i = ranges.partition_point(|(first, _)| *first <= id);
    i > 0 && u64::from(id) < u64::from(ranges[i - 1].0) + u64::from(ranges[i - 1].1)
}

fn take<'a>(r: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if r.len() < n {
        return None;
    }
    let (head, tail) = r.split_at(n);
    *r = tail;
    Some(head)
}

fn u64_of(r: &mut &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(take(r, 8)?.try_into().ok()?))
}

fn u32_of(r: &mut &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(take(r, 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<FenceMsg> {
        vec![
            FenceMsg::Hello {
                token: 0x0102_0304_0506_0708,
                name: "prefill-0".into(),
                host: Some(HostInfo {
                    boot_id: [7; 16],
                    pid_ns: 4_026_531_836,
                    pid: 4242,
                }),
                worker: vec![9; 300],
            },
            FenceMsg::Hello {
                token: 1,
                name: String::new(),
                host: None,
                worker: vec![1],
            },
            FenceMsg::Welcome {
                token: 5,
                ack: 6,
                gone: vec![],
            },
            FenceMsg::Welcome {
                token: 5,
                ack: 6,
                gone: vec![(0, 3), (7, 1), (u32::MAX, 1)],
            },
            FenceMsg::Gone {
                token: u64::MAX,
                region: 3,
            },
            FenceMsg::GoneAck {
                ack: 11,
                region: u32::MAX,
            },
            FenceMsg::Bye { ack: 12 },
            FenceMsg::Refused {
                token: 13,
                why: Refusal::Full,
            },
            FenceMsg::Refused {
                token: u64::MAX,
                why: Refusal::Descriptors,
            },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in all() {
            assert_eq!(FenceMsg::decode(&m.encode()), Some(m.clone()), "{m:?}");
        }
    }

    #[test]
    fn id_ranges_say_which_ids_they_hold() {
        let r = id_ranges([0, 1, 2, 5, 7, 8, u32::MAX]);
        assert_eq!(r, vec![(0, 3), (5, 1), (7, 2), (u32::MAX, 1)]);
        for id in [0, 1, 2, 5, 7, 8, u32::MAX] {
            assert!(in_ranges(&r, id), "{id}");
        }
        for id in [3, 4, 6, 9, u32::MAX - 1] {
            assert!(!in_ranges(&r, id), "{id}");
        }
        assert!(!in_ranges(&[], 0));
    }

    #[test]
    fn adding_to_ranges_merges_neighbours() {
        let mut r = Vec::new();
        for id in [5, 3, 4, 9, 0, 7, 8, 4, u32::MAX] {
            add_to_ranges(&mut r, id);
        }
        assert_eq!(r, vec![(0, 1), (3, 3), (7, 3), (u32::MAX, 1)]);
        assert_eq!(r, id_ranges([0, 3, 4, 5, 7, 8, 9, u32::MAX]));
        add_to_ranges(&mut r, 6);
        assert_eq!(r, vec![(0, 1), (3, 7), (u32::MAX, 1)]);
    }

    #[test]
    fn a_welcome_whose_ranges_are_unsorted_overlap_or_are_empty_is_refused() {
        for gone in [
            vec![(5, 1), (0, 1)],
            vec![(0, 3), (2, 1)],
            vec![(0, 3), (3, 1)],
            vec![(0, 0)],
            vec![(u32::MAX, 2)],
        ] {
            let b = FenceMsg::Welcome {
                token: 1,
                ack: 2,
                gone: gone.clone(),
            }
            .encode();
            assert_eq!(FenceMsg::decode(&b), None, "{gone:?}");
        }
    }

    #[test]
    fn anything_but_one_whole_message_is_refused() {
        for m in all() {
            let b = m.encode();
            // Every truncation, and one byte too many.
            for n in 0..b.len() {
                assert_eq!(FenceMsg::decode(&b[..n]), None, "{m:?} cut to {n}");
            }
            let mut long = b.clone();
            long.push(0);
            assert_eq!(FenceMsg::decode(&long), None, "{m:?} with a byte after it");
            let mut bad = b.clone();
            bad[0] = b'X';
            assert_eq!(FenceMsg::decode(&bad), None, "{m:?} with another magic");
        }
        // A refusal with a reason no version gives.
        for code in [0u8, 3, 0xff] {
            let mut b = FenceMsg::Refused {
                token: 1,
                why: Refusal::Full,
            }
            .encode();
            *b.last_mut().unwrap() = code;
            assert_eq!(FenceMsg::decode(&b), None, "reason {code}");
        }
        // An unknown kind, a host flag that is neither 0 nor 1, a worker address of 0 bytes
        // and one past the limit.
        assert_eq!(FenceMsg::decode(b"KF\x09"), None);
        let mut h = FenceMsg::Hello {
            token: 1,
            name: String::new(),
            host: None,
            worker: vec![1],
        }
        .encode();
        h[12] = 2;
        assert_eq!(FenceMsg::decode(&h), None);
        let empty = FenceMsg::Hello {
            token: 1,
            name: String::new(),
            host: None,
            worker: Vec::new(),
        };
        assert_eq!(FenceMsg::decode(&empty.encode()), None);
        let huge = FenceMsg::Hello {
            token: 1,
            name: String::new(),
            host: None,
            worker: vec![0; MAX_WORKER_ADDR + 1],
        };
        assert_eq!(FenceMsg::decode(&huge.encode()), None);
        assert!(huge.encode().len() <= MAX_ENCODED + 1);
        // A name that is not UTF-8.
        let mut bad = FenceMsg::Hello {
            token: 1,
            name: "ab".into(),
            host: None,
            worker: vec![1],
        }
        .encode();
        bad[12] = 0xff;
        assert_eq!(FenceMsg::decode(&bad), None);
        // A name past the limit is cut to it, at a char boundary.
        let long = FenceMsg::Hello {
            token: 1,
            name: "é".repeat(200),
            host: None,
            worker: vec![1],
        };
        match FenceMsg::decode(&long.encode()) {
            Some(FenceMsg::Hello { name, .. }) => assert_eq!(name, "é".repeat(127)),
            other => panic!("{other:?}"),
        }
    }
}
