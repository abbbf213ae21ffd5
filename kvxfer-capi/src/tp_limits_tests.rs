//! Hostile TP shapes through the C ABI (issue 38, part 5): a handoff names the prefill TP, so
//! every shape a client can write answers typed within milliseconds, and none allocates by
//! it. Run in a child process under a 2 GiB address-space limit, where the old
//! `kvx_tp_plan` aborted (`memory allocation of 3221225472 bytes failed`, SIGABRT) on a
//! prefill TP of 2^31.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use crate::handle_tests::last_error;
use crate::kvx_status;
use crate::tp::{kvx_tp_plan, kvx_tp_read};

const CHILD: &str = "KVX_TP_LIMITS_CHILD";
const TEST: &str = "tp_limits_tests::hostile_tp_shapes_answer_typed_under_a_2_gib_address_space";

/// (prefill TP, prefill heads, decode TP, decode heads, decode rank).
const HOSTILE: [(u32, u32, u32, u32, u32); 8] = [
    (1 << 31, 8, 1, 8, 0),
    (1 << 20, 8, 1, 8, 0),
    (1, 1 << 31, 1, 1 << 31, 0),
    (8, u32::MAX, 1, u32::MAX, 0),
    (8, 8, 1 << 31, 8, 0),
    (u32::MAX, u32::MAX, u32::MAX, u32::MAX, u32::MAX),
    (4097, 4097, 1, 4097, 0),
    (8, 8, 1, 8, 5),
];

fn plan(s: (u32, u32, u32, u32, u32), cap: usize) -> (kvx_status, usize, Duration) {
    let mut out = vec![kvx_tp_read::default(); cap];
    let mut n = 0usize;
    let t0 = Instant::now();
    // SAFETY: `out` is valid for `cap` entries; `n` is a valid out pointer.
    let st = unsafe {
        kvx_tp_plan(
            s.0,
            s.1,
            s.2,
            s.3,
            s.4,
            if cap == 0 {
                null_mut()
            } else {
                out.as_mut_ptr()
            },
            cap,
            &mut n,
        )
    };
    (st, n, t0.elapsed())
}

fn the_shapes() {
    for s in HOSTILE {
        for cap in [0, 1, 4096] {
            let (st, n, took) = plan(s, cap);
            assert_eq!(
                st,
                kvx_status::KVX_INVALID_ARGUMENT,
                "{s:?} cap {cap}: {st:?}"
            );
            assert_eq!(n, 0, "{s:?}: {n} entries said");
            assert!(
                last_error().contains("TP") || last_error().contains("head"),
                "{}",
                last_error()
            );
            assert!(took < Duration::from_millis(50), "{s:?} took {took:?}");
        }
    }
    // The largest shape allowed plans: KVX_MAX_TP entries, in milliseconds.
    let big = (4096, 65_536, 1, 65_536, 0);
    let (st, n, took) = plan(big, 0);
    assert_eq!(
        (st, n),
        (kvx_status::KVX_BUFFER_TOO_SMALL, 4096),
        "{}",
        last_error()
    );
    let (st, n, took2) = plan(big, n);
    assert_eq!((st, n), (kvx_status::KVX_OK, 4096), "{}", last_error());
    assert!(
        took + took2 < Duration::from_millis(200),
        "{took:?} + {took2:?}"
    );
}

#[test]
fn hostile_tp_shapes_answer_typed_under_a_2_gib_address_space() {
    if std::env::var_os(CHILD).is_some() {
        // AddressSanitizer reserves terabytes of address space for its shadow: no limit fits
        // it. The sanitizer run checks the answers without the limit; the plain run, with it.
        if std::env::var_os("ASAN_OPTIONS").is_some() {
            eprintln!("under AddressSanitizer: the shapes without the address-space limit");
            the_shapes();
            return;
        }
        let limit = 2u64 << 30;
        let rl = libc::rlimit {
            rlim_cur: limit,
            rlim_max: limit,
        };
        // SAFETY: a valid rlimit for this process (the child: nothing else runs in it).
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) }, 0);
        the_shapes();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "the child under a 2 GiB limit: {:?}\n{text}",
        out.status
    );
}
