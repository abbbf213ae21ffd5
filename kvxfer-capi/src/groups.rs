//! Caches of several groups (vLLM's KV cache groups under its hybrid allocator: a sliding
//! window beside full attention, a hybrid model's other layers): producers and consumers over
//! them, publishing and loading a request's blocks group by group. `KVX_NO_BLOCK` marks a slot
//! a group does not hold (a window's blocks before it); such a pair moves nothing.

use std::ffi::c_char;

use kvxfer_core::connector::{ConnectorConfig, Handoff, KvCaches, KvConnector};

use crate::connector::{caches_of, config_of};
use crate::error::{fail, guard, Fail};
use crate::ffi::{handle, new_handle, null, try_slice};
use crate::handoff::{grant_of, publish_groups};
use crate::tp::kvx_tp_read;
use crate::{
    kvx_cache_tensor, kvx_connector, kvx_connector_config, kvx_consumer, kvx_layout, kvx_producer,
    kvx_status, KVX_MAX_GROUPS,
};

/// `n` groups' block lists: `blocks[g]` valid for `counts[g]` entries.
///
/// # Safety
/// `blocks` and `counts` valid for `n` entries each, each list for its count.
unsafe fn lists<'a>(
    blocks: *const *const u32,
    counts: *const usize,
    n: usize,
) -> Result<Vec<&'a [u32]>, Fail> {
    if n == 0 || n > KVX_MAX_GROUPS as usize {
        return Err(fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            format!("{n} groups: 1 to {KVX_MAX_GROUPS}"),
        ));
    }
    let ptrs = try_slice!(blocks, n, "blocks");
    let counts = try_slice!(counts, n, "counts");
    let mut out = Vec::with_capacity(n);
    for (&p, &c) in ptrs.iter().zip(counts) {
        out.push(try_slice!(p, c, "a group's blocks"));
    }
    Ok(out)
}

/// The caches of `n` groups: `layouts[g]` with `tensors[g]` (valid for its layers).
///
/// # Safety
/// As [`kvx_connector_producer_groups`].
unsafe fn groups_of(
    layouts: *const kvx_layout,
    tensors: *const *const kvx_cache_tensor,
    n: usize,
    cuda_device: i32,
) -> Result<Vec<KvCaches>, Fail> {
    if n == 0 || n > KVX_MAX_GROUPS as usize {
        return Err(fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            format!("{n} groups: 1 to {KVX_MAX_GROUPS}"),
        ));
    }
    let ls = try_slice!(layouts, n, "layouts");
    let ts = try_slice!(tensors, n, "tensors");
    let mut out = Vec::with_capacity(n);
    for (g, (l, &t)) in ls.iter().zip(ts).enumerate() {
        let t = try_slice!(t, l.layers as usize, "a group's tensors");
        // SAFETY: the tensors' memory per this function's contract.
        let caches = unsafe { caches_of(l, t, cuda_device) }
            .map_err(|Fail(s, w)| Fail(s, format!("group {g}: {w}")))?;
        out.push(caches);
    }
    Ok(out)
}

/// A producer over caches of `n` groups: group `g` is `layouts[g]` with `tensors[g]` (one
/// per layer, as `kvx_connector_producer` takes them). Layers are numbered across groups,
/// group 0's first (`kvx_producer_layer_done`, `kvx_consumer_wait_layer`).
///
/// # Safety
/// `c` live; `layouts` and `tensors` valid for `n` entries, `tensors[g]` for
/// `layouts[g].layers`; the memory as `kvx_connector_producer` says; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_connector_producer_groups(
    c: *const kvx_connector,
    layouts: *const kvx_layout,
    tensors: *const *const kvx_cache_tensor,
    n: usize,
    cuda_device: i32,
    cfg: *const kvx_connector_config,
    out: *mut *mut kvx_producer,
) -> kvx_status {
    let what = (layouts, tensors, n, cuda_device, cfg);
    // SAFETY: per this function's contract, which `side_of_groups` states.
    unsafe {
        side_of_groups(
            "kvx_connector_producer_groups",
            c,
            what,
            out,
            |k, g, cfg| Ok(kvx_producer::new(k.producer_groups(g, cfg)?)),
        )
    }
}

/// As `kvx_connector_producer_groups`, for the decode side.
///
/// # Safety
/// As `kvx_connector_producer_groups`, until the consumer is freed.
#[no_mangle]
pub unsafe extern "C" fn kvx_connector_consumer_groups(
    c: *const kvx_connector,
    layouts: *const kvx_layout,
    tensors: *const *const kvx_cache_tensor,
    n: usize,
    cuda_device: i32,
    cfg: *const kvx_connector_config,
    out: *mut *mut kvx_consumer,
) -> kvx_status {
    let what = (layouts, tensors, n, cuda_device, cfg);
    // SAFETY: per this function's contract, which `side_of_groups` states.
    unsafe {
        side_of_groups(
            "kvx_connector_consumer_groups",
            c,
            what,
            out,
            |k, g, cfg| Ok(kvx_consumer::new(k.consumer_groups(g, cfg)?)),
        )
    }
}

/// What both `_groups` constructors take: layouts, tensors, groups, CUDA device, config.
type GroupsArgs = (
    *const kvx_layout,
    *const *const kvx_cache_tensor,
    usize,
    i32,
    *const kvx_connector_config,
);

/// The body of both: the caches of every group, the config, and `make` over them.
///
/// # Safety
/// As [`kvx_connector_producer_groups`].
unsafe fn side_of_groups<T: crate::ffi::Kind>(
    name: &str,
    c: *const kvx_connector,
    (layouts, tensors, n, cuda_device, cfg): GroupsArgs,
    out: *mut *mut T,
    make: impl FnOnce(&dyn KvConnector, &[KvCaches], &ConnectorConfig) -> Result<T, Fail>,
) -> kvx_status {
    guard(name, || {
        let c = handle(c, "connector")?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: per this function's contract.
        let groups = unsafe { groups_of(layouts, tensors, n, cuda_device) }?;
        // SAFETY: cfg NULL or valid.
        let cfg = config_of(unsafe { cfg.as_ref() })?;
        let side = make(&*c.inner, &groups, &cfg)?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(side) };
        Ok(())
    })
}

/// `kvx_producer_publish` for a cache of `n` groups: `blocks[g]` (`counts[g]` entries,
/// `KVX_NO_BLOCK` where the group holds none) are group `g`'s. Under `grant` (16 bytes), or
/// a fresh one when `grant` is NULL.
///
/// # Safety
/// `p` live; `request` NUL-terminated; `grant` NULL or valid for `grant_len`; `blocks` and
/// `counts` valid for `n`, each list for its count; `buf` for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_publish_groups(
    p: *const kvx_producer,
    request: *const c_char,
    grant: *const u8,
    grant_len: usize,
    blocks: *const *const u32,
    counts: *const usize,
    n: usize,
    tokens: u64,
    layers_done: u32,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_producer_publish_groups", || {
        let grant = if grant.is_null() {
            None
        } else {
            // SAFETY: valid for `grant_len` per the contract.
            Some(unsafe { grant_of(grant, grant_len) }?)
        };
        // SAFETY: per this function's contract.
        let b = unsafe { lists(blocks, counts, n) }?;
        // SAFETY: as above.
        unsafe {
            publish_groups(
                p,
                request,
                grant,
                &b,
                tokens,
                layers_done,
                buf,
                cap,
                out_len,
            )
        }
    })
}

/// `kvx_consumer_start_load_with` for a cache of `n` groups: `blocks[g]` (`counts[g]`
/// entries) into group `g`, paired with the last of the handoff's group `g` (each group its
/// own cached prefix; a pair with `KVX_NO_BLOCK` moves nothing). `read` NULL: every head.
///
/// # Safety
/// `c` live; `handoff` valid for `len`; `blocks` and `counts` valid for `n`, each list for its
/// count; `read` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_start_load_groups(
    c: *const kvx_consumer,
    handoff: *const u8,
    len: usize,
    blocks: *const *const u32,
    counts: *const usize,
    n: usize,
    read: *const kvx_tp_read,
) -> kvx_status {
    guard("kvx_consumer_start_load_groups", || {
        let c = handle(c, "consumer")?;
        let h = Handoff::decode(try_slice!(handoff, len, "handoff"))?;
        // SAFETY: per this function's contract.
        let b = unsafe { lists(blocks, counts, n) }?;
        // SAFETY: NULL or valid per the contract.
        let spec = unsafe { read.as_ref() }
            .map(kvx_tp_read::spec)
            .unwrap_or_default();
        c.inner.start_load_groups(&h, &b, &spec)?;
        Ok(())
    })
}
