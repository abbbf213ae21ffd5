//! Simulated device memory: stands in for a GPU in tests and on machines without one.

use std::sync::{Arc, RwLock};

use std::os::fd::OwnedFd;

use super::copy::{CopyEngine, CopyQueue, Exported, Opened};
use kvxfer_proto::copy_batch::CopyBatch;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::DeviceAlloc;
use kvxfer_proto::wire::shm_fds::DeviceHandle;

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
    ptr: *mut u8,
    len: usize,
    /// What keeps the bytes: an allocation of this device (a sealed memory file, which the
    /// device lane hands to same-host peers as an exported allocation would be), or a peer's
    /// file opened here (mapped, unmapped on drop).
    backing: Backing,
}

enum Backing {
    Own(crate::memory::HostBuffer, DeviceAlloc),
    Opened,
}

impl Drop for SimAlloc {
    fn drop(&mut self) {
        if let Backing::Opened = self.backing {
            // SAFETY: the mapping made in `open`, of len bytes, unmapped only here.
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

impl std::fmt::Debug for SimAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SimAlloc({:#x}, {} bytes)", self.addr, self.len)
    }
}

// SAFETY: the bytes are only accessed through raw copies whose exclusivity the copy
// contracts (and the callers' region pinning) guarantee, like real device memory; the
// mapping lives as long as the struct.
unsafe impl Sync for SimAlloc {}
// SAFETY: as above; the struct owns its mapping.
unsafe impl Send for SimAlloc {}

/// Base of simulated device addresses: non-canonical on x86-64 and above 48-bit user space.
pub(crate) const SIM_BASE: u64 = 0x7e57_0000_0000_0000;

impl SimulatedDevice {
    /// An empty simulated device.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allocates `len` zeroed bytes; returns their device address (page aligned).
    pub fn alloc(&self, len: usize) -> Result<u64> {
        self.alloc_as(len, DeviceAlloc::Plain)
    }

    /// Allocates `len` zeroed bytes that the engine reports as an allocation of kind `kind`
    /// (pool memory is then not exported, as CUDA's is not).
    pub fn alloc_as(&self, len: usize, kind: DeviceAlloc) -> Result<u64> {
        if len == 0 {
            return Err(Error::InvalidArgument("simulated alloc of 0 bytes".into()));
        }
        // A sealed memory file (untouched pages cost nothing), as an exportable allocation.
        let mut buf = crate::memory::HostBuffer::new(len)?;
        let ptr = buf.as_mut_slice().as_mut_ptr();
        Ok(self.insert(ptr, len, Backing::Own(buf, kind)))
    }

    /// Puts `[ptr, ptr+len)` in the table at a fresh device address.
    fn insert(&self, ptr: *mut u8, len: usize, backing: Backing) -> u64 {
        let mut a = self.inner.allocs.write().unwrap_or_else(|e| e.into_inner());
        let addr = a
            .iter()
            .map(|l| l.addr + l.len as u64)
            .max()
            .map_or(SIM_BASE, |end| (end + 4096 + 4095) & !4095);
        a.push(SimAlloc {
            addr,
            ptr,
            len,
            backing,
        });
        addr
    }

    /// A host pointer to `[addr, addr+len)` if it lies inside one allocation.
    fn host_ptr(&self, addr: u64, len: usize) -> Result<*mut u8> {
        let a = self.inner.allocs.read().unwrap_or_else(|e| e.into_inner());
        for x in a.iter() {
            if addr >= x.addr && addr.saturating_add(len as u64) <= x.addr + x.len as u64 {
                // SAFETY: addr - x.addr < x.len: inside the mapping, which never moves or
                // shrinks while the allocation is in the table.
                return Ok(unsafe { x.ptr.add((addr - x.addr) as usize) });
            }
        }
        Err(Error::InvalidArgument(format!(
            "simulated device: [{addr:#x}, +{len}) is not allocated"
        )))
    }

    /// Allocations in the table now (own and opened), for tests.
    pub fn allocations(&self) -> usize {
        self.inner
            .allocs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
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

    /// The host pointers of `pieces` (device address, length), every one checked, counted as
    /// one submission.
    fn submit_pieces(&self, pieces: &[(u64, u64)]) -> Result<Vec<(*mut u8, usize)>> {
        let ptrs = pieces
            .iter()
            .map(|&(a, n)| self.host_ptr(a, n as usize).map(|p| (p, n as usize)))
            .collect::<Result<Vec<_>>>()?;
        self.submitted(pieces.len());
        Ok(ptrs)
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
        let ptrs = self.0.submit_pieces(pieces)?;
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
        let ptrs = self.0.submit_pieces(pieces)?;
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
    /// One submission: every entry checked before any byte moves.
    unsafe fn copy_batch(&mut self, batch: &CopyBatch) -> Result<()> {
        let ptrs = batch
            .iter()
            .map(|e| {
                let n = e.len as usize;
                Ok((self.0.host_ptr(e.src, n)?, self.0.host_ptr(e.dst, n)?, n))
            })
            .collect::<Result<Vec<_>>>()?;
        self.0.submitted(ptrs.len());
        for (src, dst, n) in ptrs {
            // SAFETY: both ranges checked inside allocations; the trait's contract keeps them
            // otherwise unused (memmove: a device copy within one allocation may overlap).
            unsafe { std::ptr::copy(src, dst, n) };
        }
        Ok(())
    }
}

/// A peer's allocation opened on a simulated device: its entry in the device's table.
struct SimOpened {
    dev: SimulatedDevice,
    addr: u64,
}

impl Opened for SimOpened {
    fn base(&self) -> u64 {
        self.addr
    }
}

impl Drop for SimOpened {
    fn drop(&mut self) {
        let mut a = self
            .dev
            .inner
            .allocs
            .write()
            .unwrap_or_else(|e| e.into_inner());
        a.retain(|x| x.addr != self.addr);
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
    fn submissions(&self) -> u64 {
        SimulatedDevice::submissions(self)
    }
    fn allocation(&self, device: u32, addr: u64) -> Result<Option<DeviceAlloc>> {
        let a = self.inner.allocs.read().unwrap_or_else(|e| e.into_inner());
        let x = a
            .iter()
            .find(|x| addr >= x.addr && addr < x.addr + x.len as u64)
            .ok_or_else(|| Error::Cuda {
                device,
                why: format!("simulated device: {addr:#x} is not allocated"),
            })?;
        Ok(match x.backing {
            Backing::Own(_, k) => Some(k),
            Backing::Opened => None,
        })
    }

    /// The allocation's sealed memory file, duplicated.
    fn export(&self, device: u32, addr: u64, len: u64) -> Result<Exported> {
        let a = self.inner.allocs.read().unwrap_or_else(|e| e.into_inner());
        let x = a
            .iter()
            .find(|x| addr >= x.addr && addr.saturating_add(len) <= x.addr + x.len as u64)
            .ok_or_else(|| Error::Cuda {
                device,
                why: format!("simulated device: [{addr:#x}, +{len}) is not allocated"),
            })?;
        let buf = match &x.backing {
            Backing::Own(buf, DeviceAlloc::Plain | DeviceAlloc::Virtual) => buf,
            Backing::Own(_, _) => {
                return Err(Error::Cuda {
                    device,
                    why: "simulated pool memory is not exported (as CUDA's is not)".into(),
                })
            }
            Backing::Opened => {
                return Err(Error::Cuda {
                    device,
                    why: "simulated device: a peer's allocation is not exported again".into(),
                })
            }
        };
        let file = buf
            .file()
            .ok_or_else(|| Error::Cuda {
                device,
                why: "simulated device: an allocation without a memory file".into(),
            })?
            .try_clone()
            .map_err(|e| Error::io("duplicating a simulated allocation's file", e))?;
        Ok(Exported {
            handle: DeviceHandle::File,
            file: Some(file),
            offset: addr - x.addr,
            size: x.len as u64,
        })
    }

    /// Maps the peer's memory file (sealed, this user's, at least `size` bytes) and gives it a
    /// device address here.
    fn open(
        &self,
        device: u32,
        handle: &DeviceHandle,
        file: Option<&OwnedFd>,
        size: u64,
    ) -> Result<Box<dyn Opened>> {
        let (DeviceHandle::File, Some(fd)) = (handle, file) else {
            return Err(Error::Cuda {
                device,
                why: "simulated device: only file handles open here".into(),
            });
        };
        let len = usize::try_from(size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("an allocation of {size} bytes")))?;
        let what = "a peer's simulated device allocation";
        crate::memory::check_sealed_file(fd, size, what)?;
        // A sealed file at least `len` bytes long (checked): it cannot shrink under the
        // mapping.
        let p = crate::memory::map_shared(fd, len, true, what)?;
        let addr = self.insert(p, len, Backing::Opened);
        Ok(Box::new(SimOpened {
            dev: self.clone(),
            addr,
        }))
    }
}
