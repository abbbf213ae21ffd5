//! The staged path for device memory the transport cannot reach (GPU memory without a
//! CUDA-aware UCX): fixed pools of host chunks, allocated once and charged to the memory budget,
//! through which device memory moves chunk by chunk — copy a chunk on a copy queue (a CUDA
//! stream) while the previous one is on the wire. More concurrent transfers wait for chunks;
//! nothing else is ever allocated, so memory stays at the pools' size whatever the concurrency
//! (the seed's failure: host staging buffers grew with concurrency x KV size).
//!
//! Two users:
//! - The agent itself ([`crate::AgentConfig::gpu_path`]): device regions registered on the
//!   staged path move over kvxfer's TCP lane, each end staging its own device memory through
//!   its own [`DeviceStaging`] pools. Transparent to callers: the same descriptors, transfers
//!   and notifications as host memory.
//! - [`staged`]: an explicit staged transfer through a UCX-registered [`StagingPool`], for
//!   transports without kvxfer's lanes (RDMA without GPUDirect).
//!
//! The device side is a [`CopyEngine`]: CUDA copies on a stream with the `cuda` feature
//! (`kvxfer::cuda::CudaCopyEngine`), [`SimulatedDevice`] (device memory that is not
//! addressable from the host, for tests and CPU-only machines), or [`HostCopyEngine`].

use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use crate::budget::{Charge, MemoryBudget};
use crate::descriptor::Desc;
use crate::error::{Error, Result};
use crate::memory::{HostBuffer, Region};
use crate::transfer::XferOp;
use crate::Agent;

/// Copies between one kind of device memory and host memory.
pub trait CopyEngine: Send + Sync + std::fmt::Debug {
    /// A short name for logs and [`crate::PeerInfo`] (`"cuda"`, `"simulated"`).
    fn name(&self) -> &'static str;
    /// Checks that `device` exists (at registration).
    fn check_device(&self, device: u32) -> Result<()>;
    /// Whether UCX itself can reach this engine's memory when it has CUDA transports (true
    /// for CUDA device memory only).
    fn ucx_visible(&self) -> bool {
        false
    }
    /// A queue of copies on `device` for one thread and one transfer.
    fn queue(&self, device: u32) -> Result<Box<dyn CopyQueue>>;
    /// Prepares host memory for fast copies (CUDA: page-locks it). Called once per pool.
    ///
    /// # Safety
    /// `[ptr, ptr+len)` is host memory that stays allocated until [`unpin`](Self::unpin).
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let _ = (ptr, len);
        Ok(())
    }
    /// Undoes [`pin`](Self::pin).
    ///
    /// # Safety
    /// `ptr` was pinned by this engine and no copy uses it.
    unsafe fn unpin(&self, ptr: *mut u8) {
        let _ = ptr;
    }
}

/// Copies queued in order; they may run after the call returns, until [`sync`](Self::sync).
/// Implementations wait for their queued copies when dropped.
pub trait CopyQueue: Send {
    /// Queues a copy of `len` bytes from device address `src` to host `dst`.
    ///
    /// # Safety
    /// `[src, src+len)` is device memory of the queue's device; `[dst, dst+len)` is writable
    /// host memory that nothing else reads or writes until `sync` returns.
    unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()>;
    /// Queues a copy of `len` bytes from host `src` to device address `dst`.
    ///
    /// # Safety
    /// `[dst, dst+len)` is device memory of the queue's device; `[src, src+len)` is host
    /// memory that nothing writes until `sync` returns.
    unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()>;
    /// Waits until every queued copy is done; the first failure among them is returned.
    fn sync(&mut self) -> Result<()>;
}

/// "Device" memory that is host memory: device addresses are host pointers the caller keeps
/// valid. Copies are done at once.
#[derive(Debug, Default)]
pub struct HostCopyEngine;

struct HostQueue;

impl CopyQueue for HostQueue {
    unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the trait's contract: both ranges valid, not overlapping (host and device).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst, len) };
        Ok(())
    }
    unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src, dst as *mut u8, len) };
        Ok(())
    }
    fn sync(&mut self) -> Result<()> {
        Ok(())
    }
}

impl CopyEngine for HostCopyEngine {
    fn name(&self) -> &'static str {
        "host"
    }
    fn check_device(&self, _device: u32) -> Result<()> {
        Ok(())
    }
    fn queue(&self, _device: u32) -> Result<Box<dyn CopyQueue>> {
        Ok(Box::new(HostQueue))
    }
}

/// Simulated device memory: allocations whose device addresses are not host addresses (they
/// lie outside any user address space, so a path that touched them directly instead of
/// through the copy engine would fault), and a copy engine that checks every copy against the
/// allocations. Stands in for a GPU in tests and on machines without one.
#[derive(Clone, Debug, Default)]
pub struct SimulatedDevice {
    inner: Arc<SimInner>,
}

#[derive(Debug, Default)]
struct SimInner {
    allocs: RwLock<Vec<SimAlloc>>,
    /// Copies queued (to_host + to_device), for tests.
    copies: std::sync::atomic::AtomicU64,
}

struct SimAlloc {
    addr: u64,
    mem: Box<[std::cell::UnsafeCell<u8>]>,
}

impl std::fmt::Debug for SimAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimAlloc({:#x}, {} bytes)", self.addr, self.mem.len())
    }
}

// SAFETY: the cells are only accessed through raw copies whose exclusivity the copy contracts
// (and the callers' region pinning) guarantee, like real device memory.
unsafe impl Sync for SimAlloc {}

/// Base of simulated device addresses: non-canonical on x86-64 and above 48-bit user space.
const SIM_BASE: u64 = 0x7e57_0000_0000_0000;

impl SimulatedDevice {
    /// An empty simulated device.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allocates `len` zeroed bytes; returns their device address (page aligned).
    pub fn alloc(&self, len: usize) -> Result<u64> {
        if len == 0 {
            return Err(Error::InvalidArgument("simulated alloc of 0 bytes".into()));
        }
        let mut a = self.inner.allocs.write().unwrap_or_else(|e| e.into_inner());
        let addr = a.last().map_or(SIM_BASE, |l| {
            (l.addr + l.mem.len() as u64 + 4096 + 4095) & !4095
        });
        // Zeroed pages from the allocator (calloc: untouched pages cost nothing), seen as cells.
        let raw = Box::into_raw(vec![0u8; len].into_boxed_slice());
        // SAFETY: UnsafeCell<u8> is repr(transparent) over u8: same size, alignment and
        // validity; the box's allocation is handed over whole, once.
        let mem: Box<[std::cell::UnsafeCell<u8>]> =
            unsafe { Box::from_raw(raw as *mut [std::cell::UnsafeCell<u8>]) };
        a.push(SimAlloc { addr, mem });
        Ok(addr)
    }

    /// A host pointer to `[addr, addr+len)` if it lies inside one allocation.
    fn host_ptr(&self, addr: u64, len: usize) -> Result<*mut u8> {
        let a = self.inner.allocs.read().unwrap_or_else(|e| e.into_inner());
        for x in a.iter() {
            if addr >= x.addr && addr.saturating_add(len as u64) <= x.addr + x.mem.len() as u64 {
                // The boxes never move or shrink while the device lives.
                return Ok(x.mem[(addr - x.addr) as usize..].as_ptr() as *mut u8);
            }
        }
        Err(Error::InvalidArgument(format!(
            "simulated device: [{addr:#x}, +{len}) is not allocated"
        )))
    }

    /// Copies host bytes into device memory (synchronously).
    pub fn write(&self, dst: u64, src: &[u8]) -> Result<()> {
        let p = self.host_ptr(dst, src.len())?;
        // SAFETY: p..+len lies inside one allocation (checked); the caller does not run a
        // transfer on the same bytes meanwhile (as with cudaMemcpy on real device memory).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) };
        Ok(())
    }

    /// Copies device memory into host bytes (synchronously).
    pub fn read(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        let p = self.host_ptr(src, dst.len())?;
        // SAFETY: as in write.
        unsafe { std::ptr::copy_nonoverlapping(p, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies queued through the engine so far.
    pub fn copies(&self) -> u64 {
        self.inner.copies.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This device's copy engine (for [`crate::AgentConfig::copy_engine`]).
    pub fn engine(&self) -> Arc<dyn CopyEngine> {
        Arc::new(self.clone())
    }
}

struct SimQueue(SimulatedDevice);

impl CopyQueue for SimQueue {
    unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        let p = self.0.host_ptr(src, len)?;
        self.0
            .inner
            .copies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: p..+len checked inside an allocation; dst valid per the trait contract.
        unsafe { std::ptr::copy_nonoverlapping(p, dst, len) };
        Ok(())
    }
    unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        let p = self.0.host_ptr(dst, len)?;
        self.0
            .inner
            .copies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src, p, len) };
        Ok(())
    }
    fn sync(&mut self) -> Result<()> {
        Ok(())
    }
}

impl CopyEngine for SimulatedDevice {
    fn name(&self) -> &'static str {
        "simulated"
    }
    fn check_device(&self, _device: u32) -> Result<()> {
        Ok(())
    }
    fn queue(&self, _device: u32) -> Result<Box<dyn CopyQueue>> {
        Ok(Box::new(SimQueue(self.clone())))
    }
}

/// A fixed set of equal host chunks handed out to one holder at a time, allocated once and
/// charged to a budget once; pinned for the copy engine when it has one.
#[derive(Debug)]
pub(crate) struct ChunkPool {
    base: *mut u8,
    chunk: usize,
    n: usize,
    free: Mutex<Free>,
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
    unsafe fn new(base: *mut u8, chunks: usize, chunk_bytes: usize) -> Self {
        ChunkPool {
            base,
            chunk: chunk_bytes,
            n: chunks,
            free: Mutex::new(Free {
                chunks: (0..chunks).rev().collect(),
                in_use: 0,
                peak: 0,
                waits: 0,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn peak(&self) -> usize {
        self.lock().peak
    }

    fn waits(&self) -> u64 {
        self.lock().waits
    }

    fn in_use(&self) -> usize {
        self.lock().in_use
    }

    /// Takes `k` chunks at once (all or none), waiting up to `wait`. A holder never waits for
    /// more, so holders cannot deadlock on the pool.
    fn acquire_n(&self, k: usize, wait: Duration) -> Option<Vec<usize>> {
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

    fn release(&self, c: usize) {
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
    fn slice(&self, c: usize, len: usize) -> &mut [u8] {
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

/// Default staging of an agent's device memory: 8 chunks of 4 MiB (32 MiB), half for the
/// transfers it starts, half for those its peers start.
pub const DEFAULT_STAGING_CHUNKS: usize = 8;
/// See [`DEFAULT_STAGING_CHUNKS`].
pub const DEFAULT_STAGING_CHUNK_BYTES: usize = 4 << 20;

/// An agent's staging for device memory on its TCP lane: the copy engine and two fixed chunk
/// pools, one for transfers this agent starts and one for transfers peers start (so that a
/// transfer holding chunks only ever waits on a peer that holds its own: no deadlock across
/// agents). Allocated once, at the first device registration, charged to the agent's budget.
#[derive(Debug)]
pub struct DeviceStaging {
    engine: Arc<dyn CopyEngine>,
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
    /// `chunks` chunks of `chunk_bytes` (split evenly between the two pools; at least 4),
    /// charged to `budget`, pinned by `engine`.
    pub(crate) fn new(
        engine: Arc<dyn CopyEngine>,
        budget: &MemoryBudget,
        chunks: usize,
        chunk_bytes: usize,
    ) -> Result<Self> {
        if chunks < 4 || chunk_bytes < 4096 {
            return Err(Error::InvalidArgument(format!(
                "device staging needs at least 4 chunks of at least 4 KiB, got {chunks} x {chunk_bytes}"
            )));
        }
        let per = chunks / 2;
        let bytes = (2 * per)
            .checked_mul(chunk_bytes)
            .ok_or_else(|| Error::InvalidArgument("staging size overflows".into()))?;
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
    chunks: usize,
    chunk_bytes: usize,
    budget: MemoryBudget,
    pools: Mutex<Option<Arc<DeviceStaging>>>,
}

impl StagingCell {
    pub(crate) fn new(
        engine: Option<Arc<dyn CopyEngine>>,
        chunks: usize,
        chunk_bytes: usize,
        budget: MemoryBudget,
    ) -> Self {
        StagingCell {
            engine: Mutex::new(engine),
            chunks,
            chunk_bytes,
            budget,
            pools: Mutex::new(None),
        }
    }

    /// The copy engine, for `device` (typed error where none can exist).
    pub(crate) fn engine(&self, device: u32) -> Result<Arc<dyn CopyEngine>> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut g = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = g.as_ref() {
            return Ok(e.clone());
        }
        #[cfg(feature = "cuda")]
        {
            crate::cuda::probe(device)?;
            let e: Arc<dyn CopyEngine> = Arc::new(crate::cuda::CudaCopyEngine::new());
            *g = Some(e.clone());
            Ok(e)
        }
        #[cfg(not(feature = "cuda"))]
        Err(Error::Cuda {
            device,
            why: "kvxfer was built without the `cuda` feature, and no copy engine was configured \
                  (AgentConfig::copy_engine)"
                .into(),
        })
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
            self.chunks,
            self.chunk_bytes,
        )?);
        *g = Some(p.clone());
        Ok(p)
    }

    /// The pools if they exist.
    pub(crate) fn existing(&self) -> Option<Arc<DeviceStaging>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Where a slice of a piece lands in a chunk: (piece index, offset in the piece, offset in the
/// chunk, length).
type Cut = (usize, u64, usize, usize);

/// Cuts pieces of `lens` bytes, in order, into groups that each fill one chunk of
/// `chunk` bytes (the last maybe less); each group with the bytes it uses.
fn cut_into_chunks(lens: impl Iterator<Item = u64>, chunk: usize) -> Vec<(Vec<Cut>, usize)> {
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
        for &(i, at, off, n) in g {
            let dev = pieces[i].0 + at;
            // SAFETY: dev..+n lies inside piece i, valid device memory (this function's
            // contract); the chunk slice is held exclusively and not touched until sync.
            unsafe {
                if send {
                    q.to_host(dev, s.as_mut_ptr().add(off), n)?;
                } else {
                    q.to_device(s.as_ptr().add(off), dev, n)?;
                }
            }
        }
        Ok(())
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
type InFlight = (usize, crate::Transfer, Group);

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

    /// A simulated device whose queue logs what it is asked, for checking the pipeline order.
    #[derive(Debug)]
    struct Logged {
        dev: SimulatedDevice,
        log: Arc<Mutex<Vec<String>>>,
    }

    struct LoggedQueue {
        inner: Box<dyn CopyQueue>,
        log: Arc<Mutex<Vec<String>>>,
        dev: SimulatedDevice,
    }

    impl CopyQueue for LoggedQueue {
        unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
            let base = self.dev.inner.allocs.read().unwrap()[0].addr;
            self.log
                .lock()
                .unwrap()
                .push(format!("d2h {} {len}", src - base));
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { self.inner.to_host(src, dst, len) }
        }
        unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
            let base = self.dev.inner.allocs.read().unwrap()[0].addr;
            self.log
                .lock()
                .unwrap()
                .push(format!("h2d {} {len}", dst - base));
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { self.inner.to_device(src, dst, len) }
        }
        fn sync(&mut self) -> Result<()> {
            self.log.lock().unwrap().push("sync".into());
            self.inner.sync()
        }
    }

    impl CopyEngine for Logged {
        fn name(&self) -> &'static str {
            "logged"
        }
        fn check_device(&self, _: u32) -> Result<()> {
            Ok(())
        }
        fn queue(&self, d: u32) -> Result<Box<dyn CopyQueue>> {
            Ok(Box::new(LoggedQueue {
                inner: self.dev.queue(d)?,
                log: self.log.clone(),
                dev: self.dev.clone(),
            }))
        }
    }

    fn staging(chunk: usize) -> (DeviceStaging, Arc<Mutex<Vec<String>>>, SimulatedDevice) {
        let dev = SimulatedDevice::new();
        let log = Arc::new(Mutex::new(Vec::new()));
        let e = Arc::new(Logged {
            dev: dev.clone(),
            log: log.clone(),
        });
        let st = DeviceStaging::new(e, &MemoryBudget::unlimited(), 4, chunk).unwrap();
        (st, log, dev)
    }

    #[test]
    fn send_copies_the_next_chunk_while_the_current_one_is_on_the_wire() {
        let (st, log, dev) = staging(4096);
        let base = dev.alloc(3 * 4096).unwrap();
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i * 7 % 251) as u8).collect();
        dev.write(base, &data).unwrap();
        let pair = st.pair(true, Duration::ZERO).unwrap();
        // Pieces of 3 KiB: they straddle the 4 KiB chunks.
        let pieces: Vec<(u64, u64)> = (0..4).map(|i| (base + i * 3072, 3072)).collect();
        let mut wire = Vec::new();
        let l2 = log.clone();
        // SAFETY: the pieces lie inside the simulated allocation, alive for the test.
        unsafe {
            stream_device(&*st.engine, 0, &pair, true, &pieces, &mut |b| {
                l2.lock().unwrap().push(format!("net {}", b.len()));
                wire.extend_from_slice(b);
                Ok(())
            })
        }
        .unwrap();
        assert!(wire == data, "bytes on the wire differ from device memory");
        let log = log.lock().unwrap().join(", ");
        assert_eq!(
            log,
            "d2h 0 3072, d2h 3072 1024, sync, \
             d2h 4096 2048, d2h 6144 2048, net 4096, sync, \
             d2h 8192 1024, d2h 9216 3072, net 4096, sync, \
             net 4096, sync"
        );
    }

    #[test]
    fn receive_copies_a_chunk_to_the_device_while_the_next_one_arrives() {
        let (st, log, dev) = staging(4096);
        let base = dev.alloc(3 * 4096).unwrap();
        let data: Vec<u8> = (0..10_000).map(|i| (i * 13 % 241) as u8).collect();
        let pair = st.pair(false, Duration::ZERO).unwrap();
        let pieces = [(base, 10_000u64)];
        let mut at = 0;
        let l2 = log.clone();
        // SAFETY: as above.
        unsafe {
            stream_device(&*st.engine, 0, &pair, false, &pieces, &mut |b| {
                l2.lock().unwrap().push(format!("net {}", b.len()));
                b.copy_from_slice(&data[at..at + b.len()]);
                at += b.len();
                Ok(())
            })
        }
        .unwrap();
        let mut got = vec![0u8; 10_000];
        dev.read(base, &mut got).unwrap();
        assert!(got == data);
        assert_eq!(
            log.lock().unwrap().join(", "),
            "net 4096, sync, h2d 0 4096, net 4096, sync, h2d 4096 4096, \
             net 1808, sync, h2d 8192 1808, sync"
        );
        assert_eq!(st.stats().in_use, 2);
        drop(pair);
        assert_eq!(st.stats().in_use, 0);
    }

    #[test]
    fn a_network_error_stops_the_stream_and_keeps_the_error() {
        let (st, _log, dev) = staging(4096);
        let base = dev.alloc(4 * 4096).unwrap();
        let pair = st.pair(true, Duration::ZERO).unwrap();
        let mut n = 0;
        // SAFETY: the piece is the simulated allocation, alive for the test.
        let e = unsafe {
            stream_device(&*st.engine, 0, &pair, true, &[(base, 16384)], &mut |_| {
                n += 1;
                if n == 2 {
                    Err(Error::Canceled)
                } else {
                    Ok(())
                }
            })
        }
        .unwrap_err();
        assert!(matches!(e, Error::Canceled));
        assert_eq!(n, 2, "the stream went on after the error");
    }

    proptest::proptest! {
        /// Any pieces, any chunk size: what one end streams from device memory, the other end
        /// lands in its device memory, byte for byte, whatever the piece and chunk boundaries.
        #[test]
        fn any_pieces_round_trip_through_the_chunks(
            lens in proptest::collection::vec(1u64..20_000, 1..24),
            chunk_pages in 1usize..5,
            rx_pages in 1usize..5,
            seed in proptest::prelude::any::<u8>(),
        ) {
            // The two ends' chunk sizes are their own: the stream between them is bytes.
            let total: u64 = lens.iter().sum();
            let (tx, _, dtx) = staging(chunk_pages * 4096);
            let (rx, _, drx) = staging(rx_pages * 4096);
            // Sender pieces: consecutive with gaps; receiver pieces: the same lengths reversed
            // in placement.
            let a = dtx.alloc((total + 64 * lens.len() as u64) as usize).unwrap();
            let b = drx.alloc(total as usize).unwrap();
            let mut send = Vec::new();
            let mut at = a;
            for &l in &lens {
                send.push((at, l));
                at += l + 64;
            }
            let mut recv = Vec::new();
            let mut end = b + total;
            for &l in &lens {
                end -= l;
                recv.push((end, l));
            }
            let mut want = Vec::new();
            for (k, &(p, l)) in send.iter().enumerate() {
                let v: Vec<u8> = (0..l).map(|i| (i as u8) ^ (k as u8) ^ seed).collect();
                dtx.write(p, &v).unwrap();
                want.push(v);
            }
            let mut wire = Vec::new();
            let tp = tx.pair(true, Duration::ZERO).unwrap();
            // SAFETY: the pieces lie inside the simulated allocations, alive for the case.
            unsafe { stream_device(&*tx.engine, 0, &tp, true, &send, &mut |c| {
                wire.extend_from_slice(c);
                Ok(())
            }) }
            .unwrap();
            proptest::prop_assert_eq!(wire.len() as u64, total);
            let rp = rx.pair(false, Duration::ZERO).unwrap();
            let mut off = 0;
            // SAFETY: as above.
            unsafe { stream_device(&*rx.engine, 0, &rp, false, &recv, &mut |c| {
                c.copy_from_slice(&wire[off..off + c.len()]);
                off += c.len();
                Ok(())
            }) }
            .unwrap();
            for (k, &(p, l)) in recv.iter().enumerate() {
                let mut got = vec![0u8; l as usize];
                drx.read(p, &mut got).unwrap();
                proptest::prop_assert!(got == want[k], "piece {}", k);
            }
        }
    }

    #[test]
    fn simulated_device_refuses_copies_outside_its_allocations() {
        let dev = SimulatedDevice::new();
        let a = dev.alloc(4096).unwrap();
        let mut q = dev.queue(0).unwrap();
        let mut buf = [0u8; 16];
        // SAFETY: the engine checks the device range; buf is valid host memory.
        let e = unsafe { q.to_host(a + 4090, buf.as_mut_ptr(), 16) }.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // SAFETY: as above.
        assert!(unsafe { q.to_device(buf.as_ptr(), a - 1, 1) }.is_err());
        assert!(dev.write(a + 4096, &[1]).is_err());
        // Addresses are not host addresses: far outside any user address space.
        assert!(a >= SIM_BASE);
    }

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
