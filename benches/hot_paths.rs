//! Hot paths that need no peer: building a KV-shaped transfer (resolving 8,344 descriptors on
//! both sides and coalescing them into operations), metadata encode/decode, KV layout math.
//! Target: building the 8,344-descriptor transfer in <= 0.5 ms.

#![allow(clippy::unwrap_used)] // Benchmarks fail loudly on purpose.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use kvxfer::layout::KvGeometry;
use kvxfer::{Desc, MemKind, RegionId, Side};
use kvxfer_proto::descriptor::{plan, resolve, RegionSpan};
use kvxfer_proto::wire::metadata::{
    HostInfo, LaneEntry, LaneInfo, Metadata, RegionMeta, ShmHandle,
};

const BLOCK: u64 = 32 * 1024;

/// A deterministic permutation of 0..n (LCG-shuffled), standing in for a paged cache's slots.
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

fn spans(n: u64) -> Vec<RegionSpan> {
    vec![RegionSpan {
        id: RegionId(0),
        base: 0x7f00_0000_0000,
        len: n * BLOCK,
        kind: MemKind::Host,
    }]
}

fn build(c: &mut Criterion) {
    let mut g = c.benchmark_group("build_transfer");
    for (name, n, random) in [
        ("qwen3_8344_random", 8344u64, true),
        ("qwen3_8344_contiguous", 8344, false),
        ("llama70b_23840_random", 23840, true),
    ] {
        let (ls, rs) = if random {
            (slots(n, 1), slots(n, 2))
        } else {
            ((0..n).collect(), (0..n).collect())
        };
        let ld: Vec<Desc> = ls
            .iter()
            .map(|&s| Desc::new(RegionId(0), s * BLOCK, BLOCK))
            .collect();
        let rd: Vec<Desc> = rs
            .iter()
            .map(|&s| Desc::new(RegionId(0), s * BLOCK, BLOCK))
            .collect();
        let table = spans(n);
        let idx: Vec<usize> = (0..n as usize).collect();
        // What a transfer costs the caller from descriptors to operations: resolve both lists
        // and plan (coalesce) them.
        g.bench_function(BenchmarkId::new("resolve_and_plan", name), |b| {
            b.iter(|| {
                let l = resolve(Side::Local, black_box(&ld), &table).unwrap();
                let r = resolve(Side::Remote, black_box(&rd), &table).unwrap();
                plan(&l, &idx, &r, &idx, 0).unwrap()
            })
        });
        // With lists prepared once (the normal case), only the plan is per transfer.
        let l = resolve(Side::Local, &ld, &table).unwrap();
        let r = resolve(Side::Remote, &rd, &table).unwrap();
        g.bench_function(BenchmarkId::new("plan_prepared", name), |b| {
            b.iter(|| plan(black_box(&l), &idx, black_box(&r), &idx, 0).unwrap())
        });
    }
    g.finish();
}

fn metadata(c: &mut Criterion) {
    let mut g = c.benchmark_group("metadata");
    for regions in [1u32, 56, 1024] {
        let m = Metadata {
            name: "prefill-0".into(),
            compat: 7,
            worker_addr: vec![3; 180],
            epoch: 0x5eed,
            host: Some(HostInfo {
                boot_id: [1; 16],
                pid_ns: 4026531836,
                pid: 42,
            }),
            lanes: vec![LaneEntry::tcp(&LaneInfo {
                addr: "198.18.0.1:4000".parse().unwrap(),
                secret: [9; 16],
                key: [7; 32],
            })],
            regions: (0..regions)
                .map(|i| RegionMeta {
                    id: RegionId(i),
                    kind: MemKind::Host,
                    base: 0x7f00_0000_0000 + u64::from(i) * (1 << 30),
                    len: 1 << 30,
                    rkey: vec![5; 40],
                    shm: Some(ShmHandle {
                        fd: 10 + i,
                        dev: 1,
                        ino: u64::from(i),
                    }),
                })
                .collect(),
        };
        let bytes = m.encode();
        g.bench_function(BenchmarkId::new("encode", regions), |b| {
            b.iter(|| black_box(&m).encode())
        });
        g.bench_function(BenchmarkId::new("decode", regions), |b| {
            b.iter(|| Metadata::decode(black_box(&bytes), 7).unwrap())
        });
    }
    g.finish();
}

/// Describing and planning one request, flat (a descriptor per block, layer and K/V, resolved
/// and coalesced into a list of operations) against paged (an entry per layer and K/V with
/// the block indices, resolved and paired into runs), with the bytes each form holds; then the
/// TCP lane's request table of each form, encoded and parsed.
fn paged(c: &mut Criterion) {
    use kvxfer::layout::{KvLayout, KvOrder, KvPacking};
    use kvxfer::paged::{plan_paged, resolve_paged, Paged};
    use kvxfer_proto::wire::lane::{
        encode_paged, paged_table_len, parse_paged, segments, Segment, SEG_LEN,
    };
    let mut g = c.benchmark_group("describe_and_plan");
    // (name, model, blocks of 16 tokens per request, blocks in each cache)
    for (name, model, n, cache) in [
        ("qwen3_0.6b_2371_tokens", "qwen3-0.6b", 149u64, 1024u64),
        ("llama_3_70b_32k_tokens", "llama-3-70b", 2048, 4096),
    ] {
        let geo = KvGeometry::preset(model).unwrap();
        let layout =
            |r| KvLayout::contiguous(geo.clone(), 16, cache, KvPacking::Separate, KvOrder::Nhd, r);
        let (ll, rl) = (layout(RegionId(0)), layout(RegionId(0)));
        let span = |base| {
            vec![RegionSpan {
                id: RegionId(0),
                base,
                len: ll.region_bytes(),
                kind: MemKind::Host,
            }]
        };
        let (lt, rt) = (span(0x7f00_0000_0000), span(0x7e00_0000_0000));
        let lb: Vec<u32> = slots(cache, 1)
            .into_iter()
            .take(n as usize)
            .map(|s| s as u32)
            .collect();
        let rb: Vec<u32> = slots(cache, 2)
            .into_iter()
            .take(n as usize)
            .map(|s| s as u32)
            .collect();
        let layers = 0..geo.layers as usize;
        let heads = 0..geo.kv_heads;
        let flat = || {
            let ld = ll.descs(&lb, layers.clone(), heads.clone()).unwrap();
            let rd = rl.descs(&rb, layers.clone(), heads.clone()).unwrap();
            let idx: Vec<usize> = (0..ld.len()).collect();
            let l = resolve(Side::Local, &ld, &lt).unwrap();
            let r = resolve(Side::Remote, &rd, &rt).unwrap();
            let p = plan(&l, &idx, &r, &idx, 0).unwrap();
            let held = (ld.capacity() + rd.capacity()) * std::mem::size_of::<Desc>()
                + idx.capacity() * std::mem::size_of::<usize>()
                + (l.capacity() + r.capacity())
                    * std::mem::size_of::<kvxfer_proto::descriptor::Resolved>()
                + p.ops.capacity() * std::mem::size_of::<kvxfer_proto::descriptor::Op>();
            (p, held)
        };
        let paged = || {
            let ld = ll.paged(&lb, layers.clone(), heads.clone()).unwrap();
            let rd = rl.paged(&rb, layers.clone(), heads.clone()).unwrap();
            let l = resolve_paged(Side::Local, &ld, &lt).unwrap();
            let r = resolve_paged(Side::Remote, &rd, &rt).unwrap();
            // The block indices: one list per side, shared by every layer's entry (and by
            // the resolved entries and runs, which point at it too).
            let held = (lb.len() + rb.len()) * 4
                + (ld.capacity() + rd.capacity()) * std::mem::size_of::<kvxfer::paged::Paged>()
                + (l.capacity() + r.capacity())
                    * std::mem::size_of::<kvxfer::paged::ResolvedPaged>();
            let p = plan_paged(l, r).unwrap();
            let held = held + p.runs.capacity() * std::mem::size_of::<kvxfer::paged::Run>();
            (p, held)
        };
        let (fp, fheld) = flat();
        let (pp, pheld) = paged();
        // Same bytes, same operations.
        assert_eq!(fp.bytes, pp.bytes);
        assert_eq!(fp.ops, pp.ops().collect::<Vec<_>>());
        println!(
            "describe_and_plan/{name}: {} descriptors, {} B; memory held while planning: flat {:.2} MiB, paged {:.3} MiB",
            fp.descs,
            fp.bytes,
            fheld as f64 / (1 << 20) as f64,
            pheld as f64 / (1 << 20) as f64
        );
        g.bench_function(BenchmarkId::new("flat", name), |b| {
            b.iter(|| black_box(flat()))
        });
        g.bench_function(BenchmarkId::new("paged", name), |b| {
            b.iter(|| black_box(paged()))
        });
        // The TCP lane's request table, built by the initiator and parsed by the target: a
        // segment per operation, or the paged table (lists shared by every entry).
        let flat_table = || {
            let mut b = Vec::with_capacity(fp.ops.len() * SEG_LEN);
            for o in &fp.ops {
                Segment {
                    region: 0,
                    offset: o.remote - 0x7e00_0000_0000,
                    len: o.len,
                }
                .encode(&mut b);
            }
            let segs: Vec<Segment> = segments(&b).unwrap().collect();
            (b.len(), segs.len())
        };
        let paged_table = || {
            let remote: Vec<Paged> = pp
                .runs
                .iter()
                .map(|r| Paged {
                    region: RegionId(0),
                    offset: r.remote.base - 0x7e00_0000_0000,
                    block_len: r.remote.block_len,
                    stride: r.remote.stride,
                    blocks: r.remote.blocks.clone(),
                })
                .collect();
            let mut b = Vec::with_capacity(paged_table_len(&remote));
            encode_paged(&remote, &mut b);
            let t = parse_paged(&b).unwrap();
            (b.len(), t.entries.len())
        };
        println!(
            "lane_table/{name}: flat {} B, paged {} B on the wire",
            flat_table().0,
            paged_table().0
        );
        g.bench_function(BenchmarkId::new("lane_table_flat", name), |b| {
            b.iter(|| black_box(flat_table()))
        });
        g.bench_function(BenchmarkId::new("lane_table_paged", name), |b| {
            b.iter(|| black_box(paged_table()))
        });
    }
    g.finish();
}

fn layout(c: &mut Criterion) {
    let g = KvGeometry::preset("qwen3-0.6b").unwrap();
    c.bench_function("layout/qwen3_request_descriptors", |b| {
        b.iter(|| {
            let g = black_box(&g);
            (
                g.bytes_per_token() * black_box(2371),
                g.descriptors(black_box(2371), 16),
                g.block_bytes(16),
            )
        })
    });
}

/// Sealing and opening one TCP-lane record of 1 MiB (AES-256-GCM under a Noise session,
/// as `AgentConfig::lane_encryption` does per record on each end): one core's rate each way.
fn sealing(c: &mut Criterion) {
    use kvxfer_proto::lane_seal::{record_size, seal_record_to};
    use kvxfer_proto::session::{Initiator, Psk, Session, StaticKey, SEED};
    use kvxfer_proto::wire::lane::RECORD_PLAIN;
    let psk = Psk::lane(b"bench", b"lane");
    let (ik, rk) = (
        StaticKey::from_seed([3; SEED]),
        StaticKey::from_seed([4; SEED]),
    );
    let pair = || {
        let (i, first) = Initiator::start_keyed(&psk, &ik, &rk.public(), [1; SEED], "r").unwrap();
        let (r, answer, _) = Session::respond_keyed(&psk, &rk, [2; SEED], &first, "i").unwrap();
        (i.finish(&answer).unwrap(), r)
    };
    let (mut s, _) = pair();
    let plain: Vec<u8> = (0..RECORD_PLAIN).map(|k| (k * 7) as u8).collect();
    let mut g = c.benchmark_group("lane_sealing");
    g.throughput(criterion::Throughput::Bytes(RECORD_PLAIN as u64));
    // Buffers reused as a lane connection reuses them.
    let mut out = vec![0u8; record_size(RECORD_PLAIN)];
    g.bench_function("seal_1MiB", |b| {
        b.iter(|| seal_record_to(&mut s, black_box(&plain), &mut out))
    });
    // Opening needs records sealed in order under a fresh pair: each sealed, then opened
    // (only the opening timed).
    let (mut s, mut r) = pair();
    let mut open_out = vec![0u8; record_size(RECORD_PLAIN)];
    g.bench_function("open_1MiB", |b| {
        b.iter_custom(|n| {
            let mut spent = std::time::Duration::ZERO;
            let mut w = vec![0u8; record_size(RECORD_PLAIN)];
            for _ in 0..n {
                let len = seal_record_to(&mut s, &plain, &mut w);
                let t0 = std::time::Instant::now();
                r.open_to(black_box(&w[4..len]), &mut open_out).unwrap();
                spent += t0.elapsed();
            }
            spent
        })
    });
    g.finish();
}

/// The TCP lane target's grant check for a whole Qwen3-0.6B request (2,371 tokens: 149
/// blocks of 16 tokens, 28 layers, K and V: 8,344 block checks), with the asking peer holding
/// 16 scopes (16 requests in flight from one reader), its own the last.
fn grant_check(c: &mut Criterion) {
    use kvxfer::layout::{KvDtype, KvLayout, KvOrder, KvPacking};
    use kvxfer_proto::grants::GrantTable;
    use kvxfer_proto::wire::connector::Grant;
    let g = KvGeometry {
        name: "qwen3-0.6b".into(),
        layers: 28,
        kv_heads: 8,
        head_dim: 128,
        dtype: KvDtype::Bf16,
    };
    let l = KvLayout::contiguous(g, 16, 4096, KvPacking::Separate, KvOrder::Nhd, RegionId(0));
    let mut t = GrantTable::new();
    t.restrict([0]);
    let all = slots(4096, 11);
    for k in 0..16u8 {
        let blocks: Vec<u32> = all[k as usize * 149..(k as usize + 1) * 149]
            .iter()
            .map(|&b| b as u32)
            .collect();
        t.grant(Grant([k; 16]), "decode-0", false, &l, &blocks);
    }
    let mine: Vec<u32> = all[15 * 149..16 * 149].iter().map(|&b| b as u32).collect();
    let descs = l.descs(&mine, 0..28, 0..8).unwrap();
    assert_eq!(descs.len(), 8344);
    let mut grp = c.benchmark_group("grant_check");
    grp.bench_function("qwen3_8344_blocks_16_scopes", |b| {
        b.iter(|| {
            // As the lane target does: the peer's grants looked up once per table.
            let a = t.access("decode-0", false);
            for d in &descs {
                black_box(a.check(d.region.0, d.offset, d.len)).unwrap();
            }
        })
    });
    grp.finish();
}

/// One whole handshake, both ends' CPU in one thread: the TCP lane's (IK: each side's static
/// key proven, five X25519 operations a side) against the side channel's (NN: ephemeral keys
/// only, two a side). A lane pays it once per connection, not per transfer.
fn handshakes(c: &mut Criterion) {
    use kvxfer_proto::session::{Initiator, Psk, Session, StaticKey, SEED};
    let mut g = c.benchmark_group("handshake");
    let lane = Psk::lane(b"bench", b"lane");
    let (ik, rk) = (
        StaticKey::from_seed([3; SEED]),
        StaticKey::from_seed([4; SEED]),
    );
    g.bench_function("lane_ik", |b| {
        b.iter(|| {
            let (i, first) =
                Initiator::start_keyed(&lane, &ik, &rk.public(), [1; SEED], "r").unwrap();
            let (_, answer, key) =
                Session::respond_keyed(&lane, &rk, [2; SEED], &first, "i").unwrap();
            assert_eq!(key, ik.public());
            i.finish(&answer).unwrap()
        })
    });
    let side = Psk::side_channel(b"bench");
    g.bench_function("side_channel_nn", |b| {
        b.iter(|| {
            let (i, first) = Initiator::start(&side, [1; SEED], "r").unwrap();
            let (_, answer) = Session::respond(&side, [2; SEED], &first, "i").unwrap();
            i.finish(&answer).unwrap()
        })
    });
    g.finish();
}

/// A transfer's device copies as tables (`copy_batch::batches`, the device lane's CPU work
/// per request besides planning): the Qwen3-0.6B request and a Llama-3-70B 32k-token one
/// (80 x 2 x 2,048 = 327,680 blocks), blocks of 32 KiB at random slots on both sides. The
/// 70B request must move in at most 10 ms on a GPU (issue 36), so this has to stay well
/// under it.
fn copy_tables(c: &mut Criterion) {
    use kvxfer_proto::copy_batch::{batches, BatchLimits, CopyRange};
    let mut g = c.benchmark_group("copy_tables");
    for n in [8_344u64, 327_680] {
        let (src, dst) = (slots(n, 3), slots(n, 4));
        let copies: Vec<CopyRange> = src
            .iter()
            .zip(&dst)
            .map(|(&s, &d)| CopyRange {
                src: 0x7e00_0000_0000 + s * BLOCK,
                dst: 0x7f00_0000_0000 + d * BLOCK,
                len: BLOCK,
            })
            .collect();
        g.bench_with_input(BenchmarkId::new("random", n), &copies, |b, copies| {
            b.iter(|| batches(black_box(copies.iter().copied()), &BatchLimits::DEVICE).unwrap())
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).measurement_time(std::time::Duration::from_secs(2));
    targets = build, metadata, paged, layout, sealing, grant_check, handshakes, copy_tables
}
criterion_main!(benches);
