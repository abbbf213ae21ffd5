//! Agent metadata: what a peer needs to reach this agent's memory, and its wire encoding.
//!
//! Layout (little endian), version 5 (as version 4: the version says that its agent speaks
//! the UCX fence, `super::ucx_fence`, which a version-4 agent would never answer):
//!
//! ```text
//! magic "KVXM" | version u16 | flags u16 | compat u64 | total_len u32
//! name_len u16 | name (UTF-8)
//! addr_len u32 | UCX worker address
//! [flags & 4: epoch] epoch u64
//! [flags & 1: host]  boot_id [16] | pid_ns u64 | pid u32
//! lane_count u8 | { lane u8 | len u16 | body [len] }*            (super::lane_entries)
//! region_count u32 | { id u32 | kind u8 | device u32 | base u64 | len u64 | rkey_len u16 | rkey
//!                      | shm u8 (0|1) | [shm: fd u32 | dev u64 | ino u64] }*
//! ```
//!
//! `host` lets a peer on the same host (same boot and pid namespace) map regions that carry an
//! `shm` handle (memfd-backed buffers) and copy with plain loads and stores. Each lane that
//! peers reach over the network advertises itself in an entry of its own: the TCP stream
//! lane's is its address, the secret a peer must present to use it, and the static public
//! key the lane's sealed handshake proves (the agent's lane identity). Version 3 carried
//! that one lane as a fixed field (flag 2).
//!
//! The decoder is strict and bounded: it checks magic, version and the compatibility hash before
//! it reads anything else, every length against a limit and the bytes left, region ids for
//! uniqueness, `base + len` for overflow, and refuses trailing bytes. It never panics on any
//! input (property- and fuzz-tested).

pub use super::lane_entries::LaneEntry;
use super::lane_entries::{self, MAX_LANE_ENTRY};
use crate::error::MetadataError;
pub use crate::types::{HostInfo, LaneInfo, ShmHandle};
use crate::types::{MemKind, RegionId, RegionSpan};

/// Wire version this build speaks.
pub const WIRE_VERSION: u16 = 5;
/// Compatibility hash used when no KV layout is given: the wire version alone.
pub const DEFAULT_COMPAT: u64 = 0x6b76_7866_0000_0000 | WIRE_VERSION as u64;
const MAGIC: [u8; 4] = *b"KVXM";
/// Longest agent name.
pub const MAX_NAME: usize = 255;
/// Longest UCX worker address accepted.
pub const MAX_WORKER_ADDR: usize = 64 * 1024;
/// Most regions in one metadata blob.
pub const MAX_REGIONS: usize = 65_536;
/// Longest packed rkey accepted.
pub const MAX_RKEY: usize = 4096;
/// Largest encoded metadata accepted.
pub const MAX_ENCODED: usize = 16 * 1024 * 1024;
/// magic, version, flags, compat, total length.
const HEADER: usize = 4 + 2 + 2 + 8 + 4;
/// The length prefix of the name.
const NAME_LEN_BYTES: usize = 2;
/// The length prefix of the worker address.
const ADDR_LEN_BYTES: usize = 4;
/// The region count.
const COUNT_BYTES: usize = 4;
/// A region without its key and handle: id, kind, device, base, len, key length, shm flag.
const REGION_FIXED_LEN: usize = 4 + 1 + 4 + 8 + 8 + 2 + 1;
/// A region's shm handle: fd, dev, ino.
const SHM_LEN: usize = 4 + 8 + 8;
/// The lane count.
const LANE_COUNT_BYTES: usize = 1;

/// One registered region as a peer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionMeta {
    /// Region id in the owner's agent.
    pub id: RegionId,
    /// Host or device.
    pub kind: MemKind,
    /// Base address in the owner's address space.
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// UCX packed remote key.
    pub rkey: Vec<u8>,
    /// A same-host peer can map the region through this handle.
    pub shm: Option<ShmHandle>,
}

impl RegionMeta {
    /// Encodes one region alone (an update to metadata already sent: a new registration).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(
            REGION_FIXED_LEN + self.rkey.len() + self.shm.map_or(0, |_| SHM_LEN),
        );
        self.encode_into(&mut b);
        b
    }

    /// Decodes one region encoded by [`RegionMeta::encode`], as strictly as inside
    /// [`Metadata::decode`]; trailing bytes are refused.
    pub fn decode(bytes: &[u8]) -> Result<RegionMeta, MetadataError> {
        let mut r = Reader { b: bytes, at: 0 };
        let m = RegionMeta::read(&mut r)?;
        if r.left() != 0 {
            return Err(MetadataError::Trailing { extra: r.left() });
        }
        Ok(m)
    }

    fn encode_into(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&self.id.0.to_le_bytes());
        let (kind, dev) = match self.kind {
            MemKind::Host => (0u8, 0u32),
            MemKind::Cuda(d) => (1u8, d),
        };
        b.push(kind);
        b.extend_from_slice(&dev.to_le_bytes());
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        b.extend_from_slice(&(self.rkey.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.rkey);
        match &self.shm {
            None => b.push(0),
            Some(h) => {
                b.push(1);
                b.extend_from_slice(&h.fd.to_le_bytes());
                b.extend_from_slice(&h.dev.to_le_bytes());
                b.extend_from_slice(&h.ino.to_le_bytes());
            }
        }
    }

    fn read(r: &mut Reader<'_>) -> Result<RegionMeta, MetadataError> {
        let id = RegionId(r.u32()?);
        let kind = match (r.u8()?, r.u32()?) {
            (0, 0) => MemKind::Host,
            (1, d) => MemKind::Cuda(d),
            (k, d) => {
                return Err(MetadataError::Invalid {
                    field: "region kind",
                    why: format!("kind {k} device {d}"),
                })
            }
        };
        let base = r.u64()?;
        let len = r.u64()?;
        if len == 0 || base.checked_add(len).is_none() {
            return Err(MetadataError::Invalid {
                field: "region extent",
                why: format!("region {} base {base:#x} len {len}", id.0),
            });
        }
        // No key: device memory on the staged path, or a region shared with named peers only
        // (only kvxfer's TCP lane reaches either; its target checks who asks).
        let rkey_len = r.u16()? as usize;
        if rkey_len > MAX_RKEY {
            return Err(MetadataError::TooLarge {
                field: "rkey",
                len: rkey_len,
                max: MAX_RKEY,
            });
        }
        let rkey = r.take(rkey_len)?.to_vec();
        let shm = match r.u8()? {
            0 => None,
            1 => Some(ShmHandle {
                fd: r.u32()?,
                dev: r.u64()?,
                ino: r.u64()?,
            }),
            f => {
                return Err(MetadataError::Invalid {
                    field: "region shm flag",
                    why: format!("{f}"),
                })
            }
        };
        Ok(RegionMeta {
            id,
            kind,
            base,
            len,
            rkey,
            shm,
        })
    }

    /// The part the bounds check needs.
    pub fn span(&self) -> RegionSpan {
        RegionSpan {
            id: self.id,
            base: self.base,
            len: self.len,
            kind: self.kind,
        }
    }
}

/// An agent's metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metadata {
    /// The agent's unique name.
    pub name: String,
    /// Compatibility hash: wire version, KV layout and dtype. Peers must agree.
    pub compat: u64,
    /// UCX worker address.
    pub worker_addr: Vec<u8>,
    /// This incarnation of the agent: drawn at random when it starts, so that a restarted
    /// agent (same name, new epoch) is told apart from the one before it, and two live agents
    /// with one name from each other. 0: not sent (an agent of the first release).
    pub epoch: u64,
    /// Host identity, for the shared-memory lane.
    pub host: Option<HostInfo>,
    /// The lanes peers reach it by, each in its own entry (at most one per lane).
    pub lanes: Vec<LaneEntry>,
    /// Registered regions.
    pub regions: Vec<RegionMeta>,
}

const FLAG_HOST: u16 = 1;
const FLAG_EPOCH: u16 = 4;
const EPOCH_LEN: usize = 8;
const HOST_LEN: usize = 16 + 8 + 4;

impl Metadata {
    /// The TCP stream lane's entry, decoded.
    pub fn tcp_lane(&self) -> Option<LaneInfo> {
        lane_entries::tcp_of(&self.lanes)
    }

    /// Sets (or with `None` removes) the TCP stream lane's entry.
    pub fn set_tcp_lane(&mut self, lane: Option<LaneInfo>) {
        self.lanes.retain(|e| e.lane != lane_entries::LANE_TCP);
        self.lanes.extend(lane.as_ref().map(LaneEntry::tcp));
    }

    /// Whether this is `old` with regions registered since: the same incarnation, worker,
    /// host and lane, `old`'s regions unchanged and in place, more after them. A peer that
    /// only grew keeps its entry (and the lists prepared against it) when loaded again.
    pub fn extends(&self, old: &Metadata) -> bool {
        self.name == old.name
            && self.compat == old.compat
            && self.worker_addr == old.worker_addr
            && self.epoch == old.epoch
            && self.host == old.host
            && self.lanes == old.lanes
            && self.regions.len() > old.regions.len()
            && self.regions[..old.regions.len()] == old.regions[..]
    }

    /// Encodes to the wire format.
    pub fn encode(&self) -> Vec<u8> {
        let size = HEADER
            + NAME_LEN_BYTES
            + self.name.len()
            + ADDR_LEN_BYTES
            + self.worker_addr.len()
            + if self.epoch != 0 { EPOCH_LEN } else { 0 }
            + self.host.map_or(0, |_| HOST_LEN)
            + LANE_COUNT_BYTES
            + self.lanes.iter().map(LaneEntry::wire_len).sum::<usize>()
            + COUNT_BYTES
            + self
                .regions
                .iter()
                .map(|r| REGION_FIXED_LEN + r.rkey.len() + r.shm.map_or(0, |_| SHM_LEN))
                .sum::<usize>();
        let flags = if self.host.is_some() { FLAG_HOST } else { 0 }
            | if self.epoch != 0 { FLAG_EPOCH } else { 0 };
        let mut b = Vec::with_capacity(size);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
        b.extend_from_slice(&self.compat.to_le_bytes());
        b.extend_from_slice(&(size as u32).to_le_bytes());
        b.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        b.extend_from_slice(self.name.as_bytes());
        b.extend_from_slice(&(self.worker_addr.len() as u32).to_le_bytes());
        b.extend_from_slice(&self.worker_addr);
        if self.epoch != 0 {
            b.extend_from_slice(&self.epoch.to_le_bytes());
        }
        if let Some(h) = &self.host {
            b.extend_from_slice(&h.boot_id);
            b.extend_from_slice(&h.pid_ns.to_le_bytes());
            b.extend_from_slice(&h.pid.to_le_bytes());
        }
        b.push(self.lanes.len() as u8);
        for e in &self.lanes {
            e.encode_into(&mut b);
        }
        b.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for r in &self.regions {
            r.encode_into(&mut b);
        }
        debug_assert_eq!(b.len(), size);
        b
    }

    /// Decodes and validates `bytes`, refusing metadata whose compatibility hash is not
    /// `expected_compat`.
    pub fn decode(bytes: &[u8], expected_compat: u64) -> Result<Metadata, MetadataError> {
        let mut r = Reader { b: bytes, at: 0 };
        let magic: [u8; 4] = r.array()?;
        if magic != MAGIC {
            return Err(MetadataError::BadMagic { found: magic });
        }
        let version = r.u16()?;
        if version != WIRE_VERSION {
            return Err(MetadataError::Version {
                found: version,
                expected: WIRE_VERSION,
            });
        }
        let flags = r.u16()?;
        let compat = r.u64()?;
        if compat != expected_compat {
            return Err(MetadataError::Incompatible {
                found: compat,
                expected: expected_compat,
            });
        }
        let known = FLAG_HOST | FLAG_EPOCH;
        if flags & !known != 0 {
            return Err(MetadataError::Invalid {
                field: "flags",
                why: format!("{flags:#x}, only {known:#x} are defined"),
            });
        }
        let total = r.u32()? as usize;
        if total > MAX_ENCODED {
            return Err(MetadataError::TooLarge {
                field: "metadata",
                len: total,
                max: MAX_ENCODED,
            });
        }
        if total != bytes.len() {
            return Err(if total > bytes.len() {
                MetadataError::Truncated {
                    at: 0,
                    needed: total,
                    available: bytes.len(),
                }
            } else {
                MetadataError::Trailing {
                    extra: bytes.len() - total,
                }
            });
        }
        let name_len = r.u16()? as usize;
        if name_len == 0 || name_len > MAX_NAME {
            return Err(MetadataError::Invalid {
                field: "name",
                why: format!("length {name_len}, must be 1..={MAX_NAME}"),
            });
        }
        let name = std::str::from_utf8(r.take(name_len)?)
            .map_err(|e| MetadataError::Invalid {
                field: "name",
                why: e.to_string(),
            })?
            .to_owned();
        if name.chars().any(char::is_control) {
            return Err(MetadataError::Invalid {
                field: "name",
                why: "contains control characters".into(),
            });
        }
        let addr_len = r.u32()? as usize;
        if addr_len == 0 || addr_len > MAX_WORKER_ADDR {
            return Err(MetadataError::TooLarge {
                field: "worker address",
                len: addr_len,
                max: MAX_WORKER_ADDR,
            });
        }
        let worker_addr = r.take(addr_len)?.to_vec();
        let epoch = if flags & FLAG_EPOCH != 0 {
            let e = r.u64()?;
            if e == 0 {
                return Err(MetadataError::Invalid {
                    field: "epoch",
                    why: "0 with the epoch flag set".into(),
                });
            }
            e
        } else {
            0
        };
        let host = if flags & FLAG_HOST != 0 {
            Some(HostInfo {
                boot_id: r.array()?,
                pid_ns: r.u64()?,
                pid: r.u32()?,
            })
        } else {
            None
        };
        let lane_count = r.u8()? as usize;
        if lane_count > lane_entries::MAX_LANES {
            return Err(MetadataError::TooLarge {
                field: "lane list",
                len: lane_count,
                max: lane_entries::MAX_LANES,
            });
        }
        let mut lanes = Vec::with_capacity(lane_count);
        for _ in 0..lane_count {
            let lane = r.u8()?;
            let len = r.u16()? as usize;
            if len > MAX_LANE_ENTRY {
                return Err(MetadataError::TooLarge {
                    field: "lane entry",
                    len,
                    max: MAX_LANE_ENTRY,
                });
            }
            lanes.push(LaneEntry {
                lane,
                body: r.take(len)?.to_vec(),
            });
        }
        lane_entries::check(&lanes)?;
        let count = r.u32()? as usize;
        if count > MAX_REGIONS {
            return Err(MetadataError::TooLarge {
                field: "region table",
                len: count,
                max: MAX_REGIONS,
            });
        }
        // Each entry needs at least 28 bytes: refuse counts the input cannot hold before
        // reserving memory for them.
        if count * 28 > r.left() {
            return Err(MetadataError::Truncated {
                at: r.at,
                needed: count * 28,
                available: r.left(),
            });
        }
        let mut regions: Vec<RegionMeta> = Vec::with_capacity(count);
        for _ in 0..count {
            regions.push(RegionMeta::read(&mut r)?);
        }
        if r.left() != 0 {
            return Err(MetadataError::Trailing { extra: r.left() });
        }
        let mut ids: Vec<u32> = regions.iter().map(|x| x.id.0).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(MetadataError::Invalid {
                field: "region id",
                why: format!("{} appears twice", w[0]),
            });
        }
        Ok(Metadata {
            name,
            compat,
            worker_addr,
            epoch,
            host,
            lanes,
            regions,
        })
    }

    /// Reads only the agent name and compatibility hash, without validating the rest; for
    /// error messages about metadata that was refused.
    pub fn peek_name(bytes: &[u8]) -> Option<String> {
        let at = HEADER + NAME_LEN_BYTES;
        let n = u16::from_le_bytes(bytes.get(HEADER..at)?.try_into().ok()?) as usize;
        let s = bytes.get(at..at + n.min(MAX_NAME))?;
        std::str::from_utf8(s).ok().map(str::to_owned)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.at
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], MetadataError> {
        if n > self.left() {
            return Err(MetadataError::Truncated {
                at: self.at,
                needed: n,
                available: self.left(),
            });
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], MetadataError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, MetadataError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, MetadataError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, MetadataError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, MetadataError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Metadata {
        Metadata {
            name: "prefill-0".into(),
            compat: 0xdead_beef_0123_4567,
            worker_addr: vec![1, 2, 3, 4, 5],
            epoch: 0x1234_5678_9abc_def0,
            host: Some(HostInfo {
                boot_id: [5; 16],
                pid_ns: 4026531836,
                pid: 4242,
            }),
            lanes: vec![LaneEntry::tcp(&LaneInfo {
                addr: "198.18.0.1:40000".parse().unwrap(),
                secret: [0xab; 16],
                key: [0xcd; 32],
            })],
            regions: vec![
                RegionMeta {
                    id: RegionId(0),
                    kind: MemKind::Host,
                    base: 0x7f00_0000_0000,
                    len: 1 << 30,
                    rkey: vec![9; 40],
                    shm: Some(ShmHandle {
                        fd: 17,
                        dev: 1,
                        ino: 99,
                    }),
                },
                RegionMeta {
                    id: RegionId(3),
                    kind: MemKind::Cuda(1),
                    base: 0x1000,
                    len: 4096,
                    rkey: vec![7; 12],
                    shm: None,
                },
            ],
        }
    }

    #[test]
    fn roundtrip() {
        let m = sample();
        let b = m.encode();
        assert_eq!(Metadata::decode(&b, m.compat).unwrap(), m);
        assert_eq!(Metadata::peek_name(&b).as_deref(), Some("prefill-0"));
    }

    #[test]
    fn a_region_alone_roundtrips_and_is_checked_like_in_metadata() {
        for r in sample().regions {
            let b = r.encode();
            assert_eq!(RegionMeta::decode(&b).unwrap(), r);
            let mut long = b.clone();
            long.push(0);
            assert!(matches!(
                RegionMeta::decode(&long),
                Err(MetadataError::Trailing { extra: 1 })
            ));
            assert!(matches!(
                RegionMeta::decode(&b[..b.len() - 1]),
                Err(MetadataError::Truncated { .. })
            ));
        }
        let mut host_without_key = sample().regions[0].clone();
        host_without_key.kind = MemKind::Host;
        host_without_key.rkey.clear();
        assert_eq!(
            RegionMeta::decode(&host_without_key.encode()).unwrap(),
            host_without_key
        );
    }

    #[test]
    fn roundtrip_without_options_and_v6() {
        let mut m = sample();
        m.host = None;
        m.set_tcp_lane(None);
        assert_eq!(Metadata::decode(&m.encode(), m.compat).unwrap(), m);
        let v6 = LaneInfo {
            addr: "[::1]:9".parse().unwrap(),
            secret: [1; 16],
            key: [2; 32],
        };
        m.set_tcp_lane(Some(v6));
        let back = Metadata::decode(&m.encode(), m.compat).unwrap();
        assert_eq!((back.tcp_lane(), &back), (Some(v6), &m));
        // A lane this build does not know travels along, used by no one.
        m.lanes.push(LaneEntry {
            lane: 200,
            body: vec![1, 2, 3],
        });
        assert_eq!(Metadata::decode(&m.encode(), m.compat).unwrap(), m);
    }

    #[test]
    fn lane_only_regions_carry_no_key() {
        let mut m = sample();
        // Device memory on the staged path: no UCX key, reached only through the lane.
        m.regions[1].rkey.clear();
        assert_eq!(Metadata::decode(&m.encode(), m.compat).unwrap(), m);
        // Host memory shared with named peers only: no key, no address either.
        m.regions[0].rkey.clear();
        m.regions[0].base = 0;
        assert_eq!(Metadata::decode(&m.encode(), m.compat).unwrap(), m);
    }

    #[test]
    fn refuses_foreign_and_broken() {
        let m = sample();
        let b = m.encode();
        assert!(matches!(
            Metadata::decode(&b, 1),
            Err(MetadataError::Incompatible { .. })
        ));
        let mut v = b.clone();
        v[4] = 1;
        assert!(matches!(
            Metadata::decode(&v, m.compat),
            Err(MetadataError::Version { found: 1, .. })
        ));
        let mut v = b.clone();
        v[0] = b'X';
        assert!(matches!(
            Metadata::decode(&v, m.compat),
            Err(MetadataError::BadMagic { .. })
        ));
        for cut in 0..b.len() {
            assert!(
                Metadata::decode(&b[..cut], m.compat).is_err(),
                "prefix of {cut} accepted"
            );
        }
        let mut v = b.clone();
        v.push(0);
        assert!(matches!(
            Metadata::decode(&v, m.compat),
            Err(MetadataError::Trailing { extra: 1 })
        ));
        let mut dup = m.clone();
        dup.regions[1].id = RegionId(0);
        assert!(matches!(
            Metadata::decode(&dup.encode(), m.compat),
            Err(MetadataError::Invalid {
                field: "region id",
                ..
            })
        ));
        let mut wrap = m.clone();
        wrap.regions[0].base = u64::MAX;
        assert!(matches!(
            Metadata::decode(&wrap.encode(), m.compat),
            Err(MetadataError::Invalid {
                field: "region extent",
                ..
            })
        ));
    }

    #[test]
    fn the_epoch_is_optional_and_never_zero_on_the_wire() {
        let m = sample();
        assert_eq!(
            Metadata::decode(&m.encode(), m.compat).unwrap().epoch,
            m.epoch
        );
        // A first-release agent sends none: decoded as 0, 8 bytes shorter.
        let old = Metadata {
            epoch: 0,
            ..sample()
        };
        assert_eq!(old.encode().len() + 8, m.encode().len());
        assert_eq!(Metadata::decode(&old.encode(), m.compat).unwrap(), old);
        // The flag set with a zero epoch is malformed.
        let mut b = m.encode();
        let e = m.epoch.to_le_bytes();
        let i = b.windows(8).position(|w| w == e).unwrap();
        b[i..i + 8].fill(0);
        assert!(matches!(
            Metadata::decode(&b, m.compat),
            Err(MetadataError::Invalid { field: "epoch", .. })
        ));
    }

    #[test]
    fn huge_counts_are_refused_without_allocating() {
        let m = Metadata {
            regions: vec![],
            ..sample()
        };
        let mut b = m.encode();
        let n = b.len();
        b[n - 4..].copy_from_slice(&60_000u32.to_le_bytes());
        assert!(matches!(
            Metadata::decode(&b, m.compat),
            Err(MetadataError::Truncated { .. })
        ));
        b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Metadata::decode(&b, m.compat),
            Err(MetadataError::TooLarge { .. })
        ));
    }

    proptest! {
        #[test]
        fn decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Metadata::decode(&bytes, 0);
            let _ = RegionMeta::decode(&bytes);
        }

        #[test]
        fn mutated_metadata_never_panics(pos in 0usize..200, val in any::<u8>()) {
            let m = sample();
            let mut b = m.encode();
            let p = pos % b.len();
            b[p] = val;
            let _ = Metadata::decode(&b, m.compat);
        }
    }
}
