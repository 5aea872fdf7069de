//! `ANYCCL_LOG`: a log subscriber installed once, at the first call, only when the variable is set.
//!
//! The drop-in's `tracing` is its own copy (a `cdylib` carries its dependencies), so a Rust host's subscriber
//! never sees these events and ours never sees the host's; the subscriber installed here is global only to the
//! drop-in's copy. When the crate is linked as an `rlib` into a Rust program that already set a global subscriber,
//! nothing is installed (`try_init` refuses and the host's stays). With `ANYCCL_LOG` unset or empty nothing is
//! installed at all and the process's stderr is never written. Write errors on stderr are ignored (`eprintln!`
//! would panic on some). An invalid value gives one warning line on stderr
//! and logging at `warn`; nothing here can fail the call that triggered it.

use std::io::{IsTerminal, Write};

/// The variable read.
pub const VAR: &str = "ANYCCL_LOG";

/// Installs the subscriber if `ANYCCL_LOG` asks for one and none is set; called once, at the first `nccl.h` call
/// (never in `anyccl probe`, which has its own).
pub fn init() {
    use tracing_subscriber::EnvFilter;
    const FALLBACK: &str = "warn";
    if tracing::dispatcher::has_been_set() {
        return;
    }
    let filter = match std::env::var(VAR) {
        Ok(v) if v.trim().is_empty() => return,
        Ok(v) => match EnvFilter::builder().parse(&v) {
            Ok(f) => f,
            Err(e) => {
                let shown: String = v.chars().take(80).flat_map(char::escape_debug).collect();
                let _ = writeln!(
                    std::io::stderr(),
                    "warning: anyccl drop-in NCCL: {VAR}=\"{shown}\" is not a valid log filter ({}); logging at \
                     {FALLBACK}",
                    e.to_string().replace(['\n', '\r'], " ")
                );
                EnvFilter::new(FALLBACK)
            }
        },
        Err(std::env::VarError::NotPresent) => return,
        Err(std::env::VarError::NotUnicode(_)) => {
            let _ =
                writeln!(std::io::stderr(), "warning: anyccl drop-in NCCL: {VAR} is not UTF-8; logging at {FALLBACK}");
            EnvFilter::new(FALLBACK)
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}
