//! The FFI plumbing every object's functions share: the registry of live handles (a double
//! free or a use after free is a status, not memory corruption), and the checked conversions
//! of C arguments (strings, slices, caller buffers, handles), in the manner of rustls-ffi's
//! `ffi.rs`.

use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use crate::error::{fail, set_error, Fail};
use crate::{
    kvx_agent, kvx_agent_config, kvx_connector, kvx_consumer, kvx_discovery, kvx_local_list,
    kvx_producer, kvx_region, kvx_remote_list, kvx_status, kvx_transfer,
};

// ---------------------------------------------------------------------------------------------
// Live handles: every handle is checked before use and before free, so that a double free or
// a use after free through the C ABI is a status code, not memory corruption. (An address the
// allocator reuses for a new handle of the same type is indistinguishable: that is the limit.)
// ---------------------------------------------------------------------------------------------

/// Handle types, tagged for the registry.
pub(crate) trait Kind {
    const KIND: u8;
    const NAME: &'static str;
}

macro_rules! kinds {
    ($($t:ident = $k:expr),*) => {$(
        impl Kind for $t {
            const KIND: u8 = $k;
            const NAME: &'static str = stringify!($t);
        }
    )*};
}
kinds!(
    kvx_agent = 1,
    kvx_region = 2,
    kvx_local_list = 3,
    kvx_remote_list = 4,
    kvx_transfer = 5,
    kvx_producer = 6,
    kvx_consumer = 7,
    kvx_agent_config = 8,
    kvx_connector = 9,
    kvx_discovery = 10
);

pub(crate) fn live() -> std::sync::MutexGuard<'static, std::collections::HashSet<(usize, u8)>> {
    static LIVE: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<(usize, u8)>>> =
        std::sync::OnceLock::new();
    LIVE.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Boxes a handle and records it as live.
pub(crate) fn new_handle<T: Kind>(v: T) -> *mut T {
    let p = Box::into_raw(Box::new(v));
    live().insert((p as usize, T::KIND));
    p
}

/// Frees a live handle; a NULL, foreign or already freed one is refused (recorded in the last
/// error) and left alone.
///
/// # Safety
/// `p` is NULL or a pointer this library returned (possibly already freed).
pub(crate) unsafe fn free_handle<T: Kind>(p: *mut T, fname: &str) {
    if p.is_null() {
        return;
    }
    let known = live().remove(&(p as usize, T::KIND));
    if !known {
        set_error(format!(
            "{fname}: {} {p:p} is not live (double free?); ignored",
            T::NAME
        ));
        return;
    }
    // SAFETY: p was made by new_handle (Box::into_raw) and was live until the removal above,
    // which happens once.
    let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(p) })));
}

/// A C string argument of an export, as `&str`, or return the failure (rustls-ffi's
/// `try_str!`): the one place an export's string arguments are read. Every export that takes
/// a string documents it (its `# Safety`) as NULL or NUL-terminated and valid for the call,
/// which is all `cstr` needs; NULL and non-UTF-8 are refused, typed.
macro_rules! try_cstr {
    ($p:expr, $name:expr) => {{
        // SAFETY: the export's contract (above): NULL or NUL-terminated, valid for the call.
        unsafe { $crate::ffi::cstr($p, $name) }?
    }};
}
pub(crate) use try_cstr;

/// A buffer argument of an export (`p`, `n` elements) as a slice, or return the failure
/// (rustls-ffi's `try_slice!`). Every export that takes one documents it as NULL with `n` 0,
/// or valid for reads of `n` elements for the call.
macro_rules! try_slice {
    ($p:expr, $n:expr, $name:expr) => {{
        // SAFETY: the export's contract (above): NULL with n 0, or n readable elements.
        unsafe { $crate::ffi::slice($p, $n, $name) }?
    }};
}
pub(crate) use try_slice;

pub(crate) fn null(name: &str) -> Fail {
    fail(kvx_status::KVX_NULL_PARAMETER, format!("{name} is NULL"))
}

/// # Safety
/// `p` is NULL or a NUL-terminated string valid for reads.
pub(crate) unsafe fn cstr<'a>(p: *const c_char, name: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return Err(null(name));
    }
    // SAFETY: non-NULL and NUL-terminated per the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| {
        fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            format!("{name} is not UTF-8"),
        )
    })
}

/// # Safety
/// `p` is NULL (then `n` must be 0) or valid for reads of `n` elements.
pub(crate) unsafe fn slice<'a, T>(p: *const T, n: usize, name: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(name));
    }
    // SAFETY: non-NULL, valid for n elements per the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Copies `src` to a caller buffer.
///
/// # Safety
/// `buf` is valid for writes of `cap` bytes (or NULL with `cap` 0); `out_len` is valid.
/// Writes the text `s` and a NUL to `buf` and its length (without the NUL) to `out_len`: the
/// one rule for every string kvxfer hands out. `KVX_BUFFER_TOO_SMALL` when `cap < len + 1`,
/// with the capacity needed (`len + 1`) in `out_len` and nothing written to `buf`.
///
/// # Safety
/// `buf` valid for `cap` bytes (or NULL with `cap` 0); `out_len` valid.
pub(crate) unsafe fn put_str(
    s: &str,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> Result<(), Fail> {
    if out_len.is_null() {
        return Err(null("out_len"));
    }
    if s.len() >= cap || buf.is_null() {
        // SAFETY: out_len non-NULL and valid per the contract.
        unsafe { *out_len = s.len() + 1 };
        return Err(fail(
            kvx_status::KVX_BUFFER_TOO_SMALL,
            format!(
                "{} bytes needed with the NUL, buffer holds {cap}",
                s.len() + 1
            ),
        ));
    }
    // SAFETY: buf valid for cap > s.len() bytes; s is a separate Rust allocation.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf.cast::<u8>(), s.len());
        *buf.add(s.len()) = 0;
        *out_len = s.len();
    }
    Ok(())
}

/// Writes the bytes `src` (not text: no NUL) to `buf` and their count to `out_len`.
///
/// # Safety
/// `buf` valid for `cap` bytes; `out_len` valid.
pub(crate) unsafe fn put(
    src: &[u8],
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> Result<(), Fail> {
    if out_len.is_null() {
        return Err(null("out_len"));
    }
    if src.len() > cap || (buf.is_null() && !src.is_empty()) {
        // SAFETY: out_len non-NULL and valid per the contract.
        unsafe { *out_len = src.len() };
        return Err(fail(
            kvx_status::KVX_BUFFER_TOO_SMALL,
            format!("{} bytes needed, buffer holds {cap}", src.len()),
        ));
    }
    if !src.is_empty() {
        // SAFETY: buf valid for cap >= src.len() bytes; src is a separate Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), buf, src.len()) };
    }
    // SAFETY: as above.
    unsafe { *out_len = src.len() };
    Ok(())
}

/// A caller's input struct (not a handle).
///
/// # Safety
/// `p` is NULL or valid for reads of a `T`.
pub(crate) unsafe fn plain<'a, T>(p: *const T, name: &str) -> Result<&'a T, Fail> {
    // SAFETY: per this function's contract.
    unsafe { p.as_ref() }.ok_or_else(|| null(name))
}

/// A live handle of type `T`, or why not: the one audited check every export makes of a
/// handle argument (as rustls-ffi's `try_ref_from_ptr!`). Any pointer may be passed: it is
/// looked up in the registry of live handles before it is dereferenced, so NULL, a freed
/// handle, a handle of another type and a stray pointer are refused, typed, and never read.
/// What the registry cannot see is a handle another thread frees during the call; kvxfer.h's
/// rule for threads forbids that (a handle is freed only when no call is using it).
pub(crate) fn handle<'a, T: Kind>(p: *const T, name: &str) -> Result<&'a T, Fail> {
    if p.is_null() {
        return Err(null(name));
    }
    if !live().contains(&(p as usize, T::KIND)) {
        return Err(fail(
            kvx_status::KVX_INVALID_HANDLE,
            format!(
                "{name} is not a live {} (freed, or not from this library)",
                T::NAME
            ),
        ));
    }
    // SAFETY: live: made by new_handle and not freed.
    Ok(unsafe { &*p })
}

/// As `handle`, mutably: for configs and transfers, the handles whose calls change them.
/// kvxfer.h's rule that such a handle is used by one thread at a time is what makes the
/// reference exclusive; the registry checks the rest.
pub(crate) fn handle_mut<'a, T: Kind>(p: *mut T, name: &str) -> Result<&'a mut T, Fail> {
    handle(p, name)?;
    // SAFETY: live (checked above); exclusive by kvxfer.h's one-thread rule for configs and
    // transfers.
    Ok(unsafe { &mut *p })
}

pub(crate) fn ms(v: u64) -> Option<Duration> {
    (v > 0).then(|| Duration::from_millis(v))
}
