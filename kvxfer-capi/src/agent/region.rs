//! Registered memory and prepared descriptor lists.

use std::ffi::{c_char, c_void};

use kvxfer_core::{Desc, HostBuffer, MemKind, RegionId, Share};

use crate::error::{guard, Fail};
use crate::ffi::{free_handle, handle, new_handle, null, try_cstr, try_slice};
use crate::{kvx_agent, kvx_desc, kvx_local_list, kvx_region, kvx_remote_list, kvx_status};

/// Registers `len` bytes at `ptr`: host memory (`cuda_device` < 0) or CUDA device memory
/// (needs a CUDA build). The memory must stay valid until `kvx_agent_deregister` succeeds or
/// the agent is freed.
///
/// # Safety
/// `a` live; `[ptr, ptr+len)` valid memory of that kind for the stated lifetime; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_register(
    a: *const kvx_agent,
    ptr: *mut c_void,
    len: usize,
    cuda_device: i32,
    out: *mut *mut kvx_region,
) -> kvx_status {
    guard("kvx_agent_register", || {
        let a = handle(a, "agent")?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the caller guarantees validity and lifetime (this function's contract).
        let r = unsafe { a.inner.register_raw(ptr.cast(), len, mem_kind(cuda_device)) }?;
        // SAFETY: out non-NULL, valid.
        unsafe { *out = new_handle(kvx_region { inner: r }) };
        Ok(())
    })
}

/// As `kvx_agent_register`, but the region is shared with the `n_peers` peers named in `peers`
/// only, as `kvx_agent_alloc_shared` says. An engine's KV cache registered with no peer
/// (`n_peers` 0) and then used by a connector opens only through the connector's grants, on
/// every path: it moves only on the TCP lane, in-host too (device memory, `cuda_device` >= 0,
/// staged through pinned chunks at both ends: it is not exported on the device lane).
///
/// # Safety
/// `a` live; `[ptr, ptr+len)` valid memory of the kind `cuda_device` names for the lifetime
/// `kvx_agent_register` states;
/// `peers` valid for `n_peers` NUL-terminated strings (NULL when `n_peers` is 0); `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_register_shared(
    a: *const kvx_agent,
    ptr: *mut c_void,
    len: usize,
    cuda_device: i32,
    peers: *const *const c_char,
    n_peers: usize,
    out: *mut *mut kvx_region,
) -> kvx_status {
    guard("kvx_agent_register_shared", || {
        let a = handle(a, "agent")?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: as this function's contract says of `peers`.
        let names = unsafe { peer_names(peers, n_peers) }?;
        // SAFETY: the caller guarantees validity and lifetime (this function's contract).
        let r = unsafe {
            a.inner
                .register_raw_shared(ptr.cast(), len, mem_kind(cuda_device), Share::Only(names))
        }?;
        // SAFETY: out non-NULL, valid.
        unsafe { *out = new_handle(kvx_region { inner: r }) };
        Ok(())
    })
}

/// Host memory for a negative `cuda_device`, else that CUDA device's.
fn mem_kind(cuda_device: i32) -> MemKind {
    match u32::try_from(cuda_device) {
        Ok(d) => MemKind::Cuda(d),
        Err(_) => MemKind::Host,
    }
}

/// The names of a `peers`, `n_peers` argument, each checked.
///
/// # Safety
/// `peers` is NULL with `n_peers` 0, or valid for `n_peers` pointers, each NULL or a
/// NUL-terminated string, for the call.
unsafe fn peer_names(peers: *const *const c_char, n_peers: usize) -> Result<Vec<String>, Fail> {
    let ptrs = try_slice!(peers, n_peers, "peers");
    let mut names = Vec::with_capacity(ptrs.len());
    for (i, &p) in ptrs.iter().enumerate() {
        names.push(try_cstr!(p, &format!("peers[{i}]")).to_string());
    }
    Ok(names)
}

/// As `kvx_agent_alloc`, but the region is shared with the `n_peers` peers named in `peers`
/// only (none: with no peer; the agent's own transfers still use it). It is published with no
/// UCX key, no shared-memory handle and no address, and moves only on kvxfer's TCP lane, whose
/// target refuses every other peer (`KVX_LANE_FAILED`, "is not among the peers region N is
/// shared with"). Naming peers needs a secret and the lanes (else `KVX_INVALID_ARGUMENT`).
///
/// # Safety
/// `a` live; `peers` valid for `n_peers` NUL-terminated strings (NULL when `n_peers` is 0);
/// `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_alloc_shared(
    a: *const kvx_agent,
    len: usize,
    peers: *const *const c_char,
    n_peers: usize,
    out: *mut *mut kvx_region,
) -> kvx_status {
    guard("kvx_agent_alloc_shared", || {
        let a = handle(a, "agent")?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: as this function's contract says of `peers`.
        let names = unsafe { peer_names(peers, n_peers) }?;
        let r = a
            .inner
            .register_shared(HostBuffer::new(len)?, Share::Only(names))?;
        // SAFETY: out non-NULL, valid.
        unsafe { *out = new_handle(kvx_region { inner: r }) };
        Ok(())
    })
}

/// Allocates `len` zeroed, page-aligned bytes of host memory owned by kvxfer (memfd-backed,
/// so a same-host peer maps it for the shared-memory lane) and registers it. The memory lives
/// until the region is deregistered and freed; `kvx_region_ptr` gives its address.
///
/// # Safety
/// `a` live; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_alloc(
    a: *const kvx_agent,
    len: usize,
    out: *mut *mut kvx_region,
) -> kvx_status {
    guard("kvx_agent_alloc", || {
        let a = handle(a, "agent")?;
        if out.is_null() {
            return Err(null("out"));
        }
        let r = a.inner.register(HostBuffer::new(len)?)?;
        // SAFETY: out non-NULL, valid.
        unsafe { *out = new_handle(kvx_region { inner: r }) };
        Ok(())
    })
}

/// Deregisters a region; `KVX_BUSY` while a transfer uses it. The handle stays to be freed.
///
/// # Safety
/// `a` and `r` live.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_deregister(
    a: *const kvx_agent,
    r: *const kvx_region,
) -> kvx_status {
    guard("kvx_agent_deregister", || {
        let a = handle(a, "agent")?;
        let r = handle(r, "region")?;
        a.inner.deregister(&r.inner)?;
        Ok(())
    })
}

/// The region's id, as descriptors name it (`UINT32_MAX` for NULL or a handle not live).
///
/// # Safety
/// `r` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvx_region_id(r: *const kvx_region) -> u32 {
    handle(r, "region").map_or(u32::MAX, |r| r.inner.id().0)
}

/// The region's base address (NULL for NULL or a handle not live).
///
/// # Safety
/// `r` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn kvx_region_ptr(r: *const kvx_region) -> *mut c_void {
    handle(r, "region").map_or(std::ptr::null_mut(), |r| r.inner.addr() as *mut c_void)
}

/// Frees a region handle (NULL ignored). Owned memory is released once it is deregistered (or
/// the agent is gone) and no transfer uses it.
///
/// # Safety
/// `r` NULL or from this library, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kvx_region_free(r: *mut kvx_region) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(r, "kvx_region_free") }
}

fn descs(d: &[kvx_desc]) -> Vec<Desc> {
    d.iter()
        .map(|d| Desc::new(RegionId(d.region), d.offset, d.len))
        .collect()
}

/// Resolves local descriptors once.
///
/// # Safety
/// `a` live; `d` valid for `n` elements; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_prep_local(
    a: *const kvx_agent,
    d: *const kvx_desc,
    n: usize,
    out: *mut *mut kvx_local_list,
) -> kvx_status {
    guard("kvx_agent_prep_local", || {
        let a = handle(a, "agent")?;
        let d = try_slice!(d, n, "descs");
        if out.is_null() {
            return Err(null("out"));
        }
        let l = a.inner.prep_local(&descs(d))?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_local_list { inner: l }) };
        Ok(())
    })
}

/// Resolves a peer's descriptors once, checked against its region table.
///
/// # Safety
/// `a` live; `peer` NUL-terminated; `d` valid for `n` elements; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_agent_prep_remote(
    a: *const kvx_agent,
    peer: *const c_char,
    d: *const kvx_desc,
    n: usize,
    out: *mut *mut kvx_remote_list,
) -> kvx_status {
    guard("kvx_agent_prep_remote", || {
        let a = handle(a, "agent")?;
        let peer = try_cstr!(peer, "peer");
        let d = try_slice!(d, n, "descs");
        if out.is_null() {
            return Err(null("out"));
        }
        let l = a.inner.prep_remote(peer, &descs(d))?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_remote_list { inner: l }) };
        Ok(())
    })
}

/// Frees a local list (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_local_list_free(l: *mut kvx_local_list) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(l, "kvx_local_list_free") }
}

/// Frees a remote list (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_remote_list_free(l: *mut kvx_remote_list) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(l, "kvx_remote_list_free") }
}
