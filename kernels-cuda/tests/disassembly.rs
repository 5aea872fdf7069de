//! The embedded cubins disassemble to the kernels we wrote, with system-scope release/acquire flag accesses.
//! Needs `cuobjdump` (and `nvdisasm`) from the toolkit that built them: `ci/install-cuda.sh` installs both and sets
//! `ANYCCL_REQUIRE_KERNELS`, so in CI a missing tool fails instead of skipping.

use anyccl_kernels_common::catalogue::{self, Family, Kernel};
use anyccl_kernels_common::quant::Format;
use std::path::PathBuf;
use std::process::Command;

fn cuobjdump() -> Option<PathBuf> {
    let from_toolkit = std::env::var_os("ANYCCL_CUDA_TOOLKIT").map(|t| PathBuf::from(t).join("bin").join("cuobjdump"));
    from_toolkit.filter(|p| p.is_file()).or_else(|| {
        std::env::var_os("PATH")
            .and_then(|p| std::env::split_paths(&p).map(|d| d.join("cuobjdump")).find(|p| p.is_file()))
    })
}

#[test]
fn cubins_contain_the_kernels_and_sys_scope_flags() {
    let required = std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_some();
    if anyccl_kernels_cuda::NOT_BUILT.is_some() || cuobjdump().is_none() {
        assert!(!required, "kernels or cuobjdump missing in a run that requires them");
        eprintln!("NOT CHECKED: no kernels or no cuobjdump in this build (CI checks it)");
        return;
    }
    let tool = cuobjdump().expect("checked above");
    let path_env = std::env::join_paths(
        std::iter::once(tool.parent().expect("dir").to_path_buf())
            .chain(std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default()),
    )
    .expect("PATH");
    for (src, arch, bytes) in anyccl_kernels_cuda::CUBINS {
        let path = std::env::temp_dir().join(format!("anyccl-{}-{src}-{arch}.cubin", std::process::id()));
        std::fs::write(&path, bytes).expect("write cubin");
        let out = Command::new(&tool).arg("-sass").arg(&path).env("PATH", &path_env).output();
        let out = out.expect("cuobjdump runs");
        let sass = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "cuobjdump failed on {arch}: {}", String::from_utf8_lossy(&out.stderr));
        let functions = split_functions(&sass);
        // The cubin holds exactly the catalogue's kernels (the shared source's and the NVLS ones), so the checks
        // below, which go family by family, see every kernel.
        let mut held: Vec<&str> = functions.keys().map(String::as_str).collect();
        let mut listed: Vec<String> = catalogue::kernels().map(Kernel::name).collect();
        held.sort_unstable();
        listed.sort_unstable();
        assert_eq!(held, listed, "{arch}: the kernels held are not the catalogue's");
        // Each kernel of the catalogue, by its family.
        for kernel in catalogue::kernels() {
            let k = kernel.name();
            let body = functions.get(&k).unwrap_or_else(|| panic!("{arch}: {k} missing"));
            let stores = body.matches("STG.E.STRONG.SYS").count();
            let loads = body.matches("LDG.E.STRONG.SYS").count();
            let polls = body.lines().filter(|l| l.contains("LDG.E.128.STRONG.SYS")).count();
            let pushes = body.lines().filter(|l| l.contains("STG.E.128.STRONG.SYS")).count();
            let multimem = body.contains("LDGMC");
            match kernel.family {
                // The all-reduce kernels of the source shared with HIP: each one's barriers store their flags with
                // release and load them with acquire at system scope (two barriers, each with its own copy for
                // every world 2..=8). The fused all-reduce + RMSNorm kernels synchronise the same way (2 or 3
                // barriers per world). All are unicast code.
                Family::OneShot { .. }
                | Family::TwoShot { .. }
                | Family::FusedOneShot { .. }
                | Family::FusedTwoShot { .. } => {
                    assert!(stores >= 7 * 2, "{arch}: {k}: {stores} system-scope flag stores, expected at least 14");
                    assert!(loads >= 7 * 2, "{arch}: {k}: {loads} system-scope flag loads, expected at least 14");
                    assert!(!multimem, "{arch}: {k}: multimem outside the multicast kernels");
                }
                // The separate RMSNorm kernel synchronises with nobody.
                Family::RmsNorm => {
                    assert_eq!(stores + loads, 0, "{arch}: {k}: the RMSNorm kernel touches no flags");
                    assert!(!multimem, "{arch}: {k}: multimem in a fused kernel");
                }
                // The push one-shot and two-shot and the fused push one-shot: no flags and no multimem; their
                // receive slots are polled with volatile 16-byte loads (LDG.E.128.STRONG.SYS) and written with
                // volatile 16-byte stores, one copy per world 2..=8; on sm_90 and newer they wait for their stream
                // predecessor through programmatic dependent launch (griddepcontrol.wait is ACQBULK in SASS) and
                // let their dependents launch (PREEXIT).
                Family::PushOneShot | Family::PushTwoShot | Family::FusedPushOneShot => {
                    assert!(polls >= 7, "{arch}: {k}: {polls} volatile 16-byte loads, expected at least 7");
                    assert!(pushes >= 7, "{arch}: {k}: {pushes} volatile 16-byte stores, expected at least 7");
                    assert!(!multimem, "{arch}: {k}: multimem in a push kernel");
                    if *arch != "sm_80" {
                        assert!(body.contains("ACQBULK"), "{arch}: {k}: no griddepcontrol.wait (ACQBULK)");
                        assert!(body.contains("PREEXIT"), "{arch}: {k}: no griddepcontrol.launch_dependents (PREEXIT)");
                    }
                }
                // The quantized two-shot: three barriers per world, each a system-scope release store and acquire
                // load; no multimem; fp8 conversions in hardware from sm_90 on (F2FP ... E4M3 packs two f32 into
                // e4m3).
                Family::QuantTwoShot(format) => {
                    assert!(stores >= 7 * 3, "{arch}: {k}: {stores} system-scope flag stores, expected at least 21");
                    assert!(loads >= 7 * 3, "{arch}: {k}: {loads} system-scope flag loads, expected at least 21");
                    assert!(!multimem, "{arch}: {k}: multimem outside the multicast kernels");
                    if format == Format::Fp8E4m3 && *arch != "sm_80" {
                        assert!(body.contains("E4M3"), "{arch}: {k}: no hardware e4m3 conversion");
                    }
                }
                // The emulated NVLS variants are unicast code; the multicast ones are real multimem code on sm_90
                // and newer (LDGMC is multimem.ld_reduce), and a trap on sm_80, which has no multimem.
                Family::Nvls { multicast: false, .. } => {
                    assert!(!multimem, "{arch}: {k}: the emulation must not use multimem");
                }
                Family::Nvls { multicast: true, .. } => {
                    if *arch != "sm_80" {
                        assert!(multimem, "{arch}: {k}: no multimem.ld_reduce (LDGMC)");
                    } else {
                        assert!(!multimem && body.contains("BPT.TRAP"), "{arch}: {k}: sm_80 has no multimem");
                    }
                }
            }
        }
        // Every kernel fits 64 registers per thread, so two blocks of 512 threads share an SM: emulated ranks and
        // the communicator size their grids for that (a kernel at 118 registers deadlocked 8 ranks × 24 blocks).
        let usage = Command::new(&tool).arg("-res-usage").arg(&path).env("PATH", &path_env).output();
        let usage = String::from_utf8_lossy(&usage.expect("cuobjdump -res-usage runs").stdout).into_owned();
        let regs: Vec<u32> = usage
            .split("REG:")
            .skip(1)
            .filter_map(|r| r.split_whitespace().next().and_then(|n| n.parse().ok()))
            .collect();
        assert_eq!(regs.len(), functions.len(), "{arch}: one register count per kernel");
        assert!(regs.iter().all(|r| *r <= 64), "{arch}: a kernel uses more than 64 registers: {regs:?}");
        assert!(sass.contains("STG.E.STRONG.SYS"), "{arch}: no system-scope flag store");
        assert!(sass.contains("LDG.E.STRONG.SYS"), "{arch}: no system-scope flag load");
        std::fs::remove_file(&path).ok();
    }
}

/// The all-reduce kernels take the parameters of the shared source, laid out as anyccl-kernels-common says (the
/// HIP code objects are checked against the same table), read from each cubin's `EIATTR_KPARAM_INFO` records.
#[test]
fn allreduce_kernels_take_the_shared_parameters() {
    let required = std::env::var_os("ANYCCL_REQUIRE_KERNELS").is_some();
    let (None, Some(tool)) = (anyccl_kernels_cuda::NOT_BUILT, cuobjdump()) else {
        assert!(!required, "kernels or cuobjdump missing in a run that requires them");
        eprintln!("NOT CHECKED: no kernels or no cuobjdump in this build (CI checks it)");
        return;
    };
    for (src, arch, bytes) in anyccl_kernels_cuda::CUBINS {
        let path = std::env::temp_dir().join(format!("anyccl-params-{}-{src}-{arch}.cubin", std::process::id()));
        std::fs::write(&path, bytes).expect("write cubin");
        let out = Command::new(&tool).arg("-elf").arg(&path).output().expect("cuobjdump -elf runs");
        std::fs::remove_file(&path).ok();
        assert!(out.status.success(), "cuobjdump -elf failed on {arch}: {}", String::from_utf8_lossy(&out.stderr));
        let elf = String::from_utf8_lossy(&out.stdout);
        // Every kernel of the catalogue with a tabulated layout (all but the NVLS ones).
        let mut checked = 0;
        for k in catalogue::kernels() {
            let Some(params) = k.params() else { continue };
            let want: Vec<(usize, usize)> = params.iter().map(|p| (p.1, p.2)).collect();
            let name = k.name();
            assert_eq!(
                kparams(&elf, &name),
                want,
                "{arch}: {name}: parameters (offset, size) differ from the catalogue"
            );
            checked += 1;
        }
        assert_eq!(checked, catalogue::shared_kernels().count(), "{arch}: every shared kernel's layout is checked");
    }
}

/// (offset, size) of each parameter of `kernel`, in parameter order, from the `.nv.info.<kernel>` section of a
/// `cuobjdump -elf` listing (`Ordinal : 0x1  Offset  : 0x40  Size    : 0x8`).
fn kparams(elf: &str, kernel: &str) -> Vec<(usize, usize)> {
    let header = format!(".nv.info.{kernel}");
    let Some(start) = elf.lines().position(|l| l.trim() == header) else { return Vec::new() };
    let hex = |l: &str, key: &str| -> Option<usize> {
        let v = l.split(key).nth(1)?.trim_start().trim_start_matches(':').trim_start();
        let v = v.split_whitespace().next()?.trim_start_matches("0x");
        usize::from_str_radix(v, 16).ok()
    };
    let mut params: Vec<(usize, usize, usize)> = elf
        .lines()
        .skip(start + 1)
        .take_while(|l| !l.starts_with('.'))
        .filter(|l| l.contains("Ordinal"))
        .filter_map(|l| Some((hex(l, "Ordinal")?, hex(l, "Offset")?, hex(l, "Size")?)))
        .collect();
    params.sort_unstable();
    params.into_iter().map(|(_, offset, size)| (offset, size)).collect()
}

/// The SASS of each function in a `cuobjdump -sass` listing, by name.
fn split_functions(sass: &str) -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let mut current: Option<(String, String)> = None;
    for line in sass.lines() {
        if let Some(name) = line.trim().strip_prefix("Function : ") {
            if let Some((n, body)) = current.take() {
                out.insert(n, body);
            }
            current = Some((name.trim().to_string(), String::new()));
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    if let Some((n, body)) = current {
        out.insert(n, body);
    }
    out
}
