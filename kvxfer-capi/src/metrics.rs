//! Telemetry as Prometheus text, and the per-peer device-memory path.

use std::ffi::c_char;

use crate::error::{fail, guard};
use crate::ffi::{handle, null, put_str, try_cstr};
use crate::{kvx_agent, kvx_consumer, kvx_gpu_path, kvx_producer, kvx_status};

/// Prometheus text of the consumer's (or producer's, with `kvx_producer_metrics`) telemetry.
///
/// # Safety
/// `c` live; `buf` valid for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_metrics(
    c: *const kvx_consumer,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_consumer_metrics", || {
        let c = handle(c, "consumer")?;
        let t = c.inner.telemetry().prometheus();
        // SAFETY: as above.
        unsafe { put_str(&t, buf, cap, out_len) }
    })
}

/// How device memory moves between `a` and the peer named `peer` (after their metadata was
/// exchanged).
///
/// # Safety
/// `a` live; `peer` NUL-terminated; `out` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_peer_gpu_path(
    a: *const kvx_agent,
    peer: *const c_char,
    out: *mut kvx_gpu_path,
) -> kvx_status {
    guard("kvx_agent_peer_gpu_path", || {
        let a = handle(a, "agent")?;
        let peer = try_cstr!(peer, "peer");
        if out.is_null() {
            return Err(null("out"));
        }
        let p = match a.inner.peer_info(peer)?.gpu_path {
            None => kvx_gpu_path::KVX_GPU_NONE,
            Some(kvxfer_core::GpuPath::Staged) => kvx_gpu_path::KVX_GPU_STAGED,
            Some(_) => kvx_gpu_path::KVX_GPU_DIRECT,
        };
        // SAFETY: out non-NULL, valid per the contract.
        unsafe { *out = p };
        Ok(())
    })
}

/// The regions of the peer named `peer`, as its metadata listed them: how a process learns
/// the other side's region ids. Writes up to `cap` ids to `ids` and their lengths in bytes to
/// `lens` (either may be NULL to skip it) and the count to `*n`; `KVX_BUFFER_TOO_SMALL` with
/// the count in `*n` when `cap` is less.
///
/// # Safety
/// `a` live; `peer` NUL-terminated; `ids` and `lens` NULL or valid for `cap`; `n` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_peer_regions(
    a: *const kvx_agent,
    peer: *const c_char,
    ids: *mut u32,
    lens: *mut u64,
    cap: usize,
    n: *mut usize,
) -> kvx_status {
    guard("kvx_agent_peer_regions", || {
        let a = handle(a, "agent")?;
        let peer = try_cstr!(peer, "peer");
        if n.is_null() {
            return Err(null("n"));
        }
        let regions = a.inner.peer_regions(peer)?;
        // SAFETY: n non-NULL, valid per the contract.
        unsafe { *n = regions.len() };
        if regions.len() > cap {
            return Err(fail(
                kvx_status::KVX_BUFFER_TOO_SMALL,
                format!("{} regions, room for {cap}", regions.len()),
            ));
        }
        for (i, r) in regions.iter().enumerate() {
            // SAFETY: i < regions.len() <= cap; each pointer NULL or valid for cap entries.
            unsafe {
                if !ids.is_null() {
                    *ids.add(i) = r.id.0;
                }
                if !lens.is_null() {
                    *lens.add(i) = r.len;
                }
            }
        }
        Ok(())
    })
}

/// Prometheus text of the agent's memory: budget, device staging chunks, dropped
/// notifications.
///
/// # Safety
/// `a` live; `buf` valid for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_metrics(
    a: *const kvx_agent,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_metrics", || {
        let a = handle(a, "agent")?;
        let t = a.inner.prometheus();
        // SAFETY: as above.
        unsafe { put_str(&t, buf, cap, out_len) }
    })
}

/// Prometheus text of the producer's telemetry.
///
/// # Safety
/// `p` live; `buf` valid for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_metrics(
    p: *const kvx_producer,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_producer_metrics", || {
        let p = handle(p, "producer")?;
        let t = p.inner.telemetry().prometheus();
        // SAFETY: as above.
        unsafe { put_str(&t, buf, cap, out_len) }
    })
}
