//! A side-channel HELLO by hand, without a secret, under a name of the sender's choice: what
//! a flood of new names sends (the chaos run's hostile peer, the peer-table tests).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvxfer_proto::wire::metadata::Metadata;
use kvxfer_proto::wire::side_channel::{encode_frame, FRAME_HEADER_LEN, HELLO, PREAMBLE};

/// Sends `meta` (a real agent's metadata, as encoded) renamed `name` with epoch `epoch` to
/// the side channel at `side`; returns the open connection, the answer frame's kind and its
/// payload (at most 16 MiB read).
pub fn hello_as(
    side: SocketAddr,
    meta: &[u8],
    compat: u64,
    name: &str,
    epoch: u64,
) -> std::io::Result<(TcpStream, u8, Vec<u8>)> {
    let mut m = Metadata::decode(meta, compat)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    m.name = name.to_string();
    m.epoch = epoch;
    let mut s = TcpStream::connect_timeout(&side, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(&PREAMBLE)?;
    s.write_all(&encode_frame(HELLO, &m.encode()))?;
    // The listener's preamble, then its answer frame (length counts the kind byte).
    let mut pre = [0u8; PREAMBLE.len()];
    let mut h = [0u8; FRAME_HEADER_LEN];
    s.read_exact(&mut pre)?;
    s.read_exact(&mut h)?;
    let len = (u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize).saturating_sub(1);
    let mut p = vec![0u8; len.min(16 << 20)];
    s.read_exact(&mut p)?;
    Ok((s, h[4], p))
}
