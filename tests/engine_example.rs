//! Runs `examples/engine.rs` (a prefill and a decode engine in two processes, bound to the
//! connector traits) and checks what it prints: one verified line per request, the bytes
//! moved and skipped that the prefix hit implies, nothing held at the end.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn example() -> PathBuf {
    common::example("engine")
}

#[test]
fn two_engines_hand_over_through_the_traits() {
    for transport in ["tcp", "shm"] {
        let out = Command::new(example())
            .args([
                "--requests",
                "4",
                "--prompt-tokens",
                "256",
                "--prefix-hit",
                "0.25",
            ])
            .args(["--transport", transport])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "engine over {transport}: {}\n{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        // 256 tokens = 16 blocks of 28 layers x 64 KiB; a quarter of them cached.
        let block = 28.0 * 65536.0 / 1e6;
        let lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("req-")).collect();
        assert_eq!(lines.len(), 4, "{stdout}");
        for l in lines {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f[4], "verified", "{l}");
            let moved: f64 = f[2].parse().unwrap();
            let skipped: f64 = f[3].parse().unwrap();
            assert!((moved - 12.0 * block).abs() < 0.1, "moved {moved} MB: {l}");
            assert!(
                (skipped - 4.0 * block).abs() < 0.1,
                "skipped {skipped} MB: {l}"
            );
        }
        assert!(stdout.contains("0 failed; producer holds 0"), "{stdout}");
    }
}
