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

/// The longest text [`parse_bytes`] looks at; longer input is refused unread (no byte size needs more).
pub const MAX_SIZE_TEXT: usize = 64;

/// Parses a byte size: a number (integer or decimal) and an optional unit (`B`, `KiB`/`K`, `MiB`/`M`, `GiB`/`G`
/// are powers of 1024; `KB`, `MB`, `GB` powers of 1000). Case-insensitive; spaces allowed between number and unit.
///
/// The arithmetic is exact: a decimal must come to a whole number of bytes (`1.5KiB` is 1536, `0.1KiB` is
/// refused), and anything of 2⁶⁴ bytes or more is an error, never rounded or saturated.
pub fn parse_bytes(s: &str) -> Result<u64, Error> {
    let bad = |why: &str| Error::Parse {
        what: "byte size",
        input: if s.len() > MAX_SIZE_TEXT {
            // Shortened on a char boundary, so an error never repeats a huge input.
            let cut = (0..=MAX_SIZE_TEXT).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
            format!("{}…", &s[..cut])
        } else {
            s.to_owned()
        },
        expected: why.to_owned(),
    };
    const FORM: &str = "a number with an optional unit: B, KiB, MiB, GiB (or K, M, G), KB, MB, GB";
    if s.len() > MAX_SIZE_TEXT {
        return Err(bad("at most 64 characters"));
    }
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult = if unit.is_empty() { 1 } else { UNITS.iter().find(|(u, _)| *u == unit).ok_or_else(|| bad(FORM))?.1 };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(bad(FORM));
    }
    // Exact arithmetic in u128: bytes = int·mult + frac·mult/10^k, and the second term must be whole. Trailing
    // zeros of the fraction change nothing, so they are dropped first (`1.50MiB` is `1.5MiB`). The fraction is
    // reduced by gcd(mult, 10^k) before multiplying, so that term stays below `mult` and cannot overflow.
    let frac = frac.trim_end_matches('0');
    let too_big = || bad("a size below 2^64 bytes");
    let digits = |d: &str| -> Option<u128> {
        d.bytes().try_fold(0u128, |acc, b| acc.checked_mul(10)?.checked_add(u128::from(b - b'0')))
    };
    let whole = digits(int).and_then(|n| n.checked_mul(u128::from(mult))).ok_or_else(too_big)?;
    let scale =
        u32::try_from(frac.len()).ok().and_then(|k| 10u128.checked_pow(k)).ok_or_else(|| bad("at most 38 decimals"))?;
    let f = digits(frac).ok_or_else(|| bad("at most 38 decimals"))?;
    let g = gcd(u128::from(mult), scale);
    let (m, p) = (u128::from(mult) / g, scale / g);
    if f % p != 0 {
        return Err(bad("a whole number of bytes"));
    }
    let part = (f / p).checked_mul(m).ok_or_else(too_big)?;
    whole.checked_add(part).and_then(|n| u64::try_from(n).ok()).ok_or_else(too_big)
}

/// Greatest common divisor (Euclid); `gcd(0, b) == b`.
fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Formats a byte count compactly with binary units (`512 KiB`, `1.5 MiB`, `48 B`).
pub fn format_bytes(n: u64) -> String {
    const STEPS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, m) in STEPS {
        if n >= m {
            let v = n as f64 / m as f64;
            return if n.is_multiple_of(m) { format!("{} {u}", n / m) } else { format!("{v:.2} {u}") };
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
        assert_eq!(parse_bytes("1.50MiB").ok(), Some(3 << 19));
        assert_eq!(parse_bytes(".5K").ok(), Some(512));
        assert_eq!(parse_bytes("2.").ok(), Some(2));
        assert_eq!(parse_bytes("2GB").ok(), Some(2_000_000_000));
        assert_eq!(parse_bytes(" 7 b ").ok(), Some(7));
        assert_eq!(parse_bytes("18446744073709551615").ok(), Some(u64::MAX));
        assert_eq!(parse_bytes("17179869183.999999999GiB").ok(), None, "not whole");
        for bad in [
            "",
            " ",
            ".",
            "MiB",
            "12 parsecs",
            "1.3 B",
            "0.1KiB",
            "-4",
            "+4",
            "1e3",
            "1.2.3",
            "4 Ki B",
            "４KiB",
            "4ＫiB",
            "99999999999999999999",
            "18446744073709551616",
            "16GiB0",
            "17179869184GiB",
            "18446744073709551616.0",
            "18446744073709551615.5",
            "0.00000000000000000000000000000000000000001",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} parsed as {:?}", parse_bytes(bad));
        }
    }

    /// 2^64 and beyond are errors, never saturated to 2^64 - 1 (they once were through a float path).
    #[test]
    fn overflow_is_an_error_not_saturation() {
        for s in [
            "18446744073709551616",
            "18446744073709551616.0",
            "1.8446744073709551616e19",
            "17179869184.5GiB",
            "18446744073709552KB",
            "18446744073709551616B",
            "17179869184 GiB",
        ] {
            let e = parse_bytes(s).expect_err(s);
            assert!(matches!(e, Error::Parse { what: "byte size", .. }), "{e:?}");
        }
        assert_eq!(parse_bytes("17179869183.999999940395355224609375GiB").ok(), Some(u64::MAX - 63));
        assert_eq!(parse_bytes("0.999999999068677425384521484375GiB").ok(), Some((1 << 30) - 1));
        assert_eq!(parse_bytes("0.000000000931322574615478515625GiB").ok(), Some(1));
    }

    #[test]
    fn long_input_is_refused_and_shortened_in_the_error() {
        let long = "1".repeat(10_000);
        let Err(Error::Parse { input, .. }) = parse_bytes(&long) else { panic!("a 10 000-digit size parsed") };
        assert!(input.len() < 100, "{input}");
        let long = "é".repeat(100);
        assert!(parse_bytes(&long).is_err());
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

        /// Every u64 round-trips through its decimal text, and every unit multiplies exactly or refuses.
        #[test]
        fn units_multiply_exactly_or_refuse(n in proptest::num::u64::ANY, u in 0usize..UNITS.len()) {
            proptest::prop_assert_eq!(parse_bytes(&n.to_string()).ok(), Some(n));
            let (name, mult) = UNITS[u];
            let got = parse_bytes(&format!("{n}{name}")).ok();
            proptest::prop_assert_eq!(got, n.checked_mul(mult));
        }

        /// Anything at or above 2^64 is refused, however it is written.
        #[test]
        fn rejects_overflow(extra in 0u128..(u128::MAX - (1u128 << 64)), frac in "[0-9]{0,6}") {
            let n = (1u128 << 64) + extra;
            proptest::prop_assert!(parse_bytes(&n.to_string()).is_err());
            let with_frac = format!("{n}.{frac}");
            proptest::prop_assert!(parse_bytes(&with_frac).is_err());
        }

        /// Arbitrary text never panics; whatever parses is a number followed by a known unit.
        #[test]
        fn never_panics(s in "\\PC{0,80}") {
            if let Ok(n) = parse_bytes(&s) {
                proptest::prop_assert!(s.trim().starts_with(|c: char| c.is_ascii_digit() || c == '.'), "{s:?} -> {n}");
            }
        }

        /// Arbitrary digit-and-unit soup never panics either.
        #[test]
        fn never_panics_on_size_like_text(s in "[0-9. ]{0,40}(b|kib|KiB|MiB|GiB|k|m|g|KB|MB|GB|x)?") {
            let _ = parse_bytes(&s);
        }
    }
}
