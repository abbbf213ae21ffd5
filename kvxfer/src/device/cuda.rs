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

/// Idle streams per device, reused by later queues.
type StreamPool = std::sync::Arc<
    std::sync::Mutex<std::collections::HashMap<u32, Vec<std::sync::Arc<CudaStream>>>>,
>;

/// The CUDA copy engine: device-to-host and host-to-device copies on a non-blocking stream per
/// transfer (streams are pooled and reused), staging chunks page-locked with
/// `cuMemHostRegister`.
#[derive(Debug, Default)]
pub struct CudaCopyEngine {
    ctxs: std::sync::Mutex<std::collections::HashMap<u32, std::sync::Arc<CudaContext>>>,
    streams: StreamPool,
}

use cudarc::driver::{sys, CudaContext, CudaStream};

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
}

struct CudaQueue {
    device: u32,
    ctx: std::sync::Arc<CudaContext>,
    stream: std::sync::Arc<CudaStream>,
    pool: StreamPool,
}

impl Drop for CudaQueue {
    fn drop(&mut self) {
        // Copies still queued write into or read from host memory the caller is about to
        // reuse: wait for them; a stream in an error state is not reused.
        if self.stream.synchronize().is_ok() {
            self.pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(self.device)
                .or_default()
                .push(self.stream.clone());
        }
    }
}

impl crate::device::copy::CopyQueue for CudaQueue {
    unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err(self.device, "cuCtxSetCurrent", e))?;
        // SAFETY: the trait's contract: src is device memory of this context, dst host memory
        // untouched until sync; the stream is live.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream.cu_stream()) }
            .result()
            .map_err(|e| cuda_err(self.device, "cuMemcpyDtoHAsync", e))
    }

    unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err(self.device, "cuCtxSetCurrent", e))?;
        // SAFETY: as above.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.stream.cu_stream()) }
            .result()
            .map_err(|e| cuda_err(self.device, "cuMemcpyHtoDAsync", e))
    }

    fn sync(&mut self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda_err(self.device, "cuStreamSynchronize", e))
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

    fn queue(&self, device: u32) -> Result<Box<dyn crate::device::copy::CopyQueue>> {
        let ctx = self.ctx(device)?;
        let idle = self
            .streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&device)
            .and_then(Vec::pop);
        let stream = match idle {
            Some(s) => s,
            None => ctx
                .new_stream()
                .map_err(|e| cuda_err(device, "cuStreamCreate", e))?,
        };
        Ok(Box::new(CudaQueue {
            device,
            ctx,
            stream,
            pool: self.streams.clone(),
        }))
    }

    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let ctx = self.ctx(0)?;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err(0, "cuCtxSetCurrent", e))?;
        // SAFETY: the trait's contract: ptr..+len is host memory live until unpin. PORTABLE:
        // pinned for every context, whichever device the copies run on.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
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
}
