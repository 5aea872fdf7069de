//! anyccl-kernels-common: the all-reduce kernel source written once for every vendor, and the flag layout the
//! launchers of its kernels allocate.
//!
//! `include/anyccl/allreduce.h` holds the one-shot and two-shot all-reduce (staging and input-table inputs, the
//! abort word, two-shot rounds, the per-block barrier and epoch counters) over a small vendor layer:
//! `include/anyccl/vendor_cuda.h` (nvcc: PTX release/acquire at system scope, `uint4`, `__half`,
//! `__nv_bfloat16`) and `include/anyccl/vendor_hip.h` (hipcc: `__hip_atomic_*` at system scope, `s_sleep` between
//! polls, a 16-byte struct, `_Float16`, bf16 by hand). `anyccl-kernels-cuda` and `anyccl-kernels-hip` compile it
//! (their build scripts find the headers through this crate's `links` metadata); this crate compiles nothing.
//!
//! Both vendors' kernels have the same names and parameters ([`ALLREDUCE_KERNELS`]) and the same flag array
//! ([`FLAG_BYTES`]); the constants here are the header's, which a test checks.
//!
//! [`catalogue`] is the one list of every kernel the sources define (name, element types, parameter layout); the
//! launchers name their kernels through it and the tests of the compiled kernels iterate it.
//!
//! `include/anyccl/quant.h` adds the quantized two-shot ([`QUANT_KERNELS`], fp8 e4m3 or int8 exchanged data with
//! one f32 scale per 32 elements, f32 accumulation); [`quant`] mirrors its arithmetic on the host and states its
//! error bound.
#![forbid(unsafe_code)]

pub mod catalogue;
pub mod fused_push;
pub mod push;

pub mod quant;

/// Most ranks one launch handles (`ANYCCL_MAX_RANKS`).
pub const MAX_RANKS: usize = 8;
/// Most blocks per launch; the flag arrays are sized for it (`ANYCCL_MAX_BLOCKS`).
pub const MAX_BLOCKS: usize = 128;
/// Byte offset of the abort word in a rank's flag array, after `MAX_BLOCKS × MAX_RANKS` barrier slots,
/// `MAX_BLOCKS` epoch counters and `MAX_BLOCKS` arrival counters of the multicast barrier, 32 bits each
/// (`ANYCCL_ABORT_WORD`, in words). Non-zero tells that rank's kernels to stop waiting for peers: a barrier that has
/// spun [`ABORT_CHECK`] times without its peer checks it every [`ABORT_CHECK`] spins, and the kernel then runs to
/// its end with garbage results. Set it (from a stream other than the stuck one) when a wait gave up on a dead
/// peer, so the kernel ends and the GPU's memory can be freed.
pub const ABORT_WORD_OFFSET: usize = (MAX_BLOCKS * MAX_RANKS + 2 * MAX_BLOCKS) * 4;
/// Bytes of one rank's flag array: everything up to the abort word, the abort word, and padding to 16 bytes. Zero
/// it once before first use.
pub const FLAG_BYTES: usize = ABORT_WORD_OFFSET + 16;
/// Spins between two looks at the abort word (`ANYCCL_ABORT_CHECK`).
pub const ABORT_CHECK: u32 = 1024;
/// Bytes every vector access moves; message sizes must be multiples of it.
pub const VECTOR_BYTES: usize = 16;

// The flag array holds the abort word and stays a whole number of vectors.
const _: () = assert!(FLAG_BYTES >= ABORT_WORD_OFFSET + 4 && FLAG_BYTES.is_multiple_of(VECTOR_BYTES));

/// The element types every kernel is built for, as they end the kernel names (the suffixes of
/// [`catalogue::Dtype::ALL`], which a test checks).
pub const DTYPES: [&str; 3] = ["f32", "f16", "bf16"];

/// The all-reduce kernels of the shared source, the same on every vendor: `anyccl_{one_shot,two_shot}[_table]_`
/// followed by a name of [`DTYPES`]. The `_table` kernels read the inputs' pointers from an input table in device
/// memory (kernels captured in a graph before their inputs were registered). The names of the catalogue's
/// [`catalogue::Family::OneShot`] and [`catalogue::Family::TwoShot`] kernels, which a test checks.
pub const ALLREDUCE_KERNELS: [&str; 12] = [
    "anyccl_one_shot_f32",
    "anyccl_one_shot_f16",
    "anyccl_one_shot_bf16",
    "anyccl_one_shot_table_f32",
    "anyccl_one_shot_table_f16",
    "anyccl_one_shot_table_bf16",
    "anyccl_two_shot_f32",
    "anyccl_two_shot_f16",
    "anyccl_two_shot_bf16",
    "anyccl_two_shot_table_f32",
    "anyccl_two_shot_table_f16",
    "anyccl_two_shot_table_bf16",
];

/// One parameter of a kernel: its name in the source, its byte offset in the parameter block, its size in bytes.
pub type Param = (&'static str, usize, usize);

const ONE_SHOT_PARAMS: [Param; 7] = [
    ("in", 0, 64),
    ("self_src", 64, 8),
    ("out", 72, 8),
    ("flags", 80, 64),
    ("rank", 144, 4),
    ("world", 148, 4),
    ("n_vec", 152, 8),
];
const ONE_SHOT_TABLE_PARAMS: [Param; 7] = [
    ("table", 0, 8),
    ("self_src", 8, 8),
    ("out", 16, 8),
    ("flags", 24, 64),
    ("rank", 88, 4),
    ("world", 92, 4),
    ("n_vec", 96, 8),
];
const TWO_SHOT_PARAMS: [Param; 9] = [
    ("in", 0, 64),
    ("self_src", 64, 8),
    ("scratch", 72, 64),
    ("out", 136, 8),
    ("round_vecs", 144, 8),
    ("flags", 152, 64),
    ("rank", 216, 4),
    ("world", 220, 4),
    ("n_vec", 224, 8),
];
const TWO_SHOT_TABLE_PARAMS: [Param; 9] = [
    ("table", 0, 8),
    ("self_src", 8, 8),
    ("scratch", 16, 64),
    ("out", 80, 8),
    ("round_vecs", 88, 8),
    ("flags", 96, 64),
    ("rank", 160, 4),
    ("world", 164, 4),
    ("n_vec", 168, 8),
];

/// The parameters of an all-reduce kernel of [`ALLREDUCE_KERNELS`], in order, as every vendor's compiler lays
/// them out (`in`/`scratch`/`flags`: 8 pointers by value; `table`: a device pointer to an input table of 8
/// pointers and a `u64` "registered" word; `rank`, `world`: `i32`; `round_vecs`, `n_vec`: `u64`). The kernel
/// tests read each vendor's binaries back and compare; `None` for a name that is not an all-reduce kernel.
pub fn allreduce_params(kernel: &str) -> Option<&'static [Param]> {
    use catalogue::Family;
    let k = catalogue::find(kernel)?;
    matches!(k.family, Family::OneShot { .. } | Family::TwoShot { .. }).then_some(())?;
    k.params()
}

/// The parameters of the one-shot (`one_shot`) or two-shot kernel, reading its inputs through a table or not
/// (what [`allreduce_params`] answers for each of their names).
pub fn allreduce_params_of(one_shot: bool, table: bool) -> &'static [Param] {
    match (one_shot, table) {
        (true, true) => &ONE_SHOT_TABLE_PARAMS,
        (true, false) => &ONE_SHOT_PARAMS,
        (false, true) => &TWO_SHOT_TABLE_PARAMS,
        (false, false) => &TWO_SHOT_PARAMS,
    }
}

/// The fused all-reduce + residual add + RMSNorm kernels (`include/anyccl/fused.h`), for f16 and bf16:
/// `anyccl_fused_{one_shot,two_shot}[_table]_{f16,bf16}`, and the separate RMSNorm kernel of the unfused baseline
/// `anyccl_rmsnorm_{f16,bf16}` (the same add + RMSNorm math, so fused and unfused results are bitwise equal). The
/// names of the catalogue's fused families ([`catalogue`]), which a test checks.
pub const FUSED_KERNELS: [&str; 10] = [
    "anyccl_fused_one_shot_f16",
    "anyccl_fused_one_shot_bf16",
    "anyccl_fused_one_shot_table_f16",
    "anyccl_fused_one_shot_table_bf16",
    "anyccl_fused_two_shot_f16",
    "anyccl_fused_two_shot_bf16",
    "anyccl_fused_two_shot_table_f16",
    "anyccl_fused_two_shot_table_bf16",
    "anyccl_rmsnorm_f16",
    "anyccl_rmsnorm_bf16",
];

/// The element types the fused kernels are built for.
pub const FUSED_DTYPES: [&str; 2] = ["f16", "bf16"];

/// Threads per block of the fused and RMSNorm kernels (`ANYCCL_NORM_THREADS`): the order of a row's sum of
/// squares depends on it, so every launch uses exactly this many.
pub const NORM_THREADS: u32 = 512;
/// Largest row (`hidden`, elements) the fused kernels take (`ANYCCL_MAX_HIDDEN`); rows are multiples of 8 elements.
pub const MAX_HIDDEN: usize = 16384;
/// Bytes of the `NormArgs` struct every fused kernel takes by value: `residual`, `weight`, `out` pointers, `eps`
/// and `scale` (f32), `out_fp8` (i32), `hidden_vec` (u32), `tokens` (u64).
pub const NORM_ARGS_BYTES: usize = 48;

const FUSED_ONE_SHOT_PARAMS: [Param; 6] =
    [("in", 0, 64), ("self_src", 64, 8), ("args", 72, 48), ("flags", 120, 64), ("rank", 184, 4), ("world", 188, 4)];
const FUSED_ONE_SHOT_TABLE_PARAMS: [Param; 6] =
    [("table", 0, 8), ("self_src", 8, 8), ("args", 16, 48), ("flags", 64, 64), ("rank", 128, 4), ("world", 132, 4)];
const FUSED_TWO_SHOT_PARAMS: [Param; 7] = [
    ("in", 0, 64),
    ("self_src", 64, 8),
    ("scratch", 72, 64),
    ("args", 136, 48),
    ("flags", 184, 64),
    ("rank", 248, 4),
    ("world", 252, 4),
];
const FUSED_TWO_SHOT_TABLE_PARAMS: [Param; 7] = [
    ("table", 0, 8),
    ("self_src", 8, 8),
    ("scratch", 16, 64),
    ("args", 80, 48),
    ("flags", 128, 64),
    ("rank", 192, 4),
    ("world", 196, 4),
];
const RMSNORM_PARAMS: [Param; 2] = [("in", 0, 8), ("args", 8, 48)];

/// The parameters of a kernel of [`FUSED_KERNELS`], in order, as every vendor's compiler lays them out; `None`
/// for another name.
pub fn fused_params(kernel: &str) -> Option<&'static [Param]> {
    use catalogue::Family;
    let k = catalogue::find(kernel)?;
    matches!(k.family, Family::FusedOneShot { .. } | Family::FusedTwoShot { .. } | Family::RmsNorm).then_some(())?;
    k.params()
}

/// The fused kernels' source (`include/anyccl/fused.h`, included after `allreduce.h`).
pub const FUSED_HEADER: &str = include_str!("../include/anyccl/fused.h");

/// The quantized two-shot kernels (`include/anyccl/quant.h`): `anyccl_quant_two_shot_{fp8,int8}_` followed by a
/// name of [`DTYPES`] (the input and output type; the exchanged data is the format's). Parameters:
/// [`QUANT_PARAMS`]. The names of the catalogue's [`catalogue::Family::QuantTwoShot`] kernels, which a test checks.
pub const QUANT_KERNELS: [&str; 6] = [
    "anyccl_quant_two_shot_fp8_f32",
    "anyccl_quant_two_shot_fp8_f16",
    "anyccl_quant_two_shot_fp8_bf16",
    "anyccl_quant_two_shot_int8_f32",
    "anyccl_quant_two_shot_int8_f16",
    "anyccl_quant_two_shot_int8_bf16",
];

/// The parameters of every kernel of [`QUANT_KERNELS`], in order (`in`, `out`: this rank's buffers; `stage`,
/// `scratch`, `flags`: 8 pointers by value; `rank`, `world`: `i32`; `n_vec`: `u64`, the message's 16-byte vectors).
pub const QUANT_PARAMS: [Param; 8] = [
    ("in", 0, 8),
    ("stage", 8, 64),
    ("scratch", 72, 64),
    ("out", 136, 8),
    ("flags", 144, 64),
    ("rank", 208, 4),
    ("world", 212, 4),
    ("n_vec", 216, 8),
];

/// The shared kernel source and vendor headers, by path under `include/` (for tests and tools that read them).
pub const HEADERS: [(&str, &str); 4] = [
    ("anyccl/allreduce.h", include_str!("../include/anyccl/allreduce.h")),
    ("anyccl/vendor_cuda.h", include_str!("../include/anyccl/vendor_cuda.h")),
    ("anyccl/vendor_hip.h", include_str!("../include/anyccl/vendor_hip.h")),
    ("anyccl/quant.h", include_str!("../include/anyccl/quant.h")),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer a `#define NAME …` of allreduce.h evaluates to, over the header's other defines (it uses only
    /// sums and products of them).
    fn define(name: &str) -> usize {
        let src = HEADERS[0].1;
        let line = src
            .lines()
            .find_map(|l| l.strip_prefix("#define ").and_then(|r| r.strip_prefix(name)).filter(|r| r.starts_with(' ')))
            .unwrap_or_else(|| panic!("allreduce.h has no #define {name}"));
        eval(line.trim())
    }

    fn eval(expr: &str) -> usize {
        let e = expr.trim();
        if let Some(inner) = e.strip_prefix('(').and_then(|r| r.strip_suffix(')')) {
            return eval(inner);
        }
        if let Some((a, b)) = e.split_once(" + ") {
            return eval(a) + eval(b);
        }
        if let Some((a, b)) = e.split_once(" * ") {
            return eval(a) * eval(b);
        }
        e.parse().unwrap_or_else(|_| define(e))
    }

    #[test]
    fn layout_constants_are_the_headers() {
        assert_eq!(define("ANYCCL_MAX_RANKS"), MAX_RANKS);
        assert_eq!(define("ANYCCL_MAX_BLOCKS"), MAX_BLOCKS);
        assert_eq!(define("ANYCCL_ABORT_WORD") * 4, ABORT_WORD_OFFSET);
        assert_eq!(define("ANYCCL_ABORT_CHECK"), ABORT_CHECK as usize);
        assert_eq!(define("ANYCCL_EPOCHS"), MAX_BLOCKS * MAX_RANKS, "epoch counters follow the barrier slots");
    }

    #[test]
    fn kernel_names_are_the_headers() {
        // The kernels are stamped out by one macro per dtype; its names and the list here must agree.
        let src = HEADERS[0].1;
        let mut stamped: Vec<String> = Vec::new();
        for kind in ["one_shot", "one_shot_table", "two_shot", "two_shot_table"] {
            assert!(src.contains(&format!("anyccl_{kind}_##NAME(")), "allreduce.h stamps no anyccl_{kind}_");
            for dt in DTYPES {
                stamped.push(format!("anyccl_{kind}_{dt}"));
            }
        }
        let mut listed: Vec<String> = ALLREDUCE_KERNELS.iter().map(|k| String::from(*k)).collect();
        stamped.sort();
        listed.sort();
        assert_eq!(stamped, listed);
    }

    #[test]
    fn params_follow_the_kernel_signatures() {
        let src = HEADERS[0].1;
        for k in ALLREDUCE_KERNELS {
            let params = allreduce_params(k).unwrap_or_else(|| panic!("{k}: no parameters"));
            // Natural alignment, no gaps beyond it: what nvcc and clang both do for these types.
            let mut end = 0usize;
            for (name, offset, size) in params {
                assert_eq!(*offset, end.next_multiple_of((*size).min(8)), "{k}: {name} at {offset}");
                end = offset + size;
            }
            // The names are the source's, in its order.
            let kind = k.rsplit_once('_').map(|(kind, _)| kind).unwrap_or(k);
            let start = src.find(&format!("{kind}_##NAME(")).unwrap_or_else(|| panic!("{kind} not in the source"));
            let sig = &src[start..start + src[start..].find(')').unwrap_or(0)];
            let mut at = 0;
            for (name, _, _) in params {
                let pos = sig[at..].find(&format!(" {name},")).or_else(|| sig[at..].find(&format!(" {name}")));
                let pos = pos.unwrap_or_else(|| panic!("{k}: parameter {name} not in the source's order: {sig}"));
                at += pos + name.len();
            }
        }
        assert!(allreduce_params("anyccl_nvls_zero_copy_emu_f32").is_none());
    }

    #[test]
    fn vendor_headers_define_the_same_layer() {
        // Every name allreduce.h takes from the vendor layer is defined by both vendor headers.
        for name in [
            "ANYCCL_LAUNCH_BOUNDS",
            "anyccl_vec16",
            "anyccl_f32",
            "anyccl_f16",
            "anyccl_bf16",
            "anyccl_st_release_sys(",
            "anyccl_ld_acquire_sys(",
            "anyccl_ld_volatile(",
            "anyccl_spin_pause(",
            "anyccl_min_size(",
            "Elem<",
        ] {
            assert!(HEADERS[0].1.contains(name), "allreduce.h does not use {name}");
            for (path, text) in &HEADERS[1..3] {
                assert!(text.contains(name), "{path} does not define {name}");
            }
        }
        // And what quant.h takes from it.
        for name in ["anyccl_e4m3x2_encode(", "anyccl_e4m3x2_decode("] {
            assert!(HEADERS[3].1.contains(name), "quant.h does not use {name}");
            for (path, text) in &HEADERS[1..3] {
                assert!(text.contains(name), "{path} does not define {name}");
            }
        }
    }

    /// The integer a `#define NAME <n>` of fused.h is.
    fn fused_define(name: &str) -> usize {
        FUSED_HEADER
            .lines()
            .find_map(|l| l.strip_prefix("#define ").and_then(|r| r.strip_prefix(name)).filter(|r| r.starts_with(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("fused.h has no numeric #define {name}"))
    }

    #[test]
    fn fused_constants_names_and_params_are_the_headers() {
        assert_eq!(fused_define("ANYCCL_NORM_THREADS"), NORM_THREADS as usize);
        assert_eq!(fused_define("ANYCCL_MAX_HIDDEN"), MAX_HIDDEN);
        let mut stamped = Vec::new();
        for kind in ["fused_one_shot", "fused_one_shot_table", "fused_two_shot", "fused_two_shot_table", "rmsnorm"] {
            assert!(FUSED_HEADER.contains(&format!("anyccl_{kind}_##NAME(")), "fused.h stamps no anyccl_{kind}_");
            for dt in FUSED_DTYPES {
                stamped.push(format!("anyccl_{kind}_{dt}"));
            }
        }
        let mut listed: Vec<String> = FUSED_KERNELS.iter().map(|k| String::from(*k)).collect();
        stamped.sort();
        listed.sort();
        assert_eq!(stamped, listed);
        // NormArgs: three pointers, two f32, i32, u32, u64, in that order (48 bytes, no padding).
        let start = FUSED_HEADER.find("struct NormArgs {").expect("NormArgs");
        let body = &FUSED_HEADER[start..start + FUSED_HEADER[start..].find("};").expect("end")];
        let fields: Vec<&str> = body
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with("//") && l.ends_with(';'))
            .map(|l| l.trim_end_matches(';').rsplit(' ').next().unwrap_or(""))
            .collect();
        assert_eq!(fields, ["residual", "weight", "out", "eps", "scale", "out_fp8", "hidden_vec", "tokens"]);
        assert_eq!(NORM_ARGS_BYTES, 3 * 8 + 4 * 4 + 8);
        for k in FUSED_KERNELS {
            let params = fused_params(k).unwrap_or_else(|| panic!("{k}: no parameters"));
            let mut end = 0usize;
            for (name, offset, size) in params {
                assert_eq!(*offset, end.next_multiple_of((*size).min(8)), "{k}: {name} at {offset}");
                end = offset + size;
            }
            if params.iter().any(|p| p.0 == "args") {
                assert!(params.iter().any(|p| p.0 == "args" && p.2 == NORM_ARGS_BYTES), "{k}");
            }
            let kind = k.rsplit_once('_').map(|(kind, _)| kind).unwrap_or(k);
            let start = FUSED_HEADER.find(&format!("{kind}_##NAME(")).unwrap_or_else(|| panic!("{kind} not found"));
            let sig = &FUSED_HEADER[start..start + FUSED_HEADER[start..].find(')').unwrap_or(0)];
            let mut at = 0;
            for (name, _, _) in params {
                let pos = sig[at..].find(&format!(" {name},")).or_else(|| sig[at..].find(&format!(" {name}")));
                let pos = pos.unwrap_or_else(|| panic!("{k}: parameter {name} not in the source's order: {sig}"));
                at += pos + name.len();
            }
        }
        assert!(fused_params("anyccl_one_shot_f32").is_none());
        assert!(allreduce_params("anyccl_fused_one_shot_bf16").is_none());
    }

    #[test]
    fn vendor_headers_define_the_fused_layer() {
        for name in [
            "anyccl_fadd_rn(",
            "anyccl_fmul_rn(",
            "anyccl_fdiv_rn(",
            "anyccl_fsqrt_rn(",
            "anyccl_fma_rn(",
            "anyccl_shfl_xor32(",
        ] {
            assert!(FUSED_HEADER.contains(name), "fused.h does not use {name}");
            for (path, text) in &HEADERS[1..3] {
                assert!(text.contains(name), "{path} does not define {name}");
            }
        }
    }

    #[test]
    fn quant_constants_names_and_params_are_the_headers() {
        let src = HEADERS[3].1;
        let block = src
            .lines()
            .find_map(|l| l.strip_prefix("#define ANYCCL_QUANT_BLOCK "))
            .and_then(|v| v.trim().parse::<usize>().ok());
        assert_eq!(block, Some(quant::BLOCK));
        let mut stamped = Vec::new();
        for f in quant::Format::ALL {
            assert!(src.contains(&format!("anyccl_quant_two_shot_{}_##NAME(", f.name())), "{f:?}");
            for dt in DTYPES {
                stamped.push(format!("anyccl_quant_two_shot_{}_{dt}", f.name()));
            }
        }
        let mut listed: Vec<String> = QUANT_KERNELS.iter().map(|k| String::from(*k)).collect();
        stamped.sort();
        listed.sort();
        assert_eq!(stamped, listed);
        // Natural alignment, and the source's names in its order.
        let mut end = 0usize;
        for (name, offset, size) in QUANT_PARAMS {
            assert_eq!(offset, end.next_multiple_of(size.min(8)), "{name} at {offset}");
            end = offset + size;
        }
        let start = src.find("anyccl_quant_two_shot_fp8_##NAME(").expect("fp8 kernel");
        let sig = &src[start..start + src[start..].find(')').unwrap_or(0)];
        let mut at = 0;
        for (name, _, _) in QUANT_PARAMS {
            let pos = sig[at..].find(&format!(" {name},")).or_else(|| sig[at..].find(&format!(" {name}")));
            let pos = pos.unwrap_or_else(|| panic!("parameter {name} not in the source's order: {sig}"));
            at += pos + name.len();
        }
        // The three kernel sources instantiate it.
        for f in ["kernels-cuda/cuda/allreduce.cu", "kernels-hip/hip/allreduce.hip"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(f);
            if let Ok(text) = std::fs::read_to_string(&path) {
                assert!(text.contains("#include \"anyccl/quant.h\""), "{f} does not build the quantized kernels");
            }
        }
    }
}
