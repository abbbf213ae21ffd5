//! What the C ABI takes from a caller is checked before it acts (issue 34, part 7): a
//! `kvx_op` outside the enum is `KVX_INVALID_ARGUMENT` (it used to be transmuted: `op = 7`
//! returned `KVX_OK` and put request kind 0xfb on the wire), and a call whose work cannot be
//! undone fails on a NULL output buffer before it binds or connects anything.
#![allow(clippy::unwrap_used)]

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};
use std::time::Duration;

use crate::agent::transfer::kvx_agent_transfer;
use crate::agent::{kvx_agent_connect, kvx_agent_free, kvx_agent_listen, kvx_agent_new};
use crate::handle_tests::last_error;
use crate::{kvx_agent, kvx_op, kvx_status, kvx_transfer};

fn agent(name: &CStr) -> *mut kvx_agent {
    let mut a: *mut kvx_agent = null_mut();
    // SAFETY: NUL-terminated strings, a valid out pointer.
    let st = unsafe { kvx_agent_new(name.as_ptr(), c"tcp".as_ptr(), c"lo".as_ptr(), 0, &mut a) };
    assert_eq!(st, kvx_status::KVX_OK, "{}", last_error());
    a
}

#[test]
fn an_op_outside_the_enum_is_refused_before_anything() {
    let a = agent(c"capi-op");
    // A transfer of `op` with NULL lists (which the op check comes before): its status, and
    // whether a transfer handle came out.
    let transfer = |op: u32| {
        let mut t: *mut kvx_transfer = null_mut();
        // SAFETY: `a` live; the lists NULL (refused typed); `t` a valid out pointer.
        let st = unsafe {
            kvx_agent_transfer(
                a,
                op,
                null(),
                null(),
                null(),
                null(),
                0,
                null(),
                0,
                0,
                &mut t,
            )
        };
        (st, t.is_null())
    };
    for op in [2u32, 7, 0xfb, u32::MAX] {
        assert_eq!(
            transfer(op),
            (kvx_status::KVX_INVALID_ARGUMENT, true),
            "op {op}"
        );
        let e = last_error();
        assert!(e.contains(&format!("op {op}")), "op {op}: {e}");
    }
    // The enum's own values get past it (to the NULL lists).
    for op in [kvx_op::KVX_READ as u32, kvx_op::KVX_WRITE as u32] {
        assert_ne!(transfer(op).0, kvx_status::KVX_OK);
        assert!(!last_error().contains("op "), "{}", last_error());
    }
    // SAFETY: `a` live, freed once.
    unsafe { kvx_agent_free(a) };
}

#[test]
fn listen_and_connect_with_a_null_buffer_bind_and_dial_nothing() {
    let a = agent(c"capi-null-out");
    // A free port: kvx_agent_listen must leave it free.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = CString::new(format!("127.0.0.1:{port}")).unwrap();
    let mut n = 0usize;
    // SAFETY: `a` live, `addr` NUL-terminated, `n` valid; `buf` NULL on purpose.
    let st = unsafe { kvx_agent_listen(a, addr.as_ptr(), null_mut(), 64, &mut n) };
    assert!(
        std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
        "a failed kvx_agent_listen ({st:?}) bound port {port}"
    );
    assert_eq!(st, kvx_status::KVX_NULL_PARAMETER, "{}", last_error());
    // A listener the test runs: a failed kvx_agent_connect dials it not.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let to = CString::new(l.local_addr().unwrap().to_string()).unwrap();
    // SAFETY: as above.
    let st = unsafe { kvx_agent_connect(a, to.as_ptr(), null_mut(), 256, &mut n) };
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        l.accept().is_err(),
        "a failed kvx_agent_connect ({st:?}) dialled the peer"
    );
    assert_eq!(st, kvx_status::KVX_NULL_PARAMETER, "{}", last_error());
    // SAFETY: `a` live, freed once.
    unsafe { kvx_agent_free(a) };
}

/// A connector's flags and mode outside their values are refused with their names, and no
/// producer is made (a `mode` of 7 used to be taken as pull, `fused` 2 as fused).
#[test]
fn a_connector_flag_or_mode_outside_its_values_is_refused() {
    use crate::connector::kvx_producer_new;
    use crate::{kvx_connector_config, kvx_layer_base, kvx_layout, kvx_producer, kvx_state_part};
    let a = agent(c"capi-flags");
    let good = kvx_layout {
        layers: 1,
        kv_heads: 1,
        head_dim: 8,
        dtype_bytes: 2,
        block_tokens: 4,
        num_blocks: 4,
        packing: 1,
        hnd: 0,
        state_parts: null(),
        state_parts_len: 0,
        state_padding: 0,
        pad_per_head: 0,
    };
    // More parts, and a part of more segments, than the limits (refused before either array
    // is read).
    let segs = [2u64; 9];
    let one = kvx_state_part {
        rows: 1,
        segments: 1,
        per_unit: segs.as_ptr(),
        channel_bytes: 4,
    };
    let parts = [one; 9];
    let wide = [kvx_state_part { segments: 9, ..one }];
    let bases = [kvx_layer_base {
        k_region: 0,
        k_offset: 0,
        v_region: u32::MAX,
        v_offset: 0,
    }];
    let cases = [
        ("packing is 4", kvx_layout { packing: 4, ..good }, 0),
        (
            "a state layout has block_tokens 1",
            kvx_layout { packing: 3, ..good },
            0,
        ),
        (
            "9 state parts: 1 to 8",
            kvx_layout {
                packing: 3,
                block_tokens: 1,
                hnd: 0,
                state_parts: parts.as_ptr(),
                state_parts_len: 9,
                ..good
            },
            0,
        ),
        (
            "9 segments: 1 to 8",
            kvx_layout {
                packing: 3,
                block_tokens: 1,
                state_parts: wide.as_ptr(),
                state_parts_len: 1,
                ..good
            },
            0,
        ),
        (
            "kv_heads must be 1, not 2",
            kvx_layout {
                packing: 2,
                kv_heads: 2,
                ..good
            },
            0,
        ),
        ("hnd is 9", kvx_layout { hnd: 9, ..good }, 0),
        ("mode 7", good, 7),
    ];
    for (want, l, mode) in cases {
        let cfg = kvx_connector_config {
            mode,
            ..kvx_connector_config::default()
        };
        let mut p: *mut kvx_producer = null_mut();
        // SAFETY: `a` live; `l`, `bases`, `cfg` valid; `p` a valid out pointer.
        let st = unsafe { kvx_producer_new(a, &l, bases.as_ptr(), &cfg, null(), &mut p) };
        assert_eq!(
            st,
            kvx_status::KVX_INVALID_ARGUMENT,
            "{want}: {}",
            last_error()
        );
        assert!(last_error().contains(want), "{want}: {}", last_error());
        assert!(p.is_null());
    }
    // SAFETY: `a` live, freed once.
    unsafe { kvx_agent_free(a) };
}
