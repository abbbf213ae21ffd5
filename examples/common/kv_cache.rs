//! The KV caches of the examples' workers: Qwen3-0.6B-shaped paged caches in host memory
//! (28 layers, 8 KV heads, head dim 128, bf16, 16-token blocks), one slot of blocks per
//! request in flight, and the deterministic content a request's KV has (written by the
//! prefill side, checked by the decode side).
#![allow(dead_code)]

use kvxfer::layout::{Kv, KvGeometry, KvLayout, KvOrder, KvPacking};
use kvxfer::{Agent, HostBuffer, Region};

/// Tokens of the example prompt (the motivating deployment's 2,371).
pub const TOKENS: u64 = 2371;
/// Tokens per block.
pub const BLOCK_TOKENS: u64 = 16;

/// The model's KV geometry.
pub fn geometry() -> KvGeometry {
    KvGeometry::preset("qwen3-0.6b").unwrap()
}

/// Blocks of one request.
pub fn blocks_per_request() -> u64 {
    TOKENS.div_ceil(BLOCK_TOKENS)
}

/// A worker's cache: `slots` request slots of `blocks_per_request()` blocks, one region.
pub fn cache(agent: &Agent, slots: usize) -> (Region, KvLayout) {
    cache_of(agent, slots, blocks_per_request())
}

/// A worker's cache: `slots` request slots of `per_slot` blocks, one region.
pub fn cache_of(agent: &Agent, slots: usize, per_slot: u64) -> (Region, KvLayout) {
    cache_shared(agent, slots, per_slot, kvxfer::Share::AllPeers)
}

/// As [`cache_of`], registered shared as `with` says (`Share::Only(vec![])`: a cache that only
/// a connector's grants open, on the TCP lane).
pub fn cache_shared(
    agent: &Agent,
    slots: usize,
    per_slot: u64,
    with: kvxfer::Share,
) -> (Region, KvLayout) {
    let g = geometry();
    let nb = per_slot * slots as u64;
    let probe = KvLayout::contiguous(
        g.clone(),
        BLOCK_TOKENS,
        nb,
        KvPacking::Separate,
        KvOrder::Nhd,
        kvxfer::RegionId(0),
    );
    let region = agent
        .register_shared(
            HostBuffer::new(probe.region_bytes() as usize).unwrap(),
            with,
        )
        .unwrap();
    let layout = KvLayout::contiguous(
        g,
        BLOCK_TOKENS,
        nb,
        KvPacking::Separate,
        KvOrder::Nhd,
        region.id(),
    );
    // An engine allocates and zeroes its KV cache at startup. Untouched, the first transfer
    // into (or out of) each page would fault it in and clear it: the profile of a replay at
    // concurrency 8 had 37% of its samples in clear_page_erms on the lane threads.
    let zero = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < region.len() {
        let n = (region.len() - off).min(zero.len() as u64);
        region.write(off, &zero[..n as usize]).unwrap();
        off += n;
    }
    (region, layout)
}

/// The cache blocks of request slot `slot`.
pub fn slot_blocks(slot: usize) -> Vec<u32> {
    slot_blocks_of(slot, blocks_per_request())
}

/// The cache blocks of request slot `slot` of `per_slot` blocks.
pub fn slot_blocks_of(slot: usize, per_slot: u64) -> Vec<u32> {
    let n = per_slot as u32;
    // Interleave the slot's blocks with the other slots' so they are not contiguous.
    (0..n).map(|k| slot as u32 * n + (k * 7) % n).collect()
}

/// The KV "computed" for request `req`, token block `k`, layer and K/V.
/// The content of block `k` of request `req`, layer `layer`, K or V.
pub fn pattern(req: u64, k: u64, layer: u64, kv: Kv, out: &mut [u8]) {
    let mut x =
        (req.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (k << 20) ^ (layer << 8) ^ (kv as u64)) | 1;
    for c in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

/// Writes (or checks) the pattern of `req` into token blocks `ks` (indices into the request)
/// stored at cache blocks `blocks`. Stops early, returning false, once the process is asked
/// to stop ([`kvxfer::stop`]).
pub fn fill_or_check(
    region: &Region,
    layout: &KvLayout,
    req: u64,
    ks: std::ops::Range<usize>,
    blocks: &[u32],
    check: bool,
) -> bool {
    let mut want = vec![0u8; layout.block_bytes() as usize];
    let mut got = vec![0u8; want.len()];
    let mut d = Vec::new();
    for layer in 0..layout.layers.len() {
        // A "forward pass" yields to a stopping process between layers.
        if kvxfer::stop::requested() {
            return false;
        }
        for kv in [Kv::K, Kv::V] {
            for k in ks.clone() {
                d.clear();
                layout
                    .block_descs(layer, kv, blocks[k], 0..layout.geometry.kv_heads, &mut d)
                    .unwrap();
                pattern(req, k as u64, layer as u64, kv, &mut want);
                if check {
                    region.read(d[0].offset, &mut got).unwrap();
                    if got != want {
                        return false;
                    }
                } else {
                    region.write(d[0].offset, &want).unwrap();
                }
            }
        }
    }
    true
}

/// Bytes of a block's stamp ([`stamp_or_check`]).
pub const STAMP: usize = 64;

/// Like [`fill_or_check`], but writes (or checks) only a stamp at both ends of every block: the
/// first [`STAMP`] bytes of the block's pattern. For replays whose "compute" is a sleep (a GPU
/// spends it): writing and checking every byte would put the CPU work of 273 MB per request
/// into the measurement. A block that did not move keeps another request's stamp; a block
/// whose ends moved but not its middle is not caught (the full check is `fill_or_check`).
#[allow(dead_code)] // Not every example that includes this file replays.
pub fn stamp_or_check(
    region: &Region,
    layout: &KvLayout,
    req: u64,
    ks: std::ops::Range<usize>,
    blocks: &[u32],
    check: bool,
) -> bool {
    let bb = layout.block_bytes();
    let n = (STAMP as u64).min(bb / 2) as usize;
    let mut want = vec![0u8; n];
    let mut got = vec![0u8; n];
    let mut d = Vec::new();
    for layer in 0..layout.layers.len() {
        for kv in [Kv::K, Kv::V] {
            for k in ks.clone() {
                d.clear();
                layout
                    .block_descs(layer, kv, blocks[k], 0..layout.geometry.kv_heads, &mut d)
                    .unwrap();
                pattern(req, k as u64, layer as u64, kv, &mut want);
                for off in [d[0].offset, d[0].offset + bb - n as u64] {
                    if check {
                        region.read(off, &mut got).unwrap();
                        if got != want {
                            return false;
                        }
                    } else {
                        region.write(off, &want).unwrap();
                    }
                }
            }
        }
    }
    true
}
