//! The only module that names `kvxfer_sys`: each `ucp_*` call wrapped as a function returning
//! `Result<_, UcsStatus>`, grouped by object. Every `unsafe fn` lists what its caller upholds.

// The bindgen types of UCX's enum constants differ between UCX releases and bindgen versions;
// the casts keep this file compiling against both supported UCX builds.
#![allow(clippy::unnecessary_cast)]

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::{self, NonNull};

use kvxfer_sys as sys;

use kvxfer_proto::error::UcsStatus;

pub(crate) use sys::{
    ucp_am_recv_param_t, ucp_context_h, ucp_ep_h, ucp_mem_h, ucp_rkey_h, ucp_worker_h, ucs_status_t,
};

/// Callback type for send-like operations (`ucp_send_nbx_callback_t`).
pub(crate) type SendCb = unsafe extern "C" fn(*mut c_void, sys::ucs_status_t, *mut c_void);
/// Callback for endpoint errors (`ucp_err_handler_cb_t`).
pub(crate) type ErrCb = unsafe extern "C" fn(*mut c_void, sys::ucp_ep_h, sys::ucs_status_t);
/// Active-message receive callback (`ucp_am_recv_callback_t`).
pub(crate) type AmCb = unsafe extern "C" fn(
    *mut c_void,
    *const c_void,
    usize,
    *mut c_void,
    usize,
    *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t;

/// Outcome of a non-blocking call (`ucs_status_ptr_t`).
#[derive(Debug)]
pub(crate) enum Posted {
    /// Completed in place; no callback will come.
    Done,
    /// In progress; the callback will come, then the request must be freed.
    Pending(NonNull<c_void>),
}

fn st(s: sys::ucs_status_t) -> UcsStatus {
    status(s.0)
}

fn check(s: sys::ucs_status_t) -> Result<(), UcsStatus> {
    if s.0 == 0 {
        Ok(())
    } else {
        Err(st(s))
    }
}

fn posted(p: sys::ucs_status_ptr_t) -> Result<Posted, UcsStatus> {
    match NonNull::new(p) {
        None => Ok(Posted::Done),
        Some(_) if sys::ucs_ptr_is_err(p) => Err(st(sys::ucs_ptr_status(p))),
        Some(req) => Ok(Posted::Pending(req)),
    }
}

/// The status `code` with UCX's text for it (`ucs_status_string`).
pub(crate) fn status(code: i8) -> UcsStatus {
    // SAFETY: ucs_status_string accepts any value and returns a static NUL-terminated string
    // ("Unknown error" for unknown codes).
    let p = unsafe { sys::ucs_status_string(sys::ucs_status_t(code)) };
    if p.is_null() {
        return UcsStatus::new(code, "unknown UCX status");
    }
    // SAFETY: p is non-null and points to a C string in UCX's static data, which stays mapped
    // for the life of the process (libucs is never unloaded).
    let text = unsafe { CStr::from_ptr(p) }
        .to_str()
        .unwrap_or("unknown UCX status");
    UcsStatus::new(code, text)
}

/// Routes UCX's log messages into Rust's `log` (target `ucx`) instead of UCX printing them on
/// stderr, unless the user set `UCX_LOG_LEVEL` (then UCX prints as configured). UCX logs an
/// `ERROR` beside most failures kvxfer returns as a typed error, so those go to `debug`;
/// `FATAL` to `error`, `WARN` to `info`, the rest to `trace`. Once per process.
pub(crate) fn route_log() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if std::env::var_os("UCX_LOG_LEVEL").is_some() {
        return;
    }
    ONCE.call_once(|| {
        // SAFETY: `ucx_log` has the handler's signature and never unwinds; UCX keeps the
        // function pointer, which is static.
        unsafe { sys::ucs_log_push_handler(Some(ucx_log)) }
    });
}

unsafe extern "C" fn ucx_log(
    file: *const c_char,
    line: std::ffi::c_uint,
    _function: *const c_char,
    level: sys::ucs_log_level_t,
    _comp: *const sys::ucs_log_component_config_t,
    message: *const c_char,
    ap: *mut sys::__va_list_tag,
) -> sys::ucs_log_func_rc_t {
    let mut buf = [0 as c_char; 1024];
    // SAFETY: `message` and `ap` are the format and arguments UCX passes for this call; buf
    // is writable for its length and vsnprintf always terminates within it.
    let n = unsafe { sys::vsnprintf(buf.as_mut_ptr(), buf.len() as _, message, ap) };
    let _ = std::panic::catch_unwind(|| {
        let text = if n < 0 {
            std::borrow::Cow::Borrowed("(unformattable UCX message)")
        } else {
            // SAFETY: vsnprintf succeeded, so buf holds a NUL-terminated string.
            unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy()
        };
        let file = if file.is_null() {
            std::borrow::Cow::Borrowed("?")
        } else {
            // SAFETY: UCX passes its static __FILE__ string.
            unsafe { CStr::from_ptr(file) }.to_string_lossy()
        };
        let lvl = match level {
            sys::UCS_LOG_LEVEL_FATAL => log::Level::Error,
            sys::UCS_LOG_LEVEL_ERROR => log::Level::Debug,
            sys::UCS_LOG_LEVEL_WARN => log::Level::Info,
            _ => log::Level::Trace,
        };
        log::log!(target: "ucx", lvl, "{file}:{line}: {text}");
    });
    sys::UCS_LOG_FUNC_RC_STOP
}

/// `ucp_get_version_string`: the UCX library loaded at run time.
pub(crate) fn version_string() -> String {
    // SAFETY: no preconditions; returns a static string.
    let p = unsafe { sys::ucp_get_version_string() };
    if p.is_null() {
        return "unknown".into();
    }
    // SAFETY: p is a static NUL-terminated string owned by UCX.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Version of the headers kvxfer was built against.
pub(crate) const BUILD_VERSION: &str = sys::UCX_BUILD_VERSION;

// ---- context -----------------------------------------------------------------------------

/// Creates a UCP context with RMA, AM and wakeup, applying `(name, value)` settings (UCX
/// config names without the `UCX_` prefix) on top of the environment.
/// Calls `ucp_config_read`, `ucp_config_modify`, `ucp_init`, `ucp_config_release`.
pub(crate) fn context_new(
    settings: &[(String, String)],
    name: &CStr,
) -> Result<ucp_context_h, (String, UcsStatus)> {
    let mut cfg: *mut sys::ucp_config_t = ptr::null_mut();
    // SAFETY: NULL env prefix and filename are allowed; cfg is a valid out pointer.
    check(unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut cfg) })
        .map_err(|s| ("ucp_config_read".to_string(), s))?;
    let release = |cfg| {
        // SAFETY: cfg came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(cfg) }
    };
    for (k, v) in settings {
        // A "?" prefix marks a setting that only some UCX builds know (e.g. of the IB
        // component): applied where it exists, skipped where it does not. "A|B" names one
        // setting that UCX versions spell differently: the first name UCX accepts is used.
        let (k, optional) = match k.strip_prefix('?') {
            Some(k) => (k.to_string(), true),
            None => (k.clone(), false),
        };
        let Ok(cv) = CString::new(v.as_str()) else {
            release(cfg);
            return Err((format!("ucp_config_modify({k})"), status(-5)));
        };
        let mut last = Ok(());
        for name in k.split('|') {
            let Ok(ck) = CString::new(name) else {
                release(cfg);
                return Err((format!("ucp_config_modify({name})"), status(-5)));
            };
            // SAFETY: cfg is live; ck/cv are NUL-terminated and outlive the call (UCX copies).
            last = check(unsafe { sys::ucp_config_modify(cfg, ck.as_ptr(), cv.as_ptr()) });
            if last.is_ok() {
                break;
            }
        }
        if let Err(s) = last {
            if optional {
                continue;
            }
            release(cfg);
            return Err((format!("ucp_config_modify({k}={v})"), s));
        }
    }
    let params = sys::ucp_params_t {
        field_mask: (sys::UCP_PARAM_FIELD_FEATURES
            | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED
            | sys::UCP_PARAM_FIELD_NAME) as u64,
        features: (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP) as u64,
        mt_workers_shared: 0,
        name: name.as_ptr(),
        ..Default::default()
    };
    let mut ctx: ucp_context_h = ptr::null_mut();
    // SAFETY: params is fully initialised for the fields in field_mask; cfg is live; ctx is a
    // valid out pointer. name outlives the call (UCX copies it).
    let r = check(unsafe { sys::ucp_init(&params, cfg, &mut ctx) });
    release(cfg);
    r.map_err(|s| ("ucp_init".to_string(), s))?;
    Ok(ctx)
}

/// Memory types the context can move (`ucp_context_query`, bit `1 << ucs_memory_type`);
/// CUDA appears only with a CUDA-aware UCX (`cuda_copy` / `cuda_ipc` transports).
///
/// # Safety
/// 1. `ctx` is a live context.
pub(crate) unsafe fn context_memory_types(ctx: ucp_context_h) -> u64 {
    let mut attr = sys::ucp_context_attr_t {
        field_mask: sys::UCP_ATTR_FIELD_MEMORY_TYPES as u64,
        ..Default::default()
    };
    // SAFETY: ctx live (contract 1); attr is a valid, initialised out struct.
    match check(unsafe { sys::ucp_context_query(ctx, &mut attr) }) {
        Ok(()) => attr.memory_types,
        Err(_) => 1, // host only
    }
}

/// Whether `memory_types` includes CUDA device memory.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn supports_cuda(memory_types: u64) -> bool {
    memory_types & (1u64 << sys::UCS_MEMORY_TYPE_CUDA) != 0
}

/// `ucp_cleanup`.
///
/// # Safety
/// 1. `ctx` came from [`context_new`] and is cleaned up once.
/// 2. Every worker and memory handle of `ctx` was destroyed before.
pub(crate) unsafe fn context_destroy(ctx: ucp_context_h) {
    // SAFETY: caller upholds 1-2.
    unsafe { sys::ucp_cleanup(ctx) }
}

// ---- worker ------------------------------------------------------------------------------

/// `ucp_worker_create` in single-thread mode (only the progress thread touches it) with
/// wakeup events for RMA, AM and TX/RX.
///
/// # Safety
/// 1. `ctx` is a live context.
pub(crate) unsafe fn worker_new(ctx: ucp_context_h) -> Result<ucp_worker_h, UcsStatus> {
    let params = sys::ucp_worker_params_t {
        field_mask: (sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE | sys::UCP_WORKER_PARAM_FIELD_EVENTS)
            as u64,
        thread_mode: sys::UCS_THREAD_MODE_SINGLE,
        events: (sys::UCP_WAKEUP_RMA
            | sys::UCP_WAKEUP_AMO
            | sys::UCP_WAKEUP_TAG_SEND
            | sys::UCP_WAKEUP_TAG_RECV
            | sys::UCP_WAKEUP_TX
            | sys::UCP_WAKEUP_RX) as _,
        ..Default::default()
    };
    let mut w: ucp_worker_h = ptr::null_mut();
    // SAFETY: ctx live (caller, 1); params initialised for field_mask; w valid out pointer.
    check(unsafe { sys::ucp_worker_create(ctx, &params, &mut w) })?;
    Ok(w)
}

/// `ucp_worker_destroy`.
///
/// # Safety
/// 1. `w` is live, destroyed once, and its endpoints were closed.
pub(crate) unsafe fn worker_destroy(w: ucp_worker_h) {
    // SAFETY: caller upholds 1.
    unsafe { sys::ucp_worker_destroy(w) }
}

/// The worker's address (`ucp_worker_query` + `ucp_worker_release_address`).
///
/// # Safety
/// 1. `w` is live and used by this thread only.
pub(crate) unsafe fn worker_address(w: ucp_worker_h) -> Result<Vec<u8>, UcsStatus> {
    let mut attr = sys::ucp_worker_attr_t {
        field_mask: sys::UCP_WORKER_ATTR_FIELD_ADDRESS as u64,
        ..Default::default()
    };
    // SAFETY: w live (caller); attr initialised for field_mask.
    check(unsafe { sys::ucp_worker_query(w, &mut attr) })?;
    if attr.address.is_null() || attr.address_length == 0 {
        return Err(status(-6));
    }
    // SAFETY: UCX returned address_length valid bytes at address.
    let v = unsafe { std::slice::from_raw_parts(attr.address as *const u8, attr.address_length) }
        .to_vec();
    // SAFETY: address came from ucp_worker_query on w and is released once.
    unsafe { sys::ucp_worker_release_address(w, attr.address) };
    Ok(v)
}

/// `ucp_worker_get_efd`.
///
/// # Safety
/// 1. `w` is live and was created with wakeup events.
pub(crate) unsafe fn worker_efd(w: ucp_worker_h) -> Result<i32, UcsStatus> {
    let mut fd = -1;
    // SAFETY: w live (caller); fd valid out pointer.
    check(unsafe { sys::ucp_worker_get_efd(w, &mut fd) })?;
    Ok(fd)
}

/// `ucp_worker_arm`: `Ok(true)` when armed (safe to sleep on the fd), `Ok(false)` when events
/// are pending (progress again).
///
/// # Safety
/// 1. `w` is live and used by this thread only.
pub(crate) unsafe fn worker_arm(w: ucp_worker_h) -> Result<bool, UcsStatus> {
    // SAFETY: caller upholds 1.
    let s = unsafe { sys::ucp_worker_arm(w) };
    match s.0 {
        0 => Ok(true),
        -15 => Ok(false), // UCS_ERR_BUSY
        _ => Err(st(s)),
    }
}

/// `ucp_worker_signal`: wakes a thread sleeping on the worker's fd. Thread-safe in UCX.
///
/// # Safety
/// 1. `w` is live (not yet destroyed).
pub(crate) unsafe fn worker_signal(w: ucp_worker_h) -> Result<(), UcsStatus> {
    // SAFETY: caller upholds 1; UCX documents ucp_worker_signal as callable from any thread.
    check(unsafe { sys::ucp_worker_signal(w) })
}

/// `ucp_worker_progress`.
///
/// # Safety
/// 1. `w` is live and used by this thread only. Callbacks run inside.
pub(crate) unsafe fn worker_progress(w: ucp_worker_h) -> u32 {
    // SAFETY: caller upholds 1.
    unsafe { sys::ucp_worker_progress(w) }
}

/// `ucp_worker_set_am_recv_handler` for `id`.
///
/// # Safety
/// 1. `w` is live and used by this thread only.
/// 2. `arg` stays valid until the worker is destroyed; `cb` handles any input.
pub(crate) unsafe fn worker_set_am_handler(
    w: ucp_worker_h,
    id: u32,
    cb: AmCb,
    arg: *mut c_void,
) -> Result<(), UcsStatus> {
    let p = sys::ucp_am_handler_param_t {
        field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
        id,
        cb: Some(cb),
        arg,
        ..Default::default()
    };
    // SAFETY: caller upholds 1-2; p initialised for field_mask.
    check(unsafe { sys::ucp_worker_set_am_recv_handler(w, &p) })
}

// ---- endpoint ----------------------------------------------------------------------------

/// `ucp_ep_create` to a worker address; `peer_failure` selects `UCP_ERR_HANDLING_MODE_PEER`
/// (UCX then only uses transports that can detect a dead peer).
///
/// # Safety
/// 1. `w` is live and used by this thread only.
/// 2. `err_arg` stays valid until the endpoint is closed; `err_cb` tolerates any endpoint.
pub(crate) unsafe fn ep_new(
    w: ucp_worker_h,
    addr: &[u8],
    err_cb: ErrCb,
    err_arg: *mut c_void,
    peer_failure: bool,
) -> Result<ucp_ep_h, UcsStatus> {
    let p = sys::ucp_ep_params_t {
        field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
        address: addr.as_ptr() as *const sys::ucp_address_t,
        err_mode: if peer_failure {
            sys::UCP_ERR_HANDLING_MODE_PEER
        } else {
            sys::UCP_ERR_HANDLING_MODE_NONE
        },
        err_handler: sys::ucp_err_handler_t {
            cb: Some(err_cb),
            arg: err_arg,
        },
        ..Default::default()
    };
    let mut ep: ucp_ep_h = ptr::null_mut();
    // SAFETY: caller upholds 1-2; addr is a worker address blob UCX copies during the call
    // (it was size-checked by the metadata decoder; UCX validates its content).
    check(unsafe { sys::ucp_ep_create(w, &p, &mut ep) })?;
    Ok(ep)
}

/// `ucp_ep_close_nbx`; `force` cancels outstanding operations. The request, if any, must be
/// progressed until `request_status` says done, then freed.
///
/// # Safety
/// 1. `ep` is live and closed once; its rkeys were destroyed first.
pub(crate) unsafe fn ep_close(ep: ucp_ep_h, force: bool) -> Result<Posted, UcsStatus> {
    let p = sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS as u32,
        flags: if force {
            sys::UCP_EP_CLOSE_FLAG_FORCE as u32
        } else {
            0
        },
        ..Default::default()
    };
    // SAFETY: caller upholds 1; p initialised for op_attr_mask.
    posted(unsafe { sys::ucp_ep_close_nbx(ep, &p) })
}

/// `ucp_ep_flush_nbx` with a completion callback.
///
/// # Safety
/// 1. `ep` is live and used by this thread only.
/// 2. `user_data` is valid whenever `cb` may run (until completion).
pub(crate) unsafe fn ep_flush(
    ep: ucp_ep_h,
    cb: SendCb,
    user_data: *mut c_void,
) -> Result<Posted, UcsStatus> {
    let p = send_param(cb, user_data, 0);
    // SAFETY: caller upholds 1-2.
    posted(unsafe { sys::ucp_ep_flush_nbx(ep, &p) })
}

/// The endpoint's configuration as `ucp_ep_print_info` prints it.
///
/// # Safety
/// 1. `ep` is live and used by this thread only.
pub(crate) unsafe fn ep_info(ep: ucp_ep_h) -> String {
    let mut buf: *mut libc::c_char = ptr::null_mut();
    let mut len: libc::size_t = 0;
    // SAFETY: open_memstream with valid out pointers.
    let f = unsafe { libc::open_memstream(&mut buf, &mut len) };
    if f.is_null() {
        return String::new();
    }
    // SAFETY: ep live (caller); f is an open stream (FILE is opaque on both sides).
    unsafe { sys::ucp_ep_print_info(ep, f as *mut sys::FILE) };
    // SAFETY: f is open and closed once; afterwards buf/len are valid.
    unsafe { libc::fclose(f) };
    if buf.is_null() {
        return String::new();
    }
    // SAFETY: open_memstream made buf hold len bytes (plus NUL).
    let s = unsafe { std::slice::from_raw_parts(buf as *const u8, len) };
    let out = String::from_utf8_lossy(s).into_owned();
    // SAFETY: buf was malloc'd by open_memstream and is freed once.
    unsafe { libc::free(buf as *mut c_void) };
    out
}

// ---- memory ------------------------------------------------------------------------------

/// `ucp_mem_map` of existing memory.
///
/// # Safety
/// 1. `ctx` is live; `[addr, addr+len)` is memory that stays valid until `mem_unmap`.
pub(crate) unsafe fn mem_map(
    ctx: ucp_context_h,
    addr: *mut u8,
    len: usize,
    cuda: bool,
) -> Result<ucp_mem_h, UcsStatus> {
    let mut p = sys::ucp_mem_map_params_t {
        field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
            as u64,
        address: addr as *mut c_void,
        length: len,
        ..Default::default()
    };
    if cuda {
        // The memory type stated, not detected: UCX's detection needs its CUDA module to
        // query the pointer, and a wrong guess registers VRAM as host memory.
        p.field_mask |= sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as u64;
        p.memory_type = sys::UCS_MEMORY_TYPE_CUDA as _;
    }
    let mut m: ucp_mem_h = ptr::null_mut();
    // SAFETY: caller upholds 1; p initialised for field_mask; m valid out pointer.
    check(unsafe { sys::ucp_mem_map(ctx, &p, &mut m) })?;
    Ok(m)
}

/// `ucp_mem_unmap`.
///
/// # Safety
/// 1. `m` came from `mem_map` on `ctx`, is unmapped once, and no operation uses it.
pub(crate) unsafe fn mem_unmap(ctx: ucp_context_h, m: ucp_mem_h) -> Result<(), UcsStatus> {
    // SAFETY: caller upholds 1.
    check(unsafe { sys::ucp_mem_unmap(ctx, m) })
}

/// `ucp_rkey_pack` + `ucp_rkey_buffer_release`.
///
/// # Safety
/// 1. `m` is a live memory handle of `ctx`.
pub(crate) unsafe fn rkey_pack(ctx: ucp_context_h, m: ucp_mem_h) -> Result<Vec<u8>, UcsStatus> {
    let mut buf: *mut c_void = ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: caller upholds 1; out pointers are valid.
    check(unsafe { sys::ucp_rkey_pack(ctx, m, &mut buf, &mut len) })?;
    // SAFETY: UCX returned len valid bytes at buf.
    let v = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
    // SAFETY: buf came from ucp_rkey_pack and is released once.
    unsafe { sys::ucp_rkey_buffer_release(buf) };
    Ok(v)
}

/// `ucp_ep_rkey_unpack`.
///
/// # Safety
/// 1. `ep` is live and used by this thread only.
pub(crate) unsafe fn rkey_unpack(ep: ucp_ep_h, packed: &[u8]) -> Result<ucp_rkey_h, UcsStatus> {
    let mut r: ucp_rkey_h = ptr::null_mut();
    // SAFETY: caller upholds 1; packed is readable for its length (UCX parses it; the
    // metadata decoder bounded its size).
    check(unsafe { sys::ucp_ep_rkey_unpack(ep, packed.as_ptr() as *const c_void, &mut r) })?;
    Ok(r)
}

/// `ucp_rkey_destroy`.
///
/// # Safety
/// 1. `r` is live, destroyed once, before its endpoint is closed, with no operation using it.
pub(crate) unsafe fn rkey_destroy(r: ucp_rkey_h) {
    // SAFETY: caller upholds 1.
    unsafe { sys::ucp_rkey_destroy(r) }
}

// ---- RMA and active messages -------------------------------------------------------------

fn send_param(cb: SendCb, user_data: *mut c_void, extra: u32) -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: sys::UCP_OP_ATTR_FIELD_CALLBACK as u32
            | sys::UCP_OP_ATTR_FIELD_USER_DATA as u32
            | extra,
        cb: sys::ucp_request_param_t__bindgen_ty_1 { send: Some(cb) },
        user_data,
        ..Default::default()
    }
}

fn plain_param() -> sys::ucp_request_param_t {
    sys::ucp_request_param_t {
        op_attr_mask: 0,
        ..Default::default()
    }
}

/// `ucp_put_nbx` (WRITE) or `ucp_get_nbx` (READ) of `len` bytes with no callback: completion
/// is observed through a later flush. A returned request must be freed with `request_free`
/// (UCX releases it once done).
///
/// # Safety
/// 1. `ep` and `rkey` are live and used by this thread only.
/// 2. `[local, local+len)` is registered memory that stays valid until the operation
///    completes (a later flush on `ep` reports that).
/// 3. `[remote, remote+len)` lies inside the remote region `rkey` was packed for.
pub(crate) unsafe fn rma(
    write: bool,
    ep: ucp_ep_h,
    local: u64,
    len: u64,
    remote: u64,
    rkey: ucp_rkey_h,
) -> Result<Posted, UcsStatus> {
    let p = plain_param();
    let r = if write {
        // SAFETY: caller upholds 1-3.
        unsafe { sys::ucp_put_nbx(ep, local as *const c_void, len as usize, remote, rkey, &p) }
    } else {
        // SAFETY: caller upholds 1-3.
        unsafe { sys::ucp_get_nbx(ep, local as *mut c_void, len as usize, remote, rkey, &p) }
    };
    posted(r)
}

/// `ucp_am_send_nbx` of `data` under `id`, eager, with a completion callback. UCX copies the
/// data before returning or before completion; `data` must stay valid until then.
///
/// # Safety
/// 1. `ep` is live and used by this thread only.
/// 2. `data` stays valid until `cb` runs (or the call returns `Done`).
/// 3. `user_data` is valid whenever `cb` may run.
pub(crate) unsafe fn am_send(
    ep: ucp_ep_h,
    id: u32,
    data: &[u8],
    cb: SendCb,
    user_data: *mut c_void,
) -> Result<Posted, UcsStatus> {
    let mut p = send_param(cb, user_data, sys::UCP_OP_ATTR_FIELD_FLAGS as u32);
    p.flags = sys::UCP_AM_SEND_FLAG_EAGER as u32;
    // SAFETY: caller upholds 1-3; no header.
    posted(unsafe {
        sys::ucp_am_send_nbx(
            ep,
            id,
            ptr::null(),
            0,
            data.as_ptr() as *const c_void,
            data.len(),
            &p,
        )
    })
}

/// Whether an active message's data is readable in the callback: anything but a rendezvous
/// (`UCP_AM_RECV_ATTR_FLAG_DATA` only says the data may also be kept past the callback).
pub(crate) fn am_data_in_place(param: *const sys::ucp_am_recv_param_t) -> bool {
    if param.is_null() {
        return false;
    }
    // SAFETY: UCX passes a valid param for the duration of the callback; checked non-null.
    let attr = unsafe { (*param).recv_attr };
    attr & (sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64) == 0
}

/// `ucp_request_check_status`.
///
/// # Safety
/// 1. `req` is a live request (not yet freed).
pub(crate) unsafe fn request_status(req: NonNull<c_void>) -> UcsStatus {
    // SAFETY: caller upholds 1.
    st(unsafe { sys::ucp_request_check_status(req.as_ptr()) })
}

/// `ucp_request_free`: UCX releases the request once it completes.
///
/// # Safety
/// 1. `req` is a live request, freed once, never used after.
pub(crate) unsafe fn request_free(req: NonNull<c_void>) {
    // SAFETY: caller upholds 1.
    unsafe { sys::ucp_request_free(req.as_ptr()) }
}

/// Converts a raw status passed to a callback.
pub(crate) fn cb_status(s: sys::ucs_status_t) -> UcsStatus {
    st(s)
}

/// `UCS_OK` as the C type, for callbacks' return values.
pub(crate) const STATUS_OK: sys::ucs_status_t = sys::ucs_status_t::UCS_OK;
