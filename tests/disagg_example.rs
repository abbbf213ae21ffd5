//! Runs `examples/disagg.rs` (two processes, Qwen3-0.6B-shaped caches) and checks its
//! acceptance figures: every byte verified, a 0.857 prefix hit moves at most 15% of the
//! request's bytes, and the peak RSS beyond the registered caches stays within the budget
//! plus 32 MiB. Figures, not timings.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn example() -> PathBuf {
    common::example("disagg")
}

fn run(args: &[&str]) -> serde_json::Value {
    let out = Command::new(example())
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "disagg {args:?}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[test]
fn prefix_hit_moves_at_most_15_percent_within_budget() {
    for t in ["tcp", "shm"] {
        let j = run(&[
            "--requests",
            "2",
            "--prefix-hit",
            "0.857",
            "--concurrency",
            "2",
            "--budget-mib",
            "512",
            "--transport",
            t,
        ]);
        assert_eq!(j["verified"], true, "{j}");
        let moved = j["bytes_moved"].as_f64().unwrap();
        let full = j["bytes_full"].as_f64().unwrap();
        assert!(moved <= 0.15 * full, "{t}: moved {moved} of {full}");
        assert!(moved > 0.0);
        assert!(
            j["peak_rss_extra_mib"].as_f64().unwrap() < 512.0 + 32.0,
            "{j}"
        );
    }
}

#[test]
fn push_layer_wise_full_load() {
    let j = run(&[
        "--requests",
        "1",
        "--concurrency",
        "1",
        "--transport",
        "tcp",
        "--mode",
        "push",
        "--layer-wise",
    ]);
    assert_eq!(j["verified"], true, "{j}");
    assert_eq!(j["bytes_moved"], j["bytes_full"], "{j}");
}
