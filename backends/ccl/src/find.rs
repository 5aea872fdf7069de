//! Finding the library really installed: explicit path, the dynamic loader's names, then where users have it.
//!
//! Rules (see docs/security.md), shared with the HIP runtime loader of `anyccl-rocm`:
//! - only absolute directories are searched; a relative entry of `PYTHONPATH`, `CUDA_HOME`, `ROCM_PATH`,
//!   `VIRTUAL_ENV`, `CONDA_PREFIX`, `HOME` or an explicit path is skipped and reported as an [`Attempt`], never
//!   resolved against the working directory;
//! - a bare soname goes to the dynamic loader only, and not even there when `LD_LIBRARY_PATH` has an empty or
//!   relative entry (the loader would then search the working directory): the absolute entries and the system
//!   library directories are searched instead, as paths;
//! - every path is checked before `dlopen` runs anything in it ([`check_candidate`]): opened non-blocking, a
//!   regular file, an ELF shared object for this machine whose entry points are functions;
//! - a library the dynamic loader found by soname is checked the same way, on the file it mapped, before any of its
//!   functions is called ([`open_checked`]).

use std::ffi::{c_void, OsStr};
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use object::elf;
use object::read::elf::{FileHeader, ProgramHeader, SectionHeader, Sym};
use object::read::{ReadCache, ReadRef};
use serde::Serialize;

use crate::loader::{CclLibrary, CclVendor, LoadFailure, OPTIONAL_SYMBOLS, REQUIRED_SYMBOLS};

/// One place that was tried, and why it failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Attempt {
    /// The path or soname tried.
    pub candidate: String,
    /// Why it was not used.
    pub failure: LoadFailure,
}

/// No library could be loaded; every place tried, with its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{vendor} not found; tried: {}", describe_attempts(tried))]
#[non_exhaustive]
pub struct NotFound {
    /// Which library was looked for.
    pub vendor: CclVendor,
    /// Every attempt, in order.
    pub tried: Vec<Attempt>,
}

impl Attempt {
    /// An attempt at `candidate` that failed with `failure` (for loaders of other libraries that share this search).
    pub fn new(candidate: impl Into<String>, failure: LoadFailure) -> Self {
        Attempt { candidate: candidate.into(), failure }
    }
}

/// `"a (why); b (why)"`: the attempts as one line.
pub fn describe_attempts(tried: &[Attempt]) -> String {
    tried.iter().map(|a| format!("{} ({})", a.candidate, a.failure)).collect::<Vec<_>>().join("; ")
}

/// One place of a search, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Place {
    /// An absolute path to a file, checked before it is loaded.
    Path(PathBuf),
    /// A bare soname for the dynamic loader; the file it maps is checked before anything in it is called.
    Soname(String),
    /// A place the environment named that is not searched (a relative entry), with the reason.
    Skipped(Attempt),
}

/// Where to look. [`SearchPlan::from_env`] builds the standard plan; tests build their own.
///
/// Not `#[non_exhaustive]`: callers build their own plans with a literal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchPlan {
    /// Which library.
    pub vendor: CclVendor,
    /// Every place, in order.
    pub places: Vec<Place>,
}

/// The environment variable with an explicit NCCL path.
pub const ENV_NCCL_PATH: &str = "ANYCCL_NCCL_PATH";
/// The environment variable with an explicit RCCL path.
pub const ENV_RCCL_PATH: &str = "ANYCCL_RCCL_PATH";

/// The entry points of a library: each `required` one must be defined, and every one of `required` and
/// `optional` that is defined must be a function.
///
/// Not `#[non_exhaustive]`: each loader (NCCL/RCCL here, HIP in anyccl-rocm) builds its own as a constant.
#[derive(Debug, Clone, Copy)]
pub struct Exports<'a> {
    /// Must be defined, as functions.
    pub required: &'a [&'a str],
    /// May be defined; if so, as functions.
    pub optional: &'a [&'a str],
}

/// The entry points of the `nccl.h` ABI that anyccl resolves.
pub const CCL_EXPORTS: Exports<'static> = Exports { required: REQUIRED_SYMBOLS, optional: OPTIONAL_SYMBOLS };

/// The process environment as a plan reads it: unset and empty variables are both `None`.
pub fn process_env(key: &str) -> Option<PathBuf> {
    std::env::var_os(key).map(PathBuf::from).filter(|p| !p.as_os_str().is_empty())
}

impl SearchPlan {
    /// The standard plan for `vendor`, read from the process environment.
    pub fn from_env(vendor: CclVendor) -> Self {
        Self::with_env(vendor, &process_env)
    }

    /// The standard plan with an injectable environment (`env` returns `None` for unset or empty variables).
    pub fn with_env(vendor: CclVendor, env: &dyn Fn(&str) -> Option<PathBuf>) -> Self {
        match vendor {
            CclVendor::Nccl => {
                let mut p = PlaceList::new(env, &["libnccl.so.2", "libnccl.so"]);
                p.explicit(ENV_NCCL_PATH);
                p.loader();
                python_nccl_dirs(env, &mut p);
                for var in ["CUDA_HOME", "CUDA_PATH"] {
                    if let Some(h) = env(var) {
                        p.dir(var, h.join("lib64"));
                        p.dir(var, h.join("lib"));
                    }
                }
                p.dir("the default", PathBuf::from("/usr/local/cuda/lib64"));
                SearchPlan { vendor, places: p.finish() }
            }
            CclVendor::Rccl => {
                let mut p = PlaceList::new(env, &["librccl.so.1", "librccl.so"]);
                p.explicit(ENV_RCCL_PATH);
                p.loader();
                if let Some(h) = env("ROCM_PATH") {
                    p.dir("ROCM_PATH", h.join("lib"));
                }
                p.dir("the default", PathBuf::from("/opt/rocm/lib"));
                SearchPlan { vendor, places: p.finish() }
            }
        }
    }

    /// Tries every place in order; returns the first library that loads with all required symbols.
    pub fn load(&self) -> Result<CclLibrary, NotFound> {
        let t = self.try_load();
        t.loaded.ok_or(NotFound { vendor: self.vendor, tried: t.attempts })
    }

    /// Like [`SearchPlan::load`], and also says which places failed (or were skipped) before the one that loaded.
    pub fn try_load(&self) -> Tried<CclLibrary> {
        try_in_order(&self.places, &mut |candidate| CclLibrary::open(candidate))
    }
}

/// What trying places in order gave: the first that loaded, if any, and every attempt that failed before it.
#[derive(Debug)]
#[non_exhaustive]
pub struct Tried<T> {
    /// The first success.
    pub loaded: Option<T>,
    /// The places that failed or were skipped before it (all of them when nothing loaded), in order.
    pub attempts: Vec<Attempt>,
}

/// Tries `places` in order with `open` (which gets an absolute path or a bare soname) until one loads.
pub fn try_in_order<T>(places: &[Place], open: &mut dyn FnMut(&Path) -> Result<T, LoadFailure>) -> Tried<T> {
    let mut attempts = Vec::new();
    for place in places {
        let candidate = match place {
            Place::Path(p) => p.as_path(),
            Place::Soname(n) => Path::new(n.as_str()),
            Place::Skipped(a) => {
                attempts.push(a.clone());
                continue;
            }
        };
        match open(candidate) {
            Ok(v) => return Tried { loaded: Some(v), attempts },
            Err(failure) => {
                tracing::debug!(candidate = %candidate.display(), %failure, "library not used");
                attempts.push(Attempt { candidate: candidate.display().to_string(), failure });
            }
        }
    }
    Tried { loaded: None, attempts }
}

/// Builds the ordered places of a search from the environment, refusing relative entries as it goes.
pub struct PlaceList<'e> {
    env: &'e dyn Fn(&str) -> Option<PathBuf>,
    names: Vec<String>,
    dir_names: Vec<String>,
    places: Vec<Place>,
}

impl std::fmt::Debug for PlaceList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaceList").field("names", &self.names).field("places", &self.places).finish_non_exhaustive()
    }
}

impl<'e> PlaceList<'e> {
    /// A list for a library known by `names` (sonames, most specific first), looked up under every name in each
    /// directory too.
    pub fn new(env: &'e dyn Fn(&str) -> Option<PathBuf>, names: &[&str]) -> Self {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        PlaceList { env, dir_names: names.clone(), names, places: Vec::new() }
    }

    /// Looks only for `names` (instead of every soname) in directories.
    pub fn dir_names(mut self, names: &[&str]) -> Self {
        self.dir_names = names.iter().map(|n| (*n).to_owned()).collect();
        self
    }

    /// The file named by `variable`, if set: tried first; refused if it is not an absolute path.
    pub fn explicit(&mut self, variable: &str) {
        if let Some(p) = (self.env)(variable) {
            if p.is_absolute() {
                self.places.push(Place::Path(p));
            } else {
                self.skip(p, LoadFailure::RelativePath { origin: variable.to_owned() });
            }
        }
    }

    /// The sonames for the dynamic loader, unless `LD_LIBRARY_PATH` would make it search the working directory:
    /// then the sonames are skipped, with the reason, and looked for as paths in `LD_LIBRARY_PATH`'s absolute
    /// entries and the system library directories.
    pub fn loader(&mut self) {
        let llp = (self.env)("LD_LIBRARY_PATH");
        match llp.as_deref().and_then(|v| loader_path_hazard(v.as_os_str())) {
            None => {
                for n in &self.names {
                    self.places.push(Place::Soname(n.clone()));
                }
            }
            Some(entry) => {
                tracing::warn!(
                    entry = %entry,
                    "LD_LIBRARY_PATH has a relative entry: the dynamic loader searches the working directory for \
                     every library it loads by name; anyccl looks for its libraries by absolute path instead, but \
                     their dependencies are still found through LD_LIBRARY_PATH"
                );
                for n in self.names.clone() {
                    self.skip(PathBuf::from(n), LoadFailure::LoaderSearchesWorkingDirectory { entry: entry.clone() });
                }
                let names = std::mem::replace(&mut self.dir_names, self.names.clone());
                if let Some(v) = llp {
                    for d in ld_library_path_entries(v.as_os_str()).filter(|d| d.is_absolute()) {
                        self.dir("LD_LIBRARY_PATH", d);
                    }
                }
                for d in system_library_dirs() {
                    self.dir("the system library directories", d);
                }
                self.dir_names = names;
            }
        }
    }

    /// Each name in `dir` (which `origin` named), or one skipped attempt if `dir` is relative.
    pub fn dir(&mut self, origin: &str, dir: PathBuf) {
        if !dir.is_absolute() {
            self.skip(dir, LoadFailure::RelativePath { origin: origin.to_owned() });
            return;
        }
        for n in &self.dir_names {
            self.places.push(Place::Path(dir.join(n)));
        }
    }

    fn skip(&mut self, candidate: PathBuf, failure: LoadFailure) {
        tracing::debug!(candidate = %candidate.display(), %failure, "place skipped");
        self.places.push(Place::Skipped(Attempt { candidate: candidate.display().to_string(), failure }));
    }

    /// The places, in order.
    pub fn finish(self) -> Vec<Place> {
        self.places
    }
}

/// The entries of an `LD_LIBRARY_PATH` value as the dynamic loader splits it (on `:` and `;`).
pub fn ld_library_path_entries(value: &OsStr) -> impl Iterator<Item = PathBuf> + '_ {
    value.as_bytes().split(|b| *b == b':' || *b == b';').map(|e| PathBuf::from(OsStr::from_bytes(e)))
}

/// The first entry of `LD_LIBRARY_PATH` that makes the dynamic loader search relative to the working directory
/// (an empty entry, `.`, or any relative path), as text; `None` when every entry is absolute or starts with
/// `$ORIGIN` (the executable's directory), and for an empty value, which the loader ignores.
pub fn loader_path_hazard(value: &OsStr) -> Option<String> {
    if value.is_empty() {
        return None;
    }
    ld_library_path_entries(value)
        .find(|e| {
            let b = e.as_os_str().as_bytes();
            !(b.starts_with(b"/") || b.starts_with(b"$ORIGIN") || b.starts_with(b"${ORIGIN}"))
        })
        .map(|e| e.display().to_string())
}

/// The directories the dynamic loader searches by default on this machine (searched as paths when
/// `LD_LIBRARY_PATH` rules out handing sonames to the loader), those that exist. Public for the drop-in `libnccl`,
/// which searches them as paths too.
pub fn system_library_dirs() -> Vec<PathBuf> {
    let triple = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    [triple.as_str(), "/usr/local/lib", "/usr/lib64", "/usr/lib"]
        .into_iter()
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .collect()
}

/// `nvidia/nccl/lib` inside the Python installations a user is likely to have (the wheel PyTorch brings):
/// `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `$PYTHONPATH` entries, `~/.local`, `/usr/local`, `/usr`. Only absolute
/// directories are looked into; relative ones are recorded as skipped.
fn python_nccl_dirs(env: &dyn Fn(&str) -> Option<PathBuf>, list: &mut PlaceList<'_>) {
    let nccl = |site: &Path| site.join("nvidia").join("nccl").join("lib");
    let mut prefixes: Vec<(String, PathBuf)> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = env(var) {
            prefixes.push((var.to_owned(), p));
        }
    }
    if let Some(pp) = env("PYTHONPATH") {
        for entry in std::env::split_paths(&pp) {
            let origin = format!("PYTHONPATH entry {:?}", entry.display().to_string());
            let dir = nccl(&entry);
            // A relative entry is recorded as skipped without being looked at; an absolute one only if it exists.
            if !entry.is_absolute() || dir.is_dir() {
                list.dir(&origin, dir);
            }
        }
    }
    if let Some(home) = env("HOME") {
        prefixes.push(("HOME".to_owned(), home.join(".local")));
    }
    prefixes.push(("the default".to_owned(), PathBuf::from("/usr/local")));
    prefixes.push(("the default".to_owned(), PathBuf::from("/usr")));
    for (origin, prefix) in prefixes {
        if !prefix.is_absolute() {
            list.dir(&origin, prefix);
            continue;
        }
        let Ok(entries) = std::fs::read_dir(prefix.join("lib")) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons.into_iter().rev() {
            for site in ["site-packages", "dist-packages"] {
                let dir = nccl(&py.join(site));
                if dir.is_dir() {
                    list.dir(&origin, dir);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Checking a candidate before anything in it runs.

/// The largest dynamic symbol or string table accepted (the real NCCL, RCCL and HIP runtimes have well under
/// 1 MiB); a bigger one is refused rather than read into memory.
pub const MAX_SYMBOL_TABLE_BYTES: u64 = 64 << 20;

/// Whether `p` is a bare name (no `/`): one for the dynamic loader to find, never a path relative to the
/// working directory.
pub fn is_bare_name(p: &Path) -> bool {
    !p.as_os_str().as_bytes().contains(&b'/')
}

/// The precise [`LoadFailure`] for an error of `stat`/`open` on a candidate.
pub fn os_failure(e: &std::io::Error) -> LoadFailure {
    match e.raw_os_error() {
        Some(libc::ENOENT) => LoadFailure::NotFound,
        Some(libc::EACCES) => LoadFailure::PermissionDenied,
        Some(libc::ENAMETOOLONG) => LoadFailure::NameTooLong,
        _ => LoadFailure::Unreadable { detail: e.to_string() },
    }
}

fn file_kind(t: std::fs::FileType) -> &'static str {
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a file"
    }
}

/// Checks the file at `path` before it is handed to `dlopen`, without running anything in it and without
/// anything that can block: it must be an absolute path to a regular file (checked with `stat` before it is opened,
/// and again with `fstat` on a descriptor opened `O_NONBLOCK | O_NOCTTY | O_CLOEXEC`), an ELF shared object of this
/// machine's class, byte order and architecture, whose dynamic symbol table defines every `exports.required`
/// entry point and has every defined entry point of `exports` as a function (`STT_FUNC` or `STT_GNU_IFUNC`) inside
/// an executable segment.
pub fn check_candidate(path: &Path, exports: &Exports<'_>) -> Result<(), LoadFailure> {
    if !path.is_absolute() {
        return Err(LoadFailure::RelativePath { origin: "the path".into() });
    }
    let meta = std::fs::metadata(path).map_err(|e| os_failure(&e))?;
    if !meta.is_file() {
        return Err(LoadFailure::NotRegularFile { file_type: file_kind(meta.file_type()).into() });
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| os_failure(&e))?;
    // Replaced between the stat and the open: the descriptor is what is checked.
    let meta = file.metadata().map_err(|e| os_failure(&e))?;
    if !meta.is_file() {
        return Err(LoadFailure::NotRegularFile { file_type: file_kind(meta.file_type()).into() });
    }
    check_elf(&file, exports)
}

#[cfg(target_pointer_width = "64")]
type HostHeader = elf::FileHeader64<object::Endianness>;
#[cfg(target_pointer_width = "32")]
type HostHeader = elf::FileHeader32<object::Endianness>;

/// This machine's ELF `e_machine` and its name; `None` on an architecture this list lacks (then not compared).
fn host_machine() -> Option<(u16, &'static str)> {
    match std::env::consts::ARCH {
        "x86_64" => Some((elf::EM_X86_64, "x86-64")),
        "aarch64" => Some((elf::EM_AARCH64, "AArch64")),
        "x86" => Some((elf::EM_386, "x86")),
        "arm" => Some((elf::EM_ARM, "ARM")),
        "powerpc64" => Some((elf::EM_PPC64, "PowerPC64")),
        "riscv64" => Some((elf::EM_RISCV, "RISC-V")),
        "s390x" => Some((elf::EM_S390, "s390x")),
        "loongarch64" => Some((elf::EM_LOONGARCH, "LoongArch")),
        _ => None,
    }
}

fn machine_name(m: u16) -> String {
    let known = [
        (elf::EM_X86_64, "x86-64"),
        (elf::EM_AARCH64, "AArch64"),
        (elf::EM_386, "x86"),
        (elf::EM_ARM, "ARM"),
        (elf::EM_PPC64, "PowerPC64"),
        (elf::EM_RISCV, "RISC-V"),
        (elf::EM_S390, "s390x"),
        (elf::EM_LOONGARCH, "LoongArch"),
        (elf::EM_AMDGPU, "AMD GPU code object"),
        (elf::EM_CUDA, "NVIDIA CUDA"),
    ];
    match known.iter().find(|(k, _)| *k == m) {
        Some((_, n)) => format!("{n} (ELF machine {m})"),
        None => format!("ELF machine {m}"),
    }
}

fn symbol_type_name(t: u8) -> String {
    match t {
        elf::STT_NOTYPE => "an untyped symbol (STT_NOTYPE)".into(),
        elf::STT_OBJECT => "a data object (STT_OBJECT)".into(),
        elf::STT_SECTION => "a section (STT_SECTION)".into(),
        elf::STT_FILE => "a file name (STT_FILE)".into(),
        elf::STT_COMMON => "a common data object (STT_COMMON)".into(),
        elf::STT_TLS => "a thread-local variable (STT_TLS)".into(),
        other => format!("a symbol of type {other}"),
    }
}

// The ELF words are `u32` on a 32-bit host, where the `.into()`s below are needed.
#[allow(clippy::useless_conversion)]
/// The ELF half of [`check_candidate`], on an opened file. Reads only the headers and the dynamic symbol and string
/// tables (`object`'s `ReadCache`, bounds-checked against the file's length).
fn check_elf(file: &File, exports: &Exports<'_>) -> Result<(), LoadFailure> {
    let not_lib = |detail: &str| LoadFailure::NotALibrary { detail: detail.to_owned() };
    let cache = ReadCache::new(file);
    let data = &cache;
    let ident = data.read_bytes_at(0, 16).map_err(|()| not_lib("no ELF header"))?;
    if ident[..4] != elf::ELFMAG {
        return Err(not_lib("no ELF header"));
    }
    // e_ident[EI_CLASS] and e_ident[EI_DATA] (bytes 4 and 5): the word size and byte order.
    let (class, order) = (ident[4], ident[5]);
    let want_class = if cfg!(target_pointer_width = "64") { elf::ELFCLASS64 } else { elf::ELFCLASS32 };
    let want_order = if cfg!(target_endian = "little") { elf::ELFDATA2LSB } else { elf::ELFDATA2MSB };
    let host = host_machine().map(|(_, n)| n).unwrap_or(std::env::consts::ARCH);
    if class != want_class || order != want_order {
        let bits = match class {
            elf::ELFCLASS32 => "32-bit",
            elf::ELFCLASS64 => "64-bit",
            _ => "unknown-class",
        };
        let endian = match order {
            elf::ELFDATA2LSB => "little-endian",
            elf::ELFDATA2MSB => "big-endian",
            _ => "unknown-byte-order",
        };
        return Err(LoadFailure::WrongArchitecture {
            detail: format!(
                "{bits} {endian} ELF (this process is {}-bit {} {host})",
                usize::BITS,
                if cfg!(target_endian = "little") { "little-endian" } else { "big-endian" }
            ),
        });
    }
    let header = HostHeader::parse(data).map_err(|e| not_lib(&format!("bad ELF header: {e}")))?;
    let endian = header.endian().map_err(|e| not_lib(&format!("bad ELF header: {e}")))?;
    let e_type = header.e_type(endian);
    if e_type != elf::ET_DYN {
        let what = match e_type {
            elf::ET_EXEC => "an executable",
            elf::ET_REL => "an object file",
            elf::ET_CORE => "a core dump",
            _ => "an ELF file",
        };
        return Err(not_lib(&format!("{what} (ELF type {e_type}), not a shared object")));
    }
    let machine = header.e_machine(endian);
    if let Some((want, name)) = host_machine() {
        if machine != want {
            return Err(LoadFailure::WrongArchitecture {
                detail: format!("{} (this process is {name})", machine_name(machine)),
            });
        }
    }
    // Executable address ranges: a function's address must lie in one.
    let segments = header.program_headers(endian, data).map_err(|e| not_lib(&format!("bad program headers: {e}")))?;
    let code: Vec<(u64, u64)> = segments
        .iter()
        .filter(|p| p.p_type(endian) == elf::PT_LOAD && p.p_flags(endian) & elf::PF_X != 0)
        .map(|p| {
            let start: u64 = p.p_vaddr(endian).into();
            (start, start.saturating_add(p.p_memsz(endian).into()))
        })
        .collect();
    let sections = header.sections(endian, data).map_err(|e| not_lib(&format!("bad section headers: {e}")))?;
    let Some((_, dynsym)) = sections.enumerate().find(|(_, s)| s.sh_type(endian) == elf::SHT_DYNSYM) else {
        return Err(not_lib("no dynamic symbol table (.dynsym section); anyccl needs one to check the entry points"));
    };
    let table_bytes = |s: &<HostHeader as FileHeader>::SectionHeader, what: &str| -> Result<&[u8], LoadFailure> {
        let size: u64 = s.sh_size(endian).into();
        if size > MAX_SYMBOL_TABLE_BYTES {
            return Err(not_lib(&format!("{what} of {size} bytes, more than the {MAX_SYMBOL_TABLE_BYTES} accepted")));
        }
        s.data(endian, data).map_err(|e| not_lib(&format!("unreadable {what}: {e}")))
    };
    let syms_raw = table_bytes(dynsym, "dynamic symbol table")?;
    let strtab = sections
        .section(object::SectionIndex(dynsym.sh_link(endian) as usize))
        .map_err(|e| not_lib(&format!("dynamic string table: {e}")))?;
    let strings = table_bytes(strtab, "dynamic string table")?;
    let syms: &[<HostHeader as FileHeader>::Sym] =
        object::pod::slice_from_all_bytes(syms_raw).map_err(|()| not_lib("dynamic symbol table of a partial size"))?;
    let name_of = |s: &<HostHeader as FileHeader>::Sym| -> Option<&[u8]> {
        let start = usize::try_from(s.st_name(endian)).ok()?;
        let rest = strings.get(start..)?;
        rest.split(|b| *b == 0).next()
    };
    let check = |symbol: &str, required: bool| -> Result<(), LoadFailure> {
        let mut defined = false;
        for s in syms.iter().filter(|s| !s.is_undefined(endian) && name_of(s) == Some(symbol.as_bytes())) {
            defined = true;
            let t = s.st_type();
            if t != elf::STT_FUNC && t != elf::STT_GNU_IFUNC {
                return Err(LoadFailure::SymbolNotAFunction {
                    symbol: symbol.to_owned(),
                    detail: format!("it is {}", symbol_type_name(t)),
                });
            }
            let addr: u64 = s.st_value(endian).into();
            let shndx = s.st_shndx(endian);
            if shndx >= elf::SHN_LORESERVE || !code.iter().any(|(a, b)| (*a..*b).contains(&addr)) {
                return Err(LoadFailure::SymbolNotAFunction {
                    symbol: symbol.to_owned(),
                    detail: format!("its address {addr:#x} is outside the library's executable segments"),
                });
            }
        }
        if required && !defined {
            return Err(LoadFailure::MissingRequired { symbol: symbol.to_owned() });
        }
        Ok(())
    };
    for s in exports.required {
        check(s, true)?;
    }
    for s in exports.optional {
        check(s, false)?;
    }
    Ok(())
}

/// `dlopen`s `path` so that the library's calls to its own exported functions stay inside it (`RTLD_DEEPBIND` on
/// glibc): in a process that also holds anyccl's drop-in `libnccl` (linked as `libnccl.so.2` or `LD_PRELOAD`ed), a
/// vendor library bound the default way would reach the drop-in's same-named symbols from inside its own calls
/// (NCCL's `ncclCommDestroy` calls its `ncclCommGetAsyncError`), which answer for a communicator the drop-in has
/// already released. Loaded `RTLD_LAZY | RTLD_LOCAL` otherwise, as `libloading::Library::new` does.
///
/// # Safety
/// As [`libloading::Library::new`]: loading runs the library's initialisers.
unsafe fn open_own_bound(path: &Path) -> Result<libloading::Library, libloading::Error> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    let flags = libloading::os::unix::RTLD_LAZY | libloading::os::unix::RTLD_LOCAL | libc::RTLD_DEEPBIND;
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let flags = libloading::os::unix::RTLD_LAZY | libloading::os::unix::RTLD_LOCAL;
    // SAFETY: the caller's contract (initialisers run); the flags only choose symbol binding and visibility.
    unsafe { libloading::os::unix::Library::open(Some(path), flags) }.map(libloading::Library::from)
}

/// Opens a library for `exports` and checks it before anything in it is called.
///
/// - A path must be absolute and pass [`check_candidate`] before `dlopen` sees it.
/// - A bare soname goes to the dynamic loader as it is (never `stat`ed or opened relative to the working directory),
///   and only when the process's `LD_LIBRARY_PATH` has no relative entry. The loader's search cannot be checked
///   beforehand without reimplementing it, so the library's initialisers run; then the file it mapped (found with
///   `dladdr` from the first required entry point) gets the same [`check_candidate`] before any of its functions
///   is called.
pub fn open_checked(candidate: &Path, exports: &Exports<'_>) -> Result<libloading::Library, LoadFailure> {
    if candidate.as_os_str().is_empty() {
        // `dlopen("")` would hand back the main program.
        return Err(LoadFailure::NotFound);
    }
    let bare = is_bare_name(candidate);
    if bare {
        if let Some(entry) = std::env::var_os("LD_LIBRARY_PATH").as_deref().and_then(loader_path_hazard) {
            return Err(LoadFailure::LoaderSearchesWorkingDirectory { entry });
        }
    } else {
        check_candidate(candidate, exports)?;
    }
    // SAFETY: loading a shared library runs its initialisers. A path has passed the checks above (a regular ELF
    // shared object of this machine whose entry points are functions); a bare name is found by the dynamic loader
    // in the system's own directories (LD_LIBRARY_PATH has no relative entry, checked above).
    let lib = unsafe { open_own_bound(candidate) }.map_err(|e| {
        let message = crate::loader::dl_error_text(&e);
        if bare && message.contains("No such file") {
            LoadFailure::NotFound
        } else {
            LoadFailure::LoaderError { message }
        }
    })?;
    if bare {
        let Some(first) = exports.required.first() else { return Ok(lib) };
        let mut name = first.as_bytes().to_vec();
        name.push(0);
        // SAFETY: a lookup by name reads the dynamic symbol table; the address is only passed to dladdr.
        let addr = match unsafe { lib.get::<*const c_void>(name.as_slice()) } {
            Ok(s) => *s,
            Err(_) => return Err(LoadFailure::MissingRequired { symbol: (*first).to_owned() }),
        };
        let Some(file) = file_of_address(addr as usize) else {
            return Err(LoadFailure::LoaderError {
                message: format!("the dynamic loader does not say which file defines {first}"),
            });
        };
        check_candidate(&file, exports).map_err(|failure| LoadFailure::LoadedFileRefused {
            path: file.display().to_string(),
            reason: Box::new(failure),
        })?;
    }
    Ok(lib)
}

/// The file the dynamic loader mapped at address `addr` (`dladdr`), if it says and the name is absolute.
pub fn file_of_address(addr: usize) -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::uninit();
    // SAFETY: dladdr only looks the address up in the loader's tables (it never dereferences it) and fills `info`.
    let ok = unsafe { libc::dladdr(addr as *const c_void, info.as_mut_ptr()) };
    if ok == 0 {
        return None;
    }
    // SAFETY: dladdr returned non-zero, so it initialised `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: `dli_fname` is a NUL-terminated path owned by the loader, valid while the library is loaded.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let p = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
    p.is_absolute().then_some(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(places: &[Place]) -> Vec<String> {
        places
            .iter()
            .map(|p| match p {
                Place::Path(p) => p.display().to_string(),
                Place::Soname(n) => format!("soname {n}"),
                Place::Skipped(a) => format!("skipped {} ({})", a.candidate, a.failure),
            })
            .collect()
    }

    #[test]
    fn plan_order_and_env() {
        let env = |k: &str| match k {
            "ANYCCL_NCCL_PATH" => Some(PathBuf::from("/x/libnccl.so.2")),
            "CUDA_HOME" => Some(PathBuf::from("/cuda")),
            _ => None,
        };
        let p = paths(&SearchPlan::with_env(CclVendor::Nccl, &env).places);
        assert_eq!(p[..3], ["/x/libnccl.so.2", "soname libnccl.so.2", "soname libnccl.so"]);
        assert!(p.contains(&"/cuda/lib64/libnccl.so.2".to_owned()), "{p:?}");
        assert_eq!(p.last().map(String::as_str), Some("/usr/local/cuda/lib64/libnccl.so"));
        let r = paths(&SearchPlan::with_env(CclVendor::Rccl, &|_| None).places);
        assert_eq!(
            r,
            ["soname librccl.so.1", "soname librccl.so", "/opt/rocm/lib/librccl.so.1", "/opt/rocm/lib/librccl.so"]
        );
    }

    #[test]
    fn relative_entries_are_skipped_with_their_origin_and_never_touched() {
        let env = |k: &str| match k {
            "ANYCCL_NCCL_PATH" => Some(PathBuf::from("build/libnccl.so.2")),
            "PYTHONPATH" => Some(PathBuf::from("/nonexistent-anyccl-site::.:rel")),
            "CUDA_HOME" => Some(PathBuf::from(".")),
            "VIRTUAL_ENV" => Some(PathBuf::from("venv")),
            "HOME" => Some(PathBuf::from("home")),
            _ => None,
        };
        let places = SearchPlan::with_env(CclVendor::Nccl, &env).places;
        for place in &places {
            if let Place::Path(p) = place {
                assert!(p.is_absolute(), "{p:?}");
            }
        }
        let skipped = paths(&places).into_iter().filter(|p| p.starts_with("skipped")).collect::<Vec<_>>();
        let rel = "is relative; anyccl looks only in absolute directories, never in the working directory";
        assert_eq!(
            skipped,
            [
                format!("skipped build/libnccl.so.2 (not searched: ANYCCL_NCCL_PATH {rel})"),
                format!("skipped nvidia/nccl/lib (not searched: PYTHONPATH entry \"\" {rel})"),
                format!("skipped ./nvidia/nccl/lib (not searched: PYTHONPATH entry \".\" {rel})"),
                format!("skipped rel/nvidia/nccl/lib (not searched: PYTHONPATH entry \"rel\" {rel})"),
                format!("skipped venv (not searched: VIRTUAL_ENV {rel})"),
                format!("skipped home/.local (not searched: HOME {rel})"),
                format!("skipped ./lib64 (not searched: CUDA_HOME {rel})"),
                format!("skipped ./lib (not searched: CUDA_HOME {rel})"),
            ]
        );
    }

    #[test]
    fn a_relative_ld_library_path_entry_turns_sonames_into_absolute_paths() {
        for (llp, entry) in [("/opt/nccl/lib:", ""), (".", "."), ("/a;lib", "lib"), ("/a::/b", "")] {
            let env = |k: &str| (k == "LD_LIBRARY_PATH").then(|| PathBuf::from(llp));
            let places = SearchPlan::with_env(CclVendor::Rccl, &env).places;
            assert!(!places.iter().any(|p| matches!(p, Place::Soname(_))), "{llp}: {places:?}");
            let want = LoadFailure::LoaderSearchesWorkingDirectory { entry: entry.into() };
            assert!(
                matches!(&places[0], Place::Skipped(a) if a.candidate == "librccl.so.1" && a.failure == want),
                "{llp}: {places:?}"
            );
            for p in &places {
                if let Place::Path(p) = p {
                    assert!(p.is_absolute(), "{llp}: {p:?}");
                }
            }
            if llp.starts_with("/a") {
                assert!(places.contains(&Place::Path(PathBuf::from("/a/librccl.so.1"))), "{llp}: {places:?}");
            }
        }
        for ok in ["", "/usr/lib", "/a:/b", "$ORIGIN/../lib:/x", "${ORIGIN}/lib"] {
            assert_eq!(loader_path_hazard(OsStr::new(ok)), None, "{ok}");
        }
    }

    #[test]
    fn os_errors_map_to_precise_failures() {
        let e = |n| std::io::Error::from_raw_os_error(n);
        assert_eq!(os_failure(&e(libc::ENOENT)), LoadFailure::NotFound);
        assert_eq!(os_failure(&e(libc::EACCES)), LoadFailure::PermissionDenied);
        assert_eq!(os_failure(&e(libc::ENAMETOOLONG)), LoadFailure::NameTooLong);
        let other = os_failure(&e(libc::ENOTDIR));
        assert!(matches!(&other, LoadFailure::Unreadable { detail } if detail.contains("Not a directory")), "{other}");
        assert_eq!(LoadFailure::PermissionDenied.to_string(), "permission denied");
        assert_eq!(LoadFailure::NameTooLong.to_string(), "name too long");
        // `dlopen("")` would be the main program: an empty candidate is simply not there.
        assert_eq!(open_checked(Path::new(""), &CCL_EXPORTS).err(), Some(LoadFailure::NotFound));
    }

    /// A 64-byte ELF file header: `class`, byte order `data`, `e_type`, `e_machine`, nothing else.
    fn elf_header(class: u8, data: u8, e_type: u16, machine: u16) -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(&elf::ELFMAG);
        h[4] = class;
        h[5] = data;
        h[6] = 1; // EV_CURRENT
        let le = data == elf::ELFDATA2LSB;
        let put16 = |v: u16| if le { v.to_le_bytes() } else { v.to_be_bytes() };
        h[16..18].copy_from_slice(&put16(e_type));
        h[18..20].copy_from_slice(&put16(machine));
        h[20..24].copy_from_slice(&if le { 1u32.to_le_bytes() } else { 1u32.to_be_bytes() });
        h[52..54].copy_from_slice(&put16(64)); // e_ehsize
        h
    }

    #[test]
    fn the_elf_check_gives_precise_reasons() {
        let dir = std::env::temp_dir().join(format!("anyccl-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let check = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).expect("write");
            check_candidate(&p, &CCL_EXPORTS)
        };
        let not_lib = |d: &str| Err(LoadFailure::NotALibrary { detail: d.into() });
        assert_eq!(check("text.so", b"#!/bin/sh\necho hi\n"), not_lib("no ELF header"));
        assert_eq!(check("short.so", b"\x7fEL"), not_lib("no ELF header"));
        assert_eq!(check("empty.so", b""), not_lib("no ELF header"));
        let Some((machine, host)) = host_machine() else { return };
        let lsb = cfg!(target_endian = "little");
        let (order, other_order) =
            if lsb { (elf::ELFDATA2LSB, elf::ELFDATA2MSB) } else { (elf::ELFDATA2MSB, elf::ELFDATA2LSB) };
        let (class, other_class) = if cfg!(target_pointer_width = "64") {
            (elf::ELFCLASS64, elf::ELFCLASS32)
        } else {
            (elf::ELFCLASS32, elf::ELFCLASS64)
        };
        let here = format!("{}-bit {} {host}", usize::BITS, if lsb { "little-endian" } else { "big-endian" });
        let got = check("class.so", &elf_header(other_class, order, elf::ET_DYN, machine));
        assert!(
            matches!(&got, Err(LoadFailure::WrongArchitecture { detail }) if detail.ends_with(&format!("ELF (this process is {here})"))),
            "{got:?}"
        );
        let got = check("order.so", &elf_header(class, other_order, elf::ET_DYN, machine));
        assert!(matches!(&got, Err(LoadFailure::WrongArchitecture { .. })), "{got:?}");
        let foreign = if machine == elf::EM_AARCH64 { elf::EM_X86_64 } else { elf::EM_AARCH64 };
        let got = check("machine.so", &elf_header(class, order, elf::ET_DYN, foreign));
        let want = format!("{} (this process is {host})", machine_name(foreign));
        assert_eq!(got, Err(LoadFailure::WrongArchitecture { detail: want }));
        let got = check("gpu.so", &elf_header(class, order, elf::ET_DYN, elf::EM_AMDGPU));
        assert!(
            matches!(&got, Err(LoadFailure::WrongArchitecture { detail }) if detail.starts_with("AMD GPU code object (ELF machine 224)")),
            "{got:?}"
        );
        assert_eq!(
            check("exec.so", &elf_header(class, order, elf::ET_EXEC, machine)),
            not_lib("an executable (ELF type 2), not a shared object")
        );
        assert_eq!(
            check("bare.so", &elf_header(class, order, elf::ET_DYN, machine)),
            not_lib("no dynamic symbol table (.dynsym section); anyccl needs one to check the entry points")
        );
        // A real shared object without the entry points: this test binary's own libc.
        // SAFETY: the C library is already loaded in this process; opening it again runs nothing.
        let libc_so = unsafe { libloading::Library::new("libc.so.6") }.expect("glibc");
        // SAFETY: a lookup only; the address goes to dladdr.
        let getpid = unsafe { libc_so.get::<*const c_void>(b"getpid\0") }.map(|s| *s).expect("getpid");
        let libc_path = file_of_address(getpid as usize).expect("libc is mapped from a file");
        assert_eq!(
            check_candidate(&libc_path, &CCL_EXPORTS),
            Err(LoadFailure::MissingRequired { symbol: "ncclGetVersion".into() })
        );
        // ...and a data object where a function is wanted.
        let environ = Exports { required: &["getpid", "environ"], optional: &[] };
        assert_eq!(
            check_candidate(&libc_path, &environ),
            Err(LoadFailure::SymbolNotAFunction {
                symbol: "environ".into(),
                detail: "it is a data object (STT_OBJECT)".into()
            })
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn nothing_found_lists_every_place() {
        let dir = std::env::temp_dir().join(format!("anyccl-find-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        std::fs::write(dir.join("libanyccl-garbage.so.2"), b"garbage").expect("write");
        let plan = SearchPlan {
            vendor: CclVendor::Nccl,
            places: vec![
                Place::Path(dir.join("missing.so")),
                Place::Soname("libnccl-that-does-not-exist.so.2".into()),
                Place::Path(dir.join("libanyccl-garbage.so.2")),
            ],
        };
        let err = plan.load().expect_err("nothing loads");
        assert_eq!(err.tried.len(), 3, "{err}");
        assert_eq!(err.tried[0].failure, LoadFailure::NotFound);
        assert_eq!(err.tried[1].failure, LoadFailure::NotFound);
        assert_eq!(err.tried[2].candidate, dir.join("libanyccl-garbage.so.2").display().to_string());
        assert_eq!(err.tried[2].failure, LoadFailure::NotALibrary { detail: "no ELF header".into() });
        std::fs::remove_dir_all(&dir).ok();
    }
}
