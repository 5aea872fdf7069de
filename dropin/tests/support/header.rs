//! The function declarations of an `nccl.h`: how the drop-in's function list is derived from the real header.

/// The names of the functions `header` declares whose names start with `nccl` or `pnccl`, in order, each once.
///
/// Comments, string literals' contents inside `__attribute__((…))` and preprocessor lines are removed first; each
/// remaining statement (up to `;`, after its last brace) that has an identifier right before its first `(` and a
/// return type before that is a function declaration.
pub fn functions(header: &str) -> Vec<String> {
    let code = strip_preprocessor(&strip_comments(header));
    let mut names = Vec::new();
    for stmt in code.split(';') {
        let stmt = stmt.rsplit(['{', '}']).next().unwrap_or("");
        let stmt = strip_attributes(stmt);
        let Some(open) = stmt.find('(') else { continue };
        let before = stmt[..open].trim_end();
        let name_start = before.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
        let (ret, name) = before.split_at(name_start);
        if ret.trim().is_empty() || ret.contains("typedef") || ret.contains('=') {
            continue;
        }
        if (name.starts_with("nccl") || name.starts_with("pnccl")) && !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
    }
    names
}

fn strip_comments(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
            out.push(' ');
        } else if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

fn strip_preprocessor(s: &str) -> String {
    let mut out = String::new();
    let mut continued = false;
    for line in s.lines() {
        let directive = continued || line.trim_start().starts_with('#');
        continued = directive && line.trim_end().ends_with('\\');
        if !directive {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// `stmt` without `__attribute__ ((…))` groups (balanced parentheses).
fn strip_attributes(stmt: &str) -> String {
    let mut out = String::new();
    let mut rest = stmt;
    while let Some(i) = rest.find("__attribute__") {
        out.push_str(&rest[..i]);
        let after = &rest[i + "__attribute__".len()..];
        let mut depth = 0usize;
        let mut end = after.len();
        for (j, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The snapshot of the `nccl*` functions of the PyPI wheel `nvidia-nccl-cu12==2.32.3`'s `nccl.h`, one per line (made
/// with [`functions`]; the real-NCCL test checks it against the header again).
pub const SNAPSHOT: &str = include_str!("../nccl-2.32.3-functions.txt");

/// The snapshot's names.
pub fn snapshot() -> Vec<&'static str> {
    names(SNAPSHOT)
}

/// The snapshot of the device API's host functions (`nccl_device/host.h`) that the wheel's `libnccl.so.2` exports,
/// one per line (the real-NCCL test checks it against the library's exports and the header again).
pub const DEVICE_SNAPSHOT: &str = include_str!("../nccl-2.32.3-device-host-functions.txt");

/// The device snapshot's names.
pub fn device_snapshot() -> Vec<&'static str> {
    names(DEVICE_SNAPSHOT)
}

fn names(list: &'static str) -> Vec<&'static str> {
    list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect()
}
