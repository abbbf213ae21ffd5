//! 1. Puts the UCX library directory that kvxfer-sys linked against on the runtime path of this
//!    package's binaries, tests and examples, so that they load the UCX they were built with.
//! 2. Generates the C header of the C ABI (`kvxfer-capi`) with the pinned cbindgen into
//!    `$OUT_DIR/kvxfer.h`; `tests/c_abi.rs` fails when the committed `include/kvxfer.h` differs.
//!    `KVXFER_UPDATE_HEADER=1 cargo build` writes the committed copy.
use std::path::PathBuf;

fn main() {
    if let Ok(dir) = std::env::var("DEP_UCX_LIBDIR") {
        if !dir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let capi = root.join("kvxfer-capi");
    println!("cargo:rerun-if-changed=kvxfer-capi/src");
    println!("cargo:rerun-if-changed=kvxfer-capi/cbindgen.toml");
    println!("cargo:rerun-if-env-changed=KVXFER_UPDATE_HEADER");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_default()).join("kvxfer.h");
    let config = match cbindgen::Config::from_file(capi.join("cbindgen.toml")) {
        Ok(c) => c,
        Err(e) => {
            println!("cargo:warning=kvxfer: reading cbindgen.toml: {e}");
            return;
        }
    };
    match cbindgen::Builder::new()
        .with_crate(&capi)
        .with_config(config)
        .generate()
    {
        Ok(b) => {
            let mut raw = Vec::new();
            b.write(&mut raw);
            let text = c89(&String::from_utf8_lossy(&raw));
            let _ = std::fs::write(&out, &text);
            if std::env::var("KVXFER_UPDATE_HEADER").is_ok_and(|v| v == "1") {
                let _ = std::fs::write(root.join("include").join("kvxfer.h"), &text);
            }
        }
        Err(e) => println!("cargo:warning=kvxfer: generating the C header failed: {e}"),
    }
}

/// The header as C89 accepts it under `-pedantic`: cbindgen's `// ...` after `#endif` become
/// `/* ... */`, and the comma after an enum's last enumerator goes.
fn c89(h: &str) -> String {
    let lines: Vec<String> = h
        .lines()
        .map(|l| match l.split_once("// ") {
            Some((code, c)) if code.starts_with('#') => format!("{code}/* {c} */"),
            _ => l.to_string(),
        })
        .collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    for l in lines {
        if l.trim_start().starts_with("};") {
            // The last enumerator before the close, past comments.
            if let Some(prev) = out
                .iter_mut()
                .rev()
                .find(|p| !p.trim_start().starts_with("/*") && !p.trim().is_empty())
            {
                if prev.trim_start().starts_with("KVX_") && prev.ends_with(',') {
                    prev.pop();
                }
            }
        }
        out.push(l);
    }
    out.join("\n") + "\n"
}
