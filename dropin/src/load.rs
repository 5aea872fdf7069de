//! Finding and loading the real NCCL (or RCCL) underneath, once, and never this library itself.
//!
//! The search is anyccl's ([`anyccl_ccl::SearchPlan`]: `ANYCCL_NCCL_PATH`, the dynamic loader's `libnccl.so.2`,
//! the Python wheels, `CUDA_HOME`, …; then the same for RCCL with `ANYCCL_RCCL_PATH`; the vendor whose variable
//! alone is set goes first), with two additions for a drop-in:
//! - after the sonames, every absolute `LD_LIBRARY_PATH` directory and the system library directories are tried
//!   as paths: when the drop-in itself is installed as `libnccl.so.2`, the dynamic loader hands it back for that
//!   name, and the real library must still be found further along;
//! - every candidate is refused if it is this library (the same file: device and inode, or the same loaded object)
//!   or any anyccl drop-in (it exports [`MARKER`]), before `dlopen` for a path (by reading its symbol table) and
//!   after it for a soname (by `dlsym` on the handle and `dladdr` on its `ncclGetVersion`). Forwarding to a
//!   drop-in would recurse.
//!
//! - the folders the dynamic loader would have searched for `libnccl.so.2` on behalf of the objects loaded in
//!   this process that need it (their `DT_RUNPATH`, or `DT_RPATH` without one, `$ORIGIN` expanded), right after
//!   the sonames ([`needed_dirs`]): the drop-in's SONAME is `libnccl.so.2`, so when it is preloaded
//!   (`LD_PRELOAD`) over a program linked to the real NCCL, the loader takes it for that need and never opens the
//!   real library; the drop-in looks where the loader would have.
//!
//! Every entry point is resolved with `dlsym` on the library's own handle, once, and accepted only if it lies in
//! that library (`dladdr` gives the same object base as its `ncclGetVersion`), never in one of its dependencies.

use std::ffi::{c_void, CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyccl_ccl::find::{self, Exports, Place, PlaceList, CCL_EXPORTS, ENV_NCCL_PATH, ENV_RCCL_PATH};
use anyccl_ccl::{CclLibrary, CclVendor, LoadFailure, SearchPlan};

use crate::api::Api;

/// The symbol every anyccl drop-in exports; a candidate that has it is never forwarded to.
pub const MARKER: &str = "anyccl_nccl_dropin_marker";

/// The library underneath, loaded for the life of the process.
pub struct Underlying {
    /// Every `nccl.h` entry point it exports.
    pub api: Api,
    /// Its version, vendor and path, as anyccl's loader reads them (shared with the communicators anyccl wraps).
    pub library: std::sync::Arc<CclLibrary>,
    /// `"NCCL 2.28.9 /path/libnccl.so.2"`, for `anyccl_nccl_dropin_underlying`.
    pub description: CString,
    /// Places refused before it (for the log).
    pub refused: Vec<String>,
    // Never closed: NCCL's threads (bootstrap, proxies) outlive every call, as in anyccl's own loader.
    _lib: std::mem::ManuallyDrop<libloading::Library>,
}

impl std::fmt::Debug for Underlying {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Underlying").field("library", &self.library).finish_non_exhaustive()
    }
}

/// What the one load gave.
#[derive(Debug)]
pub enum State {
    /// A library to forward to.
    Loaded(Box<Underlying>),
    /// None: why, with every place tried.
    Missing(String),
}

/// The file this code was loaded from, to recognise it among the candidates.
#[derive(Debug, Clone)]
struct Me {
    path: Option<PathBuf>,
    id: Option<(u64, u64)>,
    base: usize,
}

impl Me {
    fn find() -> Me {
        let addr = crate::anyccl_nccl_dropin_marker as *const () as usize;
        let path = find::file_of_address(addr);
        let id = path.as_deref().and_then(|p| std::fs::metadata(p).ok()).map(|m| (m.dev(), m.ino()));
        Me { path, id, base: object_base(addr).unwrap_or(0) }
    }

    fn is_file(&self, p: &Path) -> bool {
        let id = std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
        id.is_some() && id == self.id
    }
}

/// The load address of the object that contains `addr` (`dladdr`'s `dli_fbase`).
fn object_base(addr: usize) -> Option<usize> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::uninit();
    // SAFETY: dladdr only looks the address up in the loader's tables (it never dereferences it) and fills `info`.
    let ok = unsafe { libc::dladdr(addr as *const c_void, info.as_mut_ptr()) };
    if ok == 0 {
        return None;
    }
    // SAFETY: dladdr returned non-zero, so it initialised `info`.
    let info = unsafe { info.assume_init() };
    (!info.dli_fbase.is_null()).then_some(info.dli_fbase as usize)
}

/// The places to try, in order (see the module documentation).
pub fn plan(env: &dyn Fn(&str) -> Option<PathBuf>) -> Vec<Place> {
    let rccl_first = env(ENV_RCCL_PATH).is_some() && env(ENV_NCCL_PATH).is_none();
    let order = if rccl_first { [CclVendor::Rccl, CclVendor::Nccl] } else { [CclVendor::Nccl, CclVendor::Rccl] };
    let mut places = Vec::new();
    for vendor in order {
        let names: &[&str] = match vendor {
            CclVendor::Rccl => &["librccl.so.1", "librccl.so"],
            _ => &["libnccl.so.2", "libnccl.so"],
        };
        let standard = SearchPlan::with_env(vendor, env).places;
        let after_sonames = standard.iter().rposition(|p| matches!(p, Place::Soname(_))).map_or(0, |i| i + 1);
        let mut extra = PlaceList::new(env, names);
        if let Some(llp) = env("LD_LIBRARY_PATH") {
            for d in find::ld_library_path_entries(llp.as_os_str()).filter(|d| d.is_absolute()) {
                extra.dir("LD_LIBRARY_PATH", d);
            }
        }
        for d in anyccl_ccl::find::system_library_dirs() {
            extra.dir("the system library directories", d);
        }
        let (head, tail) = standard.split_at(after_sonames);
        places.extend(head.iter().cloned());
        places.extend(extra.finish());
        places.extend(tail.iter().cloned());
    }
    let mut seen = std::collections::HashSet::new();
    places.retain(|p| match p {
        Place::Path(p) => seen.insert(p.clone()),
        _ => true,
    });
    places
}

/// Why a candidate was not used.
enum Refusal {
    /// It is a drop-in (this one or another copy).
    DropIn(String),
    /// anyccl's loader refused it.
    Failed(LoadFailure),
}

/// The paths of the objects loaded in this process: the program first, then every shared object the dynamic
/// loader lists.
fn loaded_objects() -> Vec<PathBuf> {
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> libc::c_int {
        // SAFETY: `data` is the vector passed below, alive for the whole dl_iterate_phdr call; `info` is the
        // loader's record of one object, valid during this callback, and its name a NUL-terminated string.
        unsafe {
            let paths = &mut *data.cast::<Vec<PathBuf>>();
            let name = (*info).dlpi_name;
            if !name.is_null() {
                let name = CStr::from_ptr(name);
                if !name.is_empty() {
                    paths.push(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())));
                }
            }
        }
        0
    }
    let mut paths: Vec<PathBuf> = std::env::current_exe().into_iter().collect();
    // SAFETY: the callback only reads the loader's records and appends to `paths`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each), std::ptr::addr_of_mut!(paths).cast::<c_void>()) };
    paths
}

/// The folders of `object`'s `DT_RUNPATH` (or `DT_RPATH` without one), `$ORIGIN` expanded, if it needs one of
/// `names` (`DT_NEEDED`); reads only the ELF headers and the dynamic section.
fn search_dirs_if_needed(object: &Path, names: &[&str]) -> Vec<PathBuf> {
    use object::read::elf::{Dyn, FileHeader};
    type Header = object::elf::FileHeader64<object::Endianness>;
    let Ok(file) = std::fs::File::open(object) else { return Vec::new() };
    let cache = object::read::ReadCache::new(file);
    let Ok(header) = Header::parse(&cache) else { return Vec::new() };
    let Ok(endian) = header.endian() else { return Vec::new() };
    let Ok(sections) = header.sections(endian, &cache) else { return Vec::new() };
    let Ok(Some((dynamic, link))) = sections.dynamic(endian, &cache) else { return Vec::new() };
    let Ok(strings) = sections.strings(endian, &cache, link) else { return Vec::new() };
    let text = |d: &<Header as FileHeader>::Dyn| d.val32(endian).and_then(|v| strings.get(v).ok());
    let (mut needs, mut runpath, mut rpath) = (false, None, None);
    for d in dynamic {
        match d.tag32(endian) {
            Some(object::elf::DT_NEEDED) => needs |= text(d).is_some_and(|n| names.iter().any(|x| x.as_bytes() == n)),
            Some(object::elf::DT_RUNPATH) => runpath = text(d),
            Some(object::elf::DT_RPATH) => rpath = text(d),
            _ => {}
        }
    }
    let Some(list) = runpath.or(rpath).filter(|_| needs) else { return Vec::new() };
    let origin = object.parent().map(Path::to_path_buf).unwrap_or_default();
    list.split(|b| *b == b':')
        .filter_map(|entry| {
            let entry = std::ffi::OsStr::from_bytes(entry).to_str()?;
            let origin = origin.to_str()?;
            let dir = entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin);
            // `$LIB`, `$PLATFORM` and relative entries are left to the loader's own search.
            (!dir.contains('$') && dir.starts_with('/')).then(|| PathBuf::from(dir))
        })
        .collect()
}

/// The folders the dynamic loader would have searched for one of `names` (`libnccl.so.2`) on behalf of the loaded
/// objects that need it, each once, in load order.
pub fn needed_dirs(names: &[&str]) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for object in loaded_objects() {
        for d in search_dirs_if_needed(&object, names) {
            if !dirs.contains(&d) {
                dirs.push(d);
            }
        }
    }
    dirs
}

/// Loads the first usable library of the standard plan (the process environment).
pub fn load() -> State {
    let me = Me::find();
    let mut places = plan(&find::process_env);
    // After the NCCL sonames: where the loader would have found the libnccl.so.2 a loaded object needs.
    let after =
        places.iter().rposition(|p| matches!(p, Place::Soname(n) if n.starts_with("libnccl"))).map_or(0, |i| i + 1);
    let extra: Vec<Place> = needed_dirs(&["libnccl.so.2", "libnccl.so"])
        .into_iter()
        .map(|d| d.join("libnccl.so.2"))
        .filter(|p| !places.iter().any(|q| matches!(q, Place::Path(x) if x == p)))
        .map(Place::Path)
        .collect();
    places.splice(after..after, extra);
    let mut tried = Vec::new();
    for place in &places {
        let candidate = match place {
            Place::Path(p) => p.as_path(),
            Place::Soname(n) => Path::new(n.as_str()),
            Place::Skipped(a) => {
                tried.push(format!("{} ({})", a.candidate, a.failure));
                continue;
            }
            _ => continue,
        };
        match open(candidate, &me) {
            Ok(mut u) => {
                tracing::debug!(
                    library = %u.library.describe(),
                    path = %u.library.path().display(),
                    refused = ?tried,
                    "anyccl drop-in NCCL forwards to this library"
                );
                u.refused = tried;
                return State::Loaded(Box::new(u));
            }
            Err(r) => {
                let why = match r {
                    Refusal::DropIn(why) => why,
                    Refusal::Failed(f) => f.to_string(),
                };
                tracing::debug!(candidate = %candidate.display(), %why, "not forwarded to");
                tried.push(format!("{} ({why})", candidate.display()));
            }
        }
    }
    let me_path = me.path.as_deref().map_or_else(|| "the anyccl drop-in".to_owned(), |p| p.display().to_string());
    State::Missing(format!(
        "the anyccl drop-in NCCL ({me_path}) found no NCCL or RCCL library to forward to; set {ENV_NCCL_PATH} (or \
         {ENV_RCCL_PATH}) to the real library's absolute path. Tried: {}",
        tried.join("; ")
    ))
}

fn open(candidate: &Path, me: &Me) -> Result<Underlying, Refusal> {
    let bare = find::is_bare_name(candidate);
    if !bare {
        if me.is_file(candidate) {
            return Err(Refusal::DropIn("it is this anyccl drop-in library itself (the same file)".into()));
        }
        let marker = Exports { required: &[MARKER], optional: &[] };
        if find::check_candidate(candidate, &marker).is_ok() {
            return Err(Refusal::DropIn(format!("it is an anyccl drop-in library (it exports {MARKER})")));
        }
    }
    let lib = find::open_checked(candidate, &CCL_EXPORTS).map_err(Refusal::Failed)?;
    // SAFETY: looking symbols up by name only reads the library's dynamic symbol table; the addresses are only
    // compared and passed to dladdr here.
    let get = |name: &CStr| match unsafe { lib.get::<*const c_void>(name.to_bytes_with_nul()) } {
        Ok(s) => *s,
        Err(_) => std::ptr::null(),
    };
    let version_addr = get(c"ncclGetVersion") as usize;
    let base = object_base(version_addr).unwrap_or(0);
    if base == me.base && base != 0 {
        return Err(Refusal::DropIn("the dynamic loader gave back this anyccl drop-in library itself".into()));
    }
    let mut marker = MARKER.as_bytes().to_vec();
    marker.push(0);
    if CStr::from_bytes_with_nul(&marker).map(|m| !get(m).is_null()).unwrap_or(false) {
        return Err(Refusal::DropIn(format!("it is an anyccl drop-in library (it exports {MARKER})")));
    }
    let file = find::file_of_address(version_addr).unwrap_or_else(|| candidate.to_owned());
    if me.is_file(&file) {
        return Err(Refusal::DropIn(format!("{} is this anyccl drop-in library itself", file.display())));
    }
    // Only entry points defined in this very library: `dlsym` on a handle also searches its dependencies.
    let mut own = |name: &CStr| {
        let p = get(name);
        if !p.is_null() && object_base(p as usize) == Some(base) {
            p
        } else {
            std::ptr::null()
        }
    };
    let api = Api::resolve(&mut own);
    let library = CclLibrary::load_with(&file, &mut own).map_err(Refusal::Failed)?;
    let description = crate::last_error::to_c_string(&format!("{} {}", library.describe(), file.display()));
    Ok(Underlying {
        api,
        library: std::sync::Arc::new(library),
        description,
        refused: Vec::new(),
        _lib: std::mem::ManuallyDrop::new(lib),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(places: &[Place]) -> Vec<String> {
        places
            .iter()
            .map(|p| match p {
                Place::Path(p) => p.display().to_string(),
                Place::Soname(n) => format!("soname {n}"),
                Place::Skipped(a) => format!("skipped {}", a.candidate),
                _ => "other".into(),
            })
            .collect()
    }

    #[test]
    fn ld_library_path_dirs_follow_the_sonames_and_rccl_follows_nccl() {
        let env = |k: &str| match k {
            "ANYCCL_NCCL_PATH" => Some(PathBuf::from("/x/libnccl.so.2")),
            "LD_LIBRARY_PATH" => Some(PathBuf::from("/dropin:/real")),
            _ => None,
        };
        let p = shown(&plan(&env));
        assert_eq!(
            p[..7],
            [
                "/x/libnccl.so.2",
                "soname libnccl.so.2",
                "soname libnccl.so",
                "/dropin/libnccl.so.2",
                "/dropin/libnccl.so",
                "/real/libnccl.so.2",
                "/real/libnccl.so"
            ]
        );
        let rccl = p.iter().position(|s| s == "soname librccl.so.1").expect("RCCL is searched too");
        assert!(p[..rccl].iter().all(|s| !s.contains("rccl")), "{p:?}");
        assert!(p.contains(&"/real/librccl.so.1".to_owned()), "{p:?}");
        // Each path once.
        let paths: Vec<&String> = p.iter().filter(|s| s.starts_with('/')).collect();
        let unique: std::collections::HashSet<&&String> = paths.iter().collect();
        assert_eq!(paths.len(), unique.len(), "{p:?}");
    }

    #[test]
    fn the_vendor_named_alone_goes_first() {
        let env = |k: &str| (k == "ANYCCL_RCCL_PATH").then(|| PathBuf::from("/opt/rocm/lib/librccl.so.1"));
        let p = shown(&plan(&env));
        assert_eq!(p[0], "/opt/rocm/lib/librccl.so.1");
        let both = |k: &str| match k {
            "ANYCCL_RCCL_PATH" => Some(PathBuf::from("/r/librccl.so.1")),
            "ANYCCL_NCCL_PATH" => Some(PathBuf::from("/n/libnccl.so.2")),
            _ => None,
        };
        assert_eq!(shown(&plan(&both))[0], "/n/libnccl.so.2");
    }
}
