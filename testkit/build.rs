//! Only gives the crate an `OUT_DIR` (its scratch folder for the fakes) and rebuilds it when a fake's C changes.
fn main() {
    for f in ["c/fake_cuda.c", "c/fake_hip.c", "c/fake_rccl.c"] {
        println!("cargo:rerun-if-changed={f}");
    }
}
