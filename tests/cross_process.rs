//! Cross-process end-to-end: kvxfer-bench starts its peer as a second process (readiness via
//! the peer's READY line, port 0 everywhere), moves random-placed blocks, and verifies every
//! byte on the receiving side, for READ and WRITE over TCP and shared memory.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::process::Command;

fn bench(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args(args)
        .args(["--json", "--iters", "2", "--warmup", "1"])
        .output()
        .expect("kvxfer-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kvxfer-bench {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout.lines().last().expect("one JSON line");
    serde_json::from_str(line).expect("valid JSON")
}

fn check(transport: &str, op: &str, placement: &str) {
    let j = bench(&[
        "--transport",
        transport,
        "--op",
        op,
        "--blocks",
        "512",
        "--block-size",
        "16384",
        "--placement",
        placement,
    ]);
    assert_eq!(j["verified"], true, "{j}");
    assert_eq!(j["bytes"], 512 * 16384, "{j}");
    assert_eq!(j["descriptors"], 512, "{j}");
    assert_eq!(j["op"], op, "{j}");
    if placement == "contiguous" {
        assert_eq!(
            j["ops"], 1,
            "contiguous blocks must coalesce into one operation: {j}"
        );
    }
    assert!(
        j["ucx_version"].as_str().is_some_and(|v| !v.is_empty()),
        "{j}"
    );
}

#[test]
fn tcp_write_two_processes() {
    check("tcp", "write", "random");
}

#[test]
fn tcp_read_two_processes() {
    check("tcp", "read", "random");
}

#[test]
fn shm_write_two_processes() {
    check("shm", "write", "random");
    let j = bench(&[
        "--transport",
        "shm",
        "--op",
        "write",
        "--blocks",
        "64",
        "--block-size",
        "4096",
    ]);
    assert!(
        j["transport"].as_str().unwrap_or("").contains("(rma)"),
        "no RMA lane: {j}"
    );
}

#[test]
fn shm_read_two_processes_contiguous() {
    check("shm", "read", "contiguous");
}
