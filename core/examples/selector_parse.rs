//! Times [`SelectorTable::parse`] on generated partitions of 1 000 to 100 000 rules, to show it grows
//! near-linearly (it was O(n²): 16 000 rules took 19 s). Three shapes:
//! - `tune`: what `anyccl tune` writes (vendor, arch, world, dtype, one byte range per rule);
//! - `open`: every byte range open (`"0-"`), rules kept apart by world only, so all are active at once;
//! - `archs`: 1 000 archs, and half the rules of any arch, apart by world.
//!
//! `cargo run --release -p anyccl-core --example selector_parse`

use std::fmt::Write;
use std::time::Instant;

use anyccl_core::SelectorTable;

fn table(shape: &str, n: usize) -> String {
    let mut t = String::from("version = 1\n");
    for i in 0..n {
        let _ = match shape {
            "tune" => writeln!(
                t,
                "[[rule]]\nvendor = \"nvidia\"\narch = \"{}\"\nworld = {}\ndtype = [\"{}\"]\nbytes = \"{}-{}\"\n\
                 algorithms = [\"one-shot\", \"ccl\"]",
                ["sm_90", "sm_80", "gfx942"][i % 3],
                2 + i % 7,
                ["bf16", "f16", "f32"][i % 5 % 3],
                16 * i,
                16 * (i + 1)
            ),
            "open" => writeln!(t, "[[rule]]\nworld = {}\nbytes = \"0-\"\nalgorithms = [\"ccl\"]", i + 1),
            _ => {
                if i % 2 == 0 {
                    writeln!(t, "[[rule]]\nworld = {}\nbytes = \"0-\"\nalgorithms = [\"ccl\"]", i + 1)
                } else {
                    writeln!(t, "[[rule]]\narch = \"a{}\"\nworld = {}\nalgorithms = [\"ring\"]", i % 1000, i + 1)
                }
            }
        };
    }
    t
}

fn main() {
    println!("{:>6} {:>8} {:>8} {:>10} {:>12}", "shape", "rules", "MiB", "parse ms", "ns per rule");
    for shape in ["tune", "open", "archs"] {
        for n in [1_000, 10_000, 100_000] {
            let text = table(shape, n);
            let t0 = Instant::now();
            let parsed = SelectorTable::parse(&text, "gen.toml");
            let dt = t0.elapsed();
            match parsed {
                Ok(t) => assert_eq!(t.rules.len(), n, "every generated rule parses"),
                Err(e) => panic!("{shape} {n}: {e}"),
            }
            println!(
                "{shape:>6} {n:>8} {:>8.2} {:>10.1} {:>12.0}",
                text.len() as f64 / (1 << 20) as f64,
                dt.as_secs_f64() * 1e3,
                dt.as_secs_f64() * 1e9 / n as f64
            );
        }
    }
}
