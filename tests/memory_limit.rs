//! The serving worker under a memory cgroup (CI's short version of
//! `scripts/memory-limit.sh`): kvxfer-bench's peer in a cgroup of 768 MiB serves concurrency 8
//! of 16 MiB requests over TCP and in-host, READ and WRITE, bytes verified, with no OOM kill
//! and the cgroup's peak under the limit; a SETUP that cannot fit is refused with the figures.
//! Needs root and a cgroup memory controller; the script says SKIP without them.
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::process::Command;

#[test]
fn the_serving_worker_fits_its_memory_limit_or_refuses_at_setup() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("bash")
        .arg(root.join("scripts/memory-limit.sh"))
        .arg("--quick")
        .env("KVX_BENCH", env!("CARGO_BIN_EXE_kvxfer-bench"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    if text.contains("SKIP") {
        return;
    }
    assert!(out.status.success(), "{text}");
    assert!(text.contains("memory-limit: ok"), "{text}");
    assert!(text.contains("out of memory: the KV caches"), "{text}");
    assert_eq!(text.matches(" True ").count(), 4, "{text}");
}
