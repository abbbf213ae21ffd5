//! Puts the UCX library directory kvxfer-sys linked against on libkvxfer.so's runtime path,
//! and on the unit-test binary's (`cargo test -p kvxfer-capi`), so that both load the UCX
//! they were built against (the 1.22 wheel's, say) rather than the system's.
fn main() {
    if let Ok(dir) = std::env::var("DEP_UCX_LIBDIR") {
        if !dir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
