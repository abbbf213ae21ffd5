//! The TCP lane carries the paged form as it is: one entry per layer and tensor on the wire,
//! the data walked a window at a time at both ends. Byte for byte over many windows, striped
//! and compressed; a transfer of more blocks than a flat table may hold; and a hand-written
//! paged request naming blocks outside the target's region, refused with the stream in step.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

#[path = "support/lane_client.rs"]
mod lane_client;

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use kvxfer::paged::{Paged, WINDOW_BLOCKS};
use kvxfer::{Agent, AgentConfig, Compression, Desc, HostBuffer, Lane, Region, Transport, XferOp};
use kvxfer_proto::wire::lane::{encode_paged, paged_table_len, RequestHeader, K_WRITE, MAX_SEGS};
use rand::seq::SliceRandom;
use rand::{RngCore, SeedableRng};

struct Pair {
    a: Agent,
    b: Agent,
    ra: Region,
    rb: Region,
    peer: String,
}

fn pair(tag: &str, len: usize, cfg: impl Fn(AgentConfig) -> AgentConfig) -> Pair {
    let _ = env_logger::builder().is_test(true).try_init();
    let mk = |n: &str| {
        cfg(
            AgentConfig::new(format!("{n}-{tag}-{}", std::process::id()))
                .transport(Transport::Tcp)
                .net_devices("lo"),
        )
    };
    let b = Agent::new(mk("b")).unwrap();
    let a = Agent::new(mk("a")).unwrap();
    let ra = a.register(HostBuffer::new(len).unwrap()).unwrap();
    let rb = b.register(HostBuffer::new(len).unwrap()).unwrap();
    let peer = a.connect(b.listen("127.0.0.1:0").unwrap()).unwrap();
    Pair { a, b, ra, rb, peer }
}

fn fill(r: &Region, seed: u64) -> Vec<u8> {
    // A random pool, tiled with a shift per MiB (cheap in a debug build; no two blocks alike).
    const MIB: usize = 1 << 20;
    let mut pool = vec![0u8; MIB + 8192];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut pool);
    // bf16-like: the high byte of each 16-bit value (sign and exponent) from a narrow range,
    // so that the codec finds something to compress.
    for w in pool.chunks_exact_mut(2) {
        w[1] = 0x3c | (w[1] & 0x83);
    }
    let mut v = vec![0u8; r.len() as usize];
    for (k, c) in v.chunks_mut(MIB).enumerate() {
        let at = (k * 2 * 131) % 8192;
        c.copy_from_slice(&pool[at..at + c.len()]);
    }
    r.write(0, &v).unwrap();
    v
}

fn snapshot(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.len() as usize];
    r.read(0, &mut v).unwrap();
    v
}

/// `entries` entries of `n` blocks of `block` bytes, at random slots of `slots` per entry
/// (one shuffled list per side, shared by all entries), on both sides.
fn layers(p: &Pair, entries: u64, n: usize, block: u64, slots: u32) -> (Vec<Paged>, Vec<Paged>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(n as u64);
    let (mut la, mut lb): (Vec<u32>, Vec<u32>) = ((0..slots).collect(), (0..slots).collect());
    la.shuffle(&mut rng);
    lb.shuffle(&mut rng);
    let side = |r: &Region, blocks: &[u32]| -> Vec<Paged> {
        let shared: Arc<[u32]> = blocks[..n].into();
        (0..entries)
            .map(|e| Paged {
                region: r.id(),
                offset: e * u64::from(slots) * block,
                block_len: block,
                stride: block,
                blocks: shared.clone(),
            })
            .collect()
    };
    (side(&p.ra, &la), side(&p.rb, &lb))
}

/// What `dst` holds once `src`'s `from` blocks moved to its `to` blocks.
fn expect(src: &[u8], dst: &[u8], from: &[Paged], to: &[Paged]) -> Vec<u8> {
    let mut want = dst.to_vec();
    for (f, t) in from.iter().zip(to) {
        for (&bf, &bt) in f.blocks.iter().zip(t.blocks.iter()) {
            let s = (f.offset + u64::from(bf) * f.stride) as usize;
            let d = (t.offset + u64::from(bt) * t.stride) as usize;
            let l = f.block_len as usize;
            want[d..d + l].copy_from_slice(&src[s..s + l]);
        }
    }
    want
}

/// Writes then reads `lp` ↔ `rp`, checking every byte and the one notification of each.
fn roundtrip(p: &Pair, lp: &[Paged], rp: &[Paged], tag: &str) -> Vec<kvxfer::XferStats> {
    let mut stats = Vec::new();
    for (k, op) in [XferOp::Write, XferOp::Read].into_iter().enumerate() {
        let va = fill(&p.ra, 2 * k as u64);
        let vb = fill(&p.rb, 2 * k as u64 + 1);
        let st =
            p.a.transfer_paged(op, &p.peer, lp, rp, Some(b"paged"), None)
                .unwrap()
                .wait()
                .unwrap();
        assert_eq!(st.lane, Lane::Tcp, "{tag}");
        assert_eq!(st.bytes, lp.iter().map(Paged::bytes).sum::<u64>(), "{tag}");
        let (got, want) = match op {
            XferOp::Write => (snapshot(&p.rb), expect(&va, &vb, lp, rp)),
            XferOp::Read => (snapshot(&p.ra), expect(&vb, &va, rp, lp)),
        };
        assert!(got == want, "{tag} {op}: bytes differ");
        let note = p.b.wait_notification(Duration::from_secs(20)).unwrap();
        assert_eq!(note.payload, b"paged", "{tag}");
        assert!(
            p.b.wait_notification(Duration::from_millis(100)).is_err(),
            "{tag}: a second notification"
        );
        stats.push(st);
    }
    stats
}

#[test]
fn many_windows_move_exactly_raw_striped_and_compressed() {
    // 16 entries (8 layers, K and V) of 2,048 blocks of 512 B at random slots: 16 MiB, the
    // striping floor; each stripe's part spans windows, and windows end inside entries.
    let (block, slots, n, entries) = (512u64, 2048u32, 2048usize, 16u64);
    let len = (entries * u64::from(slots) * block) as usize;
    assert!(n * 16 / 3 > WINDOW_BLOCKS);
    for (tag, stripes, comp) in [
        ("pw-raw", 1, Compression::Off),
        ("pw-striped", 4, Compression::Off),
        ("pw-comp-striped", 3, Compression::On),
    ] {
        let p = pair(tag, len, |c| c.stripes(stripes).compression(comp));
        let (lp, rp) = layers(&p, entries, n, block, slots);
        for st in roundtrip(&p, &lp, &rp, tag) {
            if comp == Compression::On {
                assert!(st.wire_bytes < st.bytes, "{tag}: not compressed: {st:?}");
            } else {
                assert_eq!(st.wire_bytes, st.bytes, "{tag}");
            }
        }
    }
}

#[test]
fn more_blocks_than_a_flat_table_takes_move_paged() {
    // 1.1 M blocks of 8 bytes, none contiguous with the next: the flat form is one segment
    // each, past the 1 Mi segments a request may carry; the paged form carries one list.
    let (block, slots) = (8u64, 1u32 << 22);
    let n = MAX_SEGS + MAX_SEGS / 10;
    let len = (u64::from(slots) * block) as usize;
    let p = pair("pw-huge", len, |c| c);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut even: Vec<u32> = (0..slots / 2).map(|s| 2 * s).collect();
    even.shuffle(&mut rng);
    let shared: Arc<[u32]> = even[..n].into();
    let side = |r: &Region| {
        vec![Paged {
            region: r.id(),
            offset: 0,
            block_len: block,
            stride: block,
            blocks: shared.clone(),
        }]
    };
    let (lp, rp) = (side(&p.ra), side(&p.rb));
    roundtrip(&p, &lp, &rp, "pw-huge");
    // The same blocks as descriptors: a segment each, more than the lane takes.
    let descs = |r: &Region| -> Vec<Desc> {
        shared
            .iter()
            .map(|&b| Desc::new(r.id(), u64::from(b) * block, block))
            .collect()
    };
    let local = p.a.prep_local(&descs(&p.ra)).unwrap();
    let remote = p.a.prep_remote(&p.peer, &descs(&p.rb)).unwrap();
    let e =
        p.a.transfer_all(XferOp::Write, &local, &remote, None, None)
            .unwrap()
            .wait()
            .unwrap_err();
    assert!(e.to_string().contains("operations in one transfer"), "{e}");
}

/// A paged write of `data` into `entries`, by hand; the reply's status and message.
fn paged_write(c: &mut TcpStream, id: u64, entries: &[Paged], data: &[u8]) -> (u8, String) {
    let mut b = Vec::new();
    RequestHeader {
        kind: K_WRITE,
        id,
        nsegs: paged_table_len(entries),
        notif_len: 0,
        frames: None,
        paged: true,
    }
    .encode(&mut b);
    encode_paged(entries, &mut b);
    b.extend_from_slice(data);
    lane_client::write(c, id, &b)
}

#[test]
fn a_paged_request_outside_the_region_is_refused_in_step() {
    let len = 1 << 20;
    let p = pair("pw-hostile", len, |c| c);
    let before = snapshot(&p.rb);
    let mut c = lane_client::connect(&p.b);
    let entry = |blocks: Vec<u32>, stride: u64| Paged {
        region: p.rb.id(),
        offset: 0,
        block_len: 4096,
        stride,
        blocks: blocks.into(),
    };
    // The largest block ends past the region (checked from the largest index: nothing is
    // expanded), a stride that overflows, and a region that is not registered.
    for (k, (bad, why)) in [
        (entry(vec![0, 256, 1], 4096), "outside"),
        (entry(vec![0, 2], u64::MAX / 2), "outside"),
        (
            Paged {
                region: kvxfer::RegionId(p.rb.id().0 + 77),
                ..entry(vec![0], 4096)
            },
            "not registered",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let data = vec![0xAB; bad.bytes() as usize];
        let (status, msg) = paged_write(&mut c, k as u64, std::slice::from_ref(&bad), &data);
        assert_eq!(status, 1, "refused: {msg}");
        assert!(msg.to_lowercase().contains(why), "{why}: {msg}");
    }
    assert!(snapshot(&p.rb) == before, "a refused paged write landed");
    // In step: the same connection then lands a good one.
    let good = entry(vec![3, 1], 4096);
    let (status, msg) = paged_write(&mut c, 9, &[good], &[7u8; 8192]);
    assert_eq!((status, msg.as_str()), (0, ""));
    let after = snapshot(&p.rb);
    assert!(after[4096..8192].iter().all(|&x| x == 7));
    assert!(after[3 * 4096..4 * 4096].iter().all(|&x| x == 7));
    assert!(after[..4096] == before[..4096]);
}
