//! The connector: KV layouts, producers, consumers.

use std::ffi::c_char;
use std::sync::Mutex;
use std::time::Duration;

use kvxfer_core::connector::{
    AgentConnector, CacheTensor, ConnectorConfig, Consumer, Handoff, InProcessConnector, KvCaches,
    KvConnector, KvConsumer, KvProducer, LayerTensors, Mode, Producer,
};
use kvxfer_core::layout::{
    KvDtype, KvGeometry, KvLayout, KvOrder, KvPacking, LayerBase, StatePart, StateShape,
};
use kvxfer_core::{MemKind, MemoryBudget, RegionId};

use crate::error::{fail, guard, set_error, Fail};
use crate::ffi::{
    cstr, free_handle, handle, ms, new_handle, null, plain, put_str, try_cstr, try_slice,
};
use crate::{
    kvx_agent, kvx_cache_tensor, kvx_connector, kvx_connector_config, kvx_consumer, kvx_layer_base,
    kvx_layout, kvx_producer, kvx_request_stats, kvx_status, KVX_MAX_STATE_PARTS,
    KVX_PACKING_FUSED, KVX_PACKING_LATENT, KVX_PACKING_SEPARATE, KVX_PACKING_STATE,
};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl kvx_producer {
    pub(crate) fn new(inner: Box<dyn KvProducer>) -> kvx_producer {
        kvx_producer {
            inner,
            pending: Mutex::new(None),
        }
    }
}

impl kvx_consumer {
    pub(crate) fn new(inner: Box<dyn KvConsumer>) -> kvx_consumer {
        kvx_consumer {
            inner,
            finished: Mutex::new(None),
            failed: Mutex::new(None),
        }
    }
}

fn layout_of(l: &kvx_layout, bases: &[kvx_layer_base]) -> Result<KvLayout, Fail> {
    let bad = |w: &str| fail(kvx_status::KVX_INVALID_ARGUMENT, format!("layout: {w}"));
    if l.layers as usize != bases.len() || l.layers == 0 {
        return Err(bad(
            "layers must be > 0 and equal the number of layer bases",
        ));
    }
    if l.kv_heads == 0 || l.head_dim == 0 || l.block_tokens == 0 || l.num_blocks == 0 {
        return Err(bad("zero heads, head_dim, block_tokens or num_blocks"));
    }
    let dtype = match l.dtype_bytes {
        1 => KvDtype::Fp8,
        2 => KvDtype::Bf16,
        4 => KvDtype::F32,
        _ => return Err(bad("dtype_bytes must be 1, 2 or 4")),
    };
    // Flags are 0 or 1: any other value is a caller's mistake, not a "true".
    let flag = |v: u32, name: &str| match v {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(bad(&format!("{name} is {v}, not 0 or 1"))),
    };
    let packing = match l.packing {
        KVX_PACKING_SEPARATE => KvPacking::Separate,
        KVX_PACKING_FUSED => KvPacking::Fused,
        KVX_PACKING_LATENT => KvPacking::Latent,
        KVX_PACKING_STATE => KvPacking::State,
        v => {
            return Err(bad(&format!(
                "packing is {v}: 0 (separate), 1 (fused), 2 (latent) or 3 (state)"
            )))
        }
    };
    let state = (packing == KvPacking::State)
        .then(|| {
            if l.block_tokens != 1 || l.hnd != 0 {
                return Err(bad("a state layout has block_tokens 1 and hnd 0"));
            }
            if l.state_parts.is_null() {
                // One part of one segment: `kv_heads` units of `head_dim` elements.
                return Ok(StateShape {
                    parts: vec![StatePart {
                        rows: 1,
                        per_unit: vec![u64::from(l.head_dim)],
                        channel_bytes: u64::from(l.dtype_bytes),
                    }],
                    padding: l.state_padding,
                });
            }
            state_parts(l).map_err(|w| bad(&w))
        })
        .transpose()?;
    if packing != KvPacking::State && !l.state_parts.is_null() {
        return Err(bad(
            "state parts given for a layout that is not KVX_PACKING_STATE",
        ));
    }
    let separate = packing == KvPacking::Separate;
    let hnd = flag(l.hnd, "hnd")?;
    let layers = bases
        .iter()
        .map(|b| {
            let v = (b.v_region != u32::MAX).then_some((RegionId(b.v_region), b.v_offset));
            if separate != v.is_some() {
                return Err(bad(
                    "a fused or latent layout has no V bases, a separate one needs them",
                ));
            }
            Ok(LayerBase {
                k: (RegionId(b.k_region), b.k_offset),
                v,
            })
        })
        .collect::<Result<Vec<_>, Fail>>()?;
    let layout = KvLayout {
        geometry: KvGeometry {
            name: "c".into(),
            layers: u64::from(l.layers),
            kv_heads: u64::from(l.kv_heads),
            head_dim: u64::from(l.head_dim),
            dtype,
        },
        block_tokens: u64::from(l.block_tokens),
        num_blocks: l.num_blocks,
        packing,
        order: if hnd { KvOrder::Hnd } else { KvOrder::Nhd },
        layers,
        state,
        pad_per_head: l.pad_per_head,
    };
    layout.check_packing().map_err(|e| match e {
        kvxfer_core::Error::InvalidArgument(w) => bad(&w),
        e => bad(&e.to_string()),
    })?;
    Ok(layout)
}

/// The state page `l.state_parts` describes; why not, where a count is out of its bounds.
fn state_parts(l: &kvx_layout) -> Result<StateShape, String> {
    let max = KVX_MAX_STATE_PARTS;
    if l.state_parts_len == 0 || l.state_parts_len > max {
        return Err(format!("{} state parts: 1 to {max}", l.state_parts_len));
    }
    // SAFETY: per the layout's contract, `state_parts` is valid for `state_parts_len`
    // entries, checked to be at most KVX_MAX_STATE_PARTS.
    let parts = unsafe { std::slice::from_raw_parts(l.state_parts, l.state_parts_len as usize) };
    let mut out = Vec::with_capacity(parts.len());
    for (i, p) in parts.iter().enumerate() {
        if p.segments == 0 || p.segments > max || p.per_unit.is_null() {
            return Err(format!(
                "state part {i}: {} segments: 1 to {max}, and per_unit not NULL",
                p.segments
            ));
        }
        // SAFETY: per the part's contract, `per_unit` is valid for `segments` entries,
        // checked to be at most KVX_MAX_STATE_PARTS.
        let per_unit = unsafe { std::slice::from_raw_parts(p.per_unit, p.segments as usize) };
        out.push(StatePart {
            rows: u64::from(p.rows),
            per_unit: per_unit.to_vec(),
            channel_bytes: p.channel_bytes,
        });
    }
    Ok(StateShape {
        parts: out,
        padding: l.state_padding,
    })
}

pub(crate) fn config_of(c: Option<&kvx_connector_config>) -> Result<ConnectorConfig, Fail> {
    let mut cfg = ConnectorConfig::default();
    if let Some(c) = c {
        cfg.mode = match c.mode {
            0 => Mode::Pull,
            1 => Mode::Push,
            m => {
                return Err(fail(
                    kvx_status::KVX_INVALID_ARGUMENT,
                    format!("config: mode {m}: 0 (pull) or 1 (push)"),
                ))
            }
        };
        if let Some(d) = ms(c.lease_ms) {
            cfg.lease = d;
        }
        if let Some(d) = ms(c.heartbeat_ms) {
            cfg.heartbeat = d;
        }
        if c.readers > 0 {
            cfg.readers = c.readers as usize;
        }
        if c.heads_end > c.heads_start {
            cfg.heads = Some(c.heads_start..c.heads_end);
        }
        if c.budget_bytes > 0 {
            cfg.budget = MemoryBudget::new(c.budget_bytes);
        }
        if let Some(d) = ms(c.budget_wait_ms) {
            cfg.budget_wait = d;
        }
    }
    Ok(cfg)
}

/// The compatibility hash of a layout (what a handoff's `compat` carries, and what agents that
/// exchange blocks should share); 0 with an invalid layout (see the last error).
///
/// # Safety
/// `layout` valid; `bases` valid for `layout->layers`.
#[no_mangle]
pub unsafe extern "C" fn kvx_layout_compat_hash(
    layout: *const kvx_layout,
    bases: *const kvx_layer_base,
) -> u64 {
    let mut h = 0;
    let s = guard("kvx_layout_compat_hash", || {
        // SAFETY: per this function's contract.
        let l = unsafe { plain(layout, "layout") }?;
        let b = try_slice!(bases, l.layers as usize, "bases");
        h = layout_of(l, b)?.compat_hash();
        Ok(())
    });
    if s == kvx_status::KVX_OK {
        h
    } else {
        0
    }
}

/// A producer over `a`'s registered cache. `side_channel` (may be NULL): the address of the
/// agent's `kvx_agent_listen`, put into handoffs. `cfg` may be NULL (defaults).
///
/// # Safety
/// `a` live; `layout` valid; `bases` valid for `layout->layers`; strings NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_new(
    a: *const kvx_agent,
    layout: *const kvx_layout,
    bases: *const kvx_layer_base,
    cfg: *const kvx_connector_config,
    side_channel: *const c_char,
    out: *mut *mut kvx_producer,
) -> kvx_status {
    guard("kvx_producer_new", || {
        let a = handle(a, "agent")?;
        // SAFETY: as above.
        let l = unsafe { plain(layout, "layout") }?;
        let b = try_slice!(bases, l.layers as usize, "bases");
        if out.is_null() {
            return Err(null("out"));
        }
        let side = if side_channel.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(
                unsafe { cstr(side_channel, "side_channel") }?
                    .parse()
                    .map_err(|e| {
                        fail(
                            kvx_status::KVX_INVALID_ARGUMENT,
                            format!("side_channel: {e}"),
                        )
                    })?,
            )
        };
        // SAFETY: cfg NULL or valid.
        let cfg = config_of(unsafe { cfg.as_ref() })?;
        let p = Producer::new(a.inner.clone(), layout_of(l, b)?, cfg, side)?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_producer::new(Box::new(p))) };
        Ok(())
    })
}

/// Frees a producer (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_free(p: *mut kvx_producer) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(p, "kvx_producer_free") }
}

/// Layer `layer` of `request` is computed.
///
/// # Safety
/// `p` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_layer_done(
    p: *const kvx_producer,
    request: *const c_char,
    layer: u32,
) -> kvx_status {
    guard("kvx_producer_layer_done", || {
        let p = handle(p, "producer")?;
        let r = try_cstr!(request, "request");
        p.inner.layer_done(r, layer as usize)?;
        Ok(())
    })
}

/// Aborts `request`: its blocks are freed now.
///
/// # Safety
/// `p` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_abort(
    p: *const kvx_producer,
    request: *const c_char,
) -> kvx_status {
    guard("kvx_producer_abort", || {
        let p = handle(p, "producer")?;
        let r = try_cstr!(request, "request");
        p.inner.abort(r);
        Ok(())
    })
}

/// Takes the next request whose blocks may be reused, waiting up to `timeout_ms` (0: none);
/// `KVX_NOT_FOUND` if none. Writes its name, blocks, and the reason (0 acknowledged,
/// 1 aborted, 2 expired, 3 held for the longest time a request may be; `UINT32_MAX` for a
/// reason a newer library added).
/// `KVX_BUFFER_TOO_SMALL` keeps it for the next call.
///
/// # Safety
/// `p` live; buffers valid for their capacities; outputs valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_next_freed(
    p: *const kvx_producer,
    timeout_ms: u64,
    req_buf: *mut c_char,
    req_cap: usize,
    req_len: *mut usize,
    blocks: *mut u32,
    blocks_cap: usize,
    nblocks: *mut usize,
    reason: *mut u32,
) -> kvx_status {
    guard("kvx_producer_next_freed", || {
        let p = handle(p, "producer")?;
        if req_len.is_null() || nblocks.is_null() || reason.is_null() {
            return Err(null("req_len, nblocks or reason"));
        }
        let mut pending = lock(&p.pending);
        let Some(f) = pending
            .take()
            .or_else(|| p.inner.next_freed(ms(timeout_ms).unwrap_or(Duration::ZERO)))
        else {
            return Err(fail(kvx_status::KVX_NOT_FOUND, "nothing freed"));
        };
        if f.request.len() >= req_cap || f.blocks.len() > blocks_cap {
            let (r, b) = (f.request.len() + 1, f.blocks.len());
            *pending = Some(f);
            // SAFETY: outputs valid.
            unsafe {
                *req_len = r;
                *nblocks = b;
            }
            return Err(fail(
                kvx_status::KVX_BUFFER_TOO_SMALL,
                format!("{r} name bytes, {b} blocks"),
            ));
        }
        drop(pending);
        // SAFETY: capacities checked above; outputs valid.
        unsafe {
            put_str(&f.request, req_buf, req_cap, req_len)?;
            if !f.blocks.is_empty() {
                if blocks.is_null() {
                    return Err(null("blocks"));
                }
                std::ptr::copy_nonoverlapping(f.blocks.as_ptr(), blocks, f.blocks.len());
            }
            *nblocks = f.blocks.len();
            *reason = match f.reason {
                kvxfer_core::connector::FreeReason::Acked => 0,
                kvxfer_core::connector::FreeReason::Aborted => 1,
                kvxfer_core::connector::FreeReason::Expired => 2,
                kvxfer_core::connector::FreeReason::HoldLimit => 3,
                // A reason this header does not name yet.
                _ => u32::MAX,
            };
        }
        Ok(())
    })
}

/// A consumer over `a`'s registered cache. `cfg` may be NULL.
///
/// # Safety
/// As `kvx_producer_new`.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_new(
    a: *const kvx_agent,
    layout: *const kvx_layout,
    bases: *const kvx_layer_base,
    cfg: *const kvx_connector_config,
    out: *mut *mut kvx_consumer,
) -> kvx_status {
    guard("kvx_consumer_new", || {
        let a = handle(a, "agent")?;
        // SAFETY: as above.
        let l = unsafe { plain(layout, "layout") }?;
        let b = try_slice!(bases, l.layers as usize, "bases");
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: cfg NULL or valid.
        let cfg = config_of(unsafe { cfg.as_ref() })?;
        let c = Consumer::new(a.inner.clone(), layout_of(l, b)?, cfg)?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_consumer::new(Box::new(c))) };
        Ok(())
    })
}

/// Frees a consumer (NULL ignored).
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_free(c: *mut kvx_consumer) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(c, "kvx_consumer_free") }
}

/// Starts loading a handoff into `local_blocks` (pairs with the producer's last blocks; the
/// blocks before are a cached prefix and do not move; none: only the acknowledgement).
///
/// # Safety
/// `c` live; `handoff` valid for `len`; `local_blocks` valid for `n`.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_start_load(
    c: *const kvx_consumer,
    handoff: *const u8,
    len: usize,
    local_blocks: *const u32,
    n: usize,
) -> kvx_status {
    guard("kvx_consumer_start_load", || {
        let c = handle(c, "consumer")?;
        let h = Handoff::decode(try_slice!(handoff, len, "handoff"))?;
        let b = try_slice!(local_blocks, n, "local_blocks");
        c.inner.start_load(&h, b)?;
        Ok(())
    })
}

/// Waits until layer `layer` of `request` is loaded (`timeout_ms` 0: forever).
///
/// # Safety
/// `c` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_wait_layer(
    c: *const kvx_consumer,
    request: *const c_char,
    layer: u32,
    timeout_ms: u64,
) -> kvx_status {
    guard("kvx_consumer_wait_layer", || {
        let c = handle(c, "consumer")?;
        let r = try_cstr!(request, "request");
        let t = ms(timeout_ms).unwrap_or(Duration::from_secs(u32::MAX as u64));
        c.inner.wait_layer(r, layer as usize, t)?;
        Ok(())
    })
}

/// Waits until `request` is loaded completely (`timeout_ms` 0: forever).
///
/// # Safety
/// `c` live; `request` NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_wait(
    c: *const kvx_consumer,
    request: *const c_char,
    timeout_ms: u64,
) -> kvx_status {
    guard("kvx_consumer_wait", || {
        let c = handle(c, "consumer")?;
        let r = try_cstr!(request, "request");
        let t = ms(timeout_ms).unwrap_or(Duration::from_secs(u32::MAX as u64));
        c.inner.wait(r, t)?;
        Ok(())
    })
}

/// Takes the next finished load: its name and figures; `KVX_NOT_FOUND` if none.
///
/// # Safety
/// `c` live; `req_buf` valid for `cap`; `req_len` and `stats` valid (stats may be NULL).
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_next_finished(
    c: *const kvx_consumer,
    req_buf: *mut c_char,
    cap: usize,
    req_len: *mut usize,
    stats: *mut kvx_request_stats,
) -> kvx_status {
    guard("kvx_consumer_next_finished", || {
        let c = handle(c, "consumer")?;
        if req_len.is_null() {
            return Err(null("req_len"));
        }
        let mut slot = lock(&c.finished);
        let next = slot.take().or_else(|| c.inner.next_finished());
        let Some(s) = next.and_then(|s| {
            if s.request.len() < cap {
                return Some(s);
            }
            *slot = Some(s); // kept for a call with a larger buffer
            None
        }) else {
            return Err(fail(
                kvx_status::KVX_NOT_FOUND,
                "nothing finished (or the buffer is too small)",
            ));
        };
        // SAFETY: as above; the predicate checked the capacity.
        unsafe { put_str(&s.request, req_buf, cap, req_len) }?;
        // SAFETY: stats NULL or valid.
        if let Some(o) = unsafe { stats.as_mut() } {
            *o = kvx_request_stats {
                bytes_moved: s.bytes_moved,
                bytes_skipped: s.bytes_skipped,
                descriptors: s.descriptors,
                post_ns: s.post_time.as_nanos() as u64,
                transfer_ns: s.transfer_time.as_nanos() as u64,
                handoff_ns: s.handoff_time.as_nanos() as u64,
            };
        }
        Ok(())
    })
}

/// Takes the next failed load: its name, the invalid local blocks, and the error in the last
/// error message; returns `KVX_OK` when one was taken, `KVX_NOT_FOUND` if none.
///
/// # Safety
/// `c` live; buffers valid for their capacities; outputs valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_consumer_next_failed(
    c: *const kvx_consumer,
    req_buf: *mut c_char,
    cap: usize,
    req_len: *mut usize,
    blocks: *mut u32,
    blocks_cap: usize,
    nblocks: *mut usize,
) -> kvx_status {
    guard("kvx_consumer_next_failed", || {
        let c = handle(c, "consumer")?;
        if req_len.is_null() || nblocks.is_null() {
            return Err(null("req_len or nblocks"));
        }
        let mut slot = lock(&c.failed);
        let next = slot.take().or_else(|| c.inner.next_failed());
        let Some(f) = next.and_then(|f| {
            if f.request.len() < cap && f.invalid_blocks.len() <= blocks_cap {
                return Some(f);
            }
            *slot = Some(f); // kept for a call with larger buffers
            None
        }) else {
            return Err(fail(
                kvx_status::KVX_NOT_FOUND,
                "nothing failed (or buffers too small)",
            ));
        };
        // SAFETY: as above; the predicate checked the capacities.
        unsafe {
            put_str(&f.request, req_buf, cap, req_len)?;
            if !f.invalid_blocks.is_empty() {
                if blocks.is_null() {
                    return Err(null("blocks"));
                }
                std::ptr::copy_nonoverlapping(
                    f.invalid_blocks.as_ptr(),
                    blocks,
                    f.invalid_blocks.len(),
                );
            }
            *nblocks = f.invalid_blocks.len();
        }
        set_error(format!("load of {:?} failed: {}", f.request, f.error));
        Ok(())
    })
}

/// The caches `tensors` (one per layer) of the shape `l`, on CUDA device `cuda_device`
/// (negative: host memory).
///
/// # Safety
/// The tensors' memory is valid per `kvx_connector_producer`'s contract.
pub(crate) unsafe fn caches_of(
    l: &kvx_layout,
    tensors: &[kvx_cache_tensor],
    cuda_device: i32,
) -> Result<KvCaches, Fail> {
    // The shape is checked as a layout's is; the bases here only say whether V is separate.
    let bases: Vec<kvx_layer_base> = tensors
        .iter()
        .map(|t| kvx_layer_base {
            k_region: 0,
            k_offset: 0,
            v_region: if t.v.is_null() { u32::MAX } else { 0 },
            v_offset: 0,
        })
        .collect();
    let shape = layout_of(l, &bases)?;
    let kind = match u32::try_from(cuda_device) {
        Ok(d) => MemKind::Cuda(d),
        Err(_) => MemKind::Host,
    };
    let tensor = |p: *mut std::ffi::c_void, len: u64| {
        // SAFETY: per this function's contract, which is `CacheTensor::new`'s.
        unsafe { CacheTensor::new(p.cast(), len as usize, kind) }
    };
    Ok(KvCaches {
        geometry: shape.geometry,
        block_tokens: shape.block_tokens,
        num_blocks: shape.num_blocks,
        packing: shape.packing,
        order: shape.order,
        layers: tensors
            .iter()
            .map(|t| LayerTensors {
                k: tensor(t.k, t.k_len),
                v: (!t.v.is_null()).then(|| tensor(t.v, t.v_len)),
            })
            .collect(),
        state: shape.state,
        pad_per_head: shape.pad_per_head,
    })
}

/// The body of `kvx_connector_producer` and `kvx_connector_consumer`: checks the arguments,
/// describes the caches, makes the side with `make`, writes its handle to `out`.
///
/// # Safety
/// `c` live; `layout` valid; `tensors` valid for `layout->layers`, their memory valid per
/// `kvx_connector_producer`'s contract; `cfg` NULL or valid; `out` valid.
#[allow(clippy::too_many_arguments)]
unsafe fn side_of<T: crate::ffi::Kind>(
    name: &str,
    c: *const kvx_connector,
    layout: *const kvx_layout,
    tensors: *const kvx_cache_tensor,
    cuda_device: i32,
    cfg: *const kvx_connector_config,
    out: *mut *mut T,
    make: impl FnOnce(&dyn KvConnector, &KvCaches, &ConnectorConfig) -> Result<T, Fail>,
) -> kvx_status {
    guard(name, || {
        let c = handle(c, "connector")?;
        // SAFETY: as above.
        let l = unsafe { plain(layout, "layout") }?;
        let t = try_slice!(tensors, l.layers as usize, "tensors");
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the tensors' memory per this function's contract.
        let caches = unsafe { caches_of(l, t, cuda_device) }?;
        // SAFETY: cfg NULL or valid.
        let cfg = config_of(unsafe { cfg.as_ref() })?;
        let side = make(&*c.inner, &caches, &cfg)?;
        // SAFETY: out valid.
        unsafe { *out = new_handle(side) };
        Ok(())
    })
}

/// kvxfer's connector over agent `a`: producers and consumers it makes move KV through the
/// agent (UCX, kvxfer's lanes) to and from other processes and hosts. `side_channel` (may be
/// NULL): the address of `a`'s `kvx_agent_listen`, put into handoffs. Tensors given to
/// `kvx_connector_producer` / `kvx_connector_consumer` that lie in a region registered with
/// `a` use it; others are registered for the producer or consumer and deregistered with it.
///
/// # Safety
/// `a` live; `side_channel` NULL or NUL-terminated; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_connector_over_agent(
    a: *const kvx_agent,
    side_channel: *const c_char,
    out: *mut *mut kvx_connector,
) -> kvx_status {
    guard("kvx_connector_over_agent", || {
        let a = handle(a, "agent")?;
        if out.is_null() {
            return Err(null("out"));
        }
        let side = if side_channel.is_null() {
            None
        } else {
            let s = try_cstr!(side_channel, "side_channel");
            Some(s.parse().map_err(|e| {
                fail(
                    kvx_status::KVX_INVALID_ARGUMENT,
                    format!("side_channel {s:?}: {e}"),
                )
            })?)
        };
        let c = AgentConnector::new(a.inner.clone(), side);
        // SAFETY: out valid.
        unsafe { *out = new_handle(kvx_connector { inner: Box::new(c) }) };
        Ok(())
    })
}

/// The in-process connector: producers and consumers it makes move KV between caches of this
/// process by memcpy (host memory), no network, no agent.
///
/// # Safety
/// `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_connector_in_process(out: *mut *mut kvx_connector) -> kvx_status {
    guard("kvx_connector_in_process", || {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: out valid.
        unsafe {
            *out = new_handle(kvx_connector {
                inner: Box::new(InProcessConnector::new()),
            })
        };
        Ok(())
    })
}

/// Frees a connector (NULL ignored); producers and consumers made from it stay usable.
///
/// # Safety
/// NULL or from this library, once.
#[no_mangle]
pub unsafe extern "C" fn kvx_connector_free(c: *mut kvx_connector) {
    // SAFETY: per this function's contract; free_handle refuses what is not live.
    unsafe { free_handle(c, "kvx_connector_free") }
}

/// Registers the caches `tensors` (`layout->layers` of them) of the shape `layout` (its
/// `kvx_layer_base`s are not used: the tensors say where the memory is) and makes a producer
/// over them. `cuda_device`: the CUDA device of the tensors, or -1 for host memory. `cfg` may
/// be NULL (defaults).
///
/// # Safety
/// `c` live; `layout` valid; `tensors` valid for `layout->layers`; each tensor's memory valid
/// for reads and writes, of the kind given, until the producer is freed; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_connector_producer(
    c: *const kvx_connector,
    layout: *const kvx_layout,
    tensors: *const kvx_cache_tensor,
    cuda_device: i32,
    cfg: *const kvx_connector_config,
    out: *mut *mut kvx_producer,
) -> kvx_status {
    // SAFETY: per this function's contract, which `side_of` states.
    unsafe {
        side_of(
            "kvx_connector_producer",
            c,
            layout,
            tensors,
            cuda_device,
            cfg,
            out,
            |k, c, g| Ok(kvx_producer::new(k.producer(c, g)?)),
        )
    }
}

/// As `kvx_connector_producer`, for the decode side.
///
/// # Safety
/// As `kvx_connector_producer`, until the consumer is freed.
#[no_mangle]
pub unsafe extern "C" fn kvx_connector_consumer(
    c: *const kvx_connector,
    layout: *const kvx_layout,
    tensors: *const kvx_cache_tensor,
    cuda_device: i32,
    cfg: *const kvx_connector_config,
    out: *mut *mut kvx_consumer,
) -> kvx_status {
    // SAFETY: per this function's contract, which `side_of` states.
    unsafe {
        side_of(
            "kvx_connector_consumer",
            c,
            layout,
            tensors,
            cuda_device,
            cfg,
            out,
            |k, c, g| Ok(kvx_consumer::new(k.consumer(c, g)?)),
        )
    }
}
