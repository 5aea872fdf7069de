//! Finding the library really installed: explicit path, the dynamic loader's names, then where users have it.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::loader::{CclLibrary, CclVendor, LoadFailure};

/// One place that was tried, and why it failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attempt {
    /// The path or soname tried.
    pub candidate: String,
    /// Why it was not used.
    pub failure: LoadFailure,
}

/// No library could be loaded; every place tried, with its reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{vendor} not found; tried: {}", tried.iter().map(|a| format!("{} ({})", a.candidate, a.failure)).collect::<Vec<_>>().join("; "))]
pub struct NotFound {
    /// Which library was looked for.
    pub vendor: CclVendor,
    /// Every attempt, in order.
    pub tried: Vec<Attempt>,
}

/// Where to look. [`SearchPlan::from_env`] builds the standard plan; tests build their own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchPlan {
    /// Which library.
    pub vendor: CclVendor,
    /// An explicit file from the environment (tried first; if it is set, a failure there is reported too).
    pub explicit: Option<PathBuf>,
    /// Names for the dynamic loader.
    pub sonames: Vec<String>,
    /// Directories to look in, in order.
    pub dirs: Vec<PathBuf>,
}

/// The environment variable with an explicit NCCL path.
pub const ENV_NCCL_PATH: &str = "ANYCCL_NCCL_PATH";
/// The environment variable with an explicit RCCL path.
pub const ENV_RCCL_PATH: &str = "ANYCCL_RCCL_PATH";

impl SearchPlan {
    /// The standard plan for `vendor`, read from the process environment.
    pub fn from_env(vendor: CclVendor) -> Self {
        Self::with_env(vendor, &|k| std::env::var_os(k).map(PathBuf::from).filter(|p| !p.as_os_str().is_empty()))
    }

    /// The standard plan with an injectable environment.
    pub fn with_env(vendor: CclVendor, env: &dyn Fn(&str) -> Option<PathBuf>) -> Self {
        match vendor {
            CclVendor::Nccl => {
                let mut dirs = python_nccl_dirs(env);
                for var in ["CUDA_HOME", "CUDA_PATH"] {
                    if let Some(h) = env(var) {
                        dirs.push(h.join("lib64"));
                        dirs.push(h.join("lib"));
                    }
                }
                dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
                SearchPlan {
                    vendor,
                    explicit: env(ENV_NCCL_PATH),
                    sonames: vec!["libnccl.so.2".into(), "libnccl.so".into()],
                    dirs,
                }
            }
            CclVendor::Rccl => {
                let mut dirs = Vec::new();
                if let Some(h) = env("ROCM_PATH") {
                    dirs.push(h.join("lib"));
                }
                dirs.push(PathBuf::from("/opt/rocm/lib"));
                SearchPlan {
                    vendor,
                    explicit: env(ENV_RCCL_PATH),
                    sonames: vec!["librccl.so.1".into(), "librccl.so".into()],
                    dirs,
                }
            }
        }
    }

    /// Tries every place in order; returns the first library that loads with all required symbols.
    pub fn load(&self) -> Result<CclLibrary, NotFound> {
        let mut tried = Vec::new();
        let attempt = |candidate: &Path, tried: &mut Vec<Attempt>| match CclLibrary::open(candidate) {
            Ok(lib) => Some(lib),
            Err(failure) => {
                tracing::debug!(candidate = %candidate.display(), %failure, "collective library not used");
                tried.push(Attempt { candidate: candidate.display().to_string(), failure });
                None
            }
        };
        if let Some(p) = &self.explicit {
            if let Some(lib) = attempt(p, &mut tried) {
                return Ok(lib);
            }
        }
        for name in &self.sonames {
            if let Some(lib) = attempt(Path::new(name), &mut tried) {
                return Ok(lib);
            }
        }
        for dir in &self.dirs {
            for name in &self.sonames {
                let p = dir.join(name);
                if !p.exists() {
                    tried.push(Attempt { candidate: p.display().to_string(), failure: LoadFailure::NotFound });
                    continue;
                }
                if let Some(lib) = attempt(&p, &mut tried) {
                    return Ok(lib);
                }
            }
        }
        Err(NotFound { vendor: self.vendor, tried })
    }
}

/// `nvidia/nccl/lib` inside the Python installations a user is likely to have (the wheel PyTorch brings):
/// `$VIRTUAL_ENV`, `$CONDA_PREFIX`, `$PYTHONPATH` entries, `~/.local`, `/usr/local`, `/usr`.
fn python_nccl_dirs(env: &dyn Fn(&str) -> Option<PathBuf>) -> Vec<PathBuf> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    let mut site_dirs: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = env(var) {
            prefixes.push(p);
        }
    }
    if let Some(pp) = env("PYTHONPATH") {
        site_dirs.extend(std::env::split_paths(&pp));
    }
    if let Some(home) = env("HOME") {
        prefixes.push(home.join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for prefix in prefixes {
        let lib = prefix.join("lib");
        let Ok(entries) = std::fs::read_dir(&lib) else { continue };
        let mut pythons: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons.into_iter().rev() {
            site_dirs.push(py.join("site-packages"));
            site_dirs.push(py.join("dist-packages"));
        }
    }
    site_dirs.into_iter().map(|d| d.join("nvidia").join("nccl").join("lib")).filter(|d| d.is_dir()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_order_and_env() {
        let env = |k: &str| match k {
            "ANYCCL_NCCL_PATH" => Some(PathBuf::from("/x/libnccl.so.2")),
            "CUDA_HOME" => Some(PathBuf::from("/cuda")),
            _ => None,
        };
        let p = SearchPlan::with_env(CclVendor::Nccl, &env);
        assert_eq!(p.explicit, Some(PathBuf::from("/x/libnccl.so.2")));
        assert_eq!(p.sonames, ["libnccl.so.2", "libnccl.so"]);
        assert!(p.dirs.contains(&PathBuf::from("/cuda/lib64")));
        let r = SearchPlan::with_env(CclVendor::Rccl, &|_| None);
        assert_eq!(r.sonames, ["librccl.so.1", "librccl.so"]);
        assert_eq!(r.dirs.last(), Some(&PathBuf::from("/opt/rocm/lib")));
    }

    #[test]
    fn nothing_found_lists_every_place() {
        let dir = std::env::temp_dir().join(format!("anyccl-find-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        std::fs::write(dir.join("libanyccl-garbage.so.2"), b"garbage").expect("write");
        let plan = SearchPlan {
            vendor: CclVendor::Nccl,
            explicit: Some(dir.join("missing.so")),
            sonames: vec!["libnccl-that-does-not-exist.so.2".into()],
            dirs: vec![dir.clone()],
        };
        let err = plan.load().expect_err("nothing loads");
        assert_eq!(err.tried.len(), 3, "{err}");
        assert_eq!(err.tried[0].failure, LoadFailure::NotFound);
        assert_eq!(err.tried[1].failure, LoadFailure::NotFound);
        assert_eq!(err.tried[2].candidate, dir.join("libnccl-that-does-not-exist.so.2").display().to_string());
        let plan = SearchPlan { sonames: vec!["libanyccl-garbage.so.2".into()], explicit: None, ..plan };
        let err = plan.load().expect_err("garbage file");
        assert!(err.tried.iter().any(|a| matches!(a.failure, LoadFailure::NotALibrary { .. })), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
