//! The copy-engine interface between device memory and host memory, and the engine for host
//! memory itself. Implemented by CUDA streams ([`super::cuda`]) and the simulated device
//! ([`super::sim`]).

use kvxfer_proto::error::Result;

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
        let mut at = 0usize;
        for &(src, len) in pieces {
            // SAFETY: the caller's contract, piece by piece; `at` stays inside `dst`.
            unsafe { self.to_host(src, dst.add(at), len as usize)? };
            at += len as usize;
        }
        Ok(())
    }

    /// Queues a scatter, the reverse of [`gather_to_host`](Self::gather_to_host): the host
    /// bytes at `src`, back to back, into `pieces` of device memory.
    ///
    /// # Safety
    /// Every piece is device memory of the queue's device that nothing else uses until `sync`
    /// returns; `src` holds the pieces' lengths added up and is not written until then.
    unsafe fn scatter_to_device(&mut self, src: *const u8, pieces: &[(u64, u64)]) -> Result<()> {
        let mut at = 0usize;
        for &(dst, len) in pieces {
            // SAFETY: as in gather_to_host.
            unsafe { self.to_device(src.add(at), dst, len as usize)? };
            at += len as usize;
        }
        Ok(())
    }
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
