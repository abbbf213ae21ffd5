//! GPU memory (feature `cuda`): cudarc with dynamic loading, so kvxfer builds without a CUDA
//! toolkit and fails at run time, with [`Error::Cuda`], where no driver or device exists.
//!
//! Registration of device memory takes the **direct path** when the loaded UCX can move CUDA
//! memory (`cuda_copy` / `cuda_ipc`: the UCX 1.22 wheel `libucx-cu12`; Debian's UCX has none).
//! Otherwise it is refused with a typed error naming the way out; the staged path
//! ([`crate::staging`]) moves device memory through a bounded pool of host chunks.

use crate::error::{Error, Result};

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

/// Whether the loaded UCX can move CUDA memory directly (known once an agent exists).
pub fn ucx_supports_cuda() -> bool {
    crate::backend::ucx::raw::supports_cuda(
        crate::backend::ucx::driver::MEMORY_TYPES.load(std::sync::atomic::Ordering::Relaxed),
    )
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
