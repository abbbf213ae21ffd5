//! The TCP lane's compression: compressed transfers move exactly the bytes raw ones do (bf16
//! KV-like data and random bytes, WRITE and READ, one connection and striped), `auto` follows
//! the link rate, and a corrupt frame is refused as a typed error, with the stream kept in
//! step and nothing of it written.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

#[path = "support/lane_client.rs"]
mod lane_client;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use kvxfer::{Agent, AgentConfig, Compression, Desc, HostBuffer, Region, Transport, XferOp};
use kvxfer_proto::compress::codec::Encoder;
use kvxfer_proto::compress::planes::Transform;
use kvxfer_proto::wire::lane::{RequestHeader, Segment, K_WRITE};
use rand::{Rng, RngCore, SeedableRng};

const BLOCK: u64 = 32 * 1024;
const SLOTS: u64 = 256;
const N: usize = 200; // 6.5 MB: above the policy's 4 MiB floor

/// bf16 values, normal-ish at per-block scales (the exponent plane of KV is narrow): one
/// pool made once, each seed a different rotation of it.
fn kv_like(len: usize, seed: u64) -> Vec<u8> {
    static POOL: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let pool = POOL.get_or_init(|| {
        let n = (BLOCK * SLOTS) as usize + (1 << 20);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut v = Vec::with_capacity(n);
        let mut scale = 1.0f32;
        while v.len() < n {
            if v.len() % BLOCK as usize == 0 {
                scale = 2f32.powi(rng.gen_range(-4..3));
            }
            let x: f32 = (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32
                + (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32
                - 1.0;
            v.extend_from_slice(&(((x * scale).to_bits() >> 16) as u16).to_le_bytes());
        }
        v
    });
    let at = (seed as usize * 4 * BLOCK as usize) % (pool.len() - len + 1);
    pool[at..at + len].to_vec()
}

struct Pair {
    a: Agent,
    b: Agent,
    ra: Region,
    rb: Region,
    peer: String,
}

fn pair(tag: &str, cfg: impl Fn(AgentConfig) -> AgentConfig) -> Pair {
    let _ = env_logger::builder().is_test(true).try_init();
    let mk = |n: &str| {
        cfg(
            AgentConfig::new(format!("{n}-{tag}-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo"),
        )
    };
    let b = Agent::new(mk("zb")).unwrap();
    let a = Agent::new(mk("za")).unwrap();
    let ra = a
        .register(HostBuffer::new((BLOCK * SLOTS) as usize).unwrap())
        .unwrap();
    let rb = b
        .register(HostBuffer::new((BLOCK * SLOTS) as usize).unwrap())
        .unwrap();
    let peer = a.connect(b.listen("127.0.0.1:0").unwrap()).unwrap();
    Pair { a, b, ra, rb, peer }
}

fn snapshot(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.len() as usize];
    r.read(0, &mut v).unwrap();
    v
}

/// WRITE then READ of N random blocks, every byte checked; returns each op's stats.
fn roundtrip(p: &Pair, data: &dyn Fn(u64) -> Vec<u8>) -> Vec<kvxfer::XferStats> {
    use rand::seq::SliceRandom;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut la: Vec<u64> = (0..SLOTS).collect();
    let mut lb: Vec<u64> = (0..SLOTS).collect();
    la.shuffle(&mut rng);
    lb.shuffle(&mut rng);
    let ld: Vec<Desc> = la[..N]
        .iter()
        .map(|&s| Desc::new(p.ra.id(), s * BLOCK, BLOCK))
        .collect();
    let rd: Vec<Desc> = lb[..N]
        .iter()
        .map(|&s| Desc::new(p.rb.id(), s * BLOCK, BLOCK))
        .collect();
    let local = p.a.prep_local(&ld).unwrap();
    let remote = p.a.prep_remote(&p.peer, &rd).unwrap();
    let mut out = Vec::new();
    for (i, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
        let va = data(2 * i as u64);
        let vb = data(2 * i as u64 + 1);
        p.ra.write(0, &va).unwrap();
        p.rb.write(0, &vb).unwrap();
        let x =
            p.a.transfer_all(
                op,
                &local,
                &remote,
                Some(b"z"),
                Some(Duration::from_secs(60)),
            )
            .unwrap();
        let stats = x.wait().unwrap();
        let (src, mut dst, ss, ds, dr) = match op {
            XferOp::Write => (&va, vb.clone(), &la, &lb, &p.rb),
            XferOp::Read => (&vb, va.clone(), &lb, &la, &p.ra),
        };
        for k in 0..N {
            let (s, d) = ((ss[k] * BLOCK) as usize, (ds[k] * BLOCK) as usize);
            dst[d..d + BLOCK as usize].copy_from_slice(&src[s..s + BLOCK as usize]);
        }
        assert!(snapshot(dr) == dst, "{op}: destination bytes differ");
        let note = p.b.wait_notification(Duration::from_secs(10)).unwrap();
        assert_eq!(note.payload, b"z");
        assert!(p.b.try_notification().is_none(), "a second notification");
        out.push(stats);
    }
    out
}

#[test]
fn compressed_transfers_move_exactly_the_bytes() {
    let len = (BLOCK * SLOTS) as usize;
    // One connection, three stripes, and three coding threads per transfer.
    for (stripes, threads) in [(1, 1), (3, 1), (1, 3)] {
        let p = pair(&format!("on{stripes}{threads}"), |c| {
            c.compression(Compression::On)
                .stripes(stripes)
                .compress_threads(threads)
        });
        // KV-like data compresses; random bytes go as stored planes, never larger than raw
        // plus the frame headers.
        let kv = roundtrip(&p, &|s| kv_like(len, s));
        for s in &kv {
            assert!(
                s.wire_bytes < s.bytes * 9 / 10,
                "{:?}: {} wire bytes for {} raw",
                s.op,
                s.wire_bytes,
                s.bytes
            );
            assert!(s.codec_time > Duration::ZERO);
        }
        let random = roundtrip(&p, &|s| {
            let mut v = vec![0u8; len];
            rand::rngs::StdRng::seed_from_u64(100 + s).fill_bytes(&mut v);
            v
        });
        for s in &random {
            assert!(
                s.wire_bytes <= s.bytes + s.bytes / (1 << 20) * 40 + 400,
                "{s:?}"
            );
        }
        // Both sides coded: A compressed the writes and decompressed the reads, B the reverse.
        let (ta, tb) = (p.a.codec_totals(), p.b.codec_totals());
        assert!(ta.encoded.frames > 0 && ta.decoded.frames > 0, "{ta:?}");
        assert!(tb.encoded.frames > 0 && tb.decoded.frames > 0, "{tb:?}");
        assert_eq!(ta.encoded.raw, tb.decoded.raw);
        assert_eq!(tb.encoded.raw, ta.decoded.raw);
    }
}

#[test]
fn auto_follows_the_link_rate() {
    let len = (BLOCK * SLOTS) as usize;
    // A link faster than any codec here: auto sends raw, and calibrates nothing it uses.
    let fast = pair("fast", |c| {
        c.link_rate(format!("zb-fast-{}", std::process::id()), 1e11)
    });
    for _ in 0..2 {
        for s in roundtrip(&fast, &|s| kv_like(len, s)) {
            assert_eq!(s.wire_bytes, s.bytes, "compressed over a fast link: {s:?}");
        }
    }
    assert_eq!(fast.a.codec_totals().encoded.frames, 0);
    // A slow one (1 MB/s): the first transfer goes raw and measures the codec on its data,
    // the next ones compress.
    let slow = pair("slow", |c| {
        c.link_rate(format!("zb-slow-{}", std::process::id()), 1e6)
    });
    let first = roundtrip(&slow, &|s| kv_like(len, s));
    assert_eq!(first[0].wire_bytes, first[0].bytes, "calibrating transfer");
    let next = roundtrip(&slow, &|s| kv_like(len, s));
    for s in &next {
        assert!(
            s.wire_bytes < s.bytes,
            "auto did not compress a slow link: {s:?}"
        );
    }
    // Off never compresses.
    let off = pair("off", |c| {
        c.compression(Compression::Off)
            .link_rate(format!("zb-off-{}", std::process::id()), 1e6)
    });
    for _ in 0..2 {
        for s in roundtrip(&off, &|s| kv_like(len, s)) {
            assert_eq!(s.wire_bytes, s.bytes);
        }
    }
}

/// A compressed write's header and its one segment: `raw` bytes at the start of `region`.
fn framed_request(id: u64, region: u32, raw: u64) -> Vec<u8> {
    let mut b = Vec::new();
    RequestHeader {
        kind: K_WRITE,
        id,
        nsegs: 1,
        notif_len: 0,
        frames: Some(Transform::Bf16),
        paged: false,
    }
    .encode(&mut b);
    Segment {
        region,
        offset: 0,
        len: raw,
    }
    .encode(&mut b);
    b
}

fn framed_write(c: &mut TcpStream, id: u64, region: u32, frames: &[u8], raw: u64) -> (u8, String) {
    let mut b = framed_request(id, region, raw);
    b.extend_from_slice(frames);
    lane_client::write(c, id, &b)
}

#[test]
fn a_corrupt_frame_is_refused_and_nothing_of_it_lands() {
    let p = pair("corrupt", |c| c);
    let raw_len = 3 << 20;
    let data = kv_like(raw_len, 5);
    let mut e = Encoder::new(Transform::Bf16).unwrap();
    let mut frames = Vec::new();
    for c in data.chunks(1 << 20) {
        e.encode(c, &mut frames).unwrap();
    }
    let before = snapshot(&p.rb);
    let mut c = lane_client::connect(&p.b);
    let region = p.rb.id().0;
    // A byte flipped inside the second frame's planes: that frame fails its checksum or its
    // zstd decode; the third is drained; the write is refused with the reason.
    let second = frames.len() / 3 + 100;
    let mut bad = frames.clone();
    bad[second] ^= 0x20;
    let (status, msg) = framed_write(&mut c, 1, region, &bad, raw_len as u64);
    assert_eq!(status, 1, "a corrupt write was accepted");
    assert!(msg.contains("compressed data"), "{msg}");
    // Nothing of the corrupt frame or after it landed (the first frame, checked, may have).
    let after = snapshot(&p.rb);
    assert!(
        after[1 << 20..raw_len] == before[1 << 20..raw_len],
        "corrupt data landed"
    );
    // The stream is in step: the same connection then carries a good write.
    let (status, msg) = framed_write(&mut c, 2, region, &frames, raw_len as u64);
    assert_eq!((status, msg.as_str()), (0, ""));
    assert!(
        snapshot(&p.rb)[..raw_len] == data[..],
        "the good write's bytes"
    );
    // A truncated stream (the connection closes mid-frame) leaves no data and no notification.
    let mut c = lane_client::connect(&p.b);
    let mut b = framed_request(3, region, raw_len as u64);
    p.rb.write(0, &vec![0u8; raw_len]).unwrap();
    b.extend_from_slice(&frames[..frames.len() / 2]);
    c.write_all(&b).unwrap();
    drop(c);
    std::thread::sleep(Duration::from_millis(300));
    let got = snapshot(&p.rb);
    // Whole frames that arrived before the cut may have landed; nothing past them.
    assert!(
        got[2 << 20..raw_len].iter().all(|&x| x == 0),
        "truncated data landed"
    );
    assert!(p.b.try_notification().is_none());
}
