//! Property tests for every parser of user input the command uses: byte sizes (`--sizes`, table `bytes`), element
//! types (`--dtype`, table `dtype`), operators (`--op`), algorithms (`--algos`, `ANYCCL_ALLREDUCE_ALGO`, table
//! `algorithms`), vendors (table `vendor`) and whole selector tables. Each must never panic on arbitrary text,
//! accept what it prints, and refuse what does not fit.

use anyccl::core::units::{format_bytes, parse_bytes};
use anyccl::core::{Algorithm, DataType, ReduceOp, SelectorTable, Vendor};
use anyccl::Error;
use proptest::prelude::*;

/// Names of each kind, as the parsers print them.
fn names() -> Vec<String> {
    let mut v: Vec<String> = DataType::ALL.iter().map(|d| d.name().to_owned()).collect();
    v.extend(ReduceOp::ALL.iter().map(|o| o.name().to_owned()));
    v.extend(Algorithm::ALL.iter().map(|a| a.name().to_owned()));
    v.extend(["host", "nvidia", "amd"].map(str::to_owned));
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Arbitrary Unicode never panics any name parser, and every error is a `Parse` error quoting the input.
    #[test]
    fn name_parsers_never_panic(s in "\\PC{0,40}") {
        for r in [
            s.parse::<DataType>().map(|_| ()),
            s.parse::<ReduceOp>().map(|_| ()),
            s.parse::<Algorithm>().map(|_| ()),
            s.parse::<Vendor>().map(|_| ()),
        ] {
            if let Err(e) = r {
                let Error::Parse { input, .. } = &e else { return Err(TestCaseError::fail(format!("{e:?}"))) };
                prop_assert_eq!(input, &s);
            }
        }
    }

    /// Every printed name parses back to itself, whatever the case and surrounding spaces.
    #[test]
    fn names_round_trip(upper in any::<bool>(), pad in " {0,3}") {
        let case = |n: &str| if upper { n.to_ascii_uppercase() } else { n.to_owned() };
        for d in DataType::ALL {
            let text = format!("{pad}{}{pad}", case(d.name()));
            prop_assert_eq!(text.parse::<DataType>().ok(), Some(d));
        }
        for o in ReduceOp::ALL {
            prop_assert_eq!(case(o.name()).parse::<ReduceOp>().ok(), Some(o));
        }
        for a in Algorithm::ALL {
            let text = format!("{pad}{}", case(a.name()));
            prop_assert_eq!(text.parse::<Algorithm>().ok(), Some(a));
        }
    }

    /// A name with anything appended is refused by its own parser (no prefix matching).
    #[test]
    fn names_with_junk_are_refused(junk in "[a-z0-9!é]{1,4}") {
        for a in Algorithm::ALL {
            let text = format!("{}{junk}", a.name());
            prop_assert!(text.parse::<Algorithm>().is_err(), "{}", text);
        }
        for o in ReduceOp::ALL {
            let text = format!("{}{junk}", o.name());
            prop_assert!(text.parse::<ReduceOp>().is_err(), "{}", text);
        }
    }

    /// Byte sizes: arbitrary text never panics; exact sizes round-trip through their printed form; the unit
    /// arithmetic is exact and 2^64 bytes or more is always refused.
    #[test]
    fn byte_sizes(s in "\\PC{0,70}", n in any::<u64>(), unit in 0usize..4) {
        let _ = parse_bytes(&s);
        prop_assert_eq!(parse_bytes(&n.to_string()).ok(), Some(n));
        let printed = format_bytes(n);
        if !printed.contains('.') {
            prop_assert_eq!(parse_bytes(&printed).ok(), Some(n));
        }
        let (name, shift) = [("KiB", 10u32), ("MiB", 20), ("GiB", 30), ("B", 0)][unit];
        let scaled = u128::from(n) << shift;
        let text = format!("{n}{name}");
        let got = parse_bytes(&text).ok();
        prop_assert_eq!(got, u64::try_from(scaled).ok());
    }

    /// Selector tables: arbitrary text, TOML-shaped or not, never panics the parser, and any error is a
    /// `Config` error naming the file.
    #[test]
    fn tables_never_panic(text in "(\\[\\[rule\\]\\]\\n|[a-z]{1,10} = (\"[^\"\\n]{0,12}\"|-?[0-9]{1,22}|\\[\"[a-z0-9-]{0,10}\"\\])\\n|\\PC{0,8}\\n){0,10}") {
        match SelectorTable::parse(&text, "prop.toml") {
            Ok(t) => prop_assert!(t.rules.iter().all(|r| !r.algorithms.is_empty())),
            Err(Error::Config { source_name, .. }) => prop_assert_eq!(source_name, "prop.toml"),
            Err(e) => prop_assert!(false, "unexpected error {:?}", e),
        }
    }
}

#[test]
fn every_kind_has_names() {
    // The strategies above draw from these; make sure none is empty.
    assert!(names().len() >= 12 + 5 + 8 + 3);
}
