//! A kernel launch's parameters, pushed as typed values in the kernel's order: the builder keeps each value and
//! its size, and hands `cuLaunchKernel` / `hipModuleLaunchKernel` the pointer list both take (one pointer per
//! parameter). The parameter-layout tests compare [`KernelArgs::sizes`] of the very arguments a launcher builds
//! with the kernel's parameter list of `anyccl-kernels-common`.

use std::ffi::c_void;

use anyccl_kernels_common as common;

use crate::kernels::{ptrs, Ptrs};

/// Most parameters of any kernel of the shared source.
pub(crate) const MAX_PARAMS: usize = 12;

/// One parameter's value.
#[derive(Clone, Copy)]
enum Arg {
    U64(u64),
    I32(i32),
    Ptrs(Ptrs),
    /// A parameter struct passed by value (the fused kernels' argument blocks), as its bytes, 8-byte aligned.
    Block([u64; BLOCK_WORDS], usize),
}

/// Most 8-byte words of a by-value parameter struct.
const BLOCK_WORDS: usize = 8;

impl Arg {
    fn size(&self) -> usize {
        match self {
            Arg::U64(_) => 8,
            Arg::I32(_) => 4,
            Arg::Ptrs(_) => std::mem::size_of::<Ptrs>(),
            Arg::Block(_, size) => *size,
        }
    }

    fn ptr(&mut self) -> *mut c_void {
        match self {
            Arg::U64(v) => (v as *mut u64).cast(),
            Arg::I32(v) => (v as *mut i32).cast(),
            Arg::Ptrs(v) => (v as *mut Ptrs).cast(),
            Arg::Block(v, _) => v.as_mut_ptr().cast(),
        }
    }
}

/// The parameters of one launch, in order (at most [`MAX_PARAMS`]). Pushing past the limit is recorded and
/// refused when the pointers are asked for.
pub(crate) struct KernelArgs {
    args: [Arg; MAX_PARAMS],
    len: usize,
    overflow: bool,
}

impl KernelArgs {
    /// No parameters yet.
    pub(crate) fn new() -> Self {
        KernelArgs { args: [Arg::U64(0); MAX_PARAMS], len: 0, overflow: false }
    }

    fn push(mut self, a: Arg) -> Self {
        match self.args.get_mut(self.len) {
            Some(slot) => {
                *slot = a;
                self.len += 1;
            }
            None => self.overflow = true,
        }
        self
    }

    /// A `u64` (a device pointer or a count).
    pub(crate) fn u64(self, v: u64) -> Self {
        self.push(Arg::U64(v))
    }

    /// An `i32` (a rank or a world size).
    pub(crate) fn i32(self, v: i32) -> Self {
        self.push(Arg::I32(v))
    }

    /// A rank/flag pointer table by value ([`Ptrs`]: `v`'s pointers, the unused entries null).
    pub(crate) fn ptrs(self, v: &[u64]) -> Self {
        self.push(Arg::Ptrs(ptrs(v)))
    }

    /// A plain-data parameter struct by value (`T` of at most 64 bytes, 8-byte aligned at most, no padding
    /// the kernel reads as anything but bytes).
    pub(crate) fn block<T: Copy>(self, v: &T) -> Self {
        let size = std::mem::size_of::<T>();
        if size > BLOCK_WORDS * 8 || std::mem::align_of::<T>() > 8 {
            let mut s = self;
            s.overflow = true;
            return s;
        }
        let mut words = [0u64; BLOCK_WORDS];
        // SAFETY: `size` bytes fit `words` (checked above); `v` is a live `T` of `size` bytes; the regions do not
        // overlap (`words` is a local).
        unsafe { std::ptr::copy_nonoverlapping((v as *const T).cast::<u8>(), words.as_mut_ptr().cast::<u8>(), size) };
        self.push(Arg::Block(words, size))
    }

    /// Each parameter's size in bytes, in order (for the layout tests).
    #[cfg(test)]
    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.args[..self.len].iter().map(Arg::size).collect()
    }

    /// Whether the sizes are those of `params`, the kernel's list in `anyccl-kernels-common`.
    pub(crate) fn matches(&self, params: &[common::Param]) -> bool {
        !self.overflow && self.len == params.len() && self.args.iter().zip(params).all(|(a, p)| a.size() == p.2)
    }

    /// The pointer list of a kernel the shared source has no parameter list for (the NVLS emulations), pointing
    /// into `self` (valid while `self` is neither moved nor dropped), or `None` when more than [`MAX_PARAMS`] were
    /// pushed.
    pub(crate) fn pointers(&mut self) -> Option<([*mut c_void; MAX_PARAMS], usize)> {
        if self.overflow {
            return None;
        }
        let mut p = [std::ptr::null_mut(); MAX_PARAMS];
        for (d, a) in p.iter_mut().zip(&mut self.args[..self.len]) {
            *d = a.ptr();
        }
        Some((p, self.len))
    }

    /// The pointer list the launch calls take, pointing into `self` (valid while `self` is neither moved nor
    /// dropped), or `None` unless the parameters have the sizes of `params` (the kernel's list in
    /// `anyccl-kernels-common`, so a launcher cannot hand a kernel a layout other than its own).
    pub(crate) fn pointers_for(&mut self, params: &[common::Param]) -> Option<([*mut c_void; MAX_PARAMS], usize)> {
        if !self.matches(params) {
            return None;
        }
        self.pointers()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builder_records_each_parameter_and_points_at_its_value() {
        let mut a = KernelArgs::new().u64(0x1000).ptrs(&[16, 32]).i32(3).u64(7);
        assert_eq!(a.sizes(), vec![8, 64, 4, 8]);
        let wrong: [common::Param; 4] = [("a", 0, 8), ("b", 8, 64), ("c", 72, 8), ("d", 80, 8)];
        assert!(a.pointers_for(&wrong).is_none(), "an i32 where the list has 8 bytes");
        let list: [common::Param; 4] = [("a", 0, 8), ("b", 8, 64), ("c", 72, 4), ("d", 80, 8)];
        let (p, n) = a.pointers_for(&list).expect("the list's layout");
        assert_eq!(n, 4);
        // SAFETY: the pointers point into `a`, alive and unmoved here.
        unsafe {
            assert_eq!(*(p[0] as *const u64), 0x1000);
            assert_eq!(*(p[1] as *const [u64; 8]), [16, 32, 0, 0, 0, 0, 0, 0]);
            assert_eq!(*(p[2] as *const i32), 3);
            assert_eq!(*(p[3] as *const u64), 7);
        }
        let mut full = KernelArgs::new();
        for i in 0..=MAX_PARAMS {
            full = full.u64(i as u64);
        }
        assert!(!full.matches(&[]));
        let twelve = [("p", 0, 8); MAX_PARAMS];
        assert!(!full.matches(&twelve), "one parameter too many is refused");
        assert!(full.pointers_for(&twelve).is_none());
    }
}
