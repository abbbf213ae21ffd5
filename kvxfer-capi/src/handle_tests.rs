//! The C ABI's handles, driven from Rust as a C caller would (and run under AddressSanitizer
//! by `scripts/sanitizers.sh`): live handles work, freed and NULL ones are refused with a
//! status and a message, a double free is ignored, memory is written through the pointer the
//! library gives and read back by a transfer.
#![allow(clippy::unwrap_used)]

use std::ffi::{c_char, CStr};
use std::ptr::{null, null_mut};

use crate::agent::region::{
    kvx_agent_alloc, kvx_agent_deregister, kvx_region_free, kvx_region_ptr,
};
use crate::agent::{kvx_agent_free, kvx_agent_metadata, kvx_agent_new};
use crate::error::kvx_last_error;
use crate::{kvx_agent, kvx_region, kvx_status};

/// The calling thread's last error, as a C caller reads it.
pub(crate) fn last_error() -> String {
    let mut b = [0 as c_char; 512];
    // SAFETY: `b` is valid for 512 bytes.
    unsafe { kvx_last_error(b.as_mut_ptr(), b.len()) };
    // SAFETY: kvx_last_error NUL-terminates within `cap`.
    unsafe { CStr::from_ptr(b.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn live_freed_and_null_handles() {
    let mut a: *mut kvx_agent = null_mut();
    // SAFETY: NUL-terminated names, a valid out pointer, as a C caller passes them.
    let st = unsafe {
        kvx_agent_new(
            c"capi-h".as_ptr(),
            c"tcp".as_ptr(),
            c"lo".as_ptr(),
            0,
            &mut a,
        )
    };
    assert_eq!(st, kvx_status::KVX_OK, "{}", last_error());
    let mut r: *mut kvx_region = null_mut();
    // SAFETY: `a` live, `r` a valid out pointer.
    let st = unsafe { kvx_agent_alloc(a, 1 << 20, &mut r) };
    assert_eq!(st, kvx_status::KVX_OK);
    // SAFETY: `r` live.
    let p = unsafe { kvx_region_ptr(r) }.cast::<u8>();
    assert!(!p.is_null());
    // SAFETY: the library allocated 1 MiB at `p`, registered, alive until freed below.
    unsafe { std::ptr::write_bytes(p, 0xa5, 1 << 20) };
    // SAFETY: as above; reading back what was written.
    assert!(unsafe { std::slice::from_raw_parts(p, 1 << 20) }
        .iter()
        .all(|&b| b == 0xa5));

    let mut need = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    // SAFETY: `a` live, `buf` valid for its length, `need` valid.
    let st = unsafe { kvx_agent_metadata(a, buf.as_mut_ptr(), buf.len(), &mut need) };
    assert_eq!(st, kvx_status::KVX_OK, "{}", last_error());
    assert!(need > 0 && need <= buf.len());

    // SAFETY: `a`, `r` live.
    assert_eq!(unsafe { kvx_agent_deregister(a, r) }, kvx_status::KVX_OK);
    // SAFETY: `r` live; freed once.
    unsafe { kvx_region_free(r) };
    // A freed handle: refused, named, nothing touched.
    // SAFETY: the library checks handles before use; `r` is a stale pointer it returned.
    assert!(unsafe { kvx_region_ptr(r) }.is_null());
    // SAFETY: as above.
    unsafe { kvx_region_free(r) };
    assert!(last_error().contains("not live"), "{}", last_error());
    // NULL where a handle is needed.
    // SAFETY: NULL is allowed and refused.
    let st = unsafe { kvx_agent_metadata(null(), buf.as_mut_ptr(), buf.len(), &mut need) };
    assert_ne!(st, kvx_status::KVX_OK);
    // SAFETY: `a` live; freed once, then a double free that is ignored.
    unsafe { kvx_agent_free(a) };
    // SAFETY: as above.
    unsafe { kvx_agent_free(a) };
    assert!(last_error().contains("not live"), "{}", last_error());
}
