//! The embedded code objects are AMDGPU ELF holding every kernel of the shared all-reduce source (symbol and
//! kernel descriptor) and no other, and every kernel's flag accesses compile to system-scope release/acquire
//! sequences. The symbol check needs nothing but the
//! bytes; the instruction check needs an `llvm-objdump` that knows gfx90a (LLVM 15 or newer: Debian's hipcc brings
//! llvm-objdump-15, while plain `llvm-objdump` there is LLVM 14, which prints gfx90a cache instructions as raw words). CI sets
//! `ANYCCL_REQUIRE_KERNELS`, so there a missing build or tool fails instead of skipping.

use anyccl_kernels_common::catalogue::{self, Family, Kernel};
use std::path::PathBuf;
use std::process::Command;

use object::{Object, ObjectSymbol};

fn llvm_objdump() -> Option<PathBuf> {
    let paths: Vec<PathBuf> = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    ["llvm-objdump-19", "llvm-objdump-18", "llvm-objdump-17", "llvm-objdump-15"]
        .iter()
        .flat_map(|n| paths.iter().map(move |d| d.join(n)))
        .chain([PathBuf::from("/opt/rocm/llvm/bin/llvm-objdump")])
        .find(|p| p.is_file())
}

fn llvm_readelf() -> Option<PathBuf> {
    let paths: Vec<PathBuf> = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    ["llvm-readelf-19", "llvm-readelf-18", "llvm-readelf-17", "llvm-readelf-15"]
        .iter()
        .flat_map(|n| paths.iter().map(move |d| d.join(n)))
        .chain([PathBuf::from("/opt/rocm/llvm/bin/llvm-readelf")])
        .find(|p| p.is_file())
}

fn required() -> bool {
    std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_some()
}

#[test]
fn code_objects_hold_every_kernel() {
    if let Some(why) = anyccl_kernels_hip::NOT_BUILT {
        assert!(!required(), "kernels required but not built: {why}");
        eprintln!("NOT CHECKED: {why}");
        return;
    }
    assert!(anyccl_kernels_hip::code_object_for("allreduce", "gfx90a").is_some(), "gfx90a is the target CI builds");
    for (src, arch, bytes) in anyccl_kernels_hip::CODE_OBJECTS {
        let file = object::File::parse(*bytes).unwrap_or_else(|e| panic!("{src} {arch}: not an ELF: {e}"));
        let names: Vec<String> = file.symbols().filter_map(|s| s.name().ok().map(str::to_owned)).collect();
        for k in catalogue::shared_kernels().map(Kernel::name) {
            assert!(names.contains(&k), "{arch}: kernel {k} missing");
            assert!(names.iter().any(|n| *n == format!("{k}.kd")), "{arch}: kernel descriptor {k}.kd missing");
        }
        // And nothing else: the object holds exactly the catalogue's shared kernels, so the instruction checks
        // below see them all.
        let mut held: Vec<&str> = names.iter().filter_map(|n| n.strip_suffix(".kd")).collect();
        held.sort_unstable();
        held.dedup();
        let mut listed: Vec<String> = catalogue::shared_kernels().map(Kernel::name).collect();
        listed.sort_unstable();
        assert_eq!(held, listed, "{arch}: the kernels held are not the catalogue's");
    }
}

#[test]
fn flag_accesses_are_system_scope_release_acquire() {
    let (Some(co), Some(tool)) = (anyccl_kernels_hip::code_object_for("allreduce", "gfx90a"), llvm_objdump()) else {
        assert!(!required(), "gfx90a code object or llvm-objdump missing in a run that requires them");
        eprintln!("NOT CHECKED: no gfx90a code object or no llvm-objdump");
        return;
    };
    let path = std::env::temp_dir().join(format!("anyccl-hip-{}.co", std::process::id()));
    std::fs::write(&path, co).expect("write code object");
    let out = Command::new(&tool).args(["-d", "--mcpu=gfx90a"]).arg(&path).output().expect("llvm-objdump runs");
    std::fs::remove_file(&path).ok();
    assert!(out.status.success(), "llvm-objdump failed: {}", String::from_utf8_lossy(&out.stderr));
    let asm = String::from_utf8_lossy(&out.stdout);
    // llvm-objdump prints one label for the whole text section, so each kernel's instructions are found by the
    // address range of its symbol; every line ends with `// <address>: <encoding>`.
    let file = object::File::parse(co).expect("ELF");
    let instrs: Vec<(u64, &str)> = asm
        .lines()
        .filter_map(|l| {
            let (code, comment) = l.split_once("//")?;
            let addr = u64::from_str_radix(comment.trim().split(':').next()?.trim(), 16).ok()?;
            Some((addr, code.trim()))
        })
        .collect();
    // On gfx90a a system-scope release writes back L2 before the store; a system-scope acquire invalidates L2
    // after the load. A relaxed or agent-scope flag would have neither.
    // The fused kernels synchronise across GPUs the same way; the separate RMSNorm kernel does not synchronise.
    for kernel in catalogue::shared_kernels() {
        let k = kernel.name();
        let sym = file.symbols().find(|s| s.name() == Ok(k.as_str())).unwrap_or_else(|| panic!("{k}: no symbol"));
        let range = sym.address()..sym.address() + sym.size();
        let body: Vec<&str> = instrs.iter().filter(|(a, _)| range.contains(a)).map(|(_, c)| *c).collect();
        match kernel.family {
            Family::OneShot { .. }
            | Family::TwoShot { .. }
            | Family::FusedOneShot { .. }
            | Family::FusedTwoShot { .. }
            | Family::QuantTwoShot(_) => {
                assert!(body.len() > 20, "{k}: only {} instructions found in its range", body.len());
                // One release and one acquire per barrier, and every world size (2..=8) has its own copy of each.
                let wbl2 = body.iter().filter(|c| c.starts_with("buffer_wbl2")).count();
                let invl2 = body.iter().filter(|c| c.starts_with("buffer_invl2")).count();
                assert!(wbl2 >= 7 * 2, "{k}: {wbl2} system-scope releases (buffer_wbl2), expected at least 14");
                assert!(invl2 >= 7 * 2, "{k}: {invl2} system-scope acquires (buffer_invl2), expected at least 14");
            }
            // The push one-shot and two-shot and the fused push one-shot have no flags: their receive slots are
            // polled with loads that bypass L1 (`glc`, relaxed at system scope), four 32-bit words per vector, for
            // every world 2..=8.
            Family::PushOneShot | Family::PushTwoShot | Family::FusedPushOneShot => {
                let polls = body.iter().filter(|c| c.starts_with("global_load_dword ") && c.contains(" glc")).count();
                assert!(polls >= 7 * 4, "{k}: {polls} uncached (glc) 32-bit loads, expected at least 28");
            }
            // The separate RMSNorm kernel does not synchronise; the NVLS kernels are not in the shared source.
            Family::RmsNorm | Family::Nvls { .. } => {}
        }
    }
}

/// Every kernel takes the parameters of the shared source, laid out as anyccl-kernels-common says (the CUDA cubins
/// are checked against the same table), read from the code object's AMDGPU metadata (`.args`, hidden arguments
/// left out).
#[test]
fn kernels_take_the_shared_parameters() {
    let (Some(co), Some(tool)) = (anyccl_kernels_hip::code_object_for("allreduce", "gfx90a"), llvm_readelf()) else {
        assert!(!required(), "gfx90a code object or llvm-readelf missing in a run that requires them");
        eprintln!("NOT CHECKED: no gfx90a code object or no llvm-readelf");
        return;
    };
    let path = std::env::temp_dir().join(format!("anyccl-hip-params-{}.co", std::process::id()));
    std::fs::write(&path, co).expect("write code object");
    let out = Command::new(&tool).arg("--notes").arg(&path).output().expect("llvm-readelf runs");
    std::fs::remove_file(&path).ok();
    assert!(out.status.success(), "llvm-readelf failed: {}", String::from_utf8_lossy(&out.stderr));
    let notes = String::from_utf8_lossy(&out.stdout);
    let kernels = kernel_args(&notes);
    // Every kernel of the catalogue the shared source defines, with its family's layout.
    for k in catalogue::shared_kernels() {
        let want: Vec<(usize, usize)> =
            k.params().expect("shared kernels have layouts").iter().map(|p| (p.1, p.2)).collect();
        let name = k.name();
        let got = kernels.iter().find(|(n, _)| *n == name).map(|(_, a)| a.clone()).unwrap_or_default();
        assert_eq!(got, want, "{name}: parameters (offset, size) differ from the catalogue");
    }
}

/// Each kernel's name and explicit arguments (offset, size) from the YAML that `llvm-readelf --notes` prints for
/// the AMDGPU metadata: a kernel is a `  - ` item of `amdhsa.kernels`, an argument a `      - ` item of its
/// `.args`.
fn kernel_args(notes: &str) -> Vec<(String, Vec<(usize, usize)>)> {
    let mut out: Vec<(String, Vec<(usize, usize)>)> = Vec::new();
    let mut args: Vec<(Option<usize>, Option<usize>, bool)> = Vec::new();
    for line in notes.lines() {
        if line.starts_with("  - ") {
            args.clear();
        }
        let item = line.trim_start();
        let (key, value) = item.trim_start_matches("- ").split_once(':').unwrap_or(("", ""));
        let value = value.trim();
        if line.starts_with("      - ") {
            args.push((None, None, false));
        }
        if line.starts_with("      ") || line.starts_with("        ") {
            if let Some(a) = args.last_mut() {
                match key {
                    ".offset" => a.0 = value.parse().ok(),
                    ".size" => a.1 = value.parse().ok(),
                    ".value_kind" => a.2 = value.starts_with("hidden_"),
                    _ => {}
                }
            }
        } else if key == ".name" && line.starts_with("    .") {
            let explicit = args.iter().filter(|a| !a.2).filter_map(|a| Some((a.0?, a.1?))).collect();
            out.push((value.to_owned(), explicit));
        }
    }
    out
}
