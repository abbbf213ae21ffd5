//! GPU memory (feature `cuda`): cudarc with dynamic loading, so kvxfer builds without a CUDA
//! toolkit and fails at run time, with [`Error::Cuda`], where no driver or device exists.
//!
//! Device memory takes one of two paths ([`crate::GpuPath`]), chosen at registration and
//! visible per peer in [`crate::PeerInfo::gpu_path`]:
//! - **direct**: the loaded UCX has CUDA transports (`cuda_copy` / `cuda_ipc`: the UCX 1.22
//!   wheel `libucx-cu12`; Debian's UCX has none) and moves VRAM itself (cuda_ipc inside a
//!   host, GPUDirect RDMA where the NIC allows);
//! - **staged**: [`CudaCopyEngine`] copies between VRAM and pinned host chunks on a CUDA stream,
//!   pipelined with kvxfer's TCP lane (see [`crate::staging`]).

use kvxfer_proto::error::{Error, Result};

/// The cudarc kvxfer is built with, for allocating device buffers of the same version
/// (`kvxfer::cuda::cudarc::driver::CudaContext`); a `CudaSlice<u8>` registers with
/// [`crate::Agent::register`].
pub use cudarc;

/// What [`probe`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaInfo {
    /// The device asked for.
    pub device: u32,
    /// Devices the driver reports.
    pub devices: u32,
}

/// Checks that the CUDA driver loads and `device` exists.
pub fn probe(device: u32) -> Result<CudaInfo> {
    // cudarc loads libcuda lazily and panics when it is missing: contain that.
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(cudarc::driver::CudaContext::device_count);
    std::panic::set_hook(prev);
    let n = match r {
        Err(_) => {
            return Err(Error::Cuda {
                device,
                why: "the CUDA driver (libcuda.so) could not be loaded: no NVIDIA driver here"
                    .into(),
            })
        }
        Ok(Err(e)) => {
            return Err(Error::Cuda {
                device,
                why: format!("cuDeviceGetCount: {e:?}"),
            })
        }
        Ok(Ok(n)) => n.max(0) as u32,
    };
    if device >= n {
        return Err(Error::Cuda {
            device,
            why: format!("the driver reports {n} device(s)"),
        });
    }
    Ok(CudaInfo { device, devices: n })
}

fn cuda_err(device: u32, what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Cuda {
        device,
        why: format!("{what}: {e:?}"),
    }
}

/// An idle stream and its copy table, reused by a later queue of the same device.
type Idle = (PriorityStream, Option<Table>);
/// Idle streams per device.
type StreamPool = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<u32, Vec<Idle>>>>;

/// The CUDA copy engine: copies between device and host memory on a stream of the highest
/// priority per transfer (streams are pooled and reused), staging chunks page-locked with
/// `cuMemHostRegister` and mapped for the device. A gather into a chunk or a scatter out of
/// it is one launch of the copy kernel (`cuda_batch`), whatever the number of blocks.
#[derive(Debug, Default)]
pub struct CudaCopyEngine {
    ctxs: std::sync::Mutex<std::collections::HashMap<u32, std::sync::Arc<CudaContext>>>,
    streams: StreamPool,
    /// The copy kernel per device, or why it could not be loaded (then gathers are a copy a
    /// piece, said once in the log).
    kernels:
        std::sync::Mutex<std::collections::HashMap<u32, std::result::Result<Arc<Kernel>, String>>>,
    /// Submissions on every queue (copies, table uploads, launches).
    submitted: Arc<std::sync::atomic::AtomicU64>,
    /// What the copy tables are charged to (unlimited until an agent gives its own).
    budget: std::sync::OnceLock<MemoryBudget>,
}

use super::cuda_batch::{Kernel, PriorityStream, Table};
use crate::budget::MemoryBudget;
use cudarc::driver::{sys, CudaContext};
use kvxfer_proto::copy_batch::{batches, BatchLimits, CopyRange};
use std::sync::Arc;

impl CudaCopyEngine {
    /// An engine; contexts (the devices' primary contexts) are retained on first use.
    pub fn new() -> Self {
        Self::default()
    }

    fn ctx(&self, device: u32) -> Result<std::sync::Arc<CudaContext>> {
        let mut g = self.ctxs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = g.get(&device) {
            return Ok(c.clone());
        }
        probe(device)?;
        let c = CudaContext::new(device as usize).map_err(|e| cuda_err(device, "cuCtx", e))?;
        g.insert(device, c.clone());
        Ok(c)
    }

    fn kernel(&self, ctx: &Arc<CudaContext>, device: u32) -> Option<Arc<Kernel>> {
        let mut g = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        let k = g.entry(device).or_insert_with(|| {
            Kernel::load(ctx, device).map(Arc::new).map_err(|e| {
                log::warn!(
                    "kvxfer: the copy kernel did not load on device {device} ({e}): staged \
                     chunks are gathered a copy per block"
                );
                e.to_string()
            })
        });
        k.as_ref().ok().cloned()
    }
}

/// Whether batched copies go to the driver's batch copy (`KVXFER_DEVICE_COPY=driver`) rather
/// than the copy kernel (`kernel`, the default): for comparing the two on a GPU
/// (`scripts/gpu-check.sh`).
fn driver_batch() -> bool {
    static MODE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| std::env::var("KVXFER_DEVICE_COPY").is_ok_and(|v| v == "driver"))
}

struct CudaQueue {
    device: u32,
    ctx: std::sync::Arc<CudaContext>,
    /// Some until drop hands it back to the pool.
    stream: Option<PriorityStream>,
    table: Option<Table>,
    kernel: Option<Arc<Kernel>>,
    /// Tables go to the driver's batch copy instead of the kernel.
    driver_batch: bool,
    pool: StreamPool,
    submitted: Arc<std::sync::atomic::AtomicU64>,
    budget: MemoryBudget,
}

impl CudaQueue {
    fn count(&self, n: u64) {
        self.submitted
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

impl CudaQueue {
    fn stream(&self) -> &PriorityStream {
        self.stream.as_ref().expect("taken only in drop")
    }

    /// One launch per table of `copies` (device addresses on both sides), or None where the
    /// kernel is not loaded.
    ///
    /// # Safety
    /// As [`cuda_batch::launch`](super::cuda_batch::launch).
    unsafe fn run(&mut self, copies: impl Iterator<Item = CopyRange>) -> Option<Result<()>> {
        if self.driver_batch {
            // SAFETY: the caller's contract.
            return Some(unsafe { self.run_driver(copies) });
        }
        let kernel = self.kernel.clone()?;
        let tables = match batches(copies, &BatchLimits::DEVICE) {
            Ok(t) => t,
            Err(e) => return Some(Err(Error::InvalidArgument(e.to_string()))),
        };
        for b in &tables {
            // A table upload and a launch.
            self.count(2);
            let stream = self.stream.as_ref().expect("taken only in drop");
            // SAFETY: the caller's contract.
            if let Err(e) = unsafe {
                super::cuda_batch::launch(
                    &kernel,
                    stream,
                    &mut self.table,
                    self.device,
                    b,
                    &self.budget,
                )
            } {
                return Some(Err(e));
            }
        }
        Some(Ok(()))
    }

    /// [`run`](Self::run) by the driver's batch copy (`cuMemcpyBatchAsync`, CUDA 12.8): one
    /// call per table, the driver's copy engines instead of the kernel's SMs.
    ///
    /// # Safety
    /// As [`run`](Self::run).
    unsafe fn run_driver(&mut self, copies: impl Iterator<Item = CopyRange>) -> Result<()> {
        let tables = batches(copies, &BatchLimits::DEVICE)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err(self.device, "cuCtxSetCurrent", e))?;
        for b in &tables {
            self.count(1);
            let (mut dst, mut src) = (b.dst.clone(), b.src.clone());
            let mut len: Vec<usize> = b.len.iter().map(|&n| n as usize).collect();
            // SAFETY: an all-zero attribute is valid (no location hints); set below.
            let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            let (mut idx, mut fail) = (0usize, usize::MAX);
            // SAFETY: the arrays hold `entries` elements each and live across the call (the
            // driver reads them before it returns); one attribute applies from entry 0; the
            // entries' memory is the caller's contract.
            unsafe {
                sys::cuMemcpyBatchAsync(
                    dst.as_mut_ptr(),
                    src.as_mut_ptr(),
                    len.as_mut_ptr(),
                    b.entries(),
                    &mut attr,
                    &mut idx,
                    1,
                    &mut fail,
                    self.stream().raw,
                )
            }
            .result()
            .map_err(|e| {
                cuda_err(
                    self.device,
                    &format!("cuMemcpyBatchAsync (entry {fail})"),
                    e,
                )
            })?;
        }
        Ok(())
    }

    /// The device address of a pinned chunk `p`, or None (then a copy a piece).
    fn mapped(&self, p: *mut u8) -> Option<u64> {
        if self.driver_batch {
            // The driver's batch copy takes host pointers as they are.
            return Some(p as u64);
        }
        self.kernel.as_ref()?;
        super::cuda_batch::mapped(&self.ctx, self.device, p).ok()
    }
}

impl Drop for CudaQueue {
    fn drop(&mut self) {
        // Copies still queued write into or read from host memory the caller is about to
        // reuse: wait for them; a stream in an error state is not reused.
        let Some(stream) = self.stream.take() else {
            return;
        };
        if stream.sync(self.device).is_ok() {
            if let Some(t) = self.table.as_mut() {
                t.busy = false;
            }
            self.pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(self.device)
                .or_default()
                .push((stream, self.table.take()));
        }
    }
}

impl crate::device::copy::CopyQueue for CudaQueue {
    unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err(self.device, "cuCtxSetCurrent", e))?;
        self.count(1);
        // SAFETY: the trait's contract: src is device memory of this context, dst host memory
        // untouched until sync; the stream is live.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream().raw) }
            .result()
            .map_err(|e| cuda_err(self.device, "cuMemcpyDtoHAsync", e))
    }

    unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err(self.device, "cuCtxSetCurrent", e))?;
        self.count(1);
        // SAFETY: as above.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.stream().raw) }
            .result()
            .map_err(|e| cuda_err(self.device, "cuMemcpyHtoDAsync", e))
    }

    fn sync(&mut self) -> Result<()> {
        self.stream().sync(self.device)?;
        if let Some(t) = self.table.as_mut() {
            t.busy = false;
        }
        Ok(())
    }

    unsafe fn copy_batch(&mut self, batch: &kvxfer_proto::copy_batch::CopyBatch) -> Result<()> {
        // SAFETY: the trait's contract.
        if let Some(r) = unsafe { self.run(batch.iter()) } {
            return r;
        }
        // No kernel (said once in the log): a copy an entry.
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err(self.device, "cuCtxSetCurrent", e))?;
        for e in batch.iter() {
            self.count(1);
            // SAFETY: the trait's contract, entry by entry.
            unsafe { sys::cuMemcpyDtoDAsync_v2(e.dst, e.src, e.len as usize, self.stream().raw) }
                .result()
                .map_err(|x| cuda_err(self.device, "cuMemcpyDtoDAsync", x))?;
        }
        Ok(())
    }

    unsafe fn gather_to_host(&mut self, pieces: &[(u64, u64)], dst: *mut u8) -> Result<()> {
        if let Some(base) = self.mapped(dst) {
            let copies = pieces.iter().scan(base, |at, &(src, len)| {
                let c = CopyRange { src, dst: *at, len };
                *at += len;
                Some(c)
            });
            // SAFETY: the trait's contract; dst is page-locked and mapped (`base`).
            if let Some(r) = unsafe { self.run(copies) } {
                return r;
            }
        }
        // SAFETY: the trait's contract.
        unsafe { crate::device::copy::gather_each(self, pieces, dst) }
    }

    unsafe fn scatter_to_device(&mut self, src: *const u8, pieces: &[(u64, u64)]) -> Result<()> {
        if let Some(base) = self.mapped(src.cast_mut()) {
            let copies = pieces.iter().scan(base, |at, &(dst, len)| {
                let c = CopyRange { src: *at, dst, len };
                *at += len;
                Some(c)
            });
            // SAFETY: as in gather_to_host.
            if let Some(r) = unsafe { self.run(copies) } {
                return r;
            }
        }
        // SAFETY: the trait's contract.
        unsafe { crate::device::copy::scatter_each(self, src, pieces) }
    }
}

impl crate::device::copy::CopyEngine for CudaCopyEngine {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn check_device(&self, device: u32) -> Result<()> {
        probe(device).map(|_| ())
    }

    fn ucx_visible(&self) -> bool {
        true
    }

    fn allocation(
        &self,
        device: u32,
        addr: u64,
    ) -> Result<Option<kvxfer_proto::types::DeviceAlloc>> {
        super::cuda_ipc::allocation(&self.ctx(device)?, device, addr).map(Some)
    }

    fn submissions(&self) -> u64 {
        self.submitted.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn export(&self, device: u32, addr: u64, len: u64) -> Result<crate::device::copy::Exported> {
        super::cuda_ipc::export(&self.ctx(device)?, device, addr, len)
    }

    fn open(
        &self,
        device: u32,
        handle: &kvxfer_proto::wire::shm_fds::DeviceHandle,
        file: Option<&std::os::fd::OwnedFd>,
        size: u64,
    ) -> Result<Box<dyn crate::device::copy::Opened>> {
        super::cuda_ipc::open(&self.ctx(device)?, device, handle, file, size)
    }

    /// A process cannot open its own IPC handles (its memory is in its address space
    /// already).
    fn opens_own_exports(&self) -> bool {
        false
    }

    fn charge_to(&self, budget: &MemoryBudget) {
        let _ = self.budget.set(budget.clone());
    }

    fn queue(&self, device: u32) -> Result<Box<dyn crate::device::copy::CopyQueue>> {
        let ctx = self.ctx(device)?;
        let idle = self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&device)
            .and_then(Vec::pop);
        let (stream, table) = match idle {
            Some(s) => s,
            None => (PriorityStream::new(&ctx, device)?, None),
        };
        let kernel = self.kernel(&ctx, device);
        Ok(Box::new(CudaQueue {
            device,
            ctx,
            stream: Some(stream),
            table,
            kernel,
            driver_batch: driver_batch(),
            pool: self.streams.clone(),
            submitted: self.submitted.clone(),
            budget: self
                .budget
                .get()
                .cloned()
                .unwrap_or_else(MemoryBudget::unlimited),
        }))
    }

    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let ctx = self.ctx(0)?;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err(0, "cuCtxSetCurrent", e))?;
        // PORTABLE: pinned for every context, whichever device the copies run on; DEVICEMAP:
        // the copy kernel writes and reads it in place.
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the trait's contract: ptr..+len is host memory live until unpin.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, flags) }
            .result()
            .map_err(|e| cuda_err(0, "cuMemHostRegister", e))
    }

    unsafe fn unpin(&self, ptr: *mut u8) {
        if let Ok(ctx) = self.ctx(0) {
            let _ = ctx.bind_to_thread();
            // SAFETY: ptr was registered by pin and no copy uses it.
            let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) }.result();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_reports_a_typed_error_or_a_device() {
        match probe(0) {
            Ok(i) => {
                eprintln!("cuda: {} device(s)", i.devices);
                assert!(i.devices >= 1);
                assert!(matches!(probe(i.devices), Err(Error::Cuda { .. })));
            }
            Err(Error::Cuda { why, .. }) => {
                eprintln!("SKIP (no GPU here): {why}");
            }
            Err(e) => panic!("untyped: {e}"),
        }
    }

    /// A gather of scattered pieces (aligned and not) into a pinned chunk and the scatter
    /// back, each one launch, byte for byte; a skip without a GPU.
    #[test]
    fn gather_and_scatter_move_every_byte() {
        use crate::device::copy::CopyEngine;
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        if let Err(e) = probe(0) {
            eprintln!("SKIP (no GPU here): {e}");
            return;
        }
        let engine = CudaCopyEngine::new();
        let ctx = engine.ctx(0).unwrap();
        let stream = ctx.default_stream();
        let data: Vec<u8> = (0..1u32 << 20)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let src = stream.memcpy_stod(&data).unwrap();
        let mut back = stream.alloc_zeros::<u8>(data.len()).unwrap();
        stream.synchronize().unwrap();
        let (s0, _) = src.device_ptr(&stream);
        let (b0, _) = back.device_ptr_mut(&stream);
        // Blocks of 32 KiB at reversed slots, then odd lengths at odd offsets.
        let mut pieces: Vec<(u64, u64)> = (0..16u64).rev().map(|k| (k * 32768, 32768)).collect();
        pieces.extend([(600_001, 13), (700_003, 4099), (800_000, 1)]);
        let total: u64 = pieces.iter().map(|p| p.1).sum();
        let mut chunk = vec![0u8; total as usize];
        // SAFETY: chunk lives until unpin below, after the queue is synced and dropped.
        unsafe { engine.pin(chunk.as_mut_ptr(), chunk.len()) }.unwrap();
        let mut q = engine.queue(0).unwrap();
        let dev: Vec<(u64, u64)> = pieces.iter().map(|&(o, n)| (s0 + o, n)).collect();
        // SAFETY: the pieces lie in `src`; the chunk holds their total and is pinned.
        unsafe { q.gather_to_host(&dev, chunk.as_mut_ptr()) }.unwrap();
        q.sync().unwrap();
        let mut at = 0;
        for &(o, n) in &pieces {
            assert_eq!(
                &chunk[at..at + n as usize],
                &data[o as usize..(o + n) as usize]
            );
            at += n as usize;
        }
        let dev: Vec<(u64, u64)> = pieces.iter().map(|&(o, n)| (b0 + o, n)).collect();
        // SAFETY: the pieces lie in `back`.
        unsafe { q.scatter_to_device(chunk.as_ptr(), &dev) }.unwrap();
        q.sync().unwrap();
        drop(q);
        // SAFETY: pinned above; no copy uses it now.
        unsafe { engine.unpin(chunk.as_mut_ptr()) };
        let got = stream.memcpy_dtov(&back).unwrap();
        for &(o, n) in &pieces {
            assert_eq!(
                &got[o as usize..(o + n) as usize],
                &data[o as usize..(o + n) as usize]
            );
        }
        assert!(
            engine.kernel(&ctx, 0).is_some(),
            "the copy kernel did not load"
        );
    }
}
