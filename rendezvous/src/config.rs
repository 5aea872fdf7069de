//! Rendezvous configuration: built in code, or read from the launcher's environment (torchrun, then Slurm).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyccl_core::{Error, InvalidArgument, Result};

/// How long a rank waits, by default, for the group to form and for each collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The largest message one rank may contribute to a collective, by default (1 MiB).
pub const DEFAULT_MAX_MESSAGE: usize = 1 << 20;

/// Where a rank finds rank 0, who it is, and the limits it works under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// This process's rank, `0..world`.
    pub rank: usize,
    /// The number of ranks in the job.
    pub world: usize,
    /// The rank on this node (`LOCAL_RANK` / `SLURM_LOCALID`), where the launcher gives it; the rendezvous itself
    /// does not use it (a backend uses it to pick the device).
    pub local_rank: Option<usize>,
    /// Rank 0's address: rank 0 listens on exactly this address, the other ranks connect to it.
    pub master: SocketAddr,
    /// How long to wait for the group to form, and for each collective, before [`Error::Timeout`].
    pub timeout: Duration,
    /// The largest message (in bytes) one rank may send in one collective; larger frames are rejected before any
    /// buffer of the claimed size is allocated.
    pub max_message: usize,
    /// The job key every rank presents in its handshake; rank 0 rejects a connection with another key, so a rank of
    /// another job (or a stale process) reusing the port cannot join.
    pub key: u64,
}

impl RendezvousConfig {
    /// A configuration with the default timeout and message limit, and a key derived from `master` and `world`.
    pub fn new(rank: usize, world: usize, master: SocketAddr) -> Self {
        RendezvousConfig {
            rank,
            world,
            local_rank: None,
            master,
            timeout: DEFAULT_TIMEOUT,
            max_message: DEFAULT_MAX_MESSAGE,
            key: derive_key(&master.ip().to_string(), master.port(), world),
        }
    }

    /// The same configuration with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The same configuration with another message limit.
    pub fn with_max_message(mut self, max_message: usize) -> Self {
        self.max_message = max_message;
        self
    }

    /// The same configuration with another job key.
    pub fn with_key(mut self, key: u64) -> Self {
        self.key = key;
        self
    }

    /// Reads the configuration from the process environment; see [`RendezvousConfig::from_env_with`].
    pub fn from_env() -> Result<Self> {
        Self::from_env_with(&|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads the configuration through `get` (a variable's value, or `None` where it is unset).
    ///
    /// - rank: `RANK`, else `SLURM_PROCID`; world: `WORLD_SIZE`, else `SLURM_NTASKS`; local rank: `LOCAL_RANK`, else
    ///   `SLURM_LOCALID` (optional);
    /// - `MASTER_ADDR` (host name or IP address, resolved here) and `MASTER_PORT` (required);
    /// - `ANYCCL_RENDEZVOUS_TIMEOUT_SECS` (optional, seconds, fractions allowed);
    /// - `ANYCCL_RENDEZVOUS_KEY` (optional, any text; its hash is the job key), else a key derived from
    ///   `MASTER_ADDR`, `MASTER_PORT` and the world size.
    ///
    /// A variable that is set takes precedence over its fallback even when it is malformed: a missing or malformed
    /// value is an [`Error::Config`] naming the variable.
    pub fn from_env_with(get: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let (world_var, world_text) = first_of(get, &["WORLD_SIZE", "SLURM_NTASKS"])?;
        let world = parse_usize(world_var, &world_text, "a world size (a positive integer)")?;
        if world == 0 {
            return Err(config(world_var, "the world size must be at least 1"));
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
        let port_text =
            get("MASTER_PORT").ok_or_else(|| config("MASTER_PORT", "not set; set it to a free TCP port"))?;
        let port = match port_text.trim().parse::<u16>() {
            Ok(p) if p != 0 => p,
            _ => {
                return Err(config("MASTER_PORT", format!("'{port_text}' is not a TCP port (expected 1..=65535)")));
            }
        };
        let master = resolve(&addr_text, port)?;

        let timeout = match get("ANYCCL_RENDEZVOUS_TIMEOUT_SECS") {
            None => DEFAULT_TIMEOUT,
            Some(text) => parse_secs("ANYCCL_RENDEZVOUS_TIMEOUT_SECS", &text)?,
        };
        let key = match get("ANYCCL_RENDEZVOUS_KEY") {
            None => derive_key(&addr_text, port, world),
            Some(text) if text.trim().is_empty() => {
                return Err(config("ANYCCL_RENDEZVOUS_KEY", "is empty; unset it or give any non-empty text"));
            }
            Some(text) => fnv1a(text.trim().as_bytes()),
        };

        Ok(RendezvousConfig { rank, world, local_rank, master, timeout, max_message: DEFAULT_MAX_MESSAGE, key })
    }

    /// Checks the shape (world ≥ 1, rank < world, a non-zero timeout and message limit).
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidArgument(InvalidArgument::BadWorld(msg)));
        if self.world == 0 {
            return bad("the world size must be at least 1".into());
        }
        if self.rank >= self.world {
            return bad(format!("rank {} is out of range for a world of {}", self.rank, self.world));
        }
        if self.timeout.is_zero() {
            return bad("the rendezvous timeout must be greater than zero".into());
        }
        if self.max_message == 0 {
            return bad("max_message must be at least 1 byte".into());
        }
        Ok(())
    }
}

/// The job key used when `ANYCCL_RENDEZVOUS_KEY` is unset: a hash of the master address text, port and world size.
pub fn derive_key(master_addr: &str, port: u16, world: usize) -> u64 {
    fnv1a(format!("anyccl-rendezvous\0{master_addr}\0{port}\0{world}").as_bytes())
}

/// 64-bit FNV-1a: stable across builds and platforms, unlike `std`'s hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
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
    text.trim().parse::<usize>().map_err(|_| config(var, format!("'{text}' is not {expected}")))
}

fn parse_secs(var: &str, text: &str) -> Result<Duration> {
    let secs = text.trim().parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0);
    secs.and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| config(var, format!("'{text}' is not a timeout (expected a positive number of seconds)")))
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let literal = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>();
    if let Ok(ip) = literal {
        return Ok(SocketAddr::new(ip, port));
    }
    if !host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')) {
        return Err(config("MASTER_ADDR", format!("'{host}' is not a host name or IP address")));
    }
    let mut addrs =
        (host, port).to_socket_addrs().map_err(|e| config("MASTER_ADDR", format!("cannot resolve '{host}': {e}")))?;
    addrs.next().ok_or_else(|| config("MASTER_ADDR", format!("'{host}' resolves to no address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn derived_key_depends_on_every_input() {
        let k = derive_key("10.0.0.1", 29500, 8);
        assert_ne!(k, derive_key("10.0.0.2", 29500, 8));
        assert_ne!(k, derive_key("10.0.0.1", 29501, 8));
        assert_ne!(k, derive_key("10.0.0.1", 29500, 4));
        assert_eq!(k, derive_key("10.0.0.1", 29500, 8));
    }
}
