//! A small KV cache for the connector's attack tests: 2 layers of 16 blocks (16 tokens,
//! 2 heads of 32 bf16), registered on the agent and filled with one byte.
#![allow(dead_code, clippy::unwrap_used)]

use kvxfer::{Agent, HostBuffer};

/// The cache's region (every byte `fill`) and its layout.
pub fn kv_layout(a: &Agent, fill: u8) -> (kvxfer::Region, kvxfer::layout::KvLayout) {
    kv_layout_shared(a, fill, kvxfer::Share::AllPeers)
}

/// As [`kv_layout`], the region registered shared as `with` says.
pub fn kv_layout_shared(
    a: &Agent,
    fill: u8,
    with: kvxfer::Share,
) -> (kvxfer::Region, kvxfer::layout::KvLayout) {
    use kvxfer::layout::{KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking};
    let g = KvGeometry {
        name: "sec".into(),
        layers: 2,
        kv_heads: 2,
        head_dim: 32,
        dtype: KvDtype::Bf16,
    };
    let probe = KvLayout::contiguous(
        g.clone(),
        16,
        16,
        KvPacking::Separate,
        KvOrder::Nhd,
        kvxfer::RegionId(0),
    );
    let r = a
        .register_shared(
            HostBuffer::new(probe.region_bytes() as usize).unwrap(),
            with,
        )
        .unwrap();
    r.write(0, &vec![fill; r.len() as usize]).unwrap();
    let l = KvLayout::contiguous(g, 16, 16, KvPacking::Separate, KvOrder::Nhd, r.id());
    (r, l)
}
