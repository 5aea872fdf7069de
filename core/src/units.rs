//! Byte sizes as people write them (`512KiB`, `8 MiB`, `1.5MB`, `4096`).

use crate::error::Error;

const UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("k", 1 << 10),
    ("m", 1 << 20),
    ("g", 1 << 30),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
];

/// Parses a byte size: a number (integer or decimal) and an optional unit (`B`, `KiB`/`K`, `MiB`/`M`, `GiB`/`G`
/// are powers of 1024; `KB`, `MB`, `GB` powers of 1000). Case-insensitive; spaces allowed between number and unit.
pub fn parse_bytes(s: &str) -> Result<u64, Error> {
    let bad = || Error::Parse {
        what: "byte size",
        input: s.to_owned(),
        expected: "a number with an optional unit: B, KiB, MiB, GiB (or K, M, G), KB, MB, GB".to_owned(),
    };
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(bad());
    }
    let unit = unit.trim().to_ascii_lowercase();
    let mult = if unit.is_empty() { 1 } else { UNITS.iter().find(|(u, _)| *u == unit).ok_or_else(bad)?.1 };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(bad);
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    let v = f * mult as f64;
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 || v.fract() != 0.0 {
        return Err(bad());
    }
    Ok(v as u64)
}

/// Formats a byte count compactly with binary units (`512 KiB`, `1.5 MiB`, `48 B`).
pub fn format_bytes(n: u64) -> String {
    const STEPS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, m) in STEPS {
        if n >= m {
            let v = n as f64 / m as f64;
            return if n % m == 0 { format!("{} {u}", n / m) } else { format!("{v:.2} {u}") };
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        assert_eq!(parse_bytes("4096").ok(), Some(4096));
        assert_eq!(parse_bytes("512KiB").ok(), Some(512 << 10));
        assert_eq!(parse_bytes("8 MiB").ok(), Some(8 << 20));
        assert_eq!(parse_bytes("1.5M").ok(), Some(3 << 19));
        assert_eq!(parse_bytes("2GB").ok(), Some(2_000_000_000));
        for bad in ["", "MiB", "12 parsecs", "1.3 B", "-4", "99999999999999999999"] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formats() {
        assert_eq!(format_bytes(48), "48 B");
        assert_eq!(format_bytes(512 << 10), "512 KiB");
        assert_eq!(format_bytes(3 << 19), "1.50 MiB");
    }

    proptest::proptest! {
        #[test]
        fn round_trips_exact_sizes(n in 0u64..(1 << 40)) {
            let s = format_bytes(n);
            if !s.contains('.') {
                proptest::prop_assert_eq!(parse_bytes(&s).ok(), Some(n));
            }
            proptest::prop_assert_eq!(parse_bytes(&n.to_string()).ok(), Some(n));
        }
    }
}
