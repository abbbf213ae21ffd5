//! Heterogeneous block sizes: a prefill engine of 16-token blocks handing over to a decode
//! engine of 32 (or the reverse). In a token-outer block (NHD, or an MLA latent), a block of
//! `r * n` tokens is `r` blocks of `n` tokens back to back, so the side with the larger blocks
//! is read as a cache of blocks of the smaller size (same memory, `r` times the blocks) and the
//! load pairs blocks of one size, by descriptor mapping, no copy in between. In HND a head's
//! tokens of one block are apart from the next head's: such a geometry cannot map and is
//! refused naming both sizes.
//!
//! The handoff carries the producer's layout as its compat hash only: its block size is the
//! one among power-of-two multiples and fractions of the consumer's (up to 64x) whose hash
//! matches.

use crate::groups::NO_BLOCK;
use crate::layout::{KvLayout, KvOrder, KvPacking};

/// The largest ratio of block sizes tried.
pub const MAX_RATIO: u64 = 64;

/// The block size, in tokens, of a producer whose layout hashes to `compat` and is `local`
/// but for its block size and its `kv_heads` heads: `local`'s own first, then power-of-two
/// multiples and fractions of it. `None`: no block size makes the layouts agree.
pub fn producer_block_tokens(local: &KvLayout, kv_heads: u64, compat: u64) -> Option<u64> {
    let sized = |bt: u64| {
        let mut l = local.clone();
        l.geometry.kv_heads = kv_heads;
        l.block_tokens = bt;
        l.compat_hash() == compat
    };
    let bt = local.block_tokens;
    if sized(bt) {
        return Some(bt);
    }
    let mut r = 2;
    while r <= MAX_RATIO {
        if bt.checked_mul(r).is_some_and(sized) {
            return Some(bt * r);
        }
        if bt.is_multiple_of(r) && sized(bt / r) {
            return Some(bt / r);
        }
        r *= 2;
    }
    None
}

/// One side's cache and blocks of one request in blocks of the smaller size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resized {
    /// The consumer's cache read as blocks of the smaller size.
    pub local: KvLayout,
    /// The consumer's blocks, in blocks of the smaller size.
    pub local_blocks: Vec<u32>,
    /// Blocks per tensor of the producer's cache, in blocks of the smaller size.
    pub remote_num_blocks: u64,
    /// The producer's blocks paired with `local_blocks`, in blocks of the smaller size.
    pub remote_blocks: Vec<u32>,
    /// The producer's blocks before those (the consumer's cached prefix) that it holds, in
    /// blocks of the smaller size.
    pub remote_cached: u64,
}

/// A load of a `tokens`-token request from a producer of `producer_bt`-token blocks
/// (`remote`: its blocks, in token order; `remote_num_blocks` per tensor) into `local_blocks`
/// of `local` (the consumer's last blocks of the request: it holds the ones before), in
/// blocks of the smaller of the two sizes. Why, where the geometry cannot map.
pub fn resize(
    local: &KvLayout,
    producer_bt: u64,
    tokens: u64,
    local_blocks: &[u32],
    remote: &[u32],
    remote_num_blocks: u64,
) -> Result<Resized, String> {
    let (c, p) = (local.block_tokens, producer_bt);
    let both = format!("{p}-token blocks on the producer, {c}-token blocks here");
    let small = c.min(p);
    if small == 0 || !c.is_multiple_of(small) || !p.is_multiple_of(small) {
        return Err(format!("{both}: one size must divide the other"));
    }
    mappable(local, &both)?;
    let (rc, rp) = (c / small, p / small);
    let total = tokens.div_ceil(small);
    let piece = |b: u32, r: u64, i: u64| piece(b, r, i, &both);
    // The consumer's blocks are its last ones of the request: they start where its cached
    // prefix ends, in blocks of the smaller size; the last may hold fewer tokens.
    let mine = tokens.div_ceil(c);
    let cached = mine.checked_sub(local_blocks.len() as u64).ok_or_else(|| {
        format!(
            "{} local blocks for a request of {tokens} tokens in {c}-token blocks",
            local_blocks.len()
        )
    })?;
    let keep = total.saturating_sub(cached * rc);
    let mut local_sub = Vec::new();
    'out: for &b in local_blocks {
        for i in 0..rc {
            if local_sub.len() as u64 == keep {
                break 'out;
            }
            local_sub.push(piece(b, rc, i)?);
        }
    }
    // Only the producer's pieces that pair with those: the last of the request's. Sized by
    // the consumer's list, never by the handoff's (a client's) token count or block list.
    let start = total - local_sub.len() as u64;
    let mut remote_blocks = Vec::with_capacity(local_sub.len());
    for s in start..total {
        let b = remote.get((s / rp) as usize).copied().ok_or_else(|| {
            format!(
                "{both}: {} blocks published for a request of {tokens} tokens",
                remote.len()
            )
        })?;
        remote_blocks.push(piece(b, rp, s % rp)?);
    }
    let remote_cached = remote
        .iter()
        .enumerate()
        .take_while(|&(j, _)| (j as u64) * rp < start)
        .filter(|&(_, &b)| b != NO_BLOCK)
        .map(|(j, _)| rp.min(start - j as u64 * rp))
        .sum();
    let local_blocks = local_sub;
    Ok(Resized {
        local: smaller(local, small, rc, &both)?,
        local_blocks,
        remote_num_blocks: remote_num_blocks.saturating_mul(rp),
        remote_blocks,
        remote_cached,
    })
}

/// Why a cache of `layout` cannot be read as blocks of a smaller size (`both` names the two
/// sizes); `Ok` where a block is smaller blocks back to back.
fn mappable(layout: &KvLayout, both: &str) -> Result<(), String> {
    let token_outer = layout.order == KvOrder::Nhd || layout.packing == KvPacking::Latent;
    if !token_outer {
        return Err(format!(
            "{both}: in HND order a head's tokens of a block are apart from the next head's, \
             so one size does not map onto the other (use NHD, VLLM_KV_CACHE_LAYOUT=LBNHC)"
        ));
    }
    if layout.pad_per_head != 0 {
        return Err(format!(
            "{both}: a padded block ({} bytes a head after it) is not smaller blocks back to \
             back, so one size does not map onto the other",
            layout.pad_per_head
        ));
    }
    Ok(())
}

/// Piece `i` of block `b` split in `r`, as a block of the smaller size; a slot nobody holds
/// stays so.
fn piece(b: u32, r: u64, i: u64, both: &str) -> Result<u32, String> {
    if b == NO_BLOCK {
        return Ok(NO_BLOCK);
    }
    u32::try_from(u64::from(b) * r + i)
        .ok()
        .filter(|&x| x != NO_BLOCK)
        .ok_or_else(|| format!("{both}: block {b} is out of range"))
}

/// A push producer's side of [`resize`]: its own cache `own` and `blocks` of a `tokens`-token
/// request (in token order, from the first) read as blocks of `small` tokens, the size a push
/// consumer of another block size asked to be written in. The view and its blocks up to the
/// request's last token. Why, where `small` is not `own`'s size divided by a power of two (up
/// to [`MAX_RATIO`]) or the geometry cannot map. A consumer's request is sized by the
/// producer's own list: at most `MAX_RATIO` pieces a block.
pub fn split(
    own: &KvLayout,
    small: u64,
    tokens: u64,
    blocks: &[u32],
) -> Result<(KvLayout, Vec<u32>), String> {
    let bt = own.block_tokens;
    let both = format!("{bt}-token blocks on the producer, {small}-token blocks asked for");
    let r = match bt.checked_div(small) {
        Some(r) if r * small == bt && r.is_power_of_two() && r <= MAX_RATIO => r,
        _ => {
            return Err(format!(
                "{both}: the asked size must be this one divided by a power of two up to \
                 {MAX_RATIO}"
            ))
        }
    };
    mappable(own, &both)?;
    let total = tokens.div_ceil(small);
    if (blocks.len() as u64).saturating_mul(r) < total {
        return Err(format!(
            "{both}: {} blocks published for a request of {tokens} tokens",
            blocks.len()
        ));
    }
    let mut out = Vec::with_capacity(total as usize);
    for s in 0..total {
        out.push(piece(blocks[(s / r) as usize], r, s % r, &both)?);
    }
    Ok((smaller(own, small, r, &both)?, out))
}

/// `layout` read as blocks of `small` tokens: `r` times the blocks, over the same memory.
fn smaller(layout: &KvLayout, small: u64, r: u64, both: &str) -> Result<KvLayout, String> {
    Ok(KvLayout {
        block_tokens: small,
        num_blocks: layout
            .num_blocks
            .checked_mul(r)
            .ok_or_else(|| format!("{both}: the cache is too large"))?,
        ..layout.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{KvDtype, KvGeometry};
    use crate::types::RegionId;

    fn layout(bt: u64, nb: u64, order: KvOrder) -> KvLayout {
        let g = KvGeometry {
            name: "t".into(),
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
            dtype: KvDtype::Bf16,
        };
        KvLayout::contiguous(g, bt, nb, KvPacking::Fused, order, RegionId(0))
    }

    #[test]
    fn the_producers_block_size_is_found_from_its_hash() {
        let here = layout(32, 8, KvOrder::Nhd);
        for bt in [32, 16, 64, 4, 1024] {
            let theirs = layout(bt, 8, KvOrder::Nhd).compat_hash();
            assert_eq!(producer_block_tokens(&here, 2, theirs), Some(bt), "{bt}");
        }
        // Another ratio than a power of two, or another order: no size matches.
        let odd = layout(48, 8, KvOrder::Nhd).compat_hash();
        assert_eq!(producer_block_tokens(&here, 2, odd), None);
        let hnd = layout(16, 8, KvOrder::Hnd).compat_hash();
        assert_eq!(producer_block_tokens(&here, 2, hnd), None);
    }

    /// Byte for byte: every token of the request lands where the other side holds it.
    #[test]
    fn blocks_of_two_sizes_pair_token_for_token() {
        let n = NO_BLOCK;
        // 70 tokens: 16-token producer blocks [3, 9, 4, 7, 5]; the consumer (32-token blocks)
        // caches its first block and loads the other two into [6, 2].
        let here = layout(32, 8, KvOrder::Nhd);
        let r = resize(&here, 16, 70, &[6, 2], &[3, 9, 4, 7, 5], 10).unwrap();
        assert_eq!((r.local.block_tokens, r.local.num_blocks), (16, 16));
        assert_eq!(r.local_blocks, [12, 13, 4]); // 5 was past token 70
        assert_eq!(r.remote_blocks, [4, 7, 5]);
        assert_eq!((r.remote_num_blocks, r.remote_cached), (10, 2));
        // The reverse: 32-token producer blocks [1, 5, 3], 16-token consumer blocks, the first
        // two cached.
        let here = layout(16, 8, KvOrder::Nhd);
        let r = resize(&here, 32, 70, &[7, 0, 4], &[1, 5, 3], 6).unwrap();
        assert_eq!(r.local_blocks, [7, 0, 4]);
        assert_eq!(r.remote_blocks, [10, 11, 6]);
        assert_eq!((r.local.block_tokens, r.remote_num_blocks), (16, 12));
        assert_eq!(r.remote_cached, 2);
        // Slots nobody holds stay so.
        let r = resize(&here, 32, 64, &[n, 7, 8], &[n, 5], 6).unwrap();
        assert_eq!((r.remote_blocks, r.remote_cached), (vec![n, 10, 11], 0));
        // A handoff naming more tokens than its blocks hold is refused, and a huge count makes
        // nothing large: the work is sized by the consumer's own list.
        let e = resize(&here, 32, 1 << 40, &[7, 8], &[1, 2], 6).unwrap_err();
        assert!(e.contains("2 blocks published for a request of"), "{e}");
        // The token-level check: in the smaller size, token t is block t / 16 of both lists'
        // (aligned at the end) on both sides. Checked through the descriptors of a whole request.
        let big = layout(32, 4, KvOrder::Nhd);
        let small = layout(16, 8, KvOrder::Nhd);
        let r = resize(&big, 16, 64, &[1, 3], &[0, 2, 4, 6], 8).unwrap();
        assert_eq!(r.remote_blocks, [0, 2, 4, 6]);
        let mine = r.local.descs(&r.local_blocks, 0..2, 0..2).unwrap();
        let theirs = small.descs(&r.remote_blocks, 0..2, 0..2).unwrap();
        let tok = big.block_bytes() / 32;
        for (a, b) in mine.iter().zip(&theirs) {
            assert_eq!(a.len, b.len);
            // Local block 1's first 16 tokens are remote block 0's, its last 16 block 2's.
            let local_tok = (a.offset % big.tensor_bytes()) / tok;
            let remote_tok = (b.offset % small.tensor_bytes()) / tok;
            let local_block = local_tok / 32;
            let remote_block = remote_tok / 16;
            let pos = |block: u64, size: u64, list: &[u64]| {
                list.iter()
                    .position(|&x| x == block)
                    .map(|i| i as u64 * size)
            };
            let lt = pos(local_block, 32, &[1, 3]).unwrap() + local_tok % 32;
            let rt = pos(remote_block, 16, &[0, 2, 4, 6]).unwrap() + remote_tok % 16;
            assert_eq!(lt, rt, "{a:?} {b:?}");
        }
    }

    /// The producer's split of its own blocks pairs, from the end, with the pieces
    /// [`resize`] reads on the consumer's side of the same request.
    #[test]
    fn a_push_producer_splits_its_blocks_as_the_consumer_reads_them() {
        let n = NO_BLOCK;
        let theirs = layout(32, 6, KvOrder::Nhd);
        let here = layout(16, 8, KvOrder::Nhd);
        let r = resize(&here, 32, 70, &[7, 0, 4], &[1, 5, 3], 6).unwrap();
        let (view, pieces) = split(&theirs, 16, 70, &[1, 5, 3]).unwrap();
        assert_eq!(pieces, [2, 3, 10, 11, 6]); // 7 was past token 70
        assert_eq!(
            &pieces[pieces.len() - r.remote_blocks.len()..],
            r.remote_blocks
        );
        assert_eq!(
            (view.block_tokens, view.num_blocks),
            (16, r.remote_num_blocks)
        );
        assert_eq!(view.block_bytes() * 2, theirs.block_bytes());
        // Its own size: the blocks the request spans, unchanged; holes stay holes.
        let (_, same) = split(&theirs, 32, 70, &[1, 5, 3, 9]).unwrap();
        assert_eq!(same, [1, 5, 3]);
        let (_, holes) = split(&theirs, 8, 64, &[n, 2]).unwrap();
        assert_eq!(holes, [n, n, n, n, 8, 9, 10, 11]);
        // Sizes that are not this one divided by a power of two up to 64, a consumer's count
        // larger than the list, and HND: refused, naming both sizes.
        for small in [0, 12, 64, 33] {
            let e = split(&theirs, small, 64, &[1, 2]).unwrap_err();
            assert!(e.contains("divided by a power of two"), "{small}: {e}");
        }
        let big = layout(1 << 10, 6, KvOrder::Nhd);
        let e = split(&big, 8, 1 << 10, &[1]).unwrap_err();
        assert!(e.contains("up to 64"), "{e}");
        let e = split(&theirs, 16, 1 << 40, &[1, 2]).unwrap_err();
        assert!(e.contains("2 blocks published for a request of"), "{e}");
        let e = split(&layout(32, 6, KvOrder::Hnd), 16, 64, &[1, 2]).unwrap_err();
        assert!(
            e.contains("32-token blocks on the producer, 16-token blocks asked for")
                && e.contains("HND"),
            "{e}"
        );
    }

    #[test]
    fn geometries_that_cannot_map_are_refused_naming_both_sizes() {
        let hnd = layout(32, 8, KvOrder::Hnd);
        let e = resize(&hnd, 16, 64, &[1, 2], &[1, 2, 3, 4], 8).unwrap_err();
        assert!(
            e.contains("16-token blocks on the producer, 32-token blocks here"),
            "{e}"
        );
        assert!(e.contains("HND"), "{e}");
        let mut padded = layout(32, 8, KvOrder::Nhd);
        padded.pad_per_head = 64;
        let e = resize(&padded, 16, 64, &[1, 2], &[1, 2, 3, 4], 8).unwrap_err();
        assert!(e.contains("a padded block (64 bytes a head"), "{e}");
        let nhd = layout(32, 8, KvOrder::Nhd);
        let e = resize(&nhd, 48, 64, &[1], &[1, 2], 8).unwrap_err();
        assert!(e.contains("one size must divide the other"), "{e}");
        let e = resize(&nhd, 16, 64, &[1, 2, 3], &[1, 2, 3, 4], 8).unwrap_err();
        assert!(
            e.contains("3 local blocks for a request of 64 tokens"),
            "{e}"
        );
    }
}
