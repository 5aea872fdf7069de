//! Rendezvous configuration: built in code, or read from the launcher's environment (torchrun, then Slurm), with
//! the job's secret and the bounds every value must respect.

use std::ffi::{OsStr, OsString};
use std::io::Read;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

use anyccl_core::text::sanitize;
use anyccl_core::{Error, InvalidArgument, Result};
use tracing::debug;

pub use crate::auth::JobKey;

/// How long a rank waits, by default, for the group to form and for each collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The largest message one rank may contribute to a collective, by default (1 MiB).
pub const DEFAULT_MAX_MESSAGE: usize = 1 << 20;

/// The largest world size the rendezvous accepts (65,536 ranks).
///
/// The rendezvous is a star: rank 0 holds one TCP connection (one file descriptor) per rank and, in an all-gather,
/// every rank's contribution at once. At 65,536 ranks that is already 65,536 descriptors (far above the usual
/// `ulimit -n`) and, at the default message limit, up to 64 GiB gathered on every rank; a larger job needs a
/// tree-shaped bootstrap, not a bigger star. The cap also bounds rank 0's per-rank table, which is sized by the
/// world size before any rank connects, so a typo like `WORLD_SIZE=1000000000000` is an error instead of an abort.
pub const MAX_WORLD: usize = 1 << 16;

/// The longest timeout accepted (7 days). Every deadline is `now + timeout`; the cap keeps that far from the end
/// of the clock (a timeout of 1e19 seconds would overflow it), and no rendezvous or bootstrap collective usefully
/// waits longer.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// The largest `max_message` accepted (1 GiB): the rendezvous carries small blobs (ids, handles, host names).
pub const MAX_MESSAGE_LIMIT: usize = 1 << 30;

/// The shortest secret accepted in `ANYCCL_RENDEZVOUS_KEY` or a key file (bytes, after trimming white space).
/// Someone who poses as rank 0 sees a proof computed with the key and can test guesses of it offline, so the key
/// must not be guessable; 16 random characters are the least, `openssl rand -hex 32` makes a good one.
pub const MIN_SECRET_LEN: usize = 16;

/// The largest key file read (bytes).
pub const MAX_KEY_FILE_LEN: u64 = 4096;

/// The variable holding the job's secret as text.
pub const KEY_VAR: &str = "ANYCCL_RENDEZVOUS_KEY";

/// The variable naming a file that holds the job's secret.
pub const KEY_FILE_VAR: &str = "ANYCCL_RENDEZVOUS_KEY_FILE";

/// The variable holding the timeout in seconds.
pub const TIMEOUT_VAR: &str = "ANYCCL_RENDEZVOUS_TIMEOUT_SECS";

/// The variable that names the rendezvous's own port. Unset, the rendezvous uses `MASTER_PORT + 1`: under
/// `torchrun` the launcher's agent already listens on `MASTER_PORT` itself (its TCP store, which the workers join),
/// so rank 0 cannot bind it.
pub const PORT_VAR: &str = "ANYCCL_MASTER_PORT";

/// Where a rank finds rank 0, who it is, and the limits it works under.
///
/// Not `#[non_exhaustive]`: callers build one with `RendezvousConfig { .., ..other }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// The number of ranks in the job, `1..=MAX_WORLD`.
    pub world: usize,
    /// The rank on this node (`LOCAL_RANK` / `SLURM_LOCALID`), where the launcher gives it; the rendezvous itself
    /// does not use it (a backend uses it to pick the device).
    pub local_rank: Option<usize>,
    /// Rank 0's address: rank 0 listens on exactly this address, the other ranks connect to it.
    pub master: SocketAddr,
    /// How long to wait for the group to form, and for each collective, before [`Error::Timeout`]; at most
    /// [`MAX_TIMEOUT`].
    pub timeout: Duration,
    /// The largest message (in bytes) one rank may send in one collective, at most [`MAX_MESSAGE_LIMIT`]; larger
    /// frames are rejected before any buffer of the claimed size is allocated.
    pub max_message: usize,
    /// The secret every rank proves it holds (and rank 0 proves to every rank) before any payload moves.
    ///
    /// `None` (what [`RendezvousConfig::new`] gives) means: rank 0 makes a random key when it starts listening,
    /// and the other ranks must take their configuration from
    /// [`Listener::client_config`](crate::Listener::client_config), which carries it. [`RendezvousConfig::from_env`]
    /// always sets one.
    pub key: Option<JobKey>,
}

impl RendezvousConfig {
    /// A configuration with the default timeout and message limit and no key yet: rank 0 makes a random one in
    /// [`Rendezvous::listen`](crate::Rendezvous::listen), and
    /// [`Listener::client_config`](crate::Listener::client_config) hands it to the other ranks (ranks as threads,
    /// tests). Ranks in separate processes need a shared key ([`RendezvousConfig::with_key`], or
    /// [`RendezvousConfig::from_env`]).
    pub fn new(rank: usize, world: usize, master: SocketAddr) -> Self {
        RendezvousConfig {
            rank,
            world,
            local_rank: None,
            master,
            timeout: DEFAULT_TIMEOUT,
            max_message: DEFAULT_MAX_MESSAGE,
            key: None,
        }
    }

    /// The same configuration with another timeout (checked against [`MAX_TIMEOUT`] when the rendezvous starts).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same configuration with another message limit.
    pub fn with_max_message(mut self, max_message: usize) -> Self {
        self.max_message = max_message;
        self
    }

    /// The same configuration with the job key `key` (e.g. `JobKey::from_secret(secret)`).
    pub fn with_key(mut self, key: JobKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Reads the configuration from the process environment; see [`RendezvousConfig::from_env_with`].
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(&|name| std::env::var_os(name))
    }

    /// Reads the configuration through `get` (a variable's value, or `None` where it is unset).
    ///
    /// Values are taken as the operating system gives them: the secret in [`KEY_VAR`] as raw bytes and the path in
    /// [`KEY_FILE_VAR`] as a path, with no conversion (two secrets that differ only in bytes that are not UTF-8 are
    /// two secrets); every other variable must be valid UTF-8, and one that is not is an [`Error::Config`] naming it.
    ///
    /// - rank: `RANK`, else `SLURM_PROCID`; world: `WORLD_SIZE`, else `SLURM_NTASKS` (`1..=`[`MAX_WORLD`]); local
    ///   rank: `LOCAL_RANK`, else `SLURM_LOCALID` (optional);
    /// - `MASTER_ADDR` (host name or IP address, resolved here); the port: [`PORT_VAR`] (`ANYCCL_MASTER_PORT`), else
    ///   `MASTER_PORT + 1`, since `torchrun`'s agent holds `MASTER_PORT` itself;
    /// - `ANYCCL_RENDEZVOUS_TIMEOUT_SECS` (optional, seconds, fractions allowed, at most [`MAX_TIMEOUT`]);
    /// - the job's secret: `ANYCCL_RENDEZVOUS_KEY` (raw bytes) or `ANYCCL_RENDEZVOUS_KEY_FILE` (a regular file of at
    ///   most [`MAX_KEY_FILE_LEN`] bytes that neither group nor others may read or write), at least [`MIN_SECRET_LEN`]
    ///   bytes after trimming white space; not both. With neither, a loopback `MASTER_ADDR` gets this user's
    ///   per-user key ([`JobKey::per_user`] from a private file, see [`crate::userkey`]: every process of this
    ///   user finds it, no other uid can read it), and any other address is an error, since anyone who can reach
    ///   the port could then join the job.
    ///
    /// A variable that is set takes precedence over its fallback even when it is malformed: a missing or malformed
    /// value is an [`Error::Config`] naming the variable. Never panics, whatever the values.
    pub fn from_env_with(get_os: &dyn Fn(&str) -> Option<OsString>) -> Result<Self> {
        // Every text variable is checked once, up front: one that is set but not UTF-8 is an error naming it.
        for &var in TEXT_VARS {
            if get_os(var).is_some_and(|v| v.to_str().is_none()) {
                return Err(config(var, "the value is not valid UTF-8"));
            }
        }
        let get = |name: &str| get_os(name).and_then(|v| v.into_string().ok());
        Self::from_text_env(&get, get_os)
    }

    fn from_text_env(get: &dyn Fn(&str) -> Option<String>, get_os: &dyn Fn(&str) -> Option<OsString>) -> Result<Self> {
        let (world_var, world_text) = first_of(get, &["WORLD_SIZE", "SLURM_NTASKS"])?;
        let world = parse_usize(world_var, &world_text, "a world size (a positive integer)")?;
        if world == 0 {
            return Err(config(world_var, "the world size must be at least 1"));
        }
        if world > MAX_WORLD {
            return Err(config(
                world_var,
                format!("a world of {world} ranks is more than the rendezvous supports (at most {MAX_WORLD})"),
            ));
        }
        let (rank_var, rank_text) = first_of(get, &["RANK", "SLURM_PROCID"])?;
        let rank = parse_usize(rank_var, &rank_text, "a rank (a non-negative integer)")?;
        if rank >= world {
            return Err(config(
                rank_var,
                format!("rank {rank} is out of range for {world_var}={world} (expected 0..={})", world - 1),
            ));
        }
        let local_rank = match first_of(get, &["LOCAL_RANK", "SLURM_LOCALID"]) {
            Ok((var, text)) => Some(parse_usize(var, &text, "a local rank (a non-negative integer)")?),
            Err(_) => None,
        };

        let addr_text = get("MASTER_ADDR")
            .map(|v| v.trim().to_owned())
            .ok_or_else(|| config("MASTER_ADDR", "not set; set it to rank 0's host name or IP address"))?;
        if addr_text.is_empty() {
            return Err(config("MASTER_ADDR", "is empty; set it to rank 0's host name or IP address"));
        }
        let port = rendezvous_port(get)?;
        let timeout = match get(TIMEOUT_VAR) {
            None => DEFAULT_TIMEOUT,
            Some(text) => parse_secs(TIMEOUT_VAR, &text)?,
        };
        let master = resolve(&addr_text, port, timeout, system_lookup)?;
        let key = match (get_os(KEY_VAR), get_os(KEY_FILE_VAR)) {
            (Some(_), Some(_)) => {
                return Err(config(KEY_FILE_VAR, format!("both {KEY_VAR} and {KEY_FILE_VAR} are set; set only one")));
            }
            (Some(secret), None) => {
                let mut secret = os_bytes(KEY_VAR, secret)?;
                let key = check_secret(KEY_VAR, &secret).map(JobKey::from_secret);
                secret.fill(0);
                key?
            }
            (None, Some(path)) => read_key_file(&path)?,
            (None, None) if is_loopback(master.ip()) => loopback_key(get_os, &addr_text, port)?,
            (None, None) => {
                return Err(config(
                    KEY_VAR,
                    format!(
                        "not set, and MASTER_ADDR={} is not a loopback address: anyone who can reach {master} could \
                         join the job and forge its data. Give every rank the same secret: \
                         {KEY_VAR}=$(openssl rand -hex 32), or {KEY_FILE_VAR}=<a file of mode 0600 holding it>",
                        sanitize(&addr_text)
                    ),
                ));
            }
        };

        Ok(RendezvousConfig {
            rank,
            world,
            local_rank,
            master,
            timeout,
            max_message: DEFAULT_MAX_MESSAGE,
            key: Some(key),
        })
    }

    /// Checks the shape (1 ≤ world ≤ [`MAX_WORLD`], rank < world, 0 < timeout ≤ [`MAX_TIMEOUT`],
    /// 1 ≤ max_message ≤ [`MAX_MESSAGE_LIMIT`]).
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidArgument(InvalidArgument::BadWorld(msg)));
        if self.world == 0 {
            return bad("the world size must be at least 1".into());
        }
        if self.world > MAX_WORLD {
            return bad(format!(
                "a world of {} ranks is more than the rendezvous supports (at most {MAX_WORLD})",
                self.world
            ));
        }
        if self.rank >= self.world {
            return bad(format!("rank {} is out of range for a world of {}", self.rank, self.world));
        }
        if self.timeout.is_zero() {
            return bad("the rendezvous timeout must be greater than zero".into());
        }
        if self.timeout > MAX_TIMEOUT {
            return bad(format!(
                "the rendezvous timeout of {:?} is longer than the maximum ({} seconds)",
                self.timeout,
                MAX_TIMEOUT.as_secs()
            ));
        }
        if self.max_message == 0 || self.max_message > MAX_MESSAGE_LIMIT {
            return bad(format!("max_message must be 1..={MAX_MESSAGE_LIMIT} bytes, not {}", self.max_message));
        }
        Ok(())
    }
}

/// The variables read as text (everything but the secret and the key file's path); a value of one of them that is
/// not UTF-8 is an error naming it.
const TEXT_VARS: &[&str] = &[
    "WORLD_SIZE",
    "SLURM_NTASKS",
    "RANK",
    "SLURM_PROCID",
    "LOCAL_RANK",
    "SLURM_LOCALID",
    "MASTER_ADDR",
    "MASTER_PORT",
    PORT_VAR,
    TIMEOUT_VAR,
];

/// The raw bytes of a value, without any conversion (on Unix, where a value is a byte string); elsewhere the value
/// must be valid Unicode.
fn os_bytes(var: &str, value: OsString) -> Result<Vec<u8>> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStringExt;
        let _ = var;
        Ok(value.into_vec())
    }
    #[cfg(not(unix))]
    {
        value.into_string().map(String::into_bytes).map_err(|_| config(var, "the value is not valid Unicode"))
    }
}

/// The key of a loopback job without a configured secret: [`JobKey::per_user`] from this user's private secret
/// ([`crate::userkey`]), which no other uid can read, so no other user can join the job or pose as its rank 0.
#[cfg(target_os = "linux")]
fn loopback_key(get_os: &dyn Fn(&str) -> Option<OsString>, addr_text: &str, port: u16) -> Result<JobKey> {
    let base = crate::userkey::base_dir(get_os).ok_or_else(|| {
        config(
            KEY_VAR,
            format!(
                "not set, and neither XDG_RUNTIME_DIR nor HOME names a directory for the per-user key that keeps \
                 other users out of a loopback job: set one of them, or give every rank the same secret in {KEY_VAR} \
                 or {KEY_FILE_VAR}"
            ),
        )
    })?;
    let mut secret = crate::userkey::load_or_create(&base)?;
    debug!(
        target: "anyccl::rendezvous",
        "{KEY_VAR} is not set: using this user's private key under {} (loopback only)",
        base.display()
    );
    let key = JobKey::per_user(&secret, addr_text, port);
    secret.fill(0);
    Ok(key)
}

/// Without the per-user key file (Linux only), a loopback job needs a secret like any other.
#[cfg(not(target_os = "linux"))]
fn loopback_key(_: &dyn Fn(&str) -> Option<OsString>, _: &str, _: u16) -> Result<JobKey> {
    Err(config(
        KEY_VAR,
        format!("not set: on this platform every job needs a secret; set {KEY_VAR} or {KEY_FILE_VAR} on every rank"),
    ))
}

/// Whether `ip` is a loopback address (including an IPv4-mapped one such as `::ffff:127.0.0.1`).
fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// The secret with white space trimmed, checked to be long enough.
fn check_secret<'a>(var: &str, secret: &'a [u8]) -> Result<&'a [u8]> {
    let secret = secret.trim_ascii();
    if secret.is_empty() {
        return Err(config(
            var,
            "is empty; give every rank the same secret (e.g. the output of `openssl rand -hex 32`)",
        ));
    }
    if secret.len() < MIN_SECRET_LEN {
        return Err(config(
            var,
            format!(
                "the secret is {} bytes long; it must be at least {MIN_SECRET_LEN} (someone posing as rank 0 could \
                 guess a short one): use e.g. the output of `openssl rand -hex 32`",
                secret.len()
            ),
        ));
    }
    Ok(secret)
}

/// Reads the secret from the file `path_text` names: opened without blocking (a FIFO or a device cannot hang the
/// rank), and refused unless it is a regular file of at most [`MAX_KEY_FILE_LEN`] bytes that neither group nor
/// others may read or write (as ssh does with a private key).
fn read_key_file(path_os: &OsStr) -> Result<JobKey> {
    let var = KEY_FILE_VAR;
    let shown = sanitize(&path_os.to_string_lossy());
    if path_os.to_string_lossy().trim().is_empty() {
        return Err(config(var, "is empty; set it to the path of a file holding the job's secret"));
    }
    let path = Path::new(path_os);
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY);
    }
    #[cfg(not(target_os = "linux"))]
    {
        // No non-blocking open here: look first (a FIFO swapped in between is not defended against on these
        // platforms).
        if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
            return Err(config(var, format!("{shown} is not a regular file")));
        }
    }
    let file = opts.open(path).map_err(|e| config(var, format!("cannot open {shown}: {e}")))?;
    let meta = file.metadata().map_err(|e| config(var, format!("cannot inspect {shown}: {e}")))?;
    if !meta.is_file() {
        return Err(config(var, format!("{shown} is not a regular file")));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(config(
                var,
                format!(
                    "{shown} has mode {mode:04o}: group or others may read or change the job's secret; run \
                     `chmod 600 {shown}`"
                ),
            ));
        }
    }
    if meta.len() > MAX_KEY_FILE_LEN {
        return Err(config(
            var,
            format!("{shown} holds {} bytes; a key file holds at most {MAX_KEY_FILE_LEN}", meta.len()),
        ));
    }
    let mut secret = Vec::new();
    file.take(MAX_KEY_FILE_LEN + 1)
        .read_to_end(&mut secret)
        .map_err(|e| config(var, format!("cannot read {shown}: {e}")))?;
    if secret.len() as u64 > MAX_KEY_FILE_LEN {
        return Err(config(var, format!("{shown} grew beyond {MAX_KEY_FILE_LEN} bytes while it was read")));
    }
    let key = check_secret(var, &secret).map(JobKey::from_secret);
    secret.fill(0);
    key
}

/// The rendezvous's port: [`PORT_VAR`] where set, else `MASTER_PORT + 1` (see [`PORT_VAR`] for why not
/// `MASTER_PORT`).
fn rendezvous_port(get: &dyn Fn(&str) -> Option<String>) -> Result<u16> {
    let parse = |var: &str, text: &str| match text.trim().parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(config(var, format!("'{}' is not a TCP port (expected 1..=65535)", sanitize(text)))),
    };
    if let Some(text) = get(PORT_VAR) {
        return parse(PORT_VAR, &text);
    }
    let text = get("MASTER_PORT").ok_or_else(|| {
        config("MASTER_PORT", format!("not set; set it (the rendezvous uses MASTER_PORT + 1), or set {PORT_VAR}"))
    })?;
    parse("MASTER_PORT", &text)?.checked_add(1).ok_or_else(|| {
        config(
            "MASTER_PORT",
            format!("is 65535, so the rendezvous's port MASTER_PORT + 1 does not exist; set {PORT_VAR}"),
        )
    })
}

fn config(var: &str, message: impl Into<String>) -> Error {
    Error::Config { source_name: var.to_owned(), line: None, message: message.into() }
}

/// The first of `vars` that is set, with its value; an error naming all of them when none is.
fn first_of(get: &dyn Fn(&str) -> Option<String>, vars: &[&'static str]) -> Result<(&'static str, String)> {
    for &var in vars {
        if let Some(v) = get(var) {
            return Ok((var, v));
        }
    }
    let fallbacks: Vec<&str> = vars.iter().skip(1).copied().collect();
    let primary = vars.first().copied().unwrap_or("?");
    Err(config(
        primary,
        format!("not set (nor {}); start the job with torchrun or srun, or set it", fallbacks.join(", ")),
    ))
}

fn parse_usize(var: &str, text: &str, expected: &str) -> Result<usize> {
    text.trim().parse::<usize>().map_err(|_| config(var, format!("'{}' is not {expected}", sanitize(text))))
}

fn parse_secs(var: &str, text: &str) -> Result<Duration> {
    let secs = text.trim().parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0);
    match secs.and_then(|s| Duration::try_from_secs_f64(s).ok()).filter(|d| !d.is_zero()) {
        Some(d) if d <= MAX_TIMEOUT => Ok(d),
        Some(_) => Err(config(
            var,
            format!(
                "{} seconds is longer than the maximum of {} seconds (7 days)",
                sanitize(text.trim()),
                MAX_TIMEOUT.as_secs()
            ),
        )),
        None => {
            Err(config(var, format!("'{}' is not a timeout (expected a positive number of seconds)", sanitize(text))))
        }
    }
}

/// How a host name becomes addresses (the system resolver; a stand-in in tests).
type Lookup = fn(&str, u16) -> std::io::Result<Vec<SocketAddr>>;

/// The system resolver.
fn system_lookup(host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    (host, port).to_socket_addrs().map(|addrs| addrs.collect())
}

/// `host` (an IP address, or a host name looked up through `lookup`) with `port`. A lookup runs on a helper thread
/// and is waited for at most `timeout` (the rendezvous timeout): a resolver that never answers is an error naming
/// `MASTER_ADDR`, not a hang. The helper thread of a lookup given up on is left to finish on its own (the system
/// resolver cannot be cancelled); it holds nothing but its own result.
fn resolve(host: &str, port: u16, timeout: Duration, lookup: Lookup) -> Result<SocketAddr> {
    let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>();
    if let Ok(ip) = literal {
        return Ok(SocketAddr::new(ip, port));
    }
    let shown = sanitize(host);
    if !host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')) {
        return Err(config("MASTER_ADDR", format!("'{shown}' is not a host name or IP address")));
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let name = host.to_owned();
    std::thread::Builder::new()
        .name("anyccl-resolve".into())
        .spawn(move || {
            // the receiver may have given up: then nobody needs the answer
            let _ = tx.send(lookup(&name, port));
        })
        .map_err(|e| config("MASTER_ADDR", format!("cannot start resolving '{shown}': {e}")))?;
    let addrs = match rx.recv_timeout(timeout) {
        Ok(result) => result.map_err(|e| config("MASTER_ADDR", format!("cannot resolve '{shown}': {e}")))?,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            return Err(config(
                "MASTER_ADDR",
                format!(
                    "resolving '{shown}' took longer than the rendezvous timeout ({:?}); check the name and the \
                     resolver, or give an IP address",
                    timeout
                ),
            ))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            return Err(config("MASTER_ADDR", format!("resolving '{shown}' failed (the resolver thread ended)")))
        }
    };
    addrs.into_iter().next().ok_or_else(|| config("MASTER_ADDR", format!("'{shown}' resolves to no address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_includes_mapped_addresses() {
        assert!(is_loopback("127.0.0.1".parse().expect("ip")));
        assert!(is_loopback("127.8.9.10".parse().expect("ip")));
        assert!(is_loopback("::1".parse().expect("ip")));
        assert!(is_loopback("::ffff:127.0.0.1".parse().expect("ip")));
        assert!(!is_loopback("0.0.0.0".parse().expect("ip")));
        assert!(!is_loopback("10.0.0.1".parse().expect("ip")));
        assert!(!is_loopback("::".parse().expect("ip")));
    }

    #[test]
    fn secrets_are_trimmed_and_must_be_long_enough() {
        assert_eq!(check_secret("V", b"  0123456789abcdef\n").expect("16 bytes"), b"0123456789abcdef");
        let e = check_secret("V", b"0123456789abcde").expect_err("15 bytes");
        assert!(e.to_string().contains("15 bytes long; it must be at least 16"), "{e}");
        assert!(check_secret("V", b" \n\t").expect_err("blank").to_string().contains("is empty"));
    }

    #[test]
    fn a_resolver_that_never_answers_is_bounded_by_the_timeout() {
        // a lookup that blocks far longer than the test (its thread is left behind, as in real use)
        let started = std::time::Instant::now();
        let stuck: Lookup = |_, _| {
            std::thread::sleep(Duration::from_secs(3600));
            Ok(Vec::new())
        };
        let e = resolve("rank0.example", 1, Duration::from_millis(200), stuck).expect_err("no answer");
        match &e {
            Error::Config { source_name, message, .. } => {
                assert_eq!(source_name, "MASTER_ADDR");
                assert!(message.contains("longer than the rendezvous timeout"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(30), "bounded: {:?}", started.elapsed());
        // an answer in time is used; IP addresses never reach the resolver
        let local: Lookup = |_, port| Ok(vec![SocketAddr::from(([127, 0, 0, 7], port))]);
        assert_eq!(
            resolve("rank0", 9, Duration::from_secs(30), local).expect("resolved"),
            "127.0.0.7:9".parse().expect("addr")
        );
        assert_eq!(
            resolve("::1", 9, Duration::from_millis(1), stuck).expect("literal"),
            "[::1]:9".parse().expect("addr")
        );
        let none: Lookup = |_, _| Ok(Vec::new());
        assert!(resolve("rank0", 9, Duration::from_secs(30), none)
            .expect_err("empty")
            .to_string()
            .contains("no address"));
    }
}
