//! kvxfer's CUDA code on a machine without a GPU, against a fake CUDA driver
//! (`tests/fake_cuda/libcuda.c`): device memory the host cannot dereference, asynchronous
//! copies deferred until their stream is synchronized (a missing synchronization corrupts the
//! data), checked pinned registrations. kvxfer-bench (built with `--features cuda`) runs two
//! processes with `--memory cuda`: cudarc allocations registered as device memory, the CUDA
//! copy engine, pinned staging chunks, both ops, tcp and shm transports, every byte verified
//! after a copy back. What a GPU adds beyond this (real DMA, cuda_ipc, the direct path):
//! `scripts/gpu-check.sh`.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds the fake driver once per test binary; returns its directory.
fn fake_driver() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fake_cuda");
        let ok =
            Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/build.sh"))
                .arg(&dir)
                .status()
                .unwrap();
        assert!(ok.success(), "building the fake libcuda failed");
        dir
    })
    .clone()
}

fn bench(args: &[&str]) -> (Vec<serde_json::Value>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args(args)
        .args([
            "--memory", "cuda", "--json", "--iters", "2", "--warmup", "1",
        ])
        .env("LD_LIBRARY_PATH", fake_driver())
        .env("UCX_LOG_LEVEL", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "kvxfer-bench {args:?}: {stderr}\n{stdout}"
    );
    let lines = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (lines, stderr)
}

#[test]
fn cuda_memory_through_the_cuda_engine_both_ops_every_kind_and_lane() {
    // plain: cuMemAlloc (the default); pool: cudarc's stream-ordered allocation; vmm:
    // cuMemCreate + cuMemMap, shareable as a file descriptor. Over TCP: the staged path. In
    // host (shm): the device lane for what another process can open (a legacy IPC handle, a
    // file descriptor), the kernel launch per request; pool memory stays staged.
    for (transport, alloc, lane, extra) in [
        ("tcp", "plain", "tcp", None),
        ("shm", "plain", "device", None),
        ("shm", "plain", "tcp", Some("--no-device-lane")),
        ("tcp", "pool", "tcp", None),
        ("shm", "pool", "tcp", None),
        ("shm", "vmm", "device", None),
    ] {
        let mut args = vec![
            "--transport",
            transport,
            "--cuda-alloc",
            alloc,
            "--op",
            "write,read",
            "--blocks",
            "512",
            "--block-size",
            "16384",
            // Small chunks: many chunk hand-offs per transfer, each needing its sync.
            "--staging-chunk-kib",
            "64",
            "--verify-each",
        ];
        args.extend(extra);
        let (lines, stderr) = bench(&args);
        let case = format!("{transport} {alloc} {extra:?}");
        assert_eq!(lines.len(), 2, "{case}");
        for j in &lines {
            assert_eq!(j["verified"], true, "{case}: {j}");
            assert_eq!(j["verified_iterations"].as_u64(), Some(3), "{case}: {j}");
            assert_eq!(j["memory"], "cuda", "{j}");
            assert_eq!(j["cuda_alloc"], alloc, "{j}");
            assert_eq!(j["gpu_path"], "staged", "{j}");
            assert_eq!(j["lane"], lane, "{case}: {j}");
            assert_eq!(j["staging_mib"], 0.5, "{j}");
            let kind = if alloc == "vmm" { "virtual" } else { alloc };
            assert_eq!(j["device_alloc"], kind, "{j}");
            if lane == "device" {
                // 512 scattered blocks: one table, uploaded and launched.
                assert_eq!(j["submissions"], 2, "{case}: {j}");
            }
        }
        assert!(
            !stderr.contains("not modelled"),
            "{case}: a driver call the fake does not model: {stderr}"
        );
    }
}

#[test]
fn auto_path_without_a_cuda_aware_ucx_is_staged_and_forced_direct_fails() {
    // Debian's UCX has no CUDA transports: auto stages, direct is refused with the reason.
    let (lines, _) = bench(&[
        "--transport",
        "auto",
        "--gpu-path",
        "auto",
        "--blocks",
        "64",
        "--block-size",
        "16384",
    ]);
    assert_eq!(lines[0]["gpu_path"], "staged", "{}", lines[0]);
    assert_eq!(lines[0]["verified"], true);
    let out = Command::new(env!("CARGO_BIN_EXE_kvxfer-bench"))
        .args([
            "--memory",
            "cuda",
            "--gpu-path",
            "direct",
            "--transport",
            "auto",
        ])
        .args(["--blocks", "8", "--json", "--iters", "1", "--warmup", "0"])
        .env("LD_LIBRARY_PATH", fake_driver())
        .env("UCX_LOG_LEVEL", "error")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // A CUDA-aware UCX (the wheel) may take the direct path; then it must say so.
        let j: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
        assert_eq!(j["gpu_path"], "direct", "{j}");
        assert_eq!(j["verified"], true, "{j}");
    } else {
        assert!(err.contains("no CUDA transports"), "{err}");
    }
}

/// `copy_tables_are_charged_to_the_budget`'s body, run in a child with the fake driver loaded
/// (cudarc loads the driver once per process, from the library path it started with).
#[test]
#[ignore = "a child of copy_tables_are_charged_to_the_budget, with the fake driver loaded"]
fn copy_table_child() {
    use cudarc::driver::result::{malloc_sync, memcpy_dtoh_sync, memcpy_htod_sync};
    use kvxfer::staging::{CopyBatch, CopyEngine};
    const PIECE: u64 = 512;
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    ctx.bind_to_thread().unwrap();
    // SAFETY: a context is current; the allocations live until the process exits.
    let (src, dst) = unsafe { (malloc_sync(1 << 20).unwrap(), malloc_sync(1 << 20).unwrap()) };
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    // SAFETY: `src` holds 1 MiB.
    unsafe { memcpy_htod_sync(src, &data) }.unwrap();
    // `n` pieces, reversed at the destination.
    let batch = |n: u64| CopyBatch {
        src: (0..n).map(|i| src + PIECE * i).collect(),
        dst: (0..n).map(|i| dst + PIECE * (n - 1 - i)).collect(),
        len: vec![PIECE; n as usize],
        bytes: PIECE * n,
    };
    // Room for a table of 1,024 entries (24 bytes each, host and device: 48 KiB), not for
    // one of 2,048.
    let budget = kvxfer::MemoryBudget::new(80 << 10);
    let engine = kvxfer::cuda::CudaCopyEngine::new();
    engine.charge_to(&budget);
    let mut q = engine.queue(0).unwrap();
    // SAFETY: every entry lies inside the two allocations, untouched until the sync.
    unsafe { q.copy_batch(&batch(1000)) }.unwrap();
    q.sync().unwrap();
    let mut got = vec![0u8; 1 << 20];
    // SAFETY: `dst` holds 1 MiB.
    unsafe { memcpy_dtoh_sync(&mut got, dst) }.unwrap();
    let p = PIECE as usize;
    assert!(
        got[999 * p..1000 * p] == data[..p],
        "the batch moved the bytes"
    );
    assert_eq!(budget.used(), 2 * 1024 * 24, "the table, host and device");
    // Idle with its stream, the table stays allocated and charged.
    drop(q);
    assert_eq!(budget.used(), 2 * 1024 * 24, "the pooled table");
    // The pooled stream's table must grow to 2,048 entries: refused, typed, nothing held.
    let mut q = engine.queue(0).unwrap();
    // SAFETY: as above.
    let r = unsafe { q.copy_batch(&batch(1500)) };
    assert!(
        matches!(&r, Err(kvxfer::Error::OutOfMemory(w)) if w.contains("CUDA copy table")),
        "{r:?}"
    );
    assert_eq!(budget.used(), 0);
    println!("copy tables charged: ok");
}

#[test]
fn copy_tables_are_charged_to_the_budget() {
    fake_driver();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "copy_table_child", "--nocapture"])
        .env("LD_LIBRARY_PATH", fake_driver())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("copy tables charged: ok"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
