//! Puts the UCX library directory kvxfer-sys linked against on libkvxfer.so's runtime path.
fn main() {
    if let Ok(dir) = std::env::var("DEP_UCX_LIBDIR") {
        if !dir.is_empty() {
            println!("cargo:rustc-link-arg-cdylib=-Wl,-rpath,{dir}");
        }
    }
}
