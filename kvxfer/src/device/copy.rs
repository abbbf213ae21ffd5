//! The copy-engine interface between device memory and host memory, and the engine for host
//! memory itself. Implemented by CUDA streams ([`super::cuda`]) and the simulated device
//! ([`super::sim`]).

use std::os::fd::OwnedFd;

use kvxfer_proto::copy_batch::CopyBatch;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::DeviceAlloc;
use kvxfer_proto::wire::shm_fds::DeviceHandle;

/// A device allocation exported for same-host peers ([`CopyEngine::export`]): what the device
/// lane's socket hands over for a region.
#[derive(Debug)]
pub struct Exported {
    /// How a peer opens the allocation.
    pub handle: DeviceHandle,
    /// The file handed over with it, for [`DeviceHandle::File`].
    pub file: Option<OwnedFd>,
    /// The region's offset in the allocation.
    pub offset: u64,
    /// The allocation's size.
    pub size: u64,
}

/// A peer's device allocation opened in this process ([`CopyEngine::open`]): its device
/// addresses are valid here until this is dropped, which closes it.
pub trait Opened: Send + Sync {
    /// The device address of the allocation's first byte, in this process.
    fn base(&self) -> u64;
}

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

    /// Exports the allocation holding `[addr, addr+len)` of `device` for same-host peers (the
    /// device lane). Engines whose memory cannot be shared say why.
    fn export(&self, device: u32, addr: u64, len: u64) -> Result<Exported> {
        let _ = (addr, len);
        Err(Error::Cuda {
            device,
            why: format!("the {} copy engine does not export memory", self.name()),
        })
    }

    /// What kind of allocation `addr` of `device` lies in, where the engine can tell (the
    /// agent takes the path at registration by it).
    fn allocation(&self, device: u32, addr: u64) -> Result<Option<DeviceAlloc>> {
        let _ = (device, addr);
        Ok(None)
    }

    /// Submissions made so far on every queue of this engine (single copies, kernel launches,
    /// batch calls), for benchmarks: what a transfer costs in driver calls.
    fn submissions(&self) -> u64 {
        0
    }

    /// Whether [`open`](Self::open) takes this process's own exports (false for CUDA, whose
    /// IPC handles open only in another process): a peer agent in the same process is then
    /// not reached by the device lane.
    fn opens_own_exports(&self) -> bool {
        true
    }

    /// Opens on `device` an allocation of `size` bytes a same-host peer exported as `handle`
    /// (with `file` for [`DeviceHandle::File`]).
    fn open(
        &self,
        device: u32,
        handle: &DeviceHandle,
        file: Option<&OwnedFd>,
        size: u64,
    ) -> Result<Box<dyn Opened>> {
        let _ = (handle, file, size);
        Err(Error::Cuda {
            device,
            why: format!(
                "the {} copy engine does not open peers' memory",
                self.name()
            ),
        })
    }
    /// The budget this engine charges what it allocates for itself (CUDA: each stream's copy
    /// table, host and device); an agent gives its own when it takes the engine. The first
    /// budget given holds for an engine shared by several agents.
    fn charge_to(&self, budget: &crate::budget::MemoryBudget) {
        let _ = budget;
    }

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

    /// Queues one table of device-to-device copies (this device's memory, and peers' opened
    /// on it): one submission, its copies run at once (the table has no byte written twice,
    /// [`kvxfer_proto::copy_batch`]).
    ///
    /// # Safety
    /// Every entry's source and destination are device memory the queue's device reaches,
    /// valid and otherwise unused until `sync` returns.
    unsafe fn copy_batch(&mut self, batch: &CopyBatch) -> Result<()> {
        let _ = batch;
        Err(Error::InvalidArgument(
            "this copy engine has no device-to-device copies".into(),
        ))
    }

    /// Queues a gather: `pieces` (device address, length), in order, into the host buffer at
    /// `dst`, back to back. Engines that batch make it one submission (the CUDA engine: one
    /// launch of the copy kernel writing into the pinned chunk); this default is a copy a
    /// piece.
    ///
    /// # Safety
    /// Every piece is device memory of the queue's device; `dst` is writable host memory of
    /// the pieces' lengths added up, that nothing else reads or writes until `sync` returns
    /// (the staging pools' chunks, pinned by the same engine).
    unsafe fn gather_to_host(&mut self, pieces: &[(u64, u64)], dst: *mut u8) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { gather_each(self, pieces, dst) }
    }

    /// Queues a scatter, the reverse of [`gather_to_host`](Self::gather_to_host): the host
    /// bytes at `src`, back to back, into `pieces` of device memory.
    ///
    /// # Safety
    /// Every piece is device memory of the queue's device that nothing else uses until `sync`
    /// returns; `src` holds the pieces' lengths added up and is not written until then.
    unsafe fn scatter_to_device(&mut self, src: *const u8, pieces: &[(u64, u64)]) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { scatter_each(self, src, pieces) }
    }
}

/// A gather as one copy a piece (what an engine without batches does).
///
/// # Safety
/// As [`CopyQueue::gather_to_host`].
pub(crate) unsafe fn gather_each<Q: CopyQueue + ?Sized>(
    q: &mut Q,
    pieces: &[(u64, u64)],
    dst: *mut u8,
) -> Result<()> {
    let mut at = 0usize;
    for &(src, len) in pieces {
        // SAFETY: the caller's contract, piece by piece; `at` stays inside `dst`.
        unsafe { q.to_host(src, dst.add(at), len as usize)? };
        at += len as usize;
    }
    Ok(())
}

/// A scatter as one copy a piece.
///
/// # Safety
/// As [`CopyQueue::scatter_to_device`].
pub(crate) unsafe fn scatter_each<Q: CopyQueue + ?Sized>(
    q: &mut Q,
    src: *const u8,
    pieces: &[(u64, u64)],
) -> Result<()> {
    let mut at = 0usize;
    for &(dst, len) in pieces {
        // SAFETY: the caller's contract, piece by piece; `at` stays inside `src`.
        unsafe { q.to_device(src.add(at), dst, len as usize)? };
        at += len as usize;
    }
    Ok(())
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
