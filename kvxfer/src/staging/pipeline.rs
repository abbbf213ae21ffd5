//! The staged stream: device pieces cut into chunk-sized groups, each copied through one of
//! two chunks on a copy queue while the other is on the wire.

use super::pool::ChunkPair;
use crate::device::copy::{CopyEngine, CopyQueue};
use kvxfer_proto::error::Result;

/// Where a slice of a piece lands in a chunk: (piece index, offset in the piece, offset in the
/// chunk, length).
type Cut = (usize, u64, usize, usize);

/// Cuts pieces of `lens` bytes, in order, into groups that each fill one chunk of
/// `chunk` bytes (the last maybe less); each group with the bytes it uses.
pub(crate) fn cut_into_chunks(
    lens: impl Iterator<Item = u64>,
    chunk: usize,
) -> Vec<(Vec<Cut>, usize)> {
    let mut groups = Vec::new();
    let mut cur = Vec::new();
    let mut fill = 0usize;
    for (i, l) in lens.enumerate() {
        let mut done = 0u64;
        while done < l {
            if fill == chunk {
                groups.push((std::mem::take(&mut cur), fill));
                fill = 0;
            }
            let n = ((l - done) as usize).min(chunk - fill);
            cur.push((i, done, fill, n));
            fill += n;
            done += n as u64;
        }
    }
    if fill > 0 {
        groups.push((cur, fill));
    }
    groups
}

/// Moves `pieces` (device address, length) of `device` between device memory and the socket
/// through the two chunks of `pair`, copies overlapping the network: `send` copies chunk k+1
/// to the host while chunk k is written; receive copies chunk k to the device while chunk k+1
/// arrives. `net(chunk)` moves one chunk's bytes.
///
/// # Safety
/// Every piece is device memory of `device` for `engine`, readable (send) or writable
/// (receive), that stays allocated and is not freed or deregistered until the call returns.
pub(crate) unsafe fn stream_device(
    engine: &dyn CopyEngine,
    device: u32,
    pair: &ChunkPair<'_>,
    send: bool,
    pieces: &[(u64, u64)],
    net: &mut dyn FnMut(&mut [u8]) -> Result<()>,
) -> Result<()> {
    let cb = pair.chunk_bytes();
    let groups = cut_into_chunks(pieces.iter().map(|p| p.1), cb);
    if groups.is_empty() {
        return Ok(());
    }
    let mut q = engine.queue(device)?;
    let qc = |q: &mut Box<dyn CopyQueue>, k: usize| -> Result<()> {
        let (g, used) = &groups[k];
        let s = pair.slice(k % 2, *used);
        // The chunk's slices, back to back from its start (`cut_into_chunks` fills it in
        // order): one gather or scatter, one submission where the engine batches.
        debug_assert!(g
            .iter()
            .scan(0, |at, c| {
                let ok = c.2 == *at;
                *at += c.3;
                Some(ok)
            })
            .all(|ok| ok));
        let slices: Vec<(u64, u64)> = g
            .iter()
            .map(|&(i, at, _, n)| (pieces[i].0 + at, n as u64))
            .collect();
        // SAFETY: each slice lies inside its piece, valid device memory (this function's
        // contract); the chunk slice holds their lengths added up (`used`), is held
        // exclusively and is not touched until sync.
        unsafe {
            if send {
                q.gather_to_host(&slices, s.as_mut_ptr())
            } else {
                q.scatter_to_device(s.as_ptr(), &slices)
            }
        }
    };
    let r = (|| -> Result<()> {
        if send {
            qc(&mut q, 0)?;
            q.sync()?;
            for (k, (_, used)) in groups.iter().enumerate() {
                if k + 1 < groups.len() {
                    qc(&mut q, k + 1)?; // overlaps the send of chunk k
                }
                let r = net(pair.slice(k % 2, *used));
                let s = q.sync();
                r?;
                s?;
            }
        } else {
            for (k, (_, used)) in groups.iter().enumerate() {
                // Chunk k % 2 is free: its last copy was synced after the previous receive.
                let r = net(pair.slice(k % 2, *used));
                let s = q.sync(); // the copy of chunk k-1 (overlapped the receive above)
                r?;
                s?;
                qc(&mut q, k)?;
            }
            q.sync()?;
        }
        Ok(())
    })();
    if r.is_err() {
        // Never leave copies in flight into chunks the caller is about to hand to another
        // transfer.
        let _ = q.sync();
    }
    r
}
