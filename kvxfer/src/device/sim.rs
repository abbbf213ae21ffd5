//! Simulated device memory: stands in for a GPU in tests and on machines without one.

use std::sync::{Arc, RwLock};

use super::copy::{CopyEngine, CopyQueue};
use kvxfer_proto::error::{Error, Result};

/// Simulated device memory: allocations whose device addresses are not host addresses (they
/// lie outside any user address space, so a path that touched them directly instead of
/// through the copy engine would fault), and a copy engine that checks every copy against the
/// allocations. Stands in for a GPU in tests and on machines without one.
#[derive(Clone, Debug, Default)]
pub struct SimulatedDevice {
    pub(crate) inner: Arc<SimInner>,
}

#[derive(Debug, Default)]
pub(crate) struct SimInner {
    pub(crate) allocs: RwLock<Vec<SimAlloc>>,
    /// Copies queued (pieces of every kind), for tests.
    copies: std::sync::atomic::AtomicU64,
    /// Submissions: a single copy, or a whole gather or scatter (as one kernel launch).
    submissions: std::sync::atomic::AtomicU64,
}

pub(crate) struct SimAlloc {
    pub(crate) addr: u64,
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
pub(crate) const SIM_BASE: u64 = 0x7e57_0000_0000_0000;

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

    /// Submissions queued through the engine so far: one per single copy, one per gather or
    /// scatter whatever its pieces (what a batching engine pays for).
    pub fn submissions(&self) -> u64 {
        self.inner
            .submissions
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Counts one submission of `pieces` copies.
    fn submitted(&self, pieces: usize) {
        use std::sync::atomic::Ordering::Relaxed;
        self.inner.copies.fetch_add(pieces as u64, Relaxed);
        self.inner.submissions.fetch_add(1, Relaxed);
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
        self.0.submitted(1);
        // SAFETY: p..+len checked inside an allocation; dst valid per the trait contract.
        unsafe { std::ptr::copy_nonoverlapping(p, dst, len) };
        Ok(())
    }
    unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        let p = self.0.host_ptr(dst, len)?;
        self.0.submitted(1);
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src, p, len) };
        Ok(())
    }
    /// One submission: every piece is checked before any byte moves, as a launch's table is
    /// built before the launch.
    unsafe fn gather_to_host(&mut self, pieces: &[(u64, u64)], dst: *mut u8) -> Result<()> {
        let ptrs = pieces
            .iter()
            .map(|&(a, n)| self.0.host_ptr(a, n as usize).map(|p| (p, n as usize)))
            .collect::<Result<Vec<_>>>()?;
        self.0.submitted(pieces.len());
        let mut at = 0;
        for (p, n) in ptrs {
            // SAFETY: p..+n checked inside an allocation; dst holds the pieces back to back
            // (the trait's contract).
            unsafe { std::ptr::copy_nonoverlapping(p, dst.add(at), n) };
            at += n;
        }
        Ok(())
    }
    unsafe fn scatter_to_device(&mut self, src: *const u8, pieces: &[(u64, u64)]) -> Result<()> {
        let ptrs = pieces
            .iter()
            .map(|&(a, n)| self.0.host_ptr(a, n as usize).map(|p| (p, n as usize)))
            .collect::<Result<Vec<_>>>()?;
        self.0.submitted(pieces.len());
        let mut at = 0;
        for (p, n) in ptrs {
            // SAFETY: as in gather_to_host, the other way.
            unsafe { std::ptr::copy_nonoverlapping(src.add(at), p, n) };
            at += n;
        }
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
