//! Handoffs: publishing one (with a fresh grant or the caller's) and sealing one, for an
//! engine whose scheduler writes the handoff its clients see: it seals what it wrote, and the
//! decode side checks that seal before it acts on any field.

use std::ffi::c_char;

use kvxfer_core::connector::{Grant, Handoff, HandoffKey, GRANT_LEN};

use crate::error::{fail, guard, Fail};
use crate::ffi::{handle, null, put, try_cstr, try_slice};
use crate::{kvx_producer, kvx_status};

/// Holds `blocks` of `request` for consumers; writes the handoff (bytes to pass to the
/// consumer) to `buf`. `layers_done`: layers already computed (all, or 0 for layer-wise). The
/// handoff carries a fresh grant (only consumers that present it are answered) and, with a
/// secret, the producer's seal.
///
/// # Safety
/// `p` live; strings NUL-terminated; `blocks` valid for `n`; `buf` for `cap`; `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_publish(
    p: *const kvx_producer,
    request: *const c_char,
    blocks: *const u32,
    n: usize,
    tokens: u64,
    layers_done: u32,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_producer_publish", || {
        // SAFETY: per this function's contract.
        unsafe {
            publish(
                p,
                request,
                None,
                blocks,
                n,
                tokens,
                layers_done,
                buf,
                cap,
                out_len,
            )
        }
    })
}

/// [`kvx_producer_publish`] under the caller's `grant` (`grant_len` must be 16): for an engine
/// whose scheduler writes the handoff its clients see and puts the same grant into it (hex).
///
/// # Safety
/// As [`kvx_producer_publish`]; `grant` valid for `grant_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvx_producer_publish_granted(
    p: *const kvx_producer,
    request: *const c_char,
    grant: *const u8,
    grant_len: usize,
    blocks: *const u32,
    n: usize,
    tokens: u64,
    layers_done: u32,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_producer_publish_granted", || {
        // SAFETY: valid for `grant_len` per the contract.
        let g = unsafe { grant_of(grant, grant_len) }?;
        // SAFETY: as above.
        unsafe {
            publish(
                p,
                request,
                Some(g),
                blocks,
                n,
                tokens,
                layers_done,
                buf,
                cap,
                out_len,
            )
        }
    })
}

/// The grant at `grant` (`len` must be 16).
///
/// # Safety
/// `grant` valid for `len` bytes (NULL with `len` 0 is refused as too short).
pub(crate) unsafe fn grant_of(grant: *const u8, len: usize) -> Result<Grant, Fail> {
    let g = try_slice!(grant, len, "grant");
    <[u8; GRANT_LEN]>::try_from(g).map(Grant).map_err(|_| {
        fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            format!("a grant is {GRANT_LEN} bytes, not {len}"),
        )
    })
}

/// The body of both publish calls (`grant` `None`: a fresh one).
///
/// # Safety
/// As [`kvx_producer_publish`].
#[allow(clippy::too_many_arguments)]
unsafe fn publish(
    p: *const kvx_producer,
    request: *const c_char,
    grant: Option<Grant>,
    blocks: *const u32,
    n: usize,
    tokens: u64,
    layers_done: u32,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> Result<(), Fail> {
    let b = try_slice!(blocks, n, "blocks");
    // SAFETY: as above.
    unsafe {
        publish_groups(
            p,
            request,
            grant,
            &[b],
            tokens,
            layers_done,
            buf,
            cap,
            out_len,
        )
    }
}

/// Publishes `blocks` (per cache group) and writes the handoff to `buf`.
///
/// # Safety
/// `p` live; `request` NUL-terminated; `buf` valid for `cap`; `out_len` valid.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn publish_groups(
    p: *const kvx_producer,
    request: *const c_char,
    grant: Option<Grant>,
    blocks: &[&[u32]],
    tokens: u64,
    layers_done: u32,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> Result<(), Fail> {
    let p = handle(p, "producer")?;
    let r = try_cstr!(request, "request");
    if out_len.is_null() {
        return Err(null("out_len"));
    }
    let h = p
        .inner
        .publish_groups(r, blocks, tokens, layers_done as usize, grant)?;
    let bytes = h.encode();
    // A too-small buffer leaves nothing published.
    if bytes.len() > cap {
        p.inner.abort(r);
    }
    // SAFETY: as above.
    unsafe { put(&bytes, buf, cap, out_len) }
}

/// Seals the libkvxfer handoff `handoff` (JSON, as a producer writes it) under the shared
/// `secret` and writes it, sealed, to `buf`: for a decode side that built the handoff of one
/// producer rank from a handoff whose own seal it checked ([`kvx_handoff_verify_bytes`]).
///
/// # Safety
/// `secret` valid for `secret_len` bytes, `handoff` for `handoff_len`, `buf` for `cap`;
/// `out_len` valid.
#[no_mangle]
pub unsafe extern "C" fn kvx_handoff_seal(
    secret: *const u8,
    secret_len: usize,
    handoff: *const u8,
    handoff_len: usize,
    buf: *mut u8,
    cap: usize,
    out_len: *mut usize,
) -> kvx_status {
    guard("kvx_handoff_seal", || {
        // SAFETY: per this function's contract.
        let key = unsafe { key(secret, secret_len) }?;
        let b = try_slice!(handoff, handoff_len, "handoff");
        let mut h = Handoff::decode(b)?;
        key.seal(&mut h);
        // SAFETY: as above.
        unsafe { put(&h.encode(), buf, cap, out_len) }
    })
}

/// Writes to `seal` (`SEAL_LEN`, 32 bytes) the seal of the opaque `bytes` under `secret`: an
/// engine's scheduler seals the handoff it wrote in its own format.
///
/// # Safety
/// `secret` valid for `secret_len` bytes, `bytes` for `len`, `seal` for 32 bytes.
#[no_mangle]
pub unsafe extern "C" fn kvx_handoff_seal_bytes(
    secret: *const u8,
    secret_len: usize,
    bytes: *const u8,
    len: usize,
    seal: *mut u8,
) -> kvx_status {
    guard("kvx_handoff_seal_bytes", || {
        // SAFETY: per this function's contract.
        let key = unsafe { key(secret, secret_len) }?;
        let b = try_slice!(bytes, len, "bytes");
        if seal.is_null() {
            return Err(null("seal"));
        }
        let s = key.seal_bytes(b);
        // SAFETY: seal is non-NULL and valid for 32 bytes per the contract; s is a local.
        unsafe { std::ptr::copy_nonoverlapping(s.as_ptr(), seal, s.len()) };
        Ok(())
    })
}

/// `KVX_OK` when `seal` is [`kvx_handoff_seal_bytes`]'s seal of `bytes` under `secret`;
/// `KVX_AUTH` when it is not (edited, another secret, or not 32 bytes long).
///
/// # Safety
/// `secret` valid for `secret_len` bytes, `bytes` for `len`, `seal` for `seal_len`.
#[no_mangle]
pub unsafe extern "C" fn kvx_handoff_verify_bytes(
    secret: *const u8,
    secret_len: usize,
    bytes: *const u8,
    len: usize,
    seal: *const u8,
    seal_len: usize,
) -> kvx_status {
    guard("kvx_handoff_verify_bytes", || {
        // SAFETY: per this function's contract.
        let key = unsafe { key(secret, secret_len) }?;
        let b = try_slice!(bytes, len, "bytes");
        let s = try_slice!(seal, seal_len, "seal");
        key.verify_bytes(b, s)
            .map_err(|e| fail(kvx_status::KVX_AUTH, format!("handoff: {e}")))
    })
}

/// The handoff key of a non-empty secret.
///
/// # Safety
/// `secret` valid for `secret_len` bytes.
unsafe fn key(secret: *const u8, secret_len: usize) -> Result<HandoffKey, Fail> {
    let s = try_slice!(secret, secret_len, "secret");
    if s.is_empty() {
        return Err(fail(
            kvx_status::KVX_INVALID_ARGUMENT,
            "the secret is empty",
        ));
    }
    Ok(HandoffKey::new(s))
}
