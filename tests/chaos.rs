//! CI's short chaos (the long one is `scripts/chaos.sh`): `examples/chaos.rs` runs KV-shaped
//! handoffs through the connector between a prefill worker process and a decode worker
//! while the prefill worker is SIGKILLed and restarted and SIGSTOPped past its lease, pull
//! and push. Checked from its figures: faults were injected, loads completed and verified
//! byte for byte, every failed load came back typed with its blocks, nothing stuck, nothing
//! held by the producer at the end, nothing lost.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn example() -> PathBuf {
    common::example("chaos")
}

#[test]
fn handoffs_survive_killed_and_stopped_prefill_workers() {
    for mode in ["pull", "push"] {
        let out = Command::new(example())
            .args(["--seconds", "12", "--mode", mode, "--seed", "7"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "chaos {mode}: {stderr}\n{stdout}");
        let j: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        println!("{mode}: {j}\n{stderr}");
        let n = |k: &str| j[k].as_u64().unwrap();
        assert!(n("sigkills") + n("sigstops") >= 3, "{j}");
        assert!(n("verified") > 0 && n("verified") == n("completed"), "{j}");
        assert_eq!(n("bad_bytes") + n("failed_untyped") + n("stuck"), 0, "{j}");
        assert_eq!(n("held_at_end") + n("in_progress_at_end"), 0, "{j}");
    }
}
