//! The lanes an agent advertises in its metadata: a list of entries, each a lane's id and the
//! lane's own bytes, so that a lane adds what peers need to reach it without a change to the
//! metadata codec or to any other lane. An entry of a lane this build does not know (a newer
//! peer's) is kept as it is and used by no lane here; a known lane's entry is checked when
//! the metadata is decoded.
//!
//! Entry on the wire: `lane u8 | len u16 | body [len]`; the TCP lane's body is
//! `family u8 (4|6) | ip [4|16] | port u16 | secret [16] | key [32]`; the shared-memory
//! lane's is `socket [16] | token [32]` (see [`ShmLaneInfo`]).

use crate::error::MetadataError;
use crate::types::LaneInfo;

/// The TCP stream lane's id.
pub const LANE_TCP: u8 = 1;
/// The shared-memory lane's id.
pub const LANE_SHM: u8 = 2;
/// The device lane's id: same-host GPU memory, opened through the hand-over socket it names
/// (the body has the shm lane's shape: socket and token).
pub const LANE_DEVICE: u8 = 3;
/// Most entries in one agent's metadata.
pub const MAX_LANES: usize = 16;
/// Longest entry body.
pub const MAX_LANE_ENTRY: usize = 4096;
/// An entry without its body: the lane id and the body's length.
pub const ENTRY_HEADER_LEN: usize = 1 + 2;
/// The TCP lane's body without the IP: family, port, secret, key.
const TCP_FIXED_LEN: usize = 1 + 2 + 16 + 32;

/// What a same-host peer needs to be handed this agent's memory files: the name of the Unix
/// socket that hands them out (abstract, `kvxfer-shm-` and the hex of these bytes) and the
/// token it asks for. The token travels only in metadata, which a shared secret seals; the
/// socket also checks the asker's user (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShmLaneInfo {
    /// The socket's random name.
    pub socket: [u8; 16],
    /// What an asker presents.
    pub token: [u8; 32],
}

impl ShmLaneInfo {
    /// The socket's abstract name (without the leading NUL).
    pub fn socket_name(&self) -> String {
        format!("kvxfer-shm-{}", super::hex(&self.socket))
    }
}

/// One lane's entry: its id and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaneEntry {
    /// Which lane ([`LANE_TCP`], or one this build does not know).
    pub lane: u8,
    /// What the lane tells peers, in its own format.
    pub body: Vec<u8>,
}

impl LaneEntry {
    /// The TCP lane's entry for `info`.
    pub fn tcp(info: &LaneInfo) -> LaneEntry {
        let mut body = Vec::with_capacity(TCP_FIXED_LEN + 16);
        match info.addr.ip() {
            std::net::IpAddr::V4(ip) => {
                body.push(4);
                body.extend_from_slice(&ip.octets());
            }
            std::net::IpAddr::V6(ip) => {
                body.push(6);
                body.extend_from_slice(&ip.octets());
            }
        }
        body.extend_from_slice(&info.addr.port().to_le_bytes());
        body.extend_from_slice(&info.secret);
        body.extend_from_slice(&info.key);
        LaneEntry {
            lane: LANE_TCP,
            body,
        }
    }

    /// The shared-memory lane's entry for `info`.
    pub fn shm(info: &ShmLaneInfo) -> LaneEntry {
        let mut body = Vec::with_capacity(48);
        body.extend_from_slice(&info.socket);
        body.extend_from_slice(&info.token);
        LaneEntry {
            lane: LANE_SHM,
            body,
        }
    }

    /// The device lane's entry for `info` (its own hand-over socket and token).
    pub fn device(info: &ShmLaneInfo) -> LaneEntry {
        LaneEntry {
            lane: LANE_DEVICE,
            ..LaneEntry::shm(info)
        }
    }

    /// The shared-memory lane's socket and token, if this is its entry and well formed.
    pub fn as_shm(&self) -> Result<Option<ShmLaneInfo>, MetadataError> {
        self.socket_entry(LANE_SHM, "shm lane entry")
    }

    /// The device lane's socket and token, if this is its entry and well formed.
    pub fn as_device(&self) -> Result<Option<ShmLaneInfo>, MetadataError> {
        self.socket_entry(LANE_DEVICE, "device lane entry")
    }

    fn socket_entry(
        &self,
        lane: u8,
        field: &'static str,
    ) -> Result<Option<ShmLaneInfo>, MetadataError> {
        if self.lane != lane {
            return Ok(None);
        }
        if self.body.len() != 48 {
            return Err(MetadataError::Invalid {
                field,
                why: format!("{} bytes, expected 48", self.body.len()),
            });
        }
        let mut socket = [0u8; 16];
        socket.copy_from_slice(&self.body[..16]);
        let mut token = [0u8; 32];
        token.copy_from_slice(&self.body[16..]);
        Ok(Some(ShmLaneInfo { socket, token }))
    }

    /// The TCP lane's address, credential and key, if this is its entry and well formed.
    pub fn as_tcp(&self) -> Result<Option<LaneInfo>, MetadataError> {
        if self.lane != LANE_TCP {
            return Ok(None);
        }
        let b = &self.body[..];
        let invalid = |field, why: String| MetadataError::Invalid { field, why };
        let (ip, rest): (std::net::IpAddr, &[u8]) = match b.first() {
            Some(4) if b.len() == TCP_FIXED_LEN + 4 => {
                let o: [u8; 4] = b[1..5].try_into().unwrap_or_default();
                (std::net::Ipv4Addr::from(o).into(), &b[5..])
            }
            Some(6) if b.len() == TCP_FIXED_LEN + 16 => {
                let o: [u8; 16] = b[1..17].try_into().unwrap_or_default();
                (std::net::Ipv6Addr::from(o).into(), &b[17..])
            }
            Some(f @ (4 | 6)) => {
                return Err(invalid(
                    "tcp lane entry",
                    format!("{} bytes for family {f}", b.len()),
                ))
            }
            f => {
                return Err(invalid(
                    "lane address family",
                    format!("{f:?}, expected 4 or 6"),
                ))
            }
        };
        let port = u16::from_le_bytes([rest[0], rest[1]]);
        if port == 0 {
            return Err(invalid("lane port", "0".into()));
        }
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&rest[2..18]);
        let mut key = [0u8; 32];
        key.copy_from_slice(&rest[18..50]);
        Ok(Some(LaneInfo {
            addr: std::net::SocketAddr::new(ip, port),
            secret,
            key,
        }))
    }

    /// Bytes on the wire.
    pub fn wire_len(&self) -> usize {
        ENTRY_HEADER_LEN + self.body.len()
    }

    /// Appends the entry to `b`.
    pub fn encode_into(&self, b: &mut Vec<u8>) {
        b.push(self.lane);
        b.extend_from_slice(&(self.body.len() as u16).to_le_bytes());
        b.extend_from_slice(&self.body);
    }
}

/// Checks a decoded list: at most [`MAX_LANES`], each lane once, known lanes well formed.
pub fn check(entries: &[LaneEntry]) -> Result<(), MetadataError> {
    if entries.len() > MAX_LANES {
        return Err(MetadataError::TooLarge {
            field: "lane list",
            len: entries.len(),
            max: MAX_LANES,
        });
    }
    for (i, e) in entries.iter().enumerate() {
        if entries[..i].iter().any(|x| x.lane == e.lane) {
            return Err(MetadataError::Invalid {
                field: "lane list",
                why: format!("lane {} appears twice", e.lane),
            });
        }
        e.as_tcp()?;
        e.as_shm()?;
        e.as_device()?;
    }
    Ok(())
}

/// The shared-memory lane's entry of `entries`, decoded (a list that passed [`check`]).
pub fn shm_of(entries: &[LaneEntry]) -> Option<ShmLaneInfo> {
    entries.iter().find_map(|e| e.as_shm().ok().flatten())
}

/// The device lane's entry of `entries`, decoded (a list that passed [`check`]).
pub fn device_of(entries: &[LaneEntry]) -> Option<ShmLaneInfo> {
    entries.iter().find_map(|e| e.as_device().ok().flatten())
}

/// The TCP lane's entry of `entries`, decoded (a list that passed [`check`]).
pub fn tcp_of(entries: &[LaneEntry]) -> Option<LaneInfo> {
    entries.iter().find_map(|e| e.as_tcp().ok().flatten())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(addr: &str) -> LaneInfo {
        LaneInfo {
            addr: addr.parse().unwrap(),
            secret: [7; 16],
            key: [9; 32],
        }
    }

    #[test]
    fn the_tcp_entry_round_trips_and_is_checked() {
        for a in ["198.18.0.1:4000", "[::1]:9"] {
            let e = LaneEntry::tcp(&info(a));
            assert_eq!(e.as_tcp().unwrap(), Some(info(a)));
            assert_eq!(tcp_of(std::slice::from_ref(&e)), Some(info(a)));
        }
        let mut e = LaneEntry::tcp(&info("198.18.0.1:4000"));
        e.body.pop();
        assert!(e.as_tcp().is_err(), "short");
        let mut e = LaneEntry::tcp(&info("198.18.0.1:4000"));
        e.body[0] = 5;
        assert!(e.as_tcp().is_err(), "family");
        let e = LaneEntry::tcp(&info("198.18.0.1:0"));
        assert!(e.as_tcp().is_err(), "port 0");
    }

    #[test]
    fn the_shm_entry_round_trips_and_is_checked() {
        let info = ShmLaneInfo {
            socket: [3; 16],
            token: [4; 32],
        };
        let e = LaneEntry::shm(&info);
        assert_eq!(e.as_shm().unwrap(), Some(info));
        assert_eq!(e.as_tcp().unwrap(), None);
        assert_eq!(shm_of(std::slice::from_ref(&e)), Some(info));
        assert_eq!(
            info.socket_name(),
            "kvxfer-shm-03030303030303030303030303030303"
        );
        let mut short = e.clone();
        short.body.pop();
        assert!(short.as_shm().is_err() && check(&[short]).is_err());
        let mut long = e;
        long.body.push(0);
        assert!(long.as_shm().is_err());
    }

    #[test]
    fn an_unknown_lane_is_kept_and_a_repeated_one_refused() {
        let other = LaneEntry {
            lane: 200,
            body: vec![1, 2, 3],
        };
        let tcp = LaneEntry::tcp(&info("198.18.0.1:4000"));
        assert!(check(&[other.clone(), tcp.clone()]).is_ok());
        assert_eq!(other.as_tcp().unwrap(), None);
        assert!(check(&[tcp.clone(), tcp]).is_err());
        let many: Vec<LaneEntry> = (0..=MAX_LANES as u8)
            .map(|i| LaneEntry {
                lane: 100 + i,
                body: Vec::new(),
            })
            .collect();
        assert!(check(&many).is_err());
    }
}
