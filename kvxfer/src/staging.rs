//! The staged path for memory the transport cannot reach (GPU memory without a CUDA-aware
//! UCX): a fixed pool of registered host chunks, allocated once and charged to the memory
//! budget, through which device memory moves chunk by chunk — copy into a chunk, send it,
//! and copy the next chunk meanwhile (two chunks per transfer). More concurrent transfers wait
//! for chunks; nothing else is ever allocated, so memory stays at the pool's size whatever the
//! concurrency (the seed's failure: host staging buffers grew with concurrency x KV size).
//! A transfer never waits for a chunk while it holds one, so concurrent transfers cannot
//! deadlock on the pool.
//!
//! The device side is a [`CopyEngine`]: CUDA copies on a stream with the `cuda` feature, or
//! [`HostCopyEngine`], where "device" memory is host memory (tests, CPU-only engines).

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::budget::{Charge, MemoryBudget};
use crate::descriptor::Desc;
use crate::error::{Error, Result};
use crate::memory::{HostBuffer, Region};
use crate::transfer::XferOp;
use crate::Agent;

/// Copies between device memory (addresses the engine understands) and host memory.
pub trait CopyEngine: Send + Sync {
    /// Copies `dst.len()` bytes from device address `src` into `dst`.
    fn to_host(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` to device address `dst`.
    fn to_device(&self, src: &[u8], dst: u64) -> Result<()>;
}

/// "Device" memory that is host memory: addresses are host pointers the caller keeps valid.
#[derive(Debug, Default)]
pub struct HostCopyEngine;

impl CopyEngine for HostCopyEngine {
    fn to_host(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        // SAFETY: the staged calls' contract: [src, src+len) is valid readable memory for the
        // duration of the call and does not overlap the staging chunk.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn to_device(&self, src: &[u8], dst: u64) -> Result<()> {
        // SAFETY: as above, [dst, dst+len) is valid writable memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
}

#[derive(Debug)]
struct Free {
    chunks: Vec<usize>,
    in_use: usize,
    peak: usize,
    waits: u64,
}

/// A fixed pool of registered host chunks.
#[derive(Debug)]
pub struct StagingPool {
    region: Region,
    chunk: usize,
    n: usize,
    free: Mutex<Free>,
    cv: Condvar,
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
        Ok(StagingPool {
            region,
            chunk: chunk_bytes,
            n: chunks,
            free: Mutex::new(Free {
                chunks: (0..chunks).rev().collect(),
                in_use: 0,
                peak: 0,
                waits: 0,
            }),
            cv: Condvar::new(),
            _charge: charge,
        })
    }

    /// Chunk size in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }

    /// The most chunks ever in use at once (never more than the pool holds).
    pub fn peak_in_use(&self) -> usize {
        self.lock().peak
    }

    /// Acquisitions that had to wait for a chunk.
    pub fn waits(&self) -> u64 {
        self.lock().waits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn acquire(&self, until: Instant) -> Result<usize> {
        let mut f = self.lock();
        let mut waited = false;
        loop {
            if let Some(c) = f.chunks.pop() {
                f.in_use += 1;
                f.peak = f.peak.max(f.in_use);
                return Ok(c);
            }
            if !waited {
                f.waits += 1;
                waited = true;
            }
            let now = Instant::now();
            if now >= until {
                return Err(Error::OutOfMemory(format!(
                    "all {} staging chunks stayed in use past the deadline",
                    self.n
                )));
            }
            f = self
                .cv
                .wait_timeout(f, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn try_acquire(&self) -> Option<usize> {
        let mut f = self.lock();
        let c = f.chunks.pop()?;
        f.in_use += 1;
        f.peak = f.peak.max(f.in_use);
        Some(c)
    }

    fn release(&self, c: usize) {
        let mut f = self.lock();
        f.chunks.push(c);
        f.in_use -= 1;
        drop(f);
        self.cv.notify_one();
    }

    // A chunk is handed out to one transfer at a time (acquire/release), so the `&mut` is
    // exclusive although the pool is shared.
    #[allow(clippy::mut_from_ref)]
    fn chunk_slice(&self, c: usize, len: usize) -> &mut [u8] {
        // SAFETY: chunk c is held exclusively by the caller between acquire and release; the
        // range lies inside the pool's region (c < n, len <= chunk); no transfer uses it while
        // the slice lives (the caller waits for the chunk's transfer before reusing it).
        unsafe {
            std::slice::from_raw_parts_mut((self.region.addr() as *mut u8).add(c * self.chunk), len)
        }
    }
}

/// Pieces of one chunk: (device address, offset in the chunk, the peer's descriptor).
type Group = Vec<(u64, usize, Desc)>;
/// A chunk whose transfer is in flight.
type InFlight = (usize, crate::Transfer, Group);

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
    op: XferOp,
    peer: &str,
    pieces: &[StagedPiece],
    notification: Option<&[u8]>,
    deadline: Duration,
) -> Result<u64> {
    let until = Instant::now() + deadline;
    // Cut the pieces into chunk-sized groups: (device, offset in chunk, remote desc).
    let mut groups: Vec<Group> = Vec::new();
    let mut cur: Group = Vec::new();
    let mut fill = 0usize;
    for p in pieces {
        let mut done = 0u64;
        while done < p.remote.len {
            if fill == pool.chunk {
                groups.push(std::mem::take(&mut cur));
                fill = 0;
            }
            let n = ((p.remote.len - done) as usize).min(pool.chunk - fill);
            cur.push((
                p.device + done,
                fill,
                Desc::new(p.remote.region, p.remote.offset + done, n as u64),
            ));
            fill += n;
            done += n as u64;
        }
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    let mut inflight: Vec<InFlight> = Vec::new();
    let mut bytes = 0u64;
    let finish_one = |(c, t, g): InFlight| -> Result<u64> {
        let r = t.wait();
        if r.is_ok() && op == XferOp::Read {
            for &(dev, off, d) in &g {
                engine.to_device(&pool.chunk_slice(c, off + d.len as usize)[off..], dev)?;
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
        let used: usize = g.iter().map(|x| x.1 + x.2.len as usize).max().unwrap_or(0);
        if op == XferOp::Write {
            let s = pool.chunk_slice(c, used);
            for &(dev, off, d) in &g {
                if let Err(e) = engine.to_host(dev, &mut s[off..off + d.len as usize]) {
                    pool.release(c);
                    return Err(e);
                }
            }
        }
        let base = (c * pool.chunk) as u64;
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
