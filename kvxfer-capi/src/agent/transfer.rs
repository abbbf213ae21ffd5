//! Transfers (poll, wait, cancel) and notifications.

use std::ffi::c_char;
use std::time::Duration;

use kvxfer_core::{Error, XferOp, XferStats};

use crate::error::{fail, guard, status_of, Fail};
use crate::ffi::{free_handle, handle, handle_mut, ms, new_handle, null, try_cstr, try_slice};
use crate::{
    kvx_agent, kvx_local_list, kvx_op, kvx_remote_list, kvx_status, kvx_transfer, kvx_xfer_stats,
    KVX_MAX_NAME, KVX_MAX_NOTIFICATION,
};

/// Starts a transfer of the pairs `(local[li[k]], remote[ri[k]])`, k < n; `li` and `ri` NULL:
/// every pair of two lists of length n. `op` is a `kvx_op` (`KVX_READ`, `KVX_WRITE`); any
/// other value is `KVX_INVALID_ARGUMENT`, checked first. With a notification, the peer
/// receives it after the data. `deadline_ms` 0: none.
///
/// # Safety
/// Handles live; `li`/`ri` NULL or valid for `n`; `note` valid for `note_len`; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_transfer(
    a: *const kvx_agent,
    op: u32,
    local: *const kvx_local_list,
    li: *const usize,
    remote: *const kvx_remote_list,
    ri: *const usize,
    n: usize,
    note: *const u8,
    note_len: usize,
    deadline_ms: u64,
    out: *mut *mut kvx_transfer,
) -> kvx_status {
    guard("kvx_agent_transfer", || {
        // A C enum is any 32-bit value: checked, never transmuted.
        let op = match op {
            x if x == kvx_op::KVX_READ as u32 => XferOp::Read,
            x if x == kvx_op::KVX_WRITE as u32 => XferOp::Write,
            x => {
                return Err(fail(
                    kvx_status::KVX_INVALID_ARGUMENT,
                    format!("op {x}: KVX_READ (0) or KVX_WRITE (1)"),
                ))
            }
        };
        let a = handle(a, "agent")?;
        let local = handle(local, "local")?;
        let remote = handle(remote, "remote")?;
        if out.is_null() {
            return Err(null("out"));
        }
        let all: Vec<usize> = (0..n).collect();
        let li = if li.is_null() {
            all.clone()
        } else {
            try_slice!(li, n, "li").to_vec()
        };
        let ri = if ri.is_null() {
            all
        } else {
            try_slice!(ri, n, "ri").to_vec()
        };
        let note = if note.is_null() {
            None
        } else {
            Some(try_slice!(note, note_len, "note"))
        };
        let t = a.inner.transfer(
            op,
            &local.inner,
            &li,
            &remote.inner,
            &ri,
            note,
            ms(deadline_ms),
        )?;
        let h = kvx_transfer {
            inner: Some(t),
            result: None,
        };
        // SAFETY: out valid.
        unsafe { *out = new_handle(h) };
        Ok(())
    })
}

fn stats_c(s: &XferStats) -> kvx_xfer_stats {
    kvx_xfer_stats {
        bytes: s.bytes,
        descs: s.descs as u64,
        ops: s.ops as u64,
        post_ns: s.post_time.as_nanos() as u64,
        duration_ns: s.duration.as_nanos() as u64,
        lane: match s.lane {
            kvxfer_core::Lane::Ucx => 0,
            kvxfer_core::Lane::Shm => 1,
            kvxfer_core::Lane::Tcp => 2,
            kvxfer_core::Lane::Device => 3,
            // A lane this header does not name yet.
            _ => u32::MAX,
        },
    }
}

/// Takes the result if the transfer is done (waiting up to `timeout`).
fn settle(t: &mut kvx_transfer, timeout: Duration) -> Result<(), Fail> {
    if t.result.is_some() {
        return Ok(());
    }
    let Some(x) = t.inner.as_mut() else {
        return Err(fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            "transfer has no state",
        ));
    };
    match x.wait_timeout(timeout) {
        Err(Error::WaitTimeout(_)) => Err(fail(kvx_status::KVX_IN_PROGRESS, "in flight")),
        r => {
            t.result = Some(r.map_err(|e| (status_of(&e), e.to_string())));
            t.inner = None;
            Ok(())
        }
    }
}

fn report(t: &kvx_transfer, out: *mut kvx_xfer_stats) -> Result<(), Fail> {
    match &t.result {
        Some(Ok(s)) => {
            if !out.is_null() {
                // SAFETY: out non-NULL and valid per the callers' contracts.
                unsafe { *out = stats_c(s) };
            }
            Ok(())
        }
        Some(Err((st, m))) => Err(Fail(*st, m.clone())),
        None => Err(fail(kvx_status::KVX_IN_PROGRESS, "in flight")),
    }
}

/// Polls: `KVX_IN_PROGRESS` while in flight, else the transfer's final status (repeatable);
/// on `KVX_OK` writes `*stats` (may be NULL).
///
/// # Safety
/// `t` live; `stats` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_poll(
    t: *mut kvx_transfer,
    stats: *mut kvx_xfer_stats,
) -> kvx_status {
    guard("kvx_transfer_poll", || {
        let t = handle_mut(t, "transfer")?;
        match settle(t, Duration::ZERO) {
            Ok(()) => report(t, stats),
            Err(f) => Err(f),
        }
    })
}

/// Waits up to `timeout_ms` (0: forever); `KVX_TIMEOUT` leaves the transfer in flight.
///
/// # Safety
/// As `kvx_transfer_poll`.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_wait(
    t: *mut kvx_transfer,
    timeout_ms: u64,
    stats: *mut kvx_xfer_stats,
) -> kvx_status {
    guard("kvx_transfer_wait", || {
        let t = handle_mut(t, "transfer")?;
        let timeout = ms(timeout_ms).unwrap_or(Duration::from_secs(u32::MAX as u64));
        match settle(t, timeout) {
            Ok(()) => report(t, stats),
            Err(Fail(kvx_status::KVX_IN_PROGRESS, _)) => Err(fail(
                kvx_status::KVX_TIMEOUT,
                format!("not done within {timeout_ms} ms; still in flight"),
            )),
            Err(f) => Err(f),
        }
    })
}

/// Cancels: returns once nothing is in flight any more; the final status is `KVX_CANCELED`, or
/// the result if it completed first.
///
/// # Safety
/// `t` live.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_cancel(t: *mut kvx_transfer) -> kvx_status {
    guard("kvx_transfer_cancel", || {
        let t = handle_mut(t, "transfer")?;
        if let Some(x) = t.inner.take() {
            t.result = Some(x.cancel().map_err(|e| (status_of(&e), e.to_string())));
        }
        report(t, std::ptr::null_mut())
    })
}

/// Frees a transfer handle (NULL ignored). A transfer still in flight completes on its own;
/// the memory it uses stays pinned until then.
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_transfer_free(t: *mut kvx_transfer) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(t, "kvx_transfer_free") }
}

/// Sends a notification alone to `peer` (ordered after earlier completed transfers to it).
///
/// # Safety
/// `a` live; `peer` NUL-terminated; `note` valid for `len`.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_notify(
    a: *const kvx_agent,
    peer: *const c_char,
    note: *const u8,
    len: usize,
) -> kvx_status {
    guard("kvx_agent_notify", || {
        let a = handle(a, "agent")?;
        let peer = try_cstr!(peer, "peer");
        let note = try_slice!(note, len, "note");
        a.inner.notify(peer, note)?.wait()?;
        Ok(())
    })
}

/// Takes the next notification, waiting up to `timeout_ms` (0: do not wait); `KVX_NOT_FOUND`
/// if none. `from` must hold `KVX_MAX_NAME` + 1 bytes (written NUL-terminated), `payload`
/// `KVX_MAX_NOTIFICATION` bytes.
///
/// # Safety
/// `a` live; buffers valid for their capacities; length pointers valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_next_notification(
    a: *const kvx_agent,
    timeout_ms: u64,
    from: *mut c_char,
    from_cap: usize,
    payload: *mut u8,
    payload_cap: usize,
    payload_len: *mut usize,
) -> kvx_status {
    guard("kvx_agent_next_notification", || {
        let a = handle(a, "agent")?;
        if from.is_null() || payload_len.is_null() || (payload.is_null() && payload_cap > 0) {
            return Err(null("from, payload or payload_len"));
        }
        if from_cap < KVX_MAX_NAME + 1 || payload_cap < KVX_MAX_NOTIFICATION {
            return Err(fail(
                kvx_status::KVX_BUFFER_TOO_SMALL,
                format!(
                    "buffers must hold {} and {KVX_MAX_NOTIFICATION} bytes",
                    KVX_MAX_NAME + 1
                ),
            ));
        }
        let n = match ms(timeout_ms) {
            None => a.inner.try_notification(),
            Some(t) => a.inner.wait_notification(t).ok(),
        };
        let Some(n) = n else {
            return Err(fail(kvx_status::KVX_NOT_FOUND, "no notification"));
        };
        // SAFETY: capacities checked above against the largest name and payload.
        unsafe {
            std::ptr::copy_nonoverlapping(n.from.as_ptr(), from.cast::<u8>(), n.from.len());
            *from.add(n.from.len()) = 0;
            std::ptr::copy_nonoverlapping(n.payload.as_ptr(), payload, n.payload.len());
            *payload_len = n.payload.len();
        }
        Ok(())
    })
}
