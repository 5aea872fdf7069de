//! Gives the drop-in the SONAME of the library it stands in for, `libnccl.so.2`: a program linked against it (by
//! any file name) records `libnccl.so.2`, so it starts where only the real NCCL is installed, and a program linked
//! against the real NCCL starts with the drop-in installed under that name.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    }
}
