//! An explicit staged transfer through a UCX-registered [`StagingPool`], for transports
//! without kvxfer's lanes (RDMA without GPUDirect): device memory is copied chunk by chunk
//! into registered host chunks, which the agent transfers, overlapped with the next copy.

use std::time::{Duration, Instant};

use crate::agent::Agent;
use crate::budget::{Charge, MemoryBudget};
use crate::device::copy::CopyEngine;
use crate::memory::{HostBuffer, Region};
use crate::staging::pipeline::cut_into_chunks;
use crate::staging::pool::ChunkPool;
use crate::transfer::Transfer;
use kvxfer_proto::descriptor::Desc;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::XferOp;

/// A fixed pool of UCX-registered host chunks, for [`staged`].
#[derive(Debug)]
pub struct StagingPool {
    region: Region,
    pool: ChunkPool,
    _charge: Charge,
}

impl StagingPool {
    /// `chunks` chunks of `chunk_bytes`, registered with `agent`, charged to `budget` once
    /// (refused if the budget cannot hold them).
    pub fn new(
        agent: &Agent,
        budget: &MemoryBudget,
        chunks: usize,
        chunk_bytes: usize,
    ) -> Result<Self> {
        if chunks < 2 || chunk_bytes == 0 {
            return Err(Error::InvalidArgument(
                "a staging pool needs at least 2 chunks of at least 1 byte".into(),
            ));
        }
        let bytes = chunks
            .checked_mul(chunk_bytes)
            .ok_or_else(|| Error::InvalidArgument("staging pool size overflows".into()))?;
        let charge = budget.try_charge(bytes as u64, "staging pool")?;
        let region = agent.register(HostBuffer::new(bytes)?)?;
        // SAFETY: the region's owned buffer lives as long as `region`, which the pool holds.
        let pool = unsafe { ChunkPool::new(region.addr() as *mut u8, chunks, chunk_bytes) };
        Ok(StagingPool {
            region,
            pool,
            _charge: charge,
        })
    }

    /// Chunk size in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.pool.chunk
    }

    /// The most chunks ever in use at once (never more than the pool holds).
    pub fn peak_in_use(&self) -> usize {
        self.pool.peak()
    }

    /// Acquisitions that had to wait for a chunk.
    pub fn waits(&self) -> u64 {
        self.pool.waits()
    }

    fn acquire(&self, until: Instant) -> Result<usize> {
        self.pool
            .acquire_n(1, until.saturating_duration_since(Instant::now()))
            .map(|v| v[0])
            .ok_or_else(|| {
                Error::OutOfMemory(format!(
                    "all {} staging chunks stayed in use past the deadline",
                    self.pool.n
                ))
            })
    }

    fn try_acquire(&self) -> Option<usize> {
        self.pool.acquire_n(1, Duration::ZERO).map(|v| v[0])
    }

    fn release(&self, c: usize) {
        self.pool.release(c)
    }

    #[allow(clippy::mut_from_ref)]
    fn chunk_slice(&self, c: usize, len: usize) -> &mut [u8] {
        self.pool.slice(c, len)
    }
}

/// Pieces of one chunk: (device address, offset in the chunk, the peer's descriptor).
type Group = Vec<(u64, usize, Desc)>;
/// A chunk whose transfer is in flight.
type InFlight = (usize, Transfer, Group);

/// The end of the used part of a chunk.
fn off_end(g: &Group) -> usize {
    g.iter().map(|x| x.1 + x.2.len as usize).max().unwrap_or(0)
}

/// One piece of device memory and where it goes (or comes from) on the peer.
#[derive(Clone, Copy, Debug)]
pub struct StagedPiece {
    /// Device address (for the copy engine).
    pub device: u64,
    /// The peer's descriptor of the same length.
    pub remote: Desc,
}

/// Moves device memory to a peer (`XferOp::Write`) or a peer's memory into device memory
/// (`XferOp::Read`) through the pool, two chunks in flight; the notification goes with the last
/// chunk (after all data). Returns the bytes moved.
///
/// # Safety
/// Every `device` range is valid device memory for `engine` (readable for a write, writable
/// for a read) for the duration of the call.
// The argument list mirrors `Agent::transfer` plus the pool and the copy engine.
#[allow(clippy::too_many_arguments)]
pub unsafe fn staged(
    agent: &Agent,
    pool: &StagingPool,
    engine: &dyn CopyEngine,
    device: u32,
    op: XferOp,
    peer: &str,
    pieces: &[StagedPiece],
    notification: Option<&[u8]>,
    deadline: Duration,
) -> Result<u64> {
    let until = Instant::now() + deadline;
    let chunk = pool.pool.chunk;
    let q = std::cell::RefCell::new(engine.queue(device)?);
    // Chunk-sized groups of (device address, offset in chunk, the peer's descriptor).
    let groups: Vec<Group> = cut_into_chunks(pieces.iter().map(|p| p.remote.len), chunk)
        .into_iter()
        .map(|(g, _)| {
            g.into_iter()
                .map(|(i, at, off, n)| {
                    let p = &pieces[i];
                    let d = Desc::new(p.remote.region, p.remote.offset + at, n as u64);
                    (p.device + at, off, d)
                })
                .collect()
        })
        .collect();
    let mut inflight: Vec<InFlight> = Vec::new();
    let mut bytes = 0u64;
    let finish_one = |(c, t, g): InFlight| -> Result<u64> {
        let r = t.wait();
        if r.is_ok() && op == XferOp::Read {
            let s = pool.chunk_slice(c, off_end(&g));
            let mut q = q.borrow_mut();
            for &(dev, off, d) in &g {
                // SAFETY: the caller's contract for `dev`; the chunk is held until release.
                if let Err(e) = unsafe { q.to_device(s.as_ptr().add(off), dev, d.len as usize) } {
                    pool.release(c);
                    return Err(e);
                }
            }
            if let Err(e) = q.sync() {
                pool.release(c);
                return Err(e);
            }
        }
        pool.release(c);
        r.map(|s| s.bytes)
    };
    let n = groups.len();
    for (k, g) in groups.into_iter().enumerate() {
        // Double buffering: at most two chunks of this transfer in flight; the last chunk,
        // which carries the notification, goes once everything before it has landed.
        while inflight.len() == 2 || (k + 1 == n && notification.is_some() && !inflight.is_empty())
        {
            bytes += finish_one(inflight.remove(0))?;
        }
        // Never wait for a chunk while holding one: with several transfers each holding one
        // chunk and waiting for a second, nobody would progress. Finish an own chunk first.
        let c = loop {
            if let Some(c) = pool.try_acquire() {
                break c;
            }
            if !inflight.is_empty() {
                bytes += finish_one(inflight.remove(0))?;
                continue;
            }
            match pool.acquire(until) {
                Ok(c) => break c,
                Err(e) => return Err(e),
            }
        };
        if op == XferOp::Write {
            let s = pool.chunk_slice(c, off_end(&g));
            let mut q = q.borrow_mut();
            let mut r = Ok(());
            for &(dev, off, d) in &g {
                // SAFETY: the caller's contract for `dev`; the chunk is held exclusively.
                r = unsafe { q.to_host(dev, s.as_mut_ptr().add(off), d.len as usize) };
                if r.is_err() {
                    break;
                }
            }
            if let Err(e) = r.and_then(|_| q.sync()) {
                pool.release(c);
                return Err(e);
            }
        }
        let base = (c * chunk) as u64;
        let locals: Vec<Desc> = g
            .iter()
            .map(|&(_, off, d)| Desc::new(pool.region.id(), base + off as u64, d.len))
            .collect();
        let remotes: Vec<Desc> = g.iter().map(|x| x.2).collect();
        let note = if k + 1 == n { notification } else { None };
        let t = agent
            .prep_local(&locals)
            .and_then(|l| agent.prep_remote(peer, &remotes).map(|r| (l, r)))
            .and_then(|(l, r)| {
                let left = until.saturating_duration_since(Instant::now());
                agent.transfer_all(op, &l, &r, note, Some(left))
            });
        match t {
            Ok(t) => inflight.push((c, t, g)),
            Err(e) => {
                pool.release(c);
                for x in inflight.drain(..) {
                    let _ = finish_one(x);
                }
                return Err(e);
            }
        }
    }
    for x in inflight {
        bytes += finish_one(x)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_pool_makes_the_next_acquire_wait_until_a_release() {
        let agent = Agent::new(
            crate::AgentConfig::new(format!("pool-{}", std::process::id()))
                .transport(crate::Transport::Tcp)
                .net_devices("lo"),
        )
        .unwrap();
        let budget = MemoryBudget::new(4096);
        let pool = std::sync::Arc::new(StagingPool::new(&agent, &budget, 2, 2048).unwrap());
        assert_eq!(budget.used(), 4096);
        let far = Instant::now() + Duration::from_secs(30);
        let (a, b) = (pool.acquire(far).unwrap(), pool.acquire(far).unwrap());
        // Full: a bounded wait fails with a typed error, nothing is allocated.
        let e = pool
            .acquire(Instant::now() + Duration::from_millis(50))
            .unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)), "{e}");
        let p2 = pool.clone();
        let t = std::thread::spawn(move || p2.acquire(Instant::now() + Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!t.is_finished(), "acquire returned while the pool was full");
        pool.release(a);
        let c = t.join().unwrap().unwrap();
        assert_eq!(c, a, "the released chunk is the one handed out");
        assert_eq!(pool.peak_in_use(), 2);
        assert!(pool.waits() >= 2);
        pool.release(b);
        pool.release(c);
        assert_eq!(
            budget.used(),
            4096,
            "the pool's memory is charged once, for its life"
        );
    }
}
