//! Fixed pools of host chunks for device memory on the staged path, allocated once and
//! charged to the memory budget once; an agent's [`StagingCell`] creates them on first use.

use super::settings::StagingShape;
use std::sync::{Arc, Mutex};

// The chunk pool's lock and wake-ups: loom's under `--cfg loom` (scripts/sanitizers.sh loom),
// which explores every interleaving of acquires and releases (its timed wait is a plain wait).
#[cfg(loom)]
use loom::sync::{Condvar, Mutex as PoolMutex, MutexGuard as PoolGuard};
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex as PoolMutex, MutexGuard as PoolGuard};
use std::time::{Duration, Instant};

use crate::budget::{Charge, MemoryBudget};
use crate::device::copy::CopyEngine;
use crate::memory::HostBuffer;
use kvxfer_proto::error::Result;

/// A fixed set of equal host chunks handed out to one holder at a time, allocated once and
/// charged to a budget once; pinned for the copy engine when it has one.
#[derive(Debug)]
pub(crate) struct ChunkPool {
    base: *mut u8,
    pub(crate) chunk: usize,
    pub(crate) n: usize,
    free: PoolMutex<Free>,
    cv: Condvar,
}

// SAFETY: `base` points into memory owned by the pool's owner for the pool's life; chunks are
// handed out exclusively (acquire/release under the mutex).
unsafe impl Send for ChunkPool {}
// SAFETY: as above.
unsafe impl Sync for ChunkPool {}

#[derive(Debug)]
struct Free {
    chunks: Vec<usize>,
    in_use: usize,
    peak: usize,
    waits: u64,
}

impl ChunkPool {
    /// # Safety
    /// `[base, base + chunks*chunk_bytes)` is writable host memory that outlives the pool.
    pub(crate) unsafe fn new(base: *mut u8, chunks: usize, chunk_bytes: usize) -> Self {
        ChunkPool {
            base,
            chunk: chunk_bytes,
            n: chunks,
            free: PoolMutex::new(Free {
                chunks: (0..chunks).rev().collect(),
                in_use: 0,
                peak: 0,
                waits: 0,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> PoolGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn peak(&self) -> usize {
        self.lock().peak
    }

    pub(crate) fn waits(&self) -> u64 {
        self.lock().waits
    }

    fn in_use(&self) -> usize {
        self.lock().in_use
    }

    /// Takes `k` chunks at once (all or none), waiting up to `wait`. A holder never waits for
    /// more, so holders cannot deadlock on the pool.
    pub(crate) fn acquire_n(&self, k: usize, wait: Duration) -> Option<Vec<usize>> {
        let until = Instant::now() + wait;
        let mut f = self.lock();
        let mut waited = false;
        loop {
            if f.chunks.len() >= k {
                let at = f.chunks.len() - k;
                let got = f.chunks.split_off(at);
                f.in_use += k;
                f.peak = f.peak.max(f.in_use);
                return Some(got);
            }
            if !waited {
                f.waits += 1;
                waited = true;
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            f = self
                .cv
                .wait_timeout(f, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    pub(crate) fn release(&self, c: usize) {
        let mut f = self.lock();
        f.chunks.push(c);
        f.in_use -= 1;
        drop(f);
        self.cv.notify_all();
    }

    /// The start of chunk `c`.
    fn ptr(&self, c: usize) -> *mut u8 {
        // SAFETY: c < n, so the offset stays inside the pool's memory.
        unsafe { self.base.add(c * self.chunk) }
    }

    // A chunk is handed out to one holder at a time (acquire/release), so the `&mut` is
    // exclusive although the pool is shared.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn slice(&self, c: usize, len: usize) -> &mut [u8] {
        debug_assert!(c < self.n && len <= self.chunk);
        // SAFETY: chunk c is held exclusively by the caller between acquire and release; the
        // range lies inside the pool's memory (c < n, len <= chunk).
        unsafe { std::slice::from_raw_parts_mut(self.ptr(c), len) }
    }
}

/// Two chunks held by one transfer (double buffering); released on drop.
pub(crate) struct ChunkPair<'a> {
    pool: &'a ChunkPool,
    chunks: [usize; 2],
}

impl ChunkPair<'_> {
    /// Chunk `i` (0 or 1), `len` bytes of it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) fn slice(&self, i: usize, len: usize) -> &mut [u8] {
        self.pool.slice(self.chunks[i], len)
    }

    pub(crate) fn chunk_bytes(&self) -> usize {
        self.pool.chunk
    }
}

impl Drop for ChunkPair<'_> {
    fn drop(&mut self) {
        for c in self.chunks {
            self.pool.release(c);
        }
    }
}

pub use kvxfer_proto::types::{DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES};

/// An agent's staging for device memory on its TCP lane: the copy engine and two fixed chunk
/// pools, one for transfers this agent starts and one for transfers peers start (so that a
/// transfer holding chunks only ever waits on a peer that holds its own: no deadlock across
/// agents). Allocated once, at the first device registration, charged to the agent's budget.
#[derive(Debug)]
pub struct DeviceStaging {
    pub(crate) engine: Arc<dyn CopyEngine>,
    initiator: ChunkPool,
    target: ChunkPool,
    mem: HostBuffer,
    pinned: bool,
    _charge: Charge,
}

/// What a [`DeviceStaging`] has done, for telemetry and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingStats {
    /// Bytes the pools hold (allocated once).
    pub bytes: u64,
    /// Chunks per pool.
    pub chunks_per_pool: usize,
    /// Chunk size.
    pub chunk_bytes: usize,
    /// Most chunks in use at once in the pool of transfers this agent starts.
    pub peak_initiator: usize,
    /// Most chunks in use at once in the pool of transfers peers start.
    pub peak_target: usize,
    /// Chunks in use now (both pools).
    pub in_use: usize,
    /// Acquisitions that had to wait for chunks (both pools).
    pub waits: u64,
}

impl DeviceStaging {
    /// Pools of `shape` (its chunks split evenly between the two), charged to `budget`,
    /// pinned by `engine`.
    pub(crate) fn new(
        engine: Arc<dyn CopyEngine>,
        budget: &MemoryBudget,
        shape: StagingShape,
    ) -> Result<Self> {
        let (per, chunk_bytes, bytes) = (shape.per_pool(), shape.chunk_bytes(), shape.bytes());
        let charge = budget.try_charge(bytes as u64, "device staging chunks")?;
        let mut mem = HostBuffer::new(bytes)?;
        let base = mem.as_mut_slice().as_mut_ptr();
        // SAFETY: `mem` is owned by the returned value and outlives the pin (unpinned in drop).
        let pinned = match unsafe { engine.pin(base, bytes) } {
            Ok(()) => true,
            Err(e) => {
                log::warn!("kvxfer: staging chunks not pinned ({e}); copies will be slower");
                false
            }
        };
        // SAFETY: both halves lie inside `mem`, which the pools' owner keeps alive.
        let (initiator, target) = unsafe {
            (
                ChunkPool::new(base, per, chunk_bytes),
                ChunkPool::new(base.add(per * chunk_bytes), per, chunk_bytes),
            )
        };
        Ok(DeviceStaging {
            engine,
            initiator,
            target,
            mem,
            pinned,
            _charge: charge,
        })
    }

    /// The copy engine.
    pub fn engine(&self) -> &Arc<dyn CopyEngine> {
        &self.engine
    }

    /// Two chunks of the initiator (`true`) or target pool, waiting up to `wait`.
    pub(crate) fn pair(&self, initiator: bool, wait: Duration) -> Option<ChunkPair<'_>> {
        let pool = if initiator {
            &self.initiator
        } else {
            &self.target
        };
        let c = pool.acquire_n(2, wait)?;
        Some(ChunkPair {
            pool,
            chunks: [c[0], c[1]],
        })
    }

    /// Counters.
    pub fn stats(&self) -> StagingStats {
        StagingStats {
            bytes: self.mem.len() as u64,
            chunks_per_pool: self.initiator.n,
            chunk_bytes: self.initiator.chunk,
            peak_initiator: self.initiator.peak(),
            peak_target: self.target.peak(),
            in_use: self.initiator.in_use() + self.target.in_use(),
            waits: self.initiator.waits() + self.target.waits(),
        }
    }
}

impl Drop for DeviceStaging {
    fn drop(&mut self) {
        if self.pinned {
            // SAFETY: pinned in new; no chunk is in use (the pools are borrowed by holders
            // only while `self` is borrowed).
            unsafe { self.engine.unpin(self.mem.as_mut_slice().as_mut_ptr()) };
        }
    }
}

/// An agent's device-staging slot: the copy engine (given, or CUDA by default with the
/// `cuda` feature) and the [`DeviceStaging`] pools, created on first use.
pub(crate) struct StagingCell {
    engine: Mutex<Option<Arc<dyn CopyEngine>>>,
    shape: StagingShape,
    budget: MemoryBudget,
    pools: Mutex<Option<Arc<DeviceStaging>>>,
}

impl StagingCell {
    pub(crate) fn new(
        engine: Option<Arc<dyn CopyEngine>>,
        shape: StagingShape,
        budget: MemoryBudget,
    ) -> Self {
        if let Some(e) = &engine {
            e.charge_to(&budget);
        }
        StagingCell {
            engine: Mutex::new(engine),
            shape,
            budget,
            pools: Mutex::new(None),
        }
    }

    /// The copy engine, for `device` (typed error where none can exist).
    pub(crate) fn engine(&self, device: u32) -> Result<Arc<dyn CopyEngine>> {
        let mut g = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = g.as_ref() {
            return Ok(e.clone());
        }
        let e = crate::device::default_engine(device)?;
        e.charge_to(&self.budget);
        *g = Some(e.clone());
        Ok(e)
    }

    /// The pools, allocated (and charged) on the first call.
    pub(crate) fn pools(&self, device: u32) -> Result<Arc<DeviceStaging>> {
        let mut g = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = g.as_ref() {
            return Ok(p.clone());
        }
        let p = Arc::new(DeviceStaging::new(
            self.engine(device)?,
            &self.budget,
            self.shape,
        )?);
        *g = Some(p.clone());
        Ok(p)
    }

    /// The pools if they exist.
    pub(crate) fn existing(&self) -> Option<Arc<DeviceStaging>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The chunk pool's waits under loom: holders that each take two chunks at once from a pool
/// of three, use them and give them back, in every interleaving: nobody deadlocks or misses a
/// wake-up, and no chunk is handed to two holders.
#[cfg(test)]
#[cfg(loom)]
mod loom_model {
    use super::*;

    #[test]
    fn holders_of_two_chunks_never_deadlock_or_share() {
        loom::model(|| {
            let mut mem = vec![0u8; 3 * 8];
            // SAFETY: `mem` (3 chunks of 8 bytes) outlives the pool, dropped at the end.
            let pool = Arc::new(unsafe { ChunkPool::new(mem.as_mut_ptr(), 3, 8) });
            let ts: Vec<_> = (0..2)
                .map(|_| {
                    let p = pool.clone();
                    loom::thread::spawn(move || {
                        let got = p.acquire_n(2, Duration::from_secs(3600)).unwrap();
                        assert!(p.in_use() <= 3);
                        for c in got {
                            p.release(c);
                        }
                    })
                })
                .collect();
            for t in ts {
                t.join().unwrap();
            }
            assert_eq!(pool.in_use(), 0);
            assert!(pool.peak() <= 3);
            drop(pool);
            drop(mem);
        });
    }
}
