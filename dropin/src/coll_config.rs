//! What a per-call config (`const ncclCollConfig_t*` of NCCL 2.31 and later) asks of one call, as far as the
//! drop-in can tell, for `ncclAllReduceConfig`: a config that asks for nothing beyond the plain call is decided like
//! `ncclAllReduce` (anyccl's custom kernels where eligible); anything else is forwarded untouched.
//!
//! `ncclCollConfig_t` is a versioned, append-only structure (`nccl.h` 2.32.3 names it `ncclCollConfig_v23200`):
//! `size`, `magic` and `version` first, fields only ever added at the end. The drop-in reads it within its declared
//! `size` and never past it: first `size` alone, then `min(size, the 2.32 layout's size)` bytes into a copy that
//! starts as `NCCL_COLLCONFIG_INITIALIZER`, so a field beyond what the caller's header had keeps its default (as
//! the library reads it).
//!
//! The decision ([`Asks`]):
//! - [`Asks::Nothing`]: every field the 2.32 layout has is at its `NCCL_COLLCONFIG_INITIALIZER` value, except that
//!   `algSelection` may also be `""` (`nccl.h`: "NULL/UNDEF/\"\" == automatic") and `forceAlgSelection` may be 0 (it
//!   only governs a selection, and there is none). anyccl chooses as for the plain call.
//! - [`Asks::Library`]: a field is set that only the library underneath honours: an algorithm selection (the names
//!   are NCCL's algorithms and protocols), CTA counts or policy, a CGA cluster size, a profiler tag, a launch
//!   completion event, a vendor extension list, or fields newer than the 2.32 layout (a `size` larger than it).
//!   Forwarded untouched.
//! - [`Asks::Malformed`]: a config the library refuses itself (NCCL 2.32 answers `ncclInvalidArgument`): `size`
//!   smaller than the 2.31 layout, a wrong `magic`, a `forceAlgSelection` other than 0 or 1, or a `version` older
//!   than the first release with per-call configs. Forwarded untouched too, so the caller gets the library's own
//!   code and last-error text rather than one of the drop-in's.
//!
//! The decision depends only on the config, which `nccl.h` requires to be the same on every rank (the launch
//! completion event is per rank, but every rank must pass one or none): ranks never decide differently.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::size_of;

use crate::api::CollConfig;

/// `NCCL_API_MAGIC`.
pub const NCCL_API_MAGIC: c_uint = 0xcafe_beef;
/// `NCCL_CONFIG_UNDEF_INT`.
pub const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// The first `NCCL_VERSION_CODE` with per-call configs (2.31.0).
pub const FIRST_VERSION: c_uint = 23100;

/// `ncclCollConfig_t` of `nccl.h` 2.32.3 (`ncclCollConfig_v23200`), field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(non_snake_case)] // nccl.h's field names
pub struct CollConfigV23200 {
    /// `size`: the size of the structure the caller's header declared.
    pub size: usize,
    /// `magic`: `NCCL_API_MAGIC`.
    pub magic: c_uint,
    /// `version`: the caller's `NCCL_VERSION_CODE`.
    pub version: c_uint,
    /// `ext`: a list of vendor extension options, or null.
    pub ext: *mut c_void,
    /// `minCTAs`.
    pub minCTAs: c_int,
    /// `maxCTAs`.
    pub maxCTAs: c_int,
    /// `nvlsCTAs`.
    pub nvlsCTAs: c_int,
    /// `cgaClusterSize`.
    pub cgaClusterSize: c_int,
    /// `algSelection`: null or `""`: automatic.
    pub algSelection: *const c_char,
    /// `forceAlgSelection`: 0 or 1.
    pub forceAlgSelection: c_int,
    /// `CTAPolicy`.
    pub CTAPolicy: c_int,
    /// `userProfilerTag`.
    pub userProfilerTag: u64,
    /// `launchCompletionEvent` (`cudaEvent_t`).
    pub launchCompletionEvent: *mut c_void,
}

/// The size of the 2.31 layout (`ncclCollConfig_v23100`: up to `userProfilerTag`), the smallest NCCL accepts.
pub const V23100_SIZE: usize = std::mem::offset_of!(CollConfigV23200, launchCompletionEvent);

impl CollConfigV23200 {
    /// `NCCL_COLLCONFIG_INITIALIZER` of `nccl.h` 2.32.3 (`version` 2.32.3).
    pub const INITIALIZER: CollConfigV23200 = CollConfigV23200 {
        size: size_of::<CollConfigV23200>(),
        magic: NCCL_API_MAGIC,
        version: 23203,
        ext: std::ptr::null_mut(),
        minCTAs: NCCL_CONFIG_UNDEF_INT,
        maxCTAs: NCCL_CONFIG_UNDEF_INT,
        nvlsCTAs: NCCL_CONFIG_UNDEF_INT,
        cgaClusterSize: NCCL_CONFIG_UNDEF_INT,
        algSelection: std::ptr::null(),
        forceAlgSelection: 1,
        CTAPolicy: NCCL_CONFIG_UNDEF_INT,
        userProfilerTag: 0,
        launchCompletionEvent: std::ptr::null_mut(),
    };
}

/// What a non-null per-call config asks of the call (see the module's documentation). Its `Display` is the reason
/// the drop-in logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asks {
    /// Nothing beyond the plain call: anyccl decides it as `ncclAllReduce`.
    Nothing,
    /// Something only the library honours (what): forwarded untouched.
    Library(Field),
    /// A config the library refuses itself (why): forwarded untouched for the library's own answer.
    Malformed(Field),
}

/// The field that decided [`Asks`], with its value: kept as data and put into words only when logged, since the
/// decision is made on every call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `size` smaller than the 2.31 layout.
    TooSmall(usize),
    /// `magic` other than `NCCL_API_MAGIC`.
    Magic(c_uint),
    /// `version` older than the first release with per-call configs.
    Version(c_uint),
    /// `forceAlgSelection` neither 0 nor 1.
    Force(c_int),
    /// `size` larger than the 2.32 layout: fields the drop-in cannot read.
    Newer(usize),
    /// An integer field (named) set to something other than `NCCL_CONFIG_UNDEF_INT`.
    Int(&'static str, c_int),
    /// A non-empty `algSelection`.
    AlgSelection,
    /// A non-zero `userProfilerTag`.
    ProfilerTag(u64),
    /// A `launchCompletionEvent`.
    LaunchEvent,
    /// An `ext` list.
    Ext,
}

impl std::fmt::Display for Field {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Field::TooSmall(size) => {
                write!(f, "size {size} is smaller than the smallest ncclCollConfig_t ({V23100_SIZE} bytes, NCCL 2.31)")
            }
            Field::Magic(m) => write!(f, "magic {m:#x} is not NCCL_API_MAGIC ({NCCL_API_MAGIC:#x})"),
            Field::Version(v) => {
                write!(f, "version {v} is older than the first release with per-call configs ({FIRST_VERSION})")
            }
            Field::Force(v) => write!(f, "forceAlgSelection {v} is neither 0 nor 1"),
            Field::Newer(size) => write!(
                f,
                "size {size}: fields newer than nccl.h 2.32's ncclCollConfig_t ({} bytes), which the drop-in cannot \
                 read",
                size_of::<CollConfigV23200>()
            ),
            Field::Int(name, v) => write!(f, "{name} {v}"),
            Field::AlgSelection => f.write_str("an algorithm selection (algSelection)"),
            Field::ProfilerTag(t) => write!(f, "a profiler tag (userProfilerTag {t:#x})"),
            Field::LaunchEvent => f.write_str("a launch completion event (launchCompletionEvent)"),
            Field::Ext => f.write_str("vendor extension options (ext)"),
        }
    }
}

impl std::fmt::Display for Asks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Asks::Nothing => f.write_str("the per-call config asks for nothing beyond the plain call"),
            Asks::Library(what) => {
                write!(f, "the per-call config asks for {what}, which only the library underneath honours")
            }
            Asks::Malformed(what) => {
                write!(f, "the per-call config is not one the library accepts ({what}): the library answers it")
            }
        }
    }
}

/// Reads the non-null `config` within its declared size and says what it asks.
///
/// # Safety
/// `config` is non-null and points to an `ncclCollConfig_t` as `nccl.h` requires of the `*Config` calls: readable
/// for its first `size_t` and then for the `size` bytes that field declares; `algSelection`, when non-null within
/// that size, points to a readable C string.
pub unsafe fn read(config: CollConfig) -> Asks {
    // SAFETY: the caller's contract: the structure starts with its `size_t size`. Unaligned: nothing here relies on
    // the caller's alignment.
    let size = unsafe { config.cast::<usize>().read_unaligned() };
    if size < V23100_SIZE {
        return Asks::Malformed(Field::TooSmall(size));
    }
    let mut c = CollConfigV23200::INITIALIZER;
    let known = size_of::<CollConfigV23200>();
    // SAFETY: the caller's contract makes `size` bytes readable at `config`, and at most `known` (the size of `c`)
    // are copied into `c`, byte for byte; every bit pattern is a valid value of its integer and raw-pointer fields.
    unsafe {
        std::ptr::copy_nonoverlapping(config.cast::<u8>(), std::ptr::addr_of_mut!(c).cast::<u8>(), size.min(known));
    }
    if c.magic != NCCL_API_MAGIC {
        return Asks::Malformed(Field::Magic(c.magic));
    }
    if c.version < FIRST_VERSION {
        return Asks::Malformed(Field::Version(c.version));
    }
    if c.forceAlgSelection != 0 && c.forceAlgSelection != 1 {
        return Asks::Malformed(Field::Force(c.forceAlgSelection));
    }
    if size > known {
        return Asks::Library(Field::Newer(size));
    }
    let ints = [
        ("minCTAs", c.minCTAs),
        ("maxCTAs", c.maxCTAs),
        ("nvlsCTAs", c.nvlsCTAs),
        ("cgaClusterSize", c.cgaClusterSize),
        ("CTAPolicy", c.CTAPolicy),
    ];
    if let Some((name, v)) = ints.iter().find(|(_, v)| *v != NCCL_CONFIG_UNDEF_INT) {
        return Asks::Library(Field::Int(name, *v));
    }
    if !c.algSelection.is_null() {
        // SAFETY: the caller's contract: a non-null algSelection is a readable C string (its first byte at least).
        if unsafe { c.algSelection.read() } != 0 {
            return Asks::Library(Field::AlgSelection);
        }
    }
    if c.userProfilerTag != 0 {
        return Asks::Library(Field::ProfilerTag(c.userProfilerTag));
    }
    if !c.launchCompletionEvent.is_null() {
        return Asks::Library(Field::LaunchEvent);
    }
    if !c.ext.is_null() {
        return Asks::Library(Field::Ext);
    }
    Asks::Nothing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asks(c: &CollConfigV23200) -> Asks {
        // SAFETY: a whole 2.32 structure on the stack (its `size` is at most its own size in these tests, or the
        // test reads a larger buffer below).
        unsafe { read(std::ptr::from_ref(c).cast()) }
    }

    #[test]
    fn the_layout_is_nccl_h_2_32_3s() {
        assert_eq!(size_of::<CollConfigV23200>(), 72);
        assert_eq!(V23100_SIZE, 64);
        assert_eq!(std::mem::offset_of!(CollConfigV23200, algSelection), 40);
        assert_eq!(std::mem::offset_of!(CollConfigV23200, userProfilerTag), 56);
    }

    #[test]
    fn the_initializer_and_an_empty_selection_ask_nothing() {
        let c = CollConfigV23200::INITIALIZER;
        assert_eq!(asks(&c), Asks::Nothing);
        let empty = CollConfigV23200 { algSelection: c"".as_ptr(), forceAlgSelection: 0, ..c };
        assert_eq!(asks(&empty), Asks::Nothing);
        // A 2.31 structure (no launch completion event): the missing field is never read.
        let old = CollConfigV23200 {
            size: V23100_SIZE,
            version: 23102,
            launchCompletionEvent: std::ptr::without_provenance_mut(1),
            ..c
        };
        assert_eq!(asks(&old), Asks::Nothing);
    }

    #[test]
    fn any_field_anyccl_does_not_honour_is_for_the_library() {
        let c = CollConfigV23200::INITIALIZER;
        let library = |x: CollConfigV23200, what: &str| match asks(&x) {
            Asks::Library(w) => assert!(w.to_string().contains(what), "{w}"),
            other => panic!("{what}: {other:?}"),
        };
        library(CollConfigV23200 { algSelection: c"RING_SIMPLE".as_ptr(), ..c }, "algSelection");
        library(CollConfigV23200 { minCTAs: 2, ..c }, "minCTAs 2");
        library(CollConfigV23200 { maxCTAs: 8, ..c }, "maxCTAs 8");
        library(CollConfigV23200 { nvlsCTAs: 4, ..c }, "nvlsCTAs 4");
        library(CollConfigV23200 { cgaClusterSize: 2, ..c }, "cgaClusterSize 2");
        library(CollConfigV23200 { CTAPolicy: 1, ..c }, "CTAPolicy 1");
        library(CollConfigV23200 { userProfilerTag: 42, ..c }, "0x2a");
        library(
            CollConfigV23200 { launchCompletionEvent: std::ptr::without_provenance_mut(8), ..c },
            "launchCompletionEvent",
        );
        library(CollConfigV23200 { ext: std::ptr::without_provenance_mut(8), ..c }, "ext");
    }

    #[test]
    fn a_newer_larger_structure_is_for_the_library_and_read_only_within_the_known_size() {
        // 2.32's structure followed by 8 bytes of a newer release's field.
        #[repr(C)]
        struct Newer {
            c: CollConfigV23200,
            later: u64,
        }
        let n = Newer { c: CollConfigV23200 { size: size_of::<Newer>(), ..CollConfigV23200::INITIALIZER }, later: 7 };
        // SAFETY: the whole `Newer` is readable, as its `size` says.
        let got = unsafe { read(std::ptr::from_ref(&n).cast()) };
        assert!(matches!(&got, Asks::Library(w) if w.to_string().contains("size 80")), "{got:?}");
    }

    #[test]
    fn a_malformed_config_is_left_for_the_library_to_refuse() {
        let c = CollConfigV23200::INITIALIZER;
        let malformed = |x: CollConfigV23200, what: &str| match asks(&x) {
            Asks::Malformed(w) => assert!(w.to_string().contains(what), "{w}"),
            other => panic!("{what}: {other:?}"),
        };
        malformed(CollConfigV23200 { magic: 0, ..c }, "magic 0x0");
        malformed(CollConfigV23200 { size: 63, ..c }, "size 63");
        malformed(CollConfigV23200 { size: 0, ..c }, "size 0");
        malformed(CollConfigV23200 { version: 22809, ..c }, "version 22809");
        malformed(CollConfigV23200 { forceAlgSelection: 2, ..c }, "forceAlgSelection 2");
    }

    #[test]
    fn a_small_size_is_never_read_past() {
        // Only the `size` field exists: a reader that looked further would read past this allocation (which Miri
        // and the address sanitizer report); this one stops at `size`.
        let only_size: Box<usize> = Box::new(8);
        // SAFETY: the first size_t is readable, and `size` (8) says nothing else is.
        let got = unsafe { read(std::ptr::from_ref(&*only_size).cast()) };
        assert!(matches!(got, Asks::Malformed(_)), "{got:?}");
    }
}
