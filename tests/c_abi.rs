//! The C ABI: the committed header matches the code, `libkvxfer.so` exports only `kvx_*`, and a
//! C program built with gcc against the header (through `kvxfer.pc`) moves data both ways
//! between two processes and checks error paths, over TCP and shared memory, linked
//! dynamically and statically; `-- --ignored` also runs it under valgrind.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// target/<profile>, after building the C library there.
fn libdir() -> PathBuf {
    let ok = Command::new(env!("CARGO"))
        .args(["build", "-p", "kvxfer-capi"])
        .current_dir(root())
        .status()
        .unwrap()
        .success();
    assert!(ok, "building kvxfer-capi failed");
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// kvxfer.pc and kvxfer-static.pc for the library in `lib`, written to a fresh directory.
fn pc(lib: &Path, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvx-pc-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["kvxfer", "kvxfer-static"] {
        let t = std::fs::read_to_string(root().join(format!("kvxfer-capi/{name}.pc.in"))).unwrap();
        let t = t
            .replace("@LIBDIR@", lib.to_str().unwrap())
            .replace("@INCLUDEDIR@", root().join("include").to_str().unwrap())
            .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
        std::fs::write(dir.join(format!("{name}.pc")), t).unwrap();
    }
    dir
}

fn pkg_config(dir: &Path, args: &[&str]) -> Vec<String> {
    let mut path = dir.to_str().unwrap().to_string();
    if let Ok(p) = std::env::var("PKG_CONFIG_PATH") {
        path = format!("{path}:{p}");
    }
    let out = Command::new("pkg-config")
        .args(args)
        .env("PKG_CONFIG_PATH", path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "pkg-config {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn compile(tag: &str, static_link: bool) -> PathBuf {
    compile_with(tag, static_link, &[])
}

fn compile_with(tag: &str, static_link: bool, extra: &[&str]) -> PathBuf {
    let lib = libdir();
    let dir = pc(&lib, tag);
    let exe = dir.join("kvx_test");
    let mut cmd = Command::new("gcc");
    cmd.args([
        "-std=c11",
        "-D_DEFAULT_SOURCE",
        "-Wall",
        "-Wextra",
        "-pedantic",
        "-Werror",
        "-Wno-unused-result",
        "-g",
    ])
    .args(extra)
    .arg(root().join("tests/c/kvx_test.c"))
    .arg("-o")
    .arg(&exe)
    .args(pkg_config(&dir, &["--cflags", "kvxfer"]));
    if static_link {
        // `kvxfer-static` names the archive itself: `-lkvxfer` would pick the .so.
        cmd.args(pkg_config(&dir, &["--libs", "--static", "kvxfer-static"]));
        // The UCX the library was built against, found at run time.
        if let Ok(d) = std::env::var("DEP_UCX_LIBDIR").or_else(|_| ucx_libdir(&dir)) {
            cmd.arg(format!("-Wl,-rpath,{d}"));
        }
    } else {
        cmd.args(pkg_config(&dir, &["--libs", "kvxfer"]));
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "gcc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

fn ucx_libdir(dir: &Path) -> Result<String, std::env::VarError> {
    Ok(pkg_config(dir, &["--variable=libdir", "ucx"]).join(""))
}

fn run(exe: &Path, transport: &str, wrapper: &[&str]) -> String {
    run_env(exe, transport, wrapper, &[])
}

/// `run` with more environment for the program.
fn run_env(exe: &Path, transport: &str, wrapper: &[&str], env: &[(&str, &str)]) -> String {
    let mut cmd = if wrapper.is_empty() {
        Command::new(exe)
    } else {
        let mut c = Command::new(wrapper[0]);
        c.args(&wrapper[1..]).arg(exe);
        c
    };
    let out = cmd
        .arg(transport)
        .env("UCX_LOG_LEVEL", "error")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "kvx_test {transport}:\n{text}");
    assert!(
        text.contains(&format!("kvx_test {transport}: ok")),
        "{text}"
    );
    text
}

/// The header alone compiles clean as C89, C11 and C++11 with every warning an error.
#[test]
fn header_compiles_as_c89_c11_and_cxx_pedantic() {
    let dir = std::env::temp_dir().join(format!("kvx-h-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("h.c");
    std::fs::write(
        &src,
        "#include <kvxfer.h>\nint main(void) { kvx_status s = KVX_OK; return (int)s; }\n",
    )
    .unwrap();
    for (cc, std) in [
        ("gcc", "-std=c89"),
        ("gcc", "-std=c11"),
        ("g++", "-std=c++11"),
    ] {
        let mut cmd = Command::new(cc);
        cmd.arg(std)
            .args(["-pedantic", "-Wall", "-Wextra", "-Werror"]);
        if cc == "g++" {
            cmd.args(["-x", "c++"]);
        }
        let out = cmd
            .arg("-I")
            .arg(root().join("include"))
            .arg("-c")
            .arg(&src)
            .arg("-o")
            .arg(dir.join("h.o"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{cc} {std} -pedantic: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn header_is_current() {
    let generated = std::fs::read_to_string(concat!(env!("OUT_DIR"), "/kvxfer.h")).unwrap();
    let committed = std::fs::read_to_string(root().join("include/kvxfer.h")).unwrap();
    assert!(
        generated == committed,
        "include/kvxfer.h differs from the code: run `KVXFER_UPDATE_HEADER=1 cargo build` and commit it"
    );
}

#[test]
fn exports_only_kvx_symbols() {
    let lib = libdir().join("libkvxfer.so");
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .unwrap();
    assert!(out.status.success());
    let syms: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    assert!(syms.iter().any(|s| s == "kvx_agent_new"), "{syms:?}");
    let foreign: Vec<&String> = syms.iter().filter(|s| !s.starts_with("kvx_")).collect();
    assert!(foreign.is_empty(), "non-kvx exports: {foreign:?}");
}

#[test]
fn c_program_dynamic() {
    let exe = compile("dyn", false);
    for t in ["tcp", "shm"] {
        print!("{}", run(&exe, t, &[]));
    }
}

#[test]
fn c_program_static() {
    let exe = compile("static", true);
    // Linked through `pkg-config --static kvxfer-static`: no libkvxfer.so needed at run time.
    let d = Command::new("readelf")
        .arg("-d")
        .arg(&exe)
        .output()
        .unwrap();
    let d = String::from_utf8_lossy(&d.stdout);
    assert!(
        d.contains("NEEDED"),
        "readelf -d shows no dependencies: {d}"
    );
    assert!(
        !d.contains("libkvxfer"),
        "a static build still needs libkvxfer.so:\n{d}"
    );
    print!("{}", run(&exe, "tcp", &[]));
}

/// The C program built with AddressSanitizer and UndefinedBehaviorSanitizer: every call with a
/// bad enum value, NULL or a short output buffer, and both transfers, with no report (any
/// report aborts). The library is not instrumented; ASan's interceptors still check every
/// byte it copies into the program's buffers.
#[test]
fn c_program_under_asan_and_ubsan() {
    let exe = compile_with(
        "san",
        false,
        &[
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
        ],
    );
    for t in ["tcp", "shm"] {
        let text = run_env(
            &exe,
            t,
            &[],
            &[
                // UCX's memory hooks jump into ASan's interceptors; UCX keeps process-lifetime
                // allocations (its leaks are not this program's).
                ("UCX_MEM_EVENTS", "no"),
                ("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=1"),
                ("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1"),
            ],
        );
        assert!(!text.contains("runtime error"), "{text}");
    }
}

#[test]
#[ignore = "needs valgrind, ~1 min: cargo test --test c_abi -- --ignored"]
fn c_program_under_valgrind() {
    let exe = compile("vg", false);
    let text = run(
        &exe,
        "tcp",
        &[
            "valgrind",
            "--error-exitcode=9",
            "--trace-children=yes",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
        ],
    );
    println!("{text}");
}

/// A C program that stops in order: `kvx_test <transport> serve` moves blocks until SIGTERM
/// (or SIGINT), then frees every handle and exits 0 within a second, `kvx_live` reporting
/// nothing of kvxfer left in it.
#[test]
fn c_program_stops_in_order_on_sigterm_and_sigint() {
    use std::io::{BufRead, BufReader, Read};
    use std::time::{Duration, Instant};
    let exe = compile("stop", false);
    for t in ["tcp", "shm"] {
        for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
            let mut c = Command::new(&exe)
                .args([t, "serve"])
                .env("UCX_LOG_LEVEL", "error")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut out = BufReader::new(c.stdout.take().unwrap());
            let mut line = String::new();
            out.read_line(&mut line).unwrap();
            assert_eq!(line, "serving\n");
            // Moving blocks for a while.
            std::thread::sleep(Duration::from_millis(500));
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, sig) };
            let t0 = Instant::now();
            let st = loop {
                if let Some(st) = c.try_wait().unwrap() {
                    break st;
                }
                if t0.elapsed() > Duration::from_secs(1) {
                    let _ = c.kill();
                    panic!("kvx_test {t} serve still running a second after {name}");
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            let took = t0.elapsed();
            let mut said = String::new();
            out.read_to_string(&mut said).unwrap();
            assert!(
                st.success(),
                "kvx_test {t} serve after {name}: {st}: {said}"
            );
            assert!(
                said.contains("left: 0 agents, 0 regions, 0 UCX registrations, 0 peer mappings"),
                "{said}"
            );
            println!("{t}, {name}: exited 0 after {took:?}: {}", said.trim());
        }
    }
}
