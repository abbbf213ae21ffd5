//! The staged path with host memory standing in for device memory: bytes arrive intact both
//! ways, the notification comes after all the data, and concurrency above the pool never holds
//! more chunks than the pool has (peak chunks in use <= the pool, budget never exceeded). That
//! a full pool makes the next transfer wait is tested deterministically in `staging.rs`.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::sync::Arc;
use std::time::Duration;

use kvxfer::staged::{staged, StagedPiece, StagingPool};
use kvxfer::staging::HostCopyEngine;
use kvxfer::{Agent, AgentConfig, Desc, Error, HostBuffer, MemoryBudget, Transport, XferOp};
use rand::{RngCore, SeedableRng};

#[test]
fn device_memory_moves_through_a_bounded_pool() {
    let tag = std::process::id();
    let b = Agent::new(
        AgentConfig::new(format!("stg-b-{tag}"))
            .transport(Transport::Tcp)
            .net_devices("lo"),
    )
    .unwrap();
    let a = Arc::new(
        Agent::new(
            AgentConfig::new(format!("stg-a-{tag}"))
                .transport(Transport::Tcp)
                .net_devices("lo"),
        )
        .unwrap(),
    );
    const PER: usize = 3 << 20; // one "request": 3 MiB of device memory in 48 pieces
    const THREADS: usize = 6;
    let rb = b.register(HostBuffer::new(PER * THREADS).unwrap()).unwrap();
    let addr = b.listen("127.0.0.1:0").unwrap();
    let peer = a.connect(addr).unwrap();
    // 4 chunks of 256 KiB = 1 MiB of staging for 18 MiB moved by 6 concurrent requests.
    let budget = MemoryBudget::new(1 << 20);
    let pool = Arc::new(StagingPool::new(&a, &budget, 4, 256 << 10).unwrap());
    assert!(
        matches!(
            StagingPool::new(&a, &budget, 4, 256 << 10),
            Err(Error::OutOfMemory(_))
        ),
        "a second pool must not fit the budget"
    );

    let hs: Vec<_> = (0..THREADS)
        .map(|t| {
            let (a, pool, peer, rid) = (a.clone(), pool.clone(), peer.clone(), rb.id());
            std::thread::spawn(move || {
                // "Device" memory: an ordinary, unregistered allocation.
                let mut dev = vec![0u8; PER];
                rand::rngs::StdRng::seed_from_u64(t as u64).fill_bytes(&mut dev);
                let pieces: Vec<StagedPiece> = (0..48)
                    .map(|i| StagedPiece {
                        device: dev.as_ptr() as u64 + (i * PER / 48) as u64,
                        // Reversed order on the peer, so that placement is checked.
                        remote: Desc::new(
                            rid,
                            (t * PER + (47 - i) * PER / 48) as u64,
                            (PER / 48) as u64,
                        ),
                    })
                    .collect();
                // SAFETY: `dev` outlives the call and is host memory (HostCopyEngine).
                let n = unsafe {
                    staged(
                        &a,
                        &pool,
                        &HostCopyEngine,
                        0,
                        XferOp::Write,
                        &peer,
                        &pieces,
                        Some(b"staged"),
                        Duration::from_secs(60),
                    )
                }
                .unwrap();
                assert_eq!(n, PER as u64);
                // And back: read the peer's copy into a fresh "device" buffer.
                let back = vec![0u8; PER];
                let pieces_back: Vec<StagedPiece> = pieces
                    .iter()
                    .enumerate()
                    .map(|(i, p)| StagedPiece {
                        device: back.as_ptr() as u64 + (i * PER / 48) as u64,
                        remote: p.remote,
                    })
                    .collect();
                // SAFETY: `back` outlives the call, is host memory, and nothing else touches it.
                unsafe {
                    staged(
                        &a,
                        &pool,
                        &HostCopyEngine,
                        0,
                        XferOp::Read,
                        &peer,
                        &pieces_back,
                        None,
                        Duration::from_secs(60),
                    )
                }
                .unwrap();
                assert!(
                    back == dev,
                    "request {t}: bytes differ after the round trip"
                );
                (t, dev)
            })
        })
        .collect();
    for h in hs {
        let (t, dev) = h.join().unwrap();
        let mut got = vec![0u8; PER / 48];
        for i in 0..48 {
            rb.read((t * PER + (47 - i) * PER / 48) as u64, &mut got)
                .unwrap();
            assert!(
                got[..] == dev[i * PER / 48..(i + 1) * PER / 48],
                "request {t} piece {i}"
            );
        }
    }
    // Every write's notification arrived, after its data.
    let notes: Vec<_> = (0..THREADS)
        .map(|_| b.wait_notification(Duration::from_secs(10)).unwrap())
        .collect();
    assert!(notes.iter().all(|n| n.payload == b"staged"));
    // 12 concurrent staged transfers (6 threads, 2 chunks each) never held more than the pool.
    assert!(pool.peak_in_use() <= 4);
    assert!(budget.peak() <= budget.limit());
}
