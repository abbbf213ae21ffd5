//! The one source of randomness: the kernel's (`/dev/urandom`), for handshake keys, nonces,
//! lane credentials and incarnation numbers.
#![forbid(unsafe_code)]

use std::io::Read;

use kvxfer_proto::error::{Error, Result};

/// `N` fresh random bytes.
pub(crate) fn bytes<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .map_err(|e| Error::io("opening /dev/urandom", e))?
        .read_exact(&mut b)
        .map_err(|e| Error::io("reading /dev/urandom", e))?;
    Ok(b)
}
