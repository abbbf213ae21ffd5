//! Tensor parallelism: the plan of which producer ranks a decode rank loads from, and a load
//! with heads and a declared reader count.

use kvxfer_core::connector::{tp_plan, Handoff, HeadMap, LoadSpec, TpSide};

use crate::error::{fail, guard};
use crate::ffi::{handle, null, try_slice};
use crate::{kvx_consumer, kvx_status};

/// One producer rank a decode rank loads from (an entry of `kvx_tp_plan`), and how: the
/// producer rank's heads `[remote_heads_start, remote_heads_end)` go into the decode rank's
/// heads `[local_heads_start, local_heads_end)`; both ranges empty: nothing moves, the decode
/// rank only acknowledges (start the load with no local blocks). `readers`: decode ranks
/// loading from this producer rank, declared to it so it frees the blocks after the last.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvx_tp_read {
    /// The producer rank.
    pub producer_rank: u32,
    /// Decode ranks loading from it.
    pub readers: u32,
    /// First of the producer rank's heads read.
    pub remote_heads_start: u64,
    /// Past the last.
    pub remote_heads_end: u64,
    /// First of this rank's heads written.
    pub local_heads_start: u64,
    /// Past the last.
    pub local_heads_end: u64,
}

impl kvx_tp_read {
    pub(crate) fn spec(&self) -> LoadSpec {
        LoadSpec {
            // Empty ranges: nothing moves (only with no local blocks).
            heads: Some(HeadMap {
                remote: self.remote_heads_start..self.remote_heads_end,
                local: self.local_heads_start..self.local_heads_end,
            }),
            readers: (self.readers > 0).then_some(self.readers),
        }
    }
}

/// What decode rank `decode_rank` of a TP `decode_tp` deployment loads from the ranks of a TP
/// `prefill_tp` one, both over a model of `kv_heads` KV heads in all (each side gives its own
/// count: different counts are refused). Heads split over ranks as vLLM splits them (per rank
/// `kv_heads / tp`, or one head replicated on `tp / kv_heads` ranks). Writes the entries, in
/// producer rank order, to `out` and their count to `*n`; `KVX_BUFFER_TOO_SMALL` with the count
/// in `*n` when `cap` is less (never more than the prefill TP entries); `KVX_INVALID_ARGUMENT`
/// naming both sides' shapes when the heads do not split or a side is beyond `KVX_MAX_TP` or
/// `KVX_MAX_KV_HEADS` (checked before anything is sized from the shape).
///
/// # Safety
/// `out` NULL or valid for `cap` entries; `n` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_tp_plan(
    prefill_tp: u32,
    prefill_kv_heads: u32,
    decode_tp: u32,
    decode_kv_heads: u32,
    decode_rank: u32,
    out: *mut kvx_tp_read,
    cap: usize,
    n: *mut usize,
) -> kvx_status {
    guard("kvx_tp_plan", || {
        if n.is_null() {
            return Err(null("n"));
        }
        let reads = tp_plan(
            TpSide::new(u64::from(prefill_tp), u64::from(prefill_kv_heads)),
            TpSide::new(u64::from(decode_tp), u64::from(decode_kv_heads)),
            u64::from(decode_rank),
        )?;
        // SAFETY: n non-NULL, valid per the contract.
        unsafe { *n = reads.len() };
        if reads.len() > cap || out.is_null() {
            return Err(fail(
                kvx_status::KVX_BUFFER_TOO_SMALL,
                format!("{} entries, room for {cap}", reads.len()),
            ));
        }
        for (i, r) in reads.iter().enumerate() {
            let (remote, local) = r
                .heads
                .as_ref()
                .map_or((0..0, 0..0), |m| (m.remote.clone(), m.local.clone()));
            let e = kvx_tp_read {
                producer_rank: u32::try_from(r.producer_rank).unwrap_or(u32::MAX),
                readers: u32::try_from(r.readers).unwrap_or(u32::MAX),
                remote_heads_start: remote.start,
                remote_heads_end: remote.end,
                local_heads_start: local.start,
                local_heads_end: local.end,
            };
            // SAFETY: i < reads.len() <= cap; out non-NULL and valid for cap entries.
            unsafe { *out.add(i) = e };
        }
        Ok(())
    })
}

/// `kvx_consumer_start_load` with the heads and declared readers of a `kvx_tp_plan` entry
/// (`read` NULL: as `kvx_consumer_start_load`). Head slices need pull mode.
///
/// # Safety
/// `c` live; `handoff` valid for `len`; `local_blocks` valid for `n`; `read` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_start_load_with(
    c: *const kvx_consumer,
    handoff: *const u8,
    len: usize,
    local_blocks: *const u32,
    n: usize,
    read: *const kvx_tp_read,
) -> kvx_status {
    guard("kvx_consumer_start_load_with", || {
        let c = handle(c, "consumer")?;
        let h = Handoff::decode(try_slice!(handoff, len, "handoff"))?;
        let b = try_slice!(local_blocks, n, "local_blocks");
        // SAFETY: NULL or valid per the contract.
        let spec = unsafe { read.as_ref() }
            .map(kvx_tp_read::spec)
            .unwrap_or_default();
        c.inner.start_load_with(&h, b, &spec)?;
        Ok(())
    })
}
