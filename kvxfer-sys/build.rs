//! Finds UCX (>= 1.13) with pkg-config and runs bindgen over `ucp.h`. Never builds UCX.
//!
//! Two installations are supported: Debian's `libucx-dev` (system pkg-config path) and the PyPI
//! wheel `libucx-cu12` unpacked by `scripts/ucx-env.sh` (its relocated `.pc` files are found
//! through `PKG_CONFIG_PATH`). The library directory is exported as `DEP_UCX_LIBDIR` so that
//! dependents can put it on the runtime path.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let lib = match pkg_config::Config::new()
        .atleast_version("1.13")
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(e) => {
            println!(
                "cargo:warning=kvxfer-sys: UCX >= 1.13 not found by pkg-config ({e}). Install \
                 Debian's `libucx-dev` (apt-get install libucx-dev libclang-dev pkg-config), or \
                 run `source scripts/ucx-env.sh` to use the UCX wheel from PyPI."
            );
            std::process::exit(1);
        }
    };
    // The wheel's ucx.pc does not name libuct/libucs/libucm directly; ucp needs only libucp.
    for l in ["ucp", "uct", "ucs"] {
        if !lib.libs.iter().any(|x| x == l) {
            println!("cargo:rustc-link-lib={l}");
        }
    }
    let libdir = lib
        .link_paths
        .first()
        .cloned()
        .or_else(|| {
            pkg_config::get_variable("ucx", "libdir")
                .ok()
                .map(PathBuf::from)
        })
        .unwrap_or_default();
    println!("cargo:libdir={}", libdir.display());
    println!("cargo:version={}", lib.version);
    println!("cargo:rustc-env=KVXFER_UCX_BUILD_VERSION={}", lib.version);
    if !libdir.as_os_str().is_empty() {
        // Our own tests link against libucp too.
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", libdir.display());
    }

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        // UCX's log, routed into Rust's `log` (and formatted with the C library's vsnprintf).
        .allowlist_function("ucs_log_push_handler")
        .allowlist_function("vsnprintf")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_.*")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        // An unknown status from C must not be undefined behaviour: a newtype, not a Rust enum.
        .newtype_enum("ucs_status_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for p in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", p.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => {
            println!(
                "cargo:warning=kvxfer-sys: bindgen failed over ucp.h ({e}); is libclang-dev \
                 installed?"
            );
            std::process::exit(1);
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("OUT_DIR is writable");
}
