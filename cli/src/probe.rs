//! `anyccl probe`: the library's machine-level capability report ([`anyccl::report::MachineReport`]) as text.
//! The JSON form is the report's serde serialisation (schema documented in the facade's `report` module).

use anyccl::report::MachineReport;

/// The human-readable form of the machine report.
pub fn render_text(r: &MachineReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "anyccl {} probe", r.anyccl_version);
    let _ = writeln!(s, "\nGPU: {}", r.gpu.detail);
    let _ = writeln!(s, "Default backend for `anyccl bench`: {}", r.default_backend);
    let _ = writeln!(s, "\nBackends:");
    for b in &r.backends {
        let state = match (b.compiled_in, b.available) {
            (true, true) => "available",
            (true, false) => "unavailable",
            (false, _) => "not compiled in",
        };
        let _ = writeln!(s, "  {:<6} {:<16} {}", b.name, state, b.detail);
    }
    let _ = writeln!(s, "\nVendor libraries:");
    for l in &r.libraries {
        let where_ = match (&l.path, &l.version) {
            (Some(p), Some(v)) => format!("{v} at {p}"),
            (Some(p), None) => p.clone(),
            _ => l.detail.clone(),
        };
        let _ = writeln!(s, "  {:<12} {}", l.name, where_);
        for a in &l.tried {
            let _ = writeln!(s, "  {:<12}   tried {}: {}", "", a.candidate, a.failure);
        }
    }
    let _ = writeln!(s, "\nCapabilities:");
    // The report's own table (`Display`), indented under the heading.
    for line in r.capabilities.to_string().lines() {
        let _ = writeln!(s, "  {line}");
    }
    let _ = writeln!(s, "\nAll-reduce selection:");
    // `TableSource` is `#[non_exhaustive]`; its `Display` (in anyccl-core) covers every source.
    let _ = writeln!(s, "  table: {}", r.selector.source);
    if let Some(a) = r.selector.forced {
        let _ = writeln!(s, "  forced: {a} (ANYCCL_ALLREDUCE_ALGO)");
    }
    for rule in &r.selector.rules {
        let _ = writeln!(s, "  {rule}");
    }
    for w in &r.warnings {
        let _ = writeln!(s, "\nwarning: {w}");
    }
    s
}
