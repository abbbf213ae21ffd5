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

fn bench_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args(args)
        .output()
        .expect("kvxfer-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kvxfer-bench {args:?} failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect()
}

#[test]
fn sweep_prints_one_verified_line_per_combination_with_lanes() {
    let v = bench_lines(&[
        "--json",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--blocks",
        "64,128",
        "--block-size",
        "4096",
        "--op",
        "write,read",
        "--transport",
        "shm;tcp",
    ]);
    assert_eq!(v.len(), 8, "{v:?}");
    for j in &v {
        assert_eq!(j["verified"], true, "{j}");
        let want = if j["transport_requested"] == "shm" {
            "shm"
        } else {
            "tcp"
        };
        assert_eq!(j["lane"], want, "kvxfer's own lane is used: {j}");
    }
    let ucx = bench_lines(&[
        "--json",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--blocks",
        "64",
        "--block-size",
        "4096",
        "--ucx-only",
    ]);
    assert_eq!(ucx[0]["lane"], "ucx", "{}", ucx[0]);
    assert_eq!(ucx[0]["verified"], true);
}

#[test]
fn reference_and_concurrency() {
    let v = bench_lines(&[
        "--json",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--blocks",
        "256",
        "--block-size",
        "16384",
        "--concurrency",
        "3",
        "--reference",
        "--transport",
        "tcp",
    ]);
    let j = &v[0];
    assert_eq!(j["verified"], true, "{j}");
    assert_eq!(j["concurrency"], 3);
    assert_eq!(j["bytes"], 3 * 256 * 16384);
    assert_eq!(
        j["ops"],
        3 * 256,
        "three requests of 256 random blocks: {j}"
    );
    for k in [
        "memcpy_ms",
        "tcp_ms",
        "tcp_mem_ms",
        "x_memcpy",
        "x_tcp",
        "x_tcp_mem",
    ] {
        assert!(j[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {j}");
    }
    let x = j["median_ms"].as_f64().unwrap() / j["tcp_ms"].as_f64().unwrap();
    assert!((x - j["x_tcp"].as_f64().unwrap()).abs() < 1e-9);
    let x = j["median_ms"].as_f64().unwrap() / j["tcp_mem_ms"].as_f64().unwrap();
    assert!((x - j["x_tcp_mem"].as_f64().unwrap()).abs() < 1e-9);
}

#[test]
fn single_placement_is_one_operation() {
    let v = bench_lines(&[
        "--json",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--blocks",
        "100",
        "--block-size",
        "4096",
        "--placement",
        "single",
        "--transport",
        "shm",
        "--op",
        "read",
    ]);
    assert_eq!(v[0]["ops"], 1, "{}", v[0]);
    assert_eq!(v[0]["verified"], true);
}

#[test]
fn plan_reports_the_seed_figures() {
    let v = bench_lines(&[
        "plan",
        "--model",
        "qwen3-0.6b",
        "--prompt-tokens",
        "2371",
        "--link-gbps",
        "0.936",
        "--concurrency",
        "4",
        "--prefill-tokens-per-s",
        "20000",
        "--json",
    ]);
    let j = &v[0];
    assert_eq!(j["bytes_per_token"], 114688);
    assert_eq!(j["descriptors"], 8344);
    // 273.4 MB at 117 MB/s: the measured deployment's 2.3-2.5 s.
    let h = j["handoff_s"].as_f64().unwrap();
    assert!((2.3..2.4).contains(&h), "{j}");
    assert_eq!(j["host_bytes"], 4 * 273_416_192u64);
    assert!(
        j["notes"][0].as_str().unwrap().contains("cannot pay off"),
        "{j}"
    );
    // A Hugging Face config.json instead of a preset.
    let dir = std::env::temp_dir().join(format!("kvx-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"hidden_size":4096,"num_attention_heads":32,"num_hidden_layers":32,
            "num_key_value_heads":8,"torch_dtype":"bfloat16"}"#,
    )
    .unwrap();
    let v = bench_lines(&[
        "plan",
        "--config",
        cfg.to_str().unwrap(),
        "--link-gbps",
        "100",
        "--json",
    ]);
    assert_eq!(v[0]["bytes_per_token"], 131072, "{}", v[0]);
    std::fs::remove_dir_all(&dir).unwrap();
    // Bad input is an error with a message, not a panic.
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args(["plan", "--model", "gpt-9", "--link-gbps", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown model preset"));
}

/// The device lane between two processes' simulated devices (sealed memory files, exported
/// and opened as CUDA's shareable allocations are): a scattered request of 512 blocks is one
/// submission on the initiator's device, every iteration verified byte for byte.
#[test]
fn device_lane_two_processes() {
    for op in ["write", "read"] {
        let j = bench(&[
            "--memory",
            "sim",
            "--transport",
            "shm",
            "--op",
            op,
            "--blocks",
            "512",
            "--block-size",
            "16384",
            "--verify-each",
        ]);
        assert_eq!(j["verified"], true, "{j}");
        assert_eq!(j["verified_iterations"].as_u64(), Some(3), "{j}");
        assert_eq!(j["lane"], "device", "{j}");
        assert_eq!(j["submissions"], 1, "{j}");
    }
}

/// A buffer shared with the initiator only (`--shared-only`, with a secret), host and
/// device memory in two processes of one host: no shm handle, no device export, so both
/// ops go over the TCP lane, whose target checks the share set (device memory staged at both
/// ends); every iteration verified.
#[test]
fn shared_only_buffers_take_the_checked_lane_two_processes() {
    for memory in ["host", "sim"] {
        for op in ["write", "read"] {
            let j = bench(&[
                "--memory",
                memory,
                "--transport",
                "shm",
                "--secret",
                "open sesame",
                "--shared-only",
                "--op",
                op,
                "--blocks",
                "512",
                "--block-size",
                "16384",
                "--verify-each",
            ]);
            assert_eq!(j["verified"], true, "{j}");
            assert_eq!(j["verified_iterations"].as_u64(), Some(3), "{j}");
            assert_eq!(j["shared_only"], true, "{j}");
            assert_eq!(j["lane"], "tcp", "{memory} {op}: {j}");
        }
    }
}

/// Device memory in two processes (simulated: the staged path on a machine without a GPU):
/// both ends stage through their own bounded chunk pools over the TCP lane, even with the
/// shared-memory transport (the device lane off), and every byte verifies after a copy back
/// through the engine.
#[test]
fn staged_device_memory_two_processes() {
    for transport in ["tcp", "shm"] {
        for op in ["write", "read"] {
            let j = bench(&[
                "--no-device-lane",
                "--memory",
                "sim",
                "--transport",
                transport,
                "--op",
                op,
                "--blocks",
                "512",
                "--block-size",
                "16384",
                "--staging-chunks",
                "4",
                "--staging-chunk-kib",
                "256",
            ]);
            assert_eq!(j["verified"], true, "{j}");
            assert_eq!(j["lane"], "tcp", "{j}");
            assert_eq!(j["gpu_path"], "staged", "{j}");
            assert_eq!(j["memory"], "sim", "{j}");
            assert_eq!(j["staging_mib"], 1.0, "{j}");
        }
    }
    // The direct path cannot reach simulated memory: forcing it fails, it is not ignored.
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args(["--memory", "sim", "--gpu-path", "direct", "--blocks", "8"])
        .args(["--json", "--iters", "1", "--warmup", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("direct path was forced"), "{err}");
}
