//! Device memory's copy engines: the [`copy::CopyEngine`] interface, CUDA streams (feature
//! `cuda`, the only module that names cudarc), and a simulated device for machines without a
//! GPU. The staging pools and the staged stream sit above this, in `staging`.

pub(crate) mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
mod cuda_batch;
#[cfg(feature = "cuda")]
mod cuda_ipc;
pub(crate) mod sim;

use std::sync::Arc;

use copy::CopyEngine;
#[cfg(not(feature = "cuda"))]
use kvxfer_proto::error::Error;
use kvxfer_proto::error::Result;

/// The copy engine used when the agent's configuration names none: CUDA with the `cuda`
/// feature (after probing `device`), else a typed error.
pub(crate) fn default_engine(device: u32) -> Result<Arc<dyn CopyEngine>> {
    #[cfg(feature = "cuda")]
    {
        cuda::probe(device)?;
        Ok(Arc::new(cuda::CudaCopyEngine::new()))
    }
    #[cfg(not(feature = "cuda"))]
    Err(Error::Cuda {
        device,
        why: "kvxfer was built without the `cuda` feature, and no copy engine was configured \
              (AgentConfig::copy_engine)"
            .into(),
    })
}
