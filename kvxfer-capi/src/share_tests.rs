//! `kvx_agent_alloc_shared`: a region shared with named peers only. Its arguments are
//! checked before anything is allocated, naming peers needs a secret, and the region it makes
//! carries no UCX key in the agent's metadata (the TCP lane's share check is tested end to end
//! in `kvxfer/tests/shares.rs`).
#![allow(clippy::unwrap_used)]

use std::ffi::{c_char, CStr};
use std::ptr::{null, null_mut};

use crate::agent::region::{
    kvx_agent_alloc_shared, kvx_agent_deregister, kvx_agent_register_shared, kvx_region_free,
};
use crate::agent::{
    kvx_agent_config_free, kvx_agent_config_new, kvx_agent_config_set_net_devices,
    kvx_agent_config_set_secret, kvx_agent_free, kvx_agent_new_with,
};
use crate::handle_tests::last_error;
use crate::{kvx_agent, kvx_agent_config, kvx_region, kvx_status};

fn agent(name: &CStr, secret: Option<&[u8]>) -> *mut kvx_agent {
    let mut c: *mut kvx_agent_config = null_mut();
    let mut a: *mut kvx_agent = null_mut();
    // SAFETY: NUL-terminated strings, valid out pointers, `c` live until freed below.
    unsafe {
        assert_eq!(
            kvx_agent_config_new(name.as_ptr(), &mut c),
            kvx_status::KVX_OK
        );
        assert_eq!(
            kvx_agent_config_set_net_devices(c, c"lo".as_ptr()),
            kvx_status::KVX_OK
        );
        if let Some(s) = secret {
            assert_eq!(
                kvx_agent_config_set_secret(c, s.as_ptr(), s.len()),
                kvx_status::KVX_OK
            );
        }
        let st = kvx_agent_new_with(c, &mut a);
        assert_eq!(st, kvx_status::KVX_OK, "{}", last_error());
        kvx_agent_config_free(c);
    }
    a
}

fn alloc(a: *mut kvx_agent, peers: &[*const c_char]) -> (kvx_status, *mut kvx_region) {
    let mut r: *mut kvx_region = null_mut();
    let p = if peers.is_empty() {
        null()
    } else {
        peers.as_ptr()
    };
    // SAFETY: `a` live; `peers` valid for its length; `r` a valid out pointer.
    let st = unsafe { kvx_agent_alloc_shared(a, 1 << 16, p, peers.len(), &mut r) };
    (st, r)
}

#[test]
fn shared_regions_are_checked_and_need_a_secret_to_name_peers() {
    let open = agent(c"capi-share-open", None);
    let (st, r) = alloc(open, &[c"decode-0".as_ptr()]);
    assert_eq!(st, kvx_status::KVX_INVALID_ARGUMENT);
    assert!(r.is_null());
    assert!(last_error().contains("needs a secret"), "{}", last_error());
    // Shared with nobody needs no proof of names.
    let (st, r) = alloc(open, &[]);
    assert_eq!(st, kvx_status::KVX_OK, "{}", last_error());
    // SAFETY: a live region handle, freed once.
    unsafe { kvx_region_free(r) };

    let sealed = agent(c"capi-share-sealed", Some(b"open sesame"));
    // A NULL name, a NULL list with a count, a name that is not UTF-8: refused typed.
    let (st, r) = alloc(sealed, &[c"decode-0".as_ptr(), null()]);
    assert_eq!((st, r.is_null()), (kvx_status::KVX_NULL_PARAMETER, true));
    assert!(last_error().contains("peers[1]"), "{}", last_error());
    let mut r: *mut kvx_region = null_mut();
    // SAFETY: a NULL list with a count (refused before it is read).
    let st = unsafe { kvx_agent_alloc_shared(sealed, 4096, null(), 2, &mut r) };
    assert_eq!((st, r.is_null()), (kvx_status::KVX_NULL_PARAMETER, true));
    let bad = [0xffu8, 0];
    let (st, _) = alloc(sealed, &[bad.as_ptr().cast()]);
    assert_eq!(st, kvx_status::KVX_INVALID_ARGUMENT);
    // With the secret: made, and published with no key.
    let (st, r) = alloc(sealed, &[c"decode-0".as_ptr()]);
    assert_eq!(st, kvx_status::KVX_OK, "{}", last_error());
    // SAFETY: both handles live (checked above).
    let (a, region) = unsafe { (&*sealed, &*r) };
    let meta = kvxfer_proto::wire::metadata::Metadata::decode(
        &a.inner.metadata().unwrap(),
        kvxfer_core::DEFAULT_COMPAT,
    )
    .unwrap();
    let m = meta
        .regions
        .iter()
        .find(|m| m.id == region.inner.id())
        .unwrap();
    assert!(m.rkey.is_empty() && m.shm.is_none() && m.base == 0, "{m:?}");
    // An engine's memory registered shared with no peer: no key either, and it deregisters.
    let mut mem = vec![0u8; 1 << 16];
    let mut raw: *mut kvx_region = null_mut();
    // SAFETY: `mem` outlives the registration (deregistered below); NULL list with 0 names.
    let st = unsafe {
        kvx_agent_register_shared(
            sealed,
            mem.as_mut_ptr().cast(),
            mem.len(),
            -1,
            null(),
            0,
            &mut raw,
        )
    };
    assert_eq!(st, kvx_status::KVX_OK, "{}", last_error());
    // SAFETY: both handles live.
    let id = unsafe { (*raw).inner.id() };
    let meta = kvxfer_proto::wire::metadata::Metadata::decode(
        &a.inner.metadata().unwrap(),
        kvxfer_core::DEFAULT_COMPAT,
    )
    .unwrap();
    let m = meta.regions.iter().find(|m| m.id == id).unwrap();
    assert!(m.rkey.is_empty() && m.base == 0, "{m:?}");
    // SAFETY: live handles.
    let st = unsafe { kvx_agent_deregister(sealed, raw) };
    assert_eq!(st, kvx_status::KVX_OK);
    // SAFETY: live handles, each freed once.
    unsafe {
        kvx_region_free(raw);
        kvx_region_free(r);
        kvx_agent_free(sealed);
        kvx_agent_free(open);
    }
}
