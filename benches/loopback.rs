//! Two agents in one process: KV-shaped transfers (random 32 KiB blocks) over every lane and
//! op, looping over the permutations. Memory is moved for real; see kvxfer-bench for the
//! two-process figures and the references.

#![allow(clippy::unwrap_used)] // Benchmarks fail loudly on purpose.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvxfer::{Agent, AgentConfig, Desc, HostBuffer, Transport, XferOp};

const BLOCK: u64 = 32 * 1024;
const BLOCKS: u64 = 1024; // 32 MiB per transfer

fn slots(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, (x >> 33) as usize % (i + 1));
    }
    v
}

fn loopback(c: &mut Criterion) {
    let mut g = c.benchmark_group("loopback_random_32k");
    g.throughput(Throughput::Bytes(BLOCK * BLOCKS));
    for (lane, transport, lanes) in [
        ("shm", Transport::Shm, true),
        ("tcp", Transport::Tcp, true),
        ("ucx-sm", Transport::Shm, false),
        ("ucx-tcp", Transport::Tcp, false),
    ] {
        let cfg = |n: &str| {
            AgentConfig::new(format!("crit-{n}-{lane}-{}", std::process::id()))
                .transport(transport.clone())
                .lanes(lanes)
                .ucx_emulated_shm(!lanes)
                .ucx_tcp(!lanes)
                .net_devices("lo")
        };
        let b = Agent::new(cfg("b")).unwrap();
        let a = Agent::new(cfg("a")).unwrap();
        let ra = a
            .register(HostBuffer::new((BLOCK * BLOCKS) as usize).unwrap())
            .unwrap();
        let rb = b
            .register(HostBuffer::new((BLOCK * BLOCKS) as usize).unwrap())
            .unwrap();
        let addr = b.listen("127.0.0.1:0").unwrap();
        let peer = a.connect(addr).unwrap();
        let ld: Vec<Desc> = slots(BLOCKS, 1)
            .iter()
            .map(|&s| Desc::new(ra.id(), s * BLOCK, BLOCK))
            .collect();
        let rd: Vec<Desc> = slots(BLOCKS, 2)
            .iter()
            .map(|&s| Desc::new(rb.id(), s * BLOCK, BLOCK))
            .collect();
        let l = a.prep_local(&ld).unwrap();
        let r = a.prep_remote(&peer, &rd).unwrap();
        for op in [XferOp::Write, XferOp::Read] {
            g.bench_function(BenchmarkId::new(lane, op), |bch| {
                bch.iter(|| {
                    a.transfer_all(op, &l, &r, None, None)
                        .unwrap()
                        .wait()
                        .unwrap()
                })
            });
        }
    }
    g.finish();
}

/// `Agent::connect` to a listener that has the client loaded already (the metadata exchange
/// a handoff to a known producer costs), open and with a secret (the Noise handshake and the
/// sealing both ways): the target with a secret is under 5 ms on loopback.
fn side_channel(c: &mut Criterion) {
    let mut g = c.benchmark_group("side_channel");
    for (label, secret) in [("open", None), ("secret", Some(b"bench secret".to_vec()))] {
        let cfg = |n: &str| {
            let c = AgentConfig::new(format!("crit-sc-{n}-{label}-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo");
            match &secret {
                Some(s) => c.secret(s.clone()),
                None => c,
            }
        };
        let b = Agent::new(cfg("b")).unwrap();
        b.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        let a = Agent::new(cfg("a")).unwrap();
        a.register(HostBuffer::new(1 << 20).unwrap()).unwrap();
        let addr = b.listen("127.0.0.1:0").unwrap();
        a.connect(addr).unwrap();
        g.bench_function(BenchmarkId::new("connect", label), |bch| {
            bch.iter(|| a.connect(addr).unwrap())
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(std::time::Duration::from_secs(3));
    targets = loopback, side_channel
}
criterion_main!(benches);
