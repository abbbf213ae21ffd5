//! The device staging's section of an agent's configuration, owned by the staging that reads
//! it: the GPU path, the copy engine and the chunk pools' shape ([`StagingShape`], checked
//! where it is made).
#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::device::copy::CopyEngine;
use kvxfer_proto::error::{Error, Result};
use kvxfer_proto::types::{GpuPath, DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES};

/// The shape of an agent's device staging: `chunks` pinned host chunks of `chunk_bytes`, half
/// for transfers the agent starts and half for its peers'. Made only through
/// [`StagingShape::new`], so every one an agent holds is valid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingShape {
    chunks: usize,
    chunk_bytes: usize,
}

impl StagingShape {
    /// At least 4 chunks (each pool double-buffers) of at least 4 KiB, whose total fits a
    /// `usize`.
    pub fn new(chunks: usize, chunk_bytes: usize) -> Result<StagingShape> {
        if chunks < 4 || chunk_bytes < 4096 {
            return Err(Error::InvalidArgument(format!(
                "device staging needs at least 4 chunks of at least 4 KiB, got {chunks} x \
                 {chunk_bytes}"
            )));
        }
        (chunks / 2 * 2).checked_mul(chunk_bytes).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "device staging of {chunks} x {chunk_bytes} bytes overflows"
            ))
        })?;
        Ok(StagingShape {
            chunks,
            chunk_bytes,
        })
    }

    /// Chunks per pool (two pools).
    pub fn per_pool(&self) -> usize {
        self.chunks / 2
    }

    /// Bytes of one chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Bytes both pools hold (checked not to overflow when made).
    pub fn bytes(&self) -> usize {
        2 * self.per_pool() * self.chunk_bytes
    }
}

impl Default for StagingShape {
    /// 8 chunks of 4 MiB.
    fn default() -> Self {
        StagingShape {
            chunks: DEFAULT_STAGING_CHUNKS,
            chunk_bytes: DEFAULT_STAGING_CHUNK_BYTES,
        }
    }
}

/// Device memory's settings.
#[derive(Clone, Debug, Default)]
pub(crate) struct StagingConfig {
    /// How device memory moves.
    pub(crate) gpu_path: GpuPath,
    /// The copy engine; `None`: CUDA with the `cuda` feature, none without.
    pub(crate) copy_engine: Option<Arc<dyn CopyEngine>>,
    /// The chunk pools.
    pub(crate) shape: StagingShape,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_staging_shape_is_checked_where_it_is_made() {
        for (c, b) in [(0, 1 << 20), (3, 1 << 20), (8, 4095), (4, usize::MAX / 3)] {
            let e = StagingShape::new(c, b).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{c} x {b}: {e}");
        }
        let s = StagingShape::new(9, 4096).unwrap();
        assert_eq!((s.per_pool(), s.bytes()), (4, 8 * 4096));
        let d = StagingShape::default();
        assert_eq!(
            StagingShape::new(DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES).unwrap(),
            d
        );
    }
}
