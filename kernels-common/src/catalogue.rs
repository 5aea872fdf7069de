//! The one catalogue of the kernels the source defines: every family (one macro of the source, stamped out once
//! per element type), the element types and the suffixes that end the kernel names, each kernel's name and its
//! parameter layout. The launchers name their kernels through it ([`kernel_name`]), and the tests that read the
//! compiled cubins and code objects back iterate [`kernels`]; the name lists of the crate root
//! ([`crate::ALLREDUCE_KERNELS`], …) stay as `const` arrays for their users and are checked equal to it.

use crate::quant::Format;
use crate::Param;

/// An element type the kernels are built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// 32-bit float (`f32`).
    F32,
    /// IEEE half (`f16`).
    F16,
    /// bfloat16 (`bf16`).
    Bf16,
}

impl Dtype {
    /// Every element type, in the order of [`crate::DTYPES`].
    pub const ALL: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    /// The element types of the fused (add + RMSNorm) kernels, in the order of [`crate::FUSED_DTYPES`].
    pub const FUSED: [Dtype; 2] = [Dtype::F16, Dtype::Bf16];

    /// The suffix that ends the names of this type's kernels (`"bf16"`).
    pub const fn suffix(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    /// The element type whose suffix is `suffix`.
    pub fn from_suffix(suffix: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.suffix() == suffix)
    }

    /// Where this type sits in [`Dtype::ALL`] (the launchers' function tables are indexed by it).
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// A variant of the NVLS all-reduce (`kernels-cuda/cuda/nvls.cuh`, CUDA only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NvlsVariant {
    /// Loads and stores through the switch channel straight from and to the ranks' buffers.
    ZeroCopy,
    /// Staged through per-rank buffers, one tile per block.
    BlockPipeline,
    /// Staged, with copy-in, reduce and copy-out warps on consecutive tiles.
    WarpPipeline,
}

impl NvlsVariant {
    /// Every variant.
    pub const ALL: [NvlsVariant; 3] = [NvlsVariant::ZeroCopy, NvlsVariant::WarpPipeline, NvlsVariant::BlockPipeline];

    /// The variant's part of the kernel names (`"block_pipeline"`).
    pub const fn name(self) -> &'static str {
        match self {
            NvlsVariant::ZeroCopy => "zero_copy",
            NvlsVariant::BlockPipeline => "block_pipeline",
            NvlsVariant::WarpPipeline => "warp_pipeline",
        }
    }
}

/// A family of kernels: one macro of the source, stamped out once per element type of [`Family::dtypes`] as
/// [`Family::stem`] followed by the type's [`Dtype::suffix`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// The one-shot all-reduce (`allreduce.h`), reading its inputs' pointers by value (`table: false`) or from an
    /// input table in device memory (`table: true`).
    OneShot {
        /// Whether the inputs come from an input table.
        table: bool,
    },
    /// The two-shot all-reduce (`allreduce.h`).
    TwoShot {
        /// Whether the inputs come from an input table.
        table: bool,
    },
    /// The fused one-shot all-reduce + residual add + RMSNorm (`fused.h`).
    FusedOneShot {
        /// Whether the inputs come from an input table.
        table: bool,
    },
    /// The fused two-shot all-reduce + residual add + RMSNorm (`fused.h`).
    FusedTwoShot {
        /// Whether the inputs come from an input table.
        table: bool,
    },
    /// The separate add + RMSNorm kernel of the unfused baseline (`fused.h`).
    RmsNorm,
    /// The push one-shot (`push.h`).
    PushOneShot,
    /// The push two-shot (`push.h`).
    PushTwoShot,
    /// The fused push one-shot (`fused_push.h`).
    FusedPushOneShot,
    /// The quantized two-shot exchanging `Format` data (`quant.h`).
    QuantTwoShot(Format),
    /// An NVLS variant over the unicast emulation of the switch channel (`multicast: false`) or over a real
    /// multicast object (CUDA only; not in the shared source).
    Nvls {
        /// The variant.
        variant: NvlsVariant,
        /// Whether it runs on a real multicast object (`_mc_`) or the emulation (`_emu_`).
        multicast: bool,
    },
}

impl Family {
    /// Every family the kernel sources define.
    pub const ALL: [Family; 20] = [
        Family::OneShot { table: false },
        Family::OneShot { table: true },
        Family::TwoShot { table: false },
        Family::TwoShot { table: true },
        Family::FusedOneShot { table: false },
        Family::FusedOneShot { table: true },
        Family::FusedTwoShot { table: false },
        Family::FusedTwoShot { table: true },
        Family::RmsNorm,
        Family::PushOneShot,
        Family::PushTwoShot,
        Family::FusedPushOneShot,
        Family::QuantTwoShot(Format::Fp8E4m3),
        Family::QuantTwoShot(Format::Int8),
        Family::Nvls { variant: NvlsVariant::ZeroCopy, multicast: false },
        Family::Nvls { variant: NvlsVariant::WarpPipeline, multicast: false },
        Family::Nvls { variant: NvlsVariant::BlockPipeline, multicast: false },
        Family::Nvls { variant: NvlsVariant::ZeroCopy, multicast: true },
        Family::Nvls { variant: NvlsVariant::WarpPipeline, multicast: true },
        Family::Nvls { variant: NvlsVariant::BlockPipeline, multicast: true },
    ];

    /// What every kernel name of the family starts with, up to the element type's suffix
    /// (`"anyccl_one_shot_table_"`); the source stamps the kernels as `<stem>##NAME`.
    pub const fn stem(self) -> &'static str {
        use NvlsVariant::{BlockPipeline, WarpPipeline, ZeroCopy};
        match self {
            Family::OneShot { table: false } => "anyccl_one_shot_",
            Family::OneShot { table: true } => "anyccl_one_shot_table_",
            Family::TwoShot { table: false } => "anyccl_two_shot_",
            Family::TwoShot { table: true } => "anyccl_two_shot_table_",
            Family::FusedOneShot { table: false } => "anyccl_fused_one_shot_",
            Family::FusedOneShot { table: true } => "anyccl_fused_one_shot_table_",
            Family::FusedTwoShot { table: false } => "anyccl_fused_two_shot_",
            Family::FusedTwoShot { table: true } => "anyccl_fused_two_shot_table_",
            Family::RmsNorm => "anyccl_rmsnorm_",
            Family::PushOneShot => "anyccl_push_one_shot_",
            Family::PushTwoShot => "anyccl_push_two_shot_",
            Family::FusedPushOneShot => "anyccl_fused_push_one_shot_",
            Family::QuantTwoShot(Format::Fp8E4m3) => "anyccl_quant_two_shot_fp8_",
            Family::QuantTwoShot(Format::Int8) => "anyccl_quant_two_shot_int8_",
            Family::Nvls { variant: ZeroCopy, multicast: false } => "anyccl_nvls_zero_copy_emu_",
            Family::Nvls { variant: BlockPipeline, multicast: false } => "anyccl_nvls_block_pipeline_emu_",
            Family::Nvls { variant: WarpPipeline, multicast: false } => "anyccl_nvls_warp_pipeline_emu_",
            Family::Nvls { variant: ZeroCopy, multicast: true } => "anyccl_nvls_zero_copy_mc_",
            Family::Nvls { variant: BlockPipeline, multicast: true } => "anyccl_nvls_block_pipeline_mc_",
            Family::Nvls { variant: WarpPipeline, multicast: true } => "anyccl_nvls_warp_pipeline_mc_",
        }
    }

    /// The element types the family is built for.
    pub const fn dtypes(self) -> &'static [Dtype] {
        match self {
            Family::FusedOneShot { .. } | Family::FusedTwoShot { .. } | Family::RmsNorm | Family::FusedPushOneShot => {
                &Dtype::FUSED
            }
            _ => &Dtype::ALL,
        }
    }

    /// Whether only the CUDA kernels have the family (the NVLS kernels); the others are the shared source's, built
    /// for every vendor.
    pub const fn cuda_only(self) -> bool {
        matches!(self, Family::Nvls { .. })
    }

    /// The family's parameters, in order, as every vendor's compiler lays them out; `None` where the catalogue
    /// does not tabulate them (the NVLS kernels).
    pub const fn params(self) -> Option<&'static [Param]> {
        Some(match self {
            Family::OneShot { table: false } => &crate::ONE_SHOT_PARAMS,
            Family::OneShot { table: true } => &crate::ONE_SHOT_TABLE_PARAMS,
            Family::TwoShot { table: false } => &crate::TWO_SHOT_PARAMS,
            Family::TwoShot { table: true } => &crate::TWO_SHOT_TABLE_PARAMS,
            Family::FusedOneShot { table: false } => &crate::FUSED_ONE_SHOT_PARAMS,
            Family::FusedOneShot { table: true } => &crate::FUSED_ONE_SHOT_TABLE_PARAMS,
            Family::FusedTwoShot { table: false } => &crate::FUSED_TWO_SHOT_PARAMS,
            Family::FusedTwoShot { table: true } => &crate::FUSED_TWO_SHOT_TABLE_PARAMS,
            Family::RmsNorm => &crate::RMSNORM_PARAMS,
            Family::PushOneShot | Family::PushTwoShot => &crate::push::PUSH_PARAMS,
            Family::FusedPushOneShot => &crate::fused_push::FUSED_PUSH_PARAMS,
            Family::QuantTwoShot(_) => &crate::QUANT_PARAMS,
            Family::Nvls { .. } => return None,
        })
    }

    /// The family's kernel for `dtype`, if it is built for it.
    pub fn kernel(self, dtype: Dtype) -> Option<Kernel> {
        self.dtypes().contains(&dtype).then_some(Kernel { family: self, dtype })
    }
}

/// One kernel of the catalogue: a family at one element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Kernel {
    /// Its family.
    pub family: Family,
    /// Its element type (one of the family's [`Family::dtypes`]).
    pub dtype: Dtype,
}

impl Kernel {
    /// The kernel's symbol (`anyccl_two_shot_table_bf16`).
    pub fn name(self) -> String {
        let (stem, suffix) = (self.family.stem(), self.dtype.suffix());
        let mut s = String::with_capacity(stem.len() + suffix.len());
        s.push_str(stem);
        s.push_str(suffix);
        s
    }

    /// The kernel's parameters (its family's, [`Family::params`]).
    pub const fn params(self) -> Option<&'static [Param]> {
        self.family.params()
    }
}

/// The symbol of `family`'s kernel for `dtype`; `None` where the family is not built for it.
pub fn kernel_name(family: Family, dtype: Dtype) -> Option<String> {
    family.kernel(dtype).map(Kernel::name)
}

/// Every kernel the sources define (CUDA's NVLS kernels included), family by family in [`Family::ALL`] order,
/// element types in the family's order.
pub fn kernels() -> impl Iterator<Item = Kernel> {
    Family::ALL.into_iter().flat_map(|family| family.dtypes().iter().map(move |&dtype| Kernel { family, dtype }))
}

/// Every kernel of the shared source: what each vendor's build holds (the HIP code objects hold exactly these).
pub fn shared_kernels() -> impl Iterator<Item = Kernel> {
    kernels().filter(|k| !k.family.cuda_only())
}

/// The kernel whose symbol is `name`.
pub fn find(name: &str) -> Option<Kernel> {
    kernels().find(|k| name.strip_prefix(k.family.stem()).is_some_and(|suffix| suffix == k.dtype.suffix()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of the kernels of `families`, in catalogue order.
    fn names_of(families: &[Family]) -> Vec<String> {
        kernels().filter(|k| families.contains(&k.family)).map(Kernel::name).collect()
    }

    #[test]
    fn the_name_lists_are_the_catalogues() {
        let dtypes: Vec<&str> = Dtype::ALL.iter().map(|d| d.suffix()).collect();
        assert_eq!(dtypes, crate::DTYPES);
        let fused: Vec<&str> = Dtype::FUSED.iter().map(|d| d.suffix()).collect();
        assert_eq!(fused, crate::FUSED_DTYPES);
        let shots = [false, true].map(|table| Family::OneShot { table });
        let twos = [false, true].map(|table| Family::TwoShot { table });
        assert_eq!(names_of(&[shots[0], shots[1], twos[0], twos[1]]), crate::ALLREDUCE_KERNELS);
        let fused_families = [
            Family::FusedOneShot { table: false },
            Family::FusedOneShot { table: true },
            Family::FusedTwoShot { table: false },
            Family::FusedTwoShot { table: true },
            Family::RmsNorm,
        ];
        assert_eq!(names_of(&fused_families), crate::FUSED_KERNELS);
        assert_eq!(names_of(&[Family::PushOneShot]), crate::push::PUSH_KERNELS);
        assert_eq!(names_of(&[Family::PushTwoShot]), crate::push::PUSH_TWO_SHOT_KERNELS);
        assert_eq!(names_of(&[Family::FusedPushOneShot]), crate::fused_push::FUSED_PUSH_KERNELS);
        let quant = Format::ALL.map(Family::QuantTwoShot);
        assert_eq!(names_of(&quant), crate::QUANT_KERNELS);
        // The lists together are the shared source, every kernel once; the NVLS kernels are the only others.
        let mut listed: Vec<String> = crate::ALLREDUCE_KERNELS
            .iter()
            .chain(&crate::FUSED_KERNELS)
            .chain(&crate::push::PUSH_KERNELS)
            .chain(&crate::push::PUSH_TWO_SHOT_KERNELS)
            .chain(&crate::fused_push::FUSED_PUSH_KERNELS)
            .chain(&crate::QUANT_KERNELS)
            .map(|k| String::from(*k))
            .collect();
        let mut shared: Vec<String> = shared_kernels().map(Kernel::name).collect();
        listed.sort_unstable();
        shared.sort_unstable();
        assert_eq!(shared, listed);
        assert_eq!(kernels().count(), shared.len() + 6 * 3, "six NVLS families of three types");
    }

    #[test]
    fn names_are_unique_and_found_again() {
        let mut all: Vec<String> = kernels().map(Kernel::name).collect();
        for k in kernels() {
            assert_eq!(find(&k.name()), Some(k), "{k:?}");
        }
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "two kernels share a name");
        assert_eq!(find("anyccl_one_shot_table_f64"), None);
        assert_eq!(find("anyccl_fused_one_shot_f32"), None, "no f32 fused kernel");
        assert_eq!(kernel_name(Family::RmsNorm, Dtype::F32), None);
        assert_eq!(
            kernel_name(Family::Nvls { variant: NvlsVariant::BlockPipeline, multicast: true }, Dtype::Bf16).as_deref(),
            Some("anyccl_nvls_block_pipeline_mc_bf16")
        );
        assert_eq!(Dtype::from_suffix("bf16"), Some(Dtype::Bf16));
        assert_eq!(Dtype::from_suffix("f64"), None);
        for (i, d) in Dtype::ALL.into_iter().enumerate() {
            assert_eq!(d.index(), i);
        }
    }

    #[test]
    fn every_shared_family_is_stamped_by_the_source_with_its_parameters() {
        let sources = [
            crate::HEADERS[0].1,
            crate::HEADERS[3].1,
            crate::FUSED_HEADER,
            crate::push::PUSH_HEADER,
            crate::fused_push::FUSED_PUSH_HEADER,
        ];
        for family in Family::ALL.into_iter().filter(|f| !f.cuda_only()) {
            let stamp = format!("{}##NAME(", family.stem());
            let src = sources.iter().find(|s| s.contains(&stamp));
            let src = src.unwrap_or_else(|| panic!("{family:?}: no source stamps {stamp}"));
            let start = src.find(&stamp).expect("found above");
            let sig = &src[start..start + src[start..].find(')').expect("end of the signature")];
            let params = family.params().unwrap_or_else(|| panic!("{family:?}: no parameters"));
            let (mut at, mut end) = (0, 0usize);
            for (name, offset, size) in params {
                // Natural alignment, no gaps beyond it: what nvcc and clang both do for these types.
                assert_eq!(*offset, end.next_multiple_of((*size).min(8)), "{family:?}: {name} at {offset}");
                end = offset + size;
                // The names are the source's, in its order.
                let pos = sig[at..].find(&format!(" {name},")).or_else(|| sig[at..].find(&format!(" {name}")));
                at += pos.unwrap_or_else(|| panic!("{family:?}: {name} missing or out of order in {sig}")) + name.len();
            }
        }
        for family in Family::ALL.into_iter().filter(|f| f.cuda_only()) {
            assert_eq!(family.params(), None, "{family:?}");
            assert!(sources.iter().all(|s| !s.contains(family.stem())), "{family:?} is in the shared source");
        }
    }
}
