//! The CUDA side of batched copies (feature `cuda`): the copy kernel
//! (`kernels/copy_batch.cu`, its PTX built in) loaded once per context, a stream of the
//! highest priority per queue, and a table each queue uploads a batch into before the one
//! launch that runs it. One owner with `Drop` per native handle.

use crate::budget::{Charge, MemoryBudget};
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use kvxfer_proto::copy_batch::CopyBatch;
use kvxfer_proto::error::{Error, Result};

/// The kernel's PTX (`python3 scripts/gen-ptx.py` regenerates it), NUL-terminated for
/// `cuModuleLoadData`.
const PTX: &str = concat!(include_str!("kernels/copy_batch.ptx"), "\0");
/// Threads per block: each moves 16 bytes an iteration.
const THREADS: u32 = 256;
/// Blocks per launch at most; the kernel strides over the entries past it.
const MAX_BLOCKS: u32 = 65_535;

fn err(device: u32, what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Cuda {
        device,
        why: format!("{what}: {e:?}"),
    }
}

/// The copy kernel loaded into one context.
pub(crate) struct Kernel {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
    func: sys::CUfunction,
}

// SAFETY: a module and function handle may be used from any thread with their context bound
// (every use here binds it first).
unsafe impl Send for Kernel {}
// SAFETY: as above; launching takes no lock the handles need.
unsafe impl Sync for Kernel {}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Kernel(kvx_copy_batch)")
    }
}

impl Kernel {
    /// Loads the PTX into `ctx` (the driver JIT-compiles it for the device once).
    pub(crate) fn load(ctx: &Arc<CudaContext>, device: u32) -> Result<Kernel> {
        ctx.bind_to_thread()
            .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: PTX is a NUL-terminated image; module is a valid out pointer.
        unsafe { sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast()) }
            .result()
            .map_err(|e| err(device, "cuModuleLoadData (the copy kernel's PTX)", e))?;
        let mut func: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: module was just loaded; the name is NUL-terminated.
        let r = unsafe { sys::cuModuleGetFunction(&mut func, module, c"kvx_copy_batch".as_ptr()) }
            .result();
        let k = Kernel {
            ctx: ctx.clone(),
            module,
            func,
        };
        r.map_err(|e| err(device, "cuModuleGetFunction(kvx_copy_batch)", e))?;
        Ok(k)
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the module loaded in `load`, unloaded only here; no launch outlives the
            // queues that hold this kernel.
            let _ = unsafe { sys::cuModuleUnload(self.module) };
        }
    }
}

/// A non-blocking stream of the context's highest priority: the copies do not queue behind
/// an engine's model kernels.
pub(crate) struct PriorityStream {
    ctx: Arc<CudaContext>,
    pub(crate) raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread with its context bound.
unsafe impl Send for PriorityStream {}
// SAFETY: as above.
unsafe impl Sync for PriorityStream {}

impl std::fmt::Debug for PriorityStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PriorityStream({:p})", self.raw)
    }
}

impl PriorityStream {
    pub(crate) fn new(ctx: &Arc<CudaContext>, device: u32) -> Result<PriorityStream> {
        ctx.bind_to_thread()
            .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: valid out pointers.
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
            .result()
            .map_err(|e| err(device, "cuCtxGetStreamPriorityRange", e))?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: raw is a valid out pointer; greatest is a priority the context allows.
        unsafe {
            sys::cuStreamCreateWithPriority(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                greatest,
            )
        }
        .result()
        .map_err(|e| err(device, "cuStreamCreateWithPriority", e))?;
        Ok(PriorityStream {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// Waits for everything queued on it.
    pub(crate) fn sync(&self, device: u32) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
        // SAFETY: the stream is live until drop.
        unsafe { sys::cuStreamSynchronize(self.raw) }
            .result()
            .map_err(|e| err(device, "cuStreamSynchronize", e))
    }
}

impl Drop for PriorityStream {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: created in `new`, destroyed only here; the driver lets queued work
            // finish before it frees the stream.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        }
    }
}

/// A batch's table: page-locked host memory it is written into and the device memory the
/// kernel reads it from, `[src; n] [dst; n] [len; n]` for up to `cap` entries.
pub(crate) struct Table {
    ctx: Arc<CudaContext>,
    host: *mut u64,
    dev: sys::CUdeviceptr,
    cap: usize,
    /// An upload from `host` may still be running (until the stream is synced).
    pub(crate) busy: bool,
    /// Both buffers, charged to the engine's budget while they live.
    _charge: Charge,
}

// SAFETY: the buffers belong to this struct alone, used by one queue at a time.
unsafe impl Send for Table {}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Table({} entries)", self.cap)
    }
}

impl Table {
    fn new(
        ctx: &Arc<CudaContext>,
        device: u32,
        cap: usize,
        budget: &MemoryBudget,
    ) -> Result<Table> {
        let bytes = cap * 3 * 8;
        let charge = budget.try_charge(2 * bytes as u64, "a CUDA copy table (host and device)")?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out pointer; bytes > 0.
        unsafe { sys::cuMemAllocHost_v2(&mut host, bytes) }
            .result()
            .map_err(|e| err(device, "cuMemAllocHost (copy table)", e))?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer.
        if let Err(e) = unsafe { sys::cuMemAlloc_v2(&mut dev, bytes) }.result() {
            // SAFETY: allocated just above, not used.
            let _ = unsafe { sys::cuMemFreeHost(host) };
            return Err(err(device, "cuMemAlloc (copy table)", e));
        }
        Ok(Table {
            ctx: ctx.clone(),
            host: host.cast(),
            dev,
            cap,
            busy: false,
            _charge: charge,
        })
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`, freed only here, after the owning queue synced its
            // stream (a queue waits for its copies before it lets its table go).
            unsafe {
                let _ = sys::cuMemFree_v2(self.dev);
                let _ = sys::cuMemFreeHost(self.host.cast());
            }
        }
    }
}

/// Queues `batch` on `stream` as one table upload and one launch of `kernel`, growing
/// `table` as needed (waiting for the stream first when it must rewrite a table in use) and
/// charging it to `budget` (refused `OutOfMemory` past it).
///
/// # Safety
/// Every entry's source and destination are memory the device can address (its own, a peer's
/// opened for it, or host memory mapped for it) that stays valid and otherwise untouched
/// until the stream is synced.
pub(crate) unsafe fn launch(
    kernel: &Kernel,
    stream: &PriorityStream,
    table: &mut Option<Table>,
    device: u32,
    batch: &CopyBatch,
    budget: &MemoryBudget,
) -> Result<()> {
    let n = batch.entries();
    if n == 0 {
        return Ok(());
    }
    if table.as_ref().is_some_and(|t| t.busy) {
        stream.sync(device)?;
    }
    if table.as_ref().is_none_or(|t| t.cap < n) {
        *table = None;
        *table = Some(Table::new(
            &kernel.ctx,
            device,
            n.next_power_of_two().max(1024),
            budget,
        )?);
    }
    let t = table.as_mut().expect("set just above");
    t.busy = false;
    // SAFETY: the host table holds 3 * cap >= 3 * n words and no upload reads it now (synced
    // above when busy).
    let words = unsafe { std::slice::from_raw_parts_mut(t.host, 3 * n) };
    words[..n].copy_from_slice(&batch.src);
    words[n..2 * n].copy_from_slice(&batch.dst);
    words[2 * n..].copy_from_slice(&batch.len);
    kernel
        .ctx
        .bind_to_thread()
        .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
    // SAFETY: both tables hold 3 * n words; the host one is page-locked and not rewritten
    // before the stream is synced (`busy`).
    unsafe { sys::cuMemcpyHtoDAsync_v2(t.dev, t.host.cast(), 3 * n * 8, stream.raw) }
        .result()
        .map_err(|e| err(device, "cuMemcpyHtoDAsync (copy table)", e))?;
    t.busy = true;
    let (mut src, mut dst, mut len, mut count) =
        (t.dev, t.dev + 8 * n as u64, t.dev + 16 * n as u64, n as u32);
    let mut params: [*mut c_void; 4] = [
        (&mut src as *mut u64).cast(),
        (&mut dst as *mut u64).cast(),
        (&mut len as *mut u64).cast(),
        (&mut count as *mut u32).cast(),
    ];
    let blocks = (n as u32).min(MAX_BLOCKS);
    // SAFETY: the kernel takes (u64*, u64*, u64*, unsigned int), passed by address as
    // cuLaunchKernel reads them before returning; the table it reads was uploaded on the same
    // stream before it; the entries' memory is the caller's contract.
    unsafe {
        sys::cuLaunchKernel(
            kernel.func,
            blocks,
            1,
            1,
            THREADS,
            1,
            1,
            0,
            stream.raw,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(|e| err(device, "cuLaunchKernel(kvx_copy_batch)", e))
}

/// The device address of host memory `p`, page-locked by this engine (registered with
/// `CU_MEMHOSTREGISTER_DEVICEMAP`), for the kernel to write or read it.
pub(crate) fn mapped(ctx: &Arc<CudaContext>, device: u32, p: *mut u8) -> Result<u64> {
    ctx.bind_to_thread()
        .map_err(|e| err(device, "cuCtxSetCurrent", e))?;
    let mut d: sys::CUdeviceptr = 0;
    // SAFETY: valid out pointer; flags must be 0.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p.cast(), 0) }
        .result()
        .map_err(|e| err(device, "cuMemHostGetDevicePointer", e))?;
    Ok(d)
}
