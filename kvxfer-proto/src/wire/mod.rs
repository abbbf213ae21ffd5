//! Every wire format kvxfer speaks, each with a paired encoder and decoder, named sizes and
//! round-trip tests: agent metadata, notifications, the TCP lane, the side channel, the UCX
//! fence. The connector's decision logic over its messages is in [`crate::connector`].

pub mod connector;
pub mod lane;
pub mod lane_entries;
pub mod lane_window;
pub mod metadata;
pub mod notify;
pub mod shm_fds;
pub mod side_channel;
pub mod ucx_fence;

/// Lowercase hex of `b`.
pub fn hex(b: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    b.iter()
        .flat_map(|x| [D[usize::from(x >> 4)], D[usize::from(x & 15)]])
        .map(char::from)
        .collect()
}

/// Exactly `N` bytes from lowercase or uppercase hex.
pub fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let s = s.as_bytes();
    if s.len() != 2 * N {
        return None;
    }
    let nib = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
        *o = (nib(pair[0])? << 4) | nib(pair[1])?;
    }
    Some(out)
}
