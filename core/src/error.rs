//! Error types shared by every anyccl crate.

use std::time::Duration;

use crate::algo::Algorithm;
use crate::caps::Reason;
use crate::dtype::{DataType, ReduceOp};
use crate::runtime::Location;

/// Result with anyccl's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error anyccl returns.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The caller passed something invalid; nothing was sent and no buffer was touched.
    #[error("invalid argument: {0}")]
    InvalidArgument(#[from] InvalidArgument),

    /// A capability the call needs is disabled here; `reason` says why.
    #[error("{capability} is not available: {reason}")]
    Unsupported {
        /// The capability's name (as in `anyccl probe`).
        capability: String,
        /// Why it is disabled.
        reason: Reason,
    },

    /// An algorithm was asked for (forced or explicitly) that cannot run this call.
    #[error("all-reduce algorithm '{algorithm}' cannot run this call: {why}")]
    AlgorithmNotEligible {
        /// The algorithm asked for.
        algorithm: Algorithm,
        /// Why it is not eligible.
        why: String,
    },

    /// No all-reduce algorithm of this backend can run the call.
    #[error("no all-reduce algorithm can run this call: {why}")]
    NoEligibleAlgorithm {
        /// The reasons, one per algorithm.
        why: String,
    },

    /// A vendor library or runtime call failed; `message` is the vendor's own text.
    #[error("{backend}: {call} failed{}: {message}", code.map(|c| format!(" with code {c}")).unwrap_or_default())]
    Backend {
        /// The backend or library (`"nccl"`, `"cuda"`, `"host"`, …).
        backend: String,
        /// The call that failed.
        call: String,
        /// The vendor's status code, where it has one.
        code: Option<i64>,
        /// The vendor's error string (and last-error text where available).
        message: String,
    },

    /// A configuration input (table file, environment variable) is malformed.
    #[error("{source_name}{}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Config {
        /// The file path or variable name.
        source_name: String,
        /// The 1-based line the problem is on, where known.
        line: Option<usize>,
        /// What is wrong, and what was expected.
        message: String,
    },

    /// A value on the command line or in the environment could not be parsed.
    #[error("cannot parse '{input}' as {} {what} (expected {expected})", article(what))]
    Parse {
        /// What was being parsed.
        what: &'static str,
        /// The text given.
        input: String,
        /// What is accepted.
        expected: String,
    },

    /// Memory for a buffer whose size came from the caller could not be reserved; nothing was changed.
    #[error("out of memory: cannot allocate {} for {what}", crate::units::format_bytes(*bytes))]
    OutOfMemory {
        /// What the memory was for (`"the host backend's staging buffer"`).
        what: String,
        /// How many bytes were asked for.
        bytes: u64,
    },

    /// Another rank of the communicator failed or left; this rank cannot complete the collective.
    #[error("peer failure: {0}")]
    PeerFailure(String),

    /// A wait exceeded its limit.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The limit.
        after: Duration,
    },
}

impl Error {
    /// A failed vendor library or runtime call ([`Error::Backend`]): `backend` names the backend or library
    /// (`"cuda"`, `"nccl"`), `call` the call, `code` the vendor's status where it has one, `message` its text.
    pub fn backend(
        backend: impl Into<String>,
        call: impl Into<String>,
        code: Option<i64>,
        message: impl Into<String>,
    ) -> Error {
        Error::Backend { backend: backend.into(), call: call.into(), code, message: message.into() }
    }

    /// A hint for the user, where one helps (printed by the CLI below the error).
    ///
    /// A [`Error::Config`] hint follows its source: an environment variable gets a hint naming that variable (and
    /// what it accepts, for the ones anyccl reads); a file or anything else gets none here, because only the caller
    /// knows how it was named (the CLI adds "unset ANYCCL_TUNE_FILE" or "fix --table" itself).
    pub fn hint(&self) -> Option<String> {
        match self {
            Error::Config { source_name, .. } => config_hint(source_name),
            Error::AlgorithmNotEligible { .. } => Some(
                "unset ANYCCL_ALLREDUCE_ALGO or choose an algorithm that `anyccl probe` lists as eligible".to_owned(),
            ),
            Error::Unsupported { .. } => Some("`anyccl probe` shows every capability and why it is off".to_owned()),
            _ => None,
        }
    }
}

/// `"an"` before a vowel sound we produce (`an all-reduce algorithm`, `an element type`), else `"a"`.
fn article(what: &str) -> &'static str {
    if what.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    }
}

/// Whether `s` looks like an environment variable name (`ANYCCL_TUNE_FILE`, `WORLD_SIZE`, `RANK`).
fn is_env_var_name(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_uppercase())
        && s.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

/// The hint of a configuration error from `source_name` (see [`Error::hint`]).
fn config_hint(source_name: &str) -> Option<String> {
    match source_name {
        crate::selector::ENV_FORCE_ALGO => {
            Some(format!("set {source_name} to `auto` or one of {}, or unset it", crate::algo::Algorithm::all_names()))
        }
        crate::selector::ENV_TABLE_FILE => {
            Some(format!("point {source_name} at a readable table file (docs/configuration.md), or unset it"))
        }
        "ANYCCL_DISABLE" => Some(format!(
            "fix or unset {source_name}; it takes a comma-separated list of the capability names `anyccl probe` shows"
        )),
        "ANYCCL_LOG" => Some(format!("fix or unset {source_name}; it takes a tracing filter such as `info`")),
        s if is_env_var_name(s) => Some(format!("fix or unset {s}; docs/configuration.md lists the values it accepts")),
        _ => None,
    }
}

/// The classes of bad input, each its own variant so callers (and tests) can match on them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidArgument {
    /// A buffer is shorter than the call needs.
    #[error("{which} buffer holds {have} bytes, but {count} × {dtype} needs {need}")]
    BufferTooSmall {
        /// Which buffer: `"send"`, `"recv"`, `"in-place"` (one buffer for input and output), or the role a call
        /// names (`"upload"`, `"input"`, …).
        which: &'static str,
        /// Bytes available.
        have: usize,
        /// Bytes needed.
        need: usize,
        /// Element count of the call.
        count: usize,
        /// Element type of the call.
        dtype: DataType,
    },

    /// A view asked for bytes outside its buffer (or a range that ends before it starts).
    #[error("view range {start}..{end} lies outside the {len}-byte buffer")]
    RangeOutOfBounds {
        /// First byte asked for.
        start: usize,
        /// One past the last byte asked for (saturated at `usize::MAX` for an inclusive end that overflows).
        end: usize,
        /// Length of the buffer in bytes.
        len: usize,
    },

    /// The element count times the element size (times the world size, where it applies) overflows.
    #[error("element count {count} × {dtype} (× world {world}) overflows the address space")]
    CountOverflow {
        /// Element count of the call.
        count: usize,
        /// Element type.
        dtype: DataType,
        /// World size factor applied.
        world: usize,
    },

    /// A buffer's address is not a multiple of the element size.
    #[error("{which} buffer at {addr:#x} is not aligned to {align} bytes, as {dtype} requires")]
    Misaligned {
        /// Which buffer.
        which: &'static str,
        /// Its address.
        addr: usize,
        /// Alignment required.
        align: usize,
        /// Element type.
        dtype: DataType,
    },

    /// A buffer lives on another device (or on the host when device memory is required).
    #[error("{which} buffer lives on {found}, but this communicator works on {expected}")]
    WrongDevice {
        /// Which buffer.
        which: &'static str,
        /// Where it is.
        found: Location,
        /// Where it must be.
        expected: Location,
    },

    /// A buffer or stream of one backend was given to a communicator of another (the type-erased communicator
    /// of the `anyccl` facade checks this before the call).
    #[error("{which} belongs to the {found} backend, but this communicator is {expected}")]
    WrongBackend {
        /// Which argument (`"send buffer"`, `"stream"`, …).
        which: &'static str,
        /// The backend it belongs to.
        found: &'static str,
        /// This communicator's backend.
        expected: &'static str,
    },

    /// The operator is not defined on the element type.
    #[error("{op} is not supported on {dtype}: {why}")]
    UnsupportedReduction {
        /// Element type.
        dtype: DataType,
        /// Operator.
        op: ReduceOp,
        /// Why not.
        why: String,
    },

    /// The element type is not supported by a backend or the library under it (for example a type added to
    /// anyccl-core after the backend crate was released).
    #[error("{dtype} is not supported by the {backend} backend: {why}")]
    UnsupportedDataType {
        /// Element type.
        dtype: DataType,
        /// The backend (`"host"`, `"nccl"`, …).
        backend: String,
        /// Why not, naming the library or crate version where it helps.
        why: String,
    },

    /// A root or peer rank outside `0..world`.
    #[error("{what} rank {rank} is out of range for a communicator of {world} ranks")]
    RankOutOfRange {
        /// `"root"` or `"peer"`.
        what: &'static str,
        /// The rank given.
        rank: usize,
        /// The world size.
        world: usize,
    },

    /// A point-to-point call named the calling rank itself as its peer.
    #[error("rank {rank} cannot send to or receive from itself")]
    SelfPeer {
        /// The rank.
        rank: usize,
    },

    /// Separate send and receive buffers overlap; only the exact in-place layout may alias.
    #[error(
        "send [{send_addr:#x}, +{send_len}) and recv [{recv_addr:#x}, +{recv_len}) overlap; \
         pass the in-place form instead ({layout})"
    )]
    Overlap {
        /// Send buffer address.
        send_addr: usize,
        /// Send buffer length in bytes.
        send_len: usize,
        /// Receive buffer address.
        recv_addr: usize,
        /// Receive buffer length in bytes.
        recv_len: usize,
        /// The in-place layout this collective allows.
        layout: &'static str,
    },

    /// A world size or rank that cannot form a communicator.
    #[error("invalid communicator shape: {0}")]
    BadWorld(String),

    /// A size asked of an allocator is larger than it can be asked for (rounding it up would overflow, or it
    /// exceeds the limit of the call).
    #[error("{what} of {requested} bytes is too large (at most {limit} bytes)")]
    SizeTooLarge {
        /// What was to be allocated.
        what: &'static str,
        /// The size asked for.
        requested: u64,
        /// The largest size accepted.
        limit: u64,
    },

    /// A numeric option (a capacity, a limit) lies outside the range it accepts.
    #[error("{what} is {value}, outside the accepted {min}..={max}")]
    OutOfRange {
        /// The option, as the caller names it (`HostOptions::shm_capacity`).
        what: &'static str,
        /// The value given.
        value: u64,
        /// The smallest value accepted.
        min: u64,
        /// The largest value accepted.
        max: u64,
    },

    /// A call that is not capture-safe (it allocates, frees, registers, copies synchronously or waits) was made
    /// while a stream is being captured into a CUDA or HIP graph. It was refused before the vendor runtime saw it,
    /// so the capture is still valid and nothing changed ([`crate::capture`]).
    #[error(
        "{what} is not allowed while a stream is being captured into a graph (it would invalidate the capture); \
         call it before the capture begins or after it ends"
    )]
    DuringCapture {
        /// The call refused (`"MemoryRuntime::alloc (cuMemAlloc)"`, `"Communicator::wait"`, …).
        what: &'static str,
    },

    /// One operation of a grouped point-to-point call ([`crate::Communicator::p2p`]) is invalid; `error` says
    /// how. Nothing of the group was sent or received.
    #[error("point-to-point operation {index} of the group: {error}")]
    GroupOp {
        /// The operation's index in the group (0-based).
        index: usize,
        /// What is wrong with it.
        error: Box<InvalidArgument>,
    },

    /// Two operations of a grouped point-to-point call touch the same bytes, and at least one of them receives.
    #[error(
        "point-to-point operations {first} ({first_kind}, [{first_addr:#x}, +{first_len})) and {second} \
         ({second_kind}, [{second_addr:#x}, +{second_len})) of the group overlap; a receive buffer may overlap \
         neither another receive buffer nor a send buffer"
    )]
    GroupOverlap {
        /// Index of the first operation.
        first: usize,
        /// `"send"` or `"recv"`.
        first_kind: &'static str,
        /// Its start address.
        first_addr: usize,
        /// The bytes it touches.
        first_len: usize,
        /// Index of the second operation.
        second: usize,
        /// `"send"` or `"recv"`.
        second_kind: &'static str,
        /// Its start address.
        second_addr: usize,
        /// The bytes it touches.
        second_len: usize,
    },

    /// A parameter of a call has a value the call does not accept (a non-finite `eps`, a row length that is not a
    /// multiple of 8, a zero fp8 scale).
    #[error("{what} is {value}, but it must be {expected}")]
    InvalidValue {
        /// The parameter, as the caller names it (`RmsNormSpec::eps`).
        what: &'static str,
        /// The value given, as text.
        value: String,
        /// What it must be.
        expected: &'static str,
    },

    /// A point-to-point message did not match what the receiver posted.
    #[error("message from rank {peer} holds {got} bytes, but the receive expected {expected}")]
    MessageMismatch {
        /// The sender.
        peer: usize,
        /// Bytes sent.
        got: usize,
        /// Bytes expected.
        expected: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(source: &str) -> Error {
        Error::Config { source_name: source.to_owned(), line: None, message: "bad".to_owned() }
    }

    /// Each configuration error's hint is about its own source: never "unset ANYCCL_TUNE_FILE" for another one.
    #[test]
    fn config_hints_follow_their_source() {
        let hint = |s: &str| config(s).hint();
        for var in ["ANYCCL_ALLREDUCE_ALGO", "ANYCCL_DISABLE", "ANYCCL_LOG", "WORLD_SIZE", "ANYCCL_RENDEZVOUS_TIMEOUT"]
        {
            let h = hint(var).unwrap_or_default();
            assert!(h.contains(var), "{var}: {h}");
            assert!(!h.contains("ANYCCL_TUNE_FILE"), "{var}: {h}");
        }
        assert!(hint("ANYCCL_ALLREDUCE_ALGO").is_some_and(|h| h.contains("one-shot") && h.contains("auto")));
        assert!(hint("ANYCCL_TUNE_FILE").is_some_and(|h| h.contains("ANYCCL_TUNE_FILE")));
        // Files and other sources: the caller knows how they were named, so the library adds nothing misleading.
        for other in ["/etc/anyccl.toml", "tune.toml", "multicast object size", "tuned table", ""] {
            assert_eq!(hint(other), None, "{other}");
        }
    }

    #[test]
    fn parse_errors_read_naturally() {
        let e = Error::Parse { what: "all-reduce algorithm", input: "x".into(), expected: "y".into() };
        assert_eq!(e.to_string(), "cannot parse 'x' as an all-reduce algorithm (expected y)");
        let e = Error::Parse { what: "byte size", input: "x".into(), expected: "y".into() };
        assert_eq!(e.to_string(), "cannot parse 'x' as a byte size (expected y)");
    }

    #[test]
    fn the_backend_constructor_fills_every_field() {
        let e = Error::backend("cuda", "cuMemAlloc", Some(2), format!("out of {}", "memory"));
        let want = Error::Backend {
            backend: "cuda".into(),
            call: "cuMemAlloc".into(),
            code: Some(2),
            message: "out of memory".into(),
        };
        assert_eq!(e, want);
        assert_eq!(e.to_string(), "cuda: cuMemAlloc failed with code 2: out of memory");
        assert_eq!(Error::backend("host", "collective", None, "x").to_string(), "host: collective failed: x");
    }
}
