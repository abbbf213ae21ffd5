//! The lanes' section of an agent's configuration: whether they run, the shared-memory
//! lane's settings, and the TCP lane's (its own file, `tcp/settings.rs`). Apart from
//! `api.rs`, so that a lane's settings never depend on the interface it implements.
#![forbid(unsafe_code)]

use super::tcp::settings::TcpLaneConfig;

/// The lanes' section of an agent's configuration: whether they run, and each lane's own.
#[derive(Clone, Debug)]
pub(crate) struct LaneConfig {
    /// kvxfer's lanes beside UCX; off: UCX moves every byte.
    pub(crate) on: bool,
    /// The device lane (with lanes on).
    pub(crate) device: bool,
    pub(crate) shm: ShmLaneConfig,
    pub(crate) tcp: TcpLaneConfig,
}

impl Default for LaneConfig {
    fn default() -> Self {
        LaneConfig {
            on: true,
            device: true,
            shm: Default::default(),
            tcp: Default::default(),
        }
    }
}

/// The shared-memory lane's section of an agent's configuration.
#[derive(Clone, Debug)]
pub(crate) struct ShmLaneConfig {
    /// Threads that copy for the lane.
    pub(crate) copy_threads: usize,
}

impl Default for ShmLaneConfig {
    fn default() -> Self {
        ShmLaneConfig {
            copy_threads: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
        }
    }
}
