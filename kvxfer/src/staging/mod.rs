//! The staged path for device memory the transport cannot reach (GPU memory without a
//! CUDA-aware UCX): fixed pools of host chunks, allocated once and charged to the memory budget,
//! through which device memory moves chunk by chunk — copy a chunk on a copy queue (a CUDA
//! stream) while the previous one is on the wire. More concurrent transfers wait for chunks;
//! nothing else is ever allocated, so memory stays at the pools' size whatever the concurrency
//! (the seed's failure: host staging buffers grew with concurrency x KV size).
//!
//! Two users:
//! - The agent itself ([`crate::AgentConfig::gpu_path`]): device regions registered on the
//!   staged path move over kvxfer's TCP lane, each end staging its own device memory through
//!   its own [`DeviceStaging`] pools. Transparent to callers: the same descriptors, transfers
//!   and notifications as host memory.
//! - [`crate::staged`]: an explicit staged transfer through a UCX-registered
//!   [`StagingPool`](crate::staged::StagingPool), for transports without kvxfer's lanes (RDMA
//!   without GPUDirect).
//!
//! The device side is a [`CopyEngine`]: CUDA copies on a stream with the `cuda` feature
//! (`kvxfer::cuda::CudaCopyEngine`), [`SimulatedDevice`] (device memory that is not
//! addressable from the host, for tests and CPU-only machines), or [`HostCopyEngine`].

pub(crate) mod pipeline;
pub(crate) mod pool;
pub(crate) mod settings;

pub use crate::device::copy::{CopyEngine, CopyQueue, Exported, HostCopyEngine, Opened};
pub use crate::device::sim::SimulatedDevice;
pub use kvxfer_proto::copy_batch::{CopyBatch, CopyRange};
pub use kvxfer_proto::wire::shm_fds::DeviceHandle;
pub use pool::{DeviceStaging, StagingStats, DEFAULT_STAGING_CHUNKS, DEFAULT_STAGING_CHUNK_BYTES};
pub use settings::StagingShape;

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::pipeline::stream_device;
    use super::*;
    use crate::budget::MemoryBudget;
    use crate::device::sim::SIM_BASE;
    use kvxfer_proto::error::{Error, Result};

    /// A simulated device whose queue logs what it is asked, for checking the pipeline order.
    #[derive(Debug)]
    struct Logged {
        dev: SimulatedDevice,
        log: Arc<Mutex<Vec<String>>>,
    }

    struct LoggedQueue {
        inner: Box<dyn CopyQueue>,
        log: Arc<Mutex<Vec<String>>>,
        dev: SimulatedDevice,
    }

    impl CopyQueue for LoggedQueue {
        unsafe fn to_host(&mut self, src: u64, dst: *mut u8, len: usize) -> Result<()> {
            let base = self.dev.inner.allocs.read().unwrap()[0].addr;
            self.log
                .lock()
                .unwrap()
                .push(format!("d2h {} {len}", src - base));
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { self.inner.to_host(src, dst, len) }
        }
        unsafe fn to_device(&mut self, src: *const u8, dst: u64, len: usize) -> Result<()> {
            let base = self.dev.inner.allocs.read().unwrap()[0].addr;
            self.log
                .lock()
                .unwrap()
                .push(format!("h2d {} {len}", dst - base));
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { self.inner.to_device(src, dst, len) }
        }
        fn sync(&mut self) -> Result<()> {
            self.log.lock().unwrap().push("sync".into());
            self.inner.sync()
        }
    }

    impl CopyEngine for Logged {
        fn name(&self) -> &'static str {
            "logged"
        }
        fn check_device(&self, _: u32) -> Result<()> {
            Ok(())
        }
        fn queue(&self, d: u32) -> Result<Box<dyn CopyQueue>> {
            Ok(Box::new(LoggedQueue {
                inner: self.dev.queue(d)?,
                log: self.log.clone(),
                dev: self.dev.clone(),
            }))
        }
    }

    fn staging(chunk: usize) -> (DeviceStaging, Arc<Mutex<Vec<String>>>, SimulatedDevice) {
        let dev = SimulatedDevice::new();
        let log = Arc::new(Mutex::new(Vec::new()));
        let e = Arc::new(Logged {
            dev: dev.clone(),
            log: log.clone(),
        });
        let st = DeviceStaging::new(
            e,
            &MemoryBudget::unlimited(),
            settings::StagingShape::new(4, chunk).unwrap(),
        )
        .unwrap();
        (st, log, dev)
    }

    #[test]
    fn send_copies_the_next_chunk_while_the_current_one_is_on_the_wire() {
        let (st, log, dev) = staging(4096);
        let base = dev.alloc(3 * 4096).unwrap();
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i * 7 % 251) as u8).collect();
        dev.write(base, &data).unwrap();
        let pair = st.pair(true, Duration::ZERO).unwrap();
        // Pieces of 3 KiB: they straddle the 4 KiB chunks.
        let pieces: Vec<(u64, u64)> = (0..4).map(|i| (base + i * 3072, 3072)).collect();
        let mut wire = Vec::new();
        let l2 = log.clone();
        // SAFETY: the pieces lie inside the simulated allocation, alive for the test.
        unsafe {
            stream_device(&*st.engine, 0, &pair, true, &pieces, &mut |b| {
                l2.lock().unwrap().push(format!("net {}", b.len()));
                wire.extend_from_slice(b);
                Ok(())
            })
        }
        .unwrap();
        assert!(wire == data, "bytes on the wire differ from device memory");
        let log = log.lock().unwrap().join(", ");
        assert_eq!(
            log,
            "d2h 0 3072, d2h 3072 1024, sync, \
             d2h 4096 2048, d2h 6144 2048, net 4096, sync, \
             d2h 8192 1024, d2h 9216 3072, net 4096, sync, \
             net 4096, sync"
        );
    }

    #[test]
    fn receive_copies_a_chunk_to_the_device_while_the_next_one_arrives() {
        let (st, log, dev) = staging(4096);
        let base = dev.alloc(3 * 4096).unwrap();
        let data: Vec<u8> = (0..10_000).map(|i| (i * 13 % 241) as u8).collect();
        let pair = st.pair(false, Duration::ZERO).unwrap();
        let pieces = [(base, 10_000u64)];
        let mut at = 0;
        let l2 = log.clone();
        // SAFETY: as above.
        unsafe {
            stream_device(&*st.engine, 0, &pair, false, &pieces, &mut |b| {
                l2.lock().unwrap().push(format!("net {}", b.len()));
                b.copy_from_slice(&data[at..at + b.len()]);
                at += b.len();
                Ok(())
            })
        }
        .unwrap();
        let mut got = vec![0u8; 10_000];
        dev.read(base, &mut got).unwrap();
        assert!(got == data);
        assert_eq!(
            log.lock().unwrap().join(", "),
            "net 4096, sync, h2d 0 4096, net 4096, sync, h2d 4096 4096, \
             net 1808, sync, h2d 8192 1808, sync"
        );
        assert_eq!(st.stats().in_use, 2);
        drop(pair);
        assert_eq!(st.stats().in_use, 0);
    }

    #[test]
    fn a_network_error_stops_the_stream_and_keeps_the_error() {
        let (st, _log, dev) = staging(4096);
        let base = dev.alloc(4 * 4096).unwrap();
        let pair = st.pair(true, Duration::ZERO).unwrap();
        let mut n = 0;
        // SAFETY: the piece is the simulated allocation, alive for the test.
        let e = unsafe {
            stream_device(&*st.engine, 0, &pair, true, &[(base, 16384)], &mut |_| {
                n += 1;
                if n == 2 {
                    Err(Error::Canceled)
                } else {
                    Ok(())
                }
            })
        }
        .unwrap_err();
        assert!(matches!(e, Error::Canceled));
        assert_eq!(n, 2, "the stream went on after the error");
    }

    proptest::proptest! {
        /// Any pieces, any chunk size: what one end streams from device memory, the other end
        /// lands in its device memory, byte for byte, whatever the piece and chunk boundaries.
        #[test]
        fn any_pieces_round_trip_through_the_chunks(
            lens in proptest::collection::vec(1u64..20_000, 1..24),
            chunk_pages in 1usize..5,
            rx_pages in 1usize..5,
            seed in proptest::prelude::any::<u8>(),
        ) {
            // The two ends' chunk sizes are their own: the stream between them is bytes.
            let total: u64 = lens.iter().sum();
            let (tx, _, dtx) = staging(chunk_pages * 4096);
            let (rx, _, drx) = staging(rx_pages * 4096);
            // Sender pieces: consecutive with gaps; receiver pieces: the same lengths reversed
            // in placement.
            let a = dtx.alloc((total + 64 * lens.len() as u64) as usize).unwrap();
            let b = drx.alloc(total as usize).unwrap();
            let mut send = Vec::new();
            let mut at = a;
            for &l in &lens {
                send.push((at, l));
                at += l + 64;
            }
            let mut recv = Vec::new();
            let mut end = b + total;
            for &l in &lens {
                end -= l;
                recv.push((end, l));
            }
            let mut want = Vec::new();
            for (k, &(p, l)) in send.iter().enumerate() {
                let v: Vec<u8> = (0..l).map(|i| (i as u8) ^ (k as u8) ^ seed).collect();
                dtx.write(p, &v).unwrap();
                want.push(v);
            }
            let mut wire = Vec::new();
            let tp = tx.pair(true, Duration::ZERO).unwrap();
            // SAFETY: the pieces lie inside the simulated allocations, alive for the case.
            unsafe { stream_device(&*tx.engine, 0, &tp, true, &send, &mut |c| {
                wire.extend_from_slice(c);
                Ok(())
            }) }
            .unwrap();
            proptest::prop_assert_eq!(wire.len() as u64, total);
            let rp = rx.pair(false, Duration::ZERO).unwrap();
            let mut off = 0;
            // SAFETY: as above.
            unsafe { stream_device(&*rx.engine, 0, &rp, false, &recv, &mut |c| {
                c.copy_from_slice(&wire[off..off + c.len()]);
                off += c.len();
                Ok(())
            }) }
            .unwrap();
            for (k, &(p, l)) in recv.iter().enumerate() {
                let mut got = vec![0u8; l as usize];
                drx.read(p, &mut got).unwrap();
                proptest::prop_assert!(got == want[k], "piece {}", k);
            }
        }
    }

    #[test]
    fn simulated_device_refuses_copies_outside_its_allocations() {
        let dev = SimulatedDevice::new();
        let a = dev.alloc(4096).unwrap();
        let mut q = dev.queue(0).unwrap();
        let mut buf = [0u8; 16];
        // SAFETY: the engine checks the device range; buf is valid host memory.
        let e = unsafe { q.to_host(a + 4090, buf.as_mut_ptr(), 16) }.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // SAFETY: as above.
        assert!(unsafe { q.to_device(buf.as_ptr(), a - 1, 1) }.is_err());
        assert!(dev.write(a + 4096, &[1]).is_err());
        // Addresses are not host addresses: far outside any user address space.
        assert!(a >= SIM_BASE);
    }
}
