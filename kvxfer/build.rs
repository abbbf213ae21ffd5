//! Puts the UCX library directory that kvxfer-sys linked against on the runtime path of this
//! crate's tests, examples and benches, so that they load the same UCX they were built with.
fn main() {
    if let Ok(dir) = std::env::var("DEP_UCX_LIBDIR") {
        if !dir.is_empty() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
