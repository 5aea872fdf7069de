//! The agreement round at communicator creation: before a communicator created through the drop-in may set the
//! custom kernels up lazily (collectively, at the first call its selector puts on them), its ranks check that
//! they would all reach that decision at the same call.
//!
//! That decision reads rank-local things: `ANYCCL_DISABLE`, `ANYCCL_CUSTOM_MAX_BYTES`, `ANYCCL_CUSTOM_MAX_BLOCKS`,
//! `ANYCCL_TUNE_FILE` (the table it holds), `ANYCCL_ALLREDUCE_ALGO`, `ANYCCL_DETERMINISTIC`, the device's
//! architecture and anyccl's kernels for it. Each rank condenses them into a fixed-size [`Fingerprint`] (one 8-byte value per setting: the
//! effective value where it is a number, else the first 8 bytes of a SHA-256 of what was read, so nothing of a
//! value travels but its digest), and one `ncclAllGather` of [`FINGERPRINT_BYTES`] per rank over the new
//! communicator itself exchanges them. Every rank takes part, also one where anyccl is off locally (its
//! fingerprint says "off" and why, as a code). If every rank is on with equal fingerprints, the communicator sets
//! up lazily; otherwise every rank marks it off, with a reason naming the settings that differ and between which
//! ranks (bounded: setting names and rank numbers, no values), and forwards for good.
//!
//! The round needs a device buffer on every rank, so a rank takes part through its device runtime (the same one
//! the kernels would use). What it cannot fix, because a rank then has no device memory to send from:
//!
//! - a rank whose runtime cannot be used ([`DropinPlatform::usable`] fails, or the communicator's device cannot
//!   be opened) while its peers' can: it skips the round, and its peers wait in theirs until its next collective
//!   on the communicator is paired with their all-gather. (If no rank can use its runtime, none runs the round.)
//! - a rank whose two small allocations, or its stream, fail (out of memory; another thread capturing in global
//!   mode, where NCCL's own init could not have allocated either): the same.
//!
//! The library's `ncclMemAlloc` would give such a rank device memory, but nothing to write its fingerprint into it
//! or to wait for the all-gather with, and an unwritten buffer could hold a stale fingerprint of an earlier round;
//! a sound variant needs a nonce per communicator (a digest of the unique id; for splits, the parent's and a
//! counter) or a reduction in which such a rank contributes exactly zero (`ncclRedOpCreatePreMulSum` with a host
//! scalar 0 over per-bit counts), neither of which the test fakes compute.
//!
//! Every other failure after the allocations still reaches the all-gather, so no peer is left waiting.

use std::borrow::{Borrow, BorrowMut};
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use anyccl_ccl::{CclLibrary, CclStream, DeviceAddress};
use anyccl_core::{Capabilities, DataType, Error, MemoryRuntime, Selector};
use anyccl_gpu::GpuRuntime;
use anyccl_gpu::StreamOf;
use sha2::{Digest, Sha256};

use crate::accel::DropinPlatform;
use crate::api::{self, Comm};

/// The bytes each rank contributes: fixed, so the round is one `ncclAllGather` of this many bytes per rank.
pub const FINGERPRINT_BYTES: usize = 16 + 8 * FIELDS.len();

/// The first bytes of a fingerprint (its format's version in the last byte).
const MAGIC: [u8; 8] = *b"anyccl\x00\x02";

/// What each 8-byte field condenses, by the name the reason uses.
pub const FIELDS: [&str; 7] = [
    "ANYCCL_DISABLE",
    "ANYCCL_CUSTOM_MAX_BYTES",
    "ANYCCL_CUSTOM_MAX_BLOCKS",
    "ANYCCL_TUNE_FILE",
    "ANYCCL_ALLREDUCE_ALGO",
    "ANYCCL_DETERMINISTIC",
    "the device architecture (or anyccl's kernels for it)",
];

/// Why a rank is off locally, as one byte of its fingerprint (0: on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OffCode {
    /// `ANYCCL_DISABLE` turns the custom kernels (or IPC) off, or cannot be read.
    Disabled = 1,
    /// The kernels are not available for this device or world (not built, unknown architecture).
    Kernels = 2,
    /// A setting cannot be used (`ANYCCL_CUSTOM_MAX_BYTES`, `ANYCCL_TUNE_FILE`, `ANYCCL_ALLREDUCE_ALGO`).
    Setting = 3,
    /// The device runtime failed (its capabilities or architecture could not be read).
    Runtime = 4,
}

impl OffCode {
    fn from_byte(b: u8) -> Option<Self> {
        [Self::Disabled, Self::Kernels, Self::Setting, Self::Runtime].into_iter().find(|c| *c as u8 == b)
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Disabled => "ANYCCL_DISABLE turns the custom kernels off there",
            Self::Kernels => "anyccl's kernels are not available for its device",
            Self::Setting => "one of its anyccl settings cannot be used",
            Self::Runtime => "its device runtime failed",
        }
    }
}

/// This rank's condensed settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// 0: on locally; else an [`OffCode`].
    pub state: u8,
    /// One value per entry of [`FIELDS`].
    pub fields: [u64; FIELDS.len()],
}

impl Fingerprint {
    /// The bytes sent.
    pub fn encode(&self) -> [u8; FINGERPRINT_BYTES] {
        let mut out = [0u8; FINGERPRINT_BYTES];
        out[..8].copy_from_slice(&MAGIC);
        out[8] = self.state;
        for (i, f) in self.fields.iter().enumerate() {
            out[16 + 8 * i..24 + 8 * i].copy_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// A peer's bytes, if they are a fingerprint of this format.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != FINGERPRINT_BYTES || b[..8] != MAGIC || b[9..16].iter().any(|x| *x != 0) {
            return None;
        }
        let mut fields = [0u64; FIELDS.len()];
        for (i, f) in fields.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[16 + 8 * i..24 + 8 * i]);
            *f = u64::from_le_bytes(w);
        }
        Some(Fingerprint { state: b[8], fields })
    }
}

/// The first 8 bytes of a SHA-256 of `parts` (each length-prefixed, so parts cannot run into each other).
pub fn digest(parts: &[&[u8]]) -> u64 {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let d = h.finalize();
    let mut w = [0u8; 8];
    w.copy_from_slice(&d[..8]);
    u64::from_le_bytes(w)
}

/// A setting's value in a field: a number as it is, an error or text as a digest (tagged, so a number never
/// equals a digest by construction of the tag bit).
fn number(n: u64) -> u64 {
    n & !(1 << 63)
}
fn text(tag: &str, s: &str) -> u64 {
    digest(&[tag.as_bytes(), s.as_bytes()]) | (1 << 63)
}

/// What the lazy decision of one communicator reads on this rank, read once at its creation.
pub struct Local {
    /// On locally: what the slot keeps. Off: the code and the reason.
    pub on: Result<On, (OffCode, String)>,
    fields: [u64; FIELDS.len()],
}

/// The settings of a rank that is on locally.
pub struct On {
    /// The device's architecture.
    pub arch: String,
    /// The capability report for the communicator.
    pub caps: Arc<anyccl_core::CapabilityReport>,
    /// The selector (`ANYCCL_TUNE_FILE`, `ANYCCL_ALLREDUCE_ALGO`).
    pub selector: Arc<Selector>,
    /// The staging size (`ANYCCL_CUSTOM_MAX_BYTES`).
    pub capacity: usize,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl Local {
    /// Reads everything the lazy decision reads (each setting once, so the fingerprint and the slot see the same).
    pub fn read<P: DropinPlatform>(
        lib: &Arc<CclLibrary>,
        device: &P::DeviceSpec,
        runtime: &P::Runtime,
        world: usize,
    ) -> Self {
        let disabled = anyccl_core::caps::disabled_by_env();
        let capacity = anyccl_gpu::comm::custom_capacity(&env);
        let blocks = anyccl_gpu::comm::custom_max_blocks(&env);
        let selector = Selector::from_env();
        let kernels = anyccl_gpu::kernels::unavailable::<P>(world);
        let arch = P::arch(runtime);
        let fields = [
            match &disabled {
                Ok(d) => number(u64::from(d.bits())),
                Err(e) => text("error", &e.to_string()),
            },
            match &capacity {
                Ok(c) => number(*c as u64),
                Err(e) => text("error", &e.to_string()),
            },
            match &blocks {
                Ok(b) => number(*b as u64),
                Err(e) => text("error", &e.to_string()),
            },
            match &selector {
                // The parsed table, not the file's bytes: comments and the path do not matter, the rules do.
                Ok(s) => text("table", &format!("{:?}", s.table())),
                Err(e) => text("error", &format!("{e} {:?}", env(anyccl_core::selector::ENV_TABLE_FILE))),
            },
            match &selector {
                Ok(s) => text("forced", &format!("{:?}", s.forced())),
                Err(_) => text("raw", &format!("{:?}", env(anyccl_core::selector::ENV_FORCE_ALGO))),
            },
            match &selector {
                Ok(s) => number(u64::from(s.deterministic())),
                Err(_) => text("raw", &format!("{:?}", env(anyccl_core::selector::ENV_DETERMINISTIC))),
            },
            match (&kernels, &arch) {
                (None, Ok(a)) => text("arch", a),
                (Some(why), _) => text("kernels", why),
                (None, Err(e)) => text("error", &e.to_string()),
            },
        ];
        let on = (|| {
            match disabled {
                Ok(d) if d.intersects(Capabilities::CUSTOM_KERNELS | Capabilities::IPC) => {
                    return Err((
                        OffCode::Disabled,
                        "ANYCCL_DISABLE turns the custom kernels (custom-kernels or ipc) off".to_owned(),
                    ))
                }
                Ok(_) => {}
                Err(e) => return Err((OffCode::Disabled, e.to_string())),
            }
            if let Some(why) = kernels {
                return Err((OffCode::Kernels, why));
            }
            let arch = arch.map_err(|e| (OffCode::Runtime, e.to_string()))?;
            let caps = P::capabilities(device, lib, &env).map_err(|e| (OffCode::Runtime, e.to_string()))?;
            let selector = selector.map_err(|e| (OffCode::Setting, e.to_string()))?;
            let capacity = capacity.map_err(|e| (OffCode::Setting, e.to_string()))?;
            Ok(On { arch, caps: Arc::new(caps), selector: Arc::new(selector), capacity })
        })();
        Local { on, fields }
    }

    /// This rank's fingerprint.
    pub fn fingerprint(&self) -> Fingerprint {
        let state = match &self.on {
            Ok(_) => 0,
            Err((code, _)) => *code as u8,
        };
        Fingerprint { state, fields: self.fields }
    }
}

/// Puts back, when dropped, what was current on the calling thread when it was made.
pub(crate) struct KeepCurrent<P: DropinPlatform>(Option<P::Current>);

impl<P: DropinPlatform> KeepCurrent<P> {
    /// Reads what is current now.
    pub(crate) fn new() -> Self {
        KeepCurrent(P::save_current())
    }
}

impl<P: DropinPlatform> Drop for KeepCurrent<P> {
    fn drop(&mut self) {
        if let Some(saved) = self.0.take() {
            // SAFETY: read by `new` on this thread; the guard is a local of one call of the caller's (never moved
            // to another thread or kept).
            unsafe { P::restore_current(saved) };
        }
    }
}

/// The device and runtime a rank takes part with (the communicator's device), or why it has none.
/// [`DropinPlatform::usable`] has said yes already.
pub(crate) fn participant<P: DropinPlatform>(
    api: &api::Api,
    comm: Comm,
) -> Result<(P::DeviceSpec, P::Runtime), String> {
    let mut ordinal: c_int = -1;
    if let Some(f) = api.ncclCommCuDevice {
        // SAFETY: the library's own ncclCommCuDevice on its live communicator; writes one int.
        let _ = unsafe { f(comm, &mut ordinal) };
    }
    if ordinal < 0 {
        ordinal = P::current_device().map_err(|e| e.to_string())?;
    }
    let device = P::device(ordinal).map_err(|e| e.to_string())?;
    let runtime = P::runtime(&device).map_err(|e| e.to_string())?;
    Ok((device, runtime))
}

/// The round: every rank's fingerprint, by rank, through one `ncclAllGather` of [`FINGERPRINT_BYTES`] per rank
/// over `comm` on a stream of the drop-in's own (waited for). Collective: every rank of `comm` calls it once,
/// right after the communicator's creation, outside any group.
pub(crate) fn agree<P: DropinPlatform>(
    lib: &Arc<CclLibrary>,
    comm: Comm,
    world: usize,
    runtime: &P::Runtime,
    mine: &Fingerprint,
) -> anyccl_core::Result<Vec<Option<Fingerprint>>>
where
    StreamOf<P>: CclStream,
{
    let total = FINGERPRINT_BYTES
        .checked_mul(world)
        .ok_or_else(|| Error::OutOfMemory { what: "the agreement round's fingerprints".into(), bytes: u64::MAX })?;
    let mut out = Vec::new();
    out.try_reserve_exact(total)
        .map_err(|_| Error::OutOfMemory { what: "the agreement round's fingerprints".into(), bytes: total as u64 })?;
    out.resize(total, 0u8);
    runtime.bind()?;
    let stream = P::stream(runtime)?;
    let mut send = runtime.alloc(FINGERPRINT_BYTES)?;
    let mut recv = runtime.alloc(total)?;
    // Past this point every step is taken even after a failure, so the peers' all-gather is always matched: a
    // failed upload sends whatever the buffer holds, which the peers do not read as an "on" fingerprint unless it
    // is one (then this rank, which knows it failed, is off, and its peers find out at the setup's own rounds).
    let uploaded = runtime.upload(send.borrow_mut(), &mine.encode(), &stream);
    let (s, r) = (send.borrow().device_addr(), recv.borrow_mut().device_addr());
    // SAFETY: `comm` is the caller's live communicator of `lib`, used for this one call. `send` holds
    // FINGERPRINT_BYTES and `recv` world × FINGERPRINT_BYTES bytes of this rank's device, both alive until the
    // download below has waited for the stream, which lives as long.
    let gathered = anyccl_ccl::nccl_dtype(lib, DataType::U8).and_then(|u8_code| unsafe {
        anyccl_ccl::result::all_gather(
            lib,
            s as *const c_void,
            r as *mut c_void,
            FINGERPRINT_BYTES,
            u8_code,
            comm,
            stream.ccl_handle(),
        )
    });
    let downloaded = runtime.download(recv.borrow(), &mut out, &stream);
    uploaded?;
    gathered?;
    downloaded?;
    Ok(out.chunks_exact(FINGERPRINT_BYTES).map(Fingerprint::decode).collect())
}

/// The verdict every rank reaches from the same gathered fingerprints: `Ok` when every rank is on with equal
/// settings; else why not, naming the settings that differ and two ranks that disagree (or the rank that is off).
/// `local`: this rank's own state, whose reason is more precise than its code when this rank is the one off.
pub fn verdict(all: &[Option<Fingerprint>], world: usize, local: &Local) -> Result<(), String> {
    if all.len() != world {
        return Err(format!("the agreement round returned {} fingerprints for {world} ranks", all.len()));
    }
    if let Some(q) = all.iter().position(Option::is_none) {
        return Err(format!(
            "rank {q} sent no anyccl fingerprint of this format to the agreement round (another version of the \
             drop-in there, or a rank that could not write one)"
        ));
    }
    let fps: Vec<&Fingerprint> = all.iter().flatten().collect();
    let first = fps[0];
    let differing: Vec<usize> =
        (0..FIELDS.len()).filter(|&i| fps.iter().any(|f| f.fields[i] != first.fields[i])).collect();
    if let Some(&i) = differing.first() {
        let names: Vec<&str> = differing.iter().map(|&i| FIELDS[i]).collect();
        let verb = if names.len() == 1 { "differs" } else { "differ" };
        let other = fps.iter().position(|f| f.fields[i] != first.fields[i]).unwrap_or(0);
        let n = fps.iter().filter(|f| f.fields[i] != first.fields[i]).count();
        let more = if n > 1 { format!("; {n} of {world} ranks differ from rank 0") } else { String::new() };
        return Err(format!("{} {verb} between ranks (rank 0 and rank {other}{more})", names.join(" and ")));
    }
    if let Err((_, why)) = &local.on {
        return Err(why.clone());
    }
    if let Some(q) = fps.iter().position(|f| f.state != 0) {
        let what = OffCode::from_byte(fps[q].state).map_or("it is off", OffCode::describe);
        return Err(format!("rank {q} has anyccl off ({what})"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(state: u8, fields: [u64; FIELDS.len()]) -> Option<Fingerprint> {
        Some(Fingerprint { state, fields })
    }

    fn off_local() -> Local {
        Local { on: Err((OffCode::Setting, "unused".into())), fields: [0; FIELDS.len()] }
    }

    #[test]
    fn a_fingerprint_round_trips_and_garbage_is_not_one() {
        let f = Fingerprint { state: 2, fields: [1, 2, 3, u64::MAX, 5, 6, 7] };
        assert_eq!(Fingerprint::decode(&f.encode()), Some(f));
        assert_eq!(Fingerprint::decode(&[0u8; FINGERPRINT_BYTES]), None);
        assert_eq!(Fingerprint::decode(&[0u8; 3]), None);
    }

    #[test]
    fn the_verdict_names_the_differing_settings_and_two_ranks() {
        let local = off_local();
        let a = [0, 65536, 16, 9, 9, 0, 9];
        let mut b = a;
        b[1] = 8 << 20;
        let why = verdict(&[fp(0, a), fp(0, a), fp(0, b)], 3, &local).expect_err("differ");
        assert_eq!(why, "ANYCCL_CUSTOM_MAX_BYTES differs between ranks (rank 0 and rank 2)");
        b[3] = 1;
        let why = verdict(&[fp(0, a), fp(0, b), fp(0, b)], 3, &local).expect_err("differ");
        assert_eq!(
            why,
            "ANYCCL_CUSTOM_MAX_BYTES and ANYCCL_TUNE_FILE differ between ranks (rank 0 and rank 1; 2 of 3 ranks \
             differ from rank 0)"
        );
        let mut c = a;
        c[5] = 1;
        let why = verdict(&[fp(0, a), fp(0, c)], 2, &local).expect_err("differ");
        assert_eq!(why, "ANYCCL_DETERMINISTIC differs between ranks (rank 0 and rank 1)");
        let why = verdict(&[fp(0, a), None], 2, &local).expect_err("garbage");
        assert!(why.starts_with("rank 1 sent no anyccl fingerprint"), "{why}");
    }

    #[test]
    fn equal_and_on_everywhere_is_on_and_a_peer_off_is_named() {
        let on = Local {
            on: Ok(On {
                arch: "gfx942".into(),
                caps: Arc::new(anyccl_core::CapabilityReport::all_disabled(|_| anyccl_core::Reason::Unavailable {
                    component: "test".into(),
                    detail: String::new(),
                })),
                selector: Arc::new(Selector::default()),
                capacity: 64,
            }),
            fields: [0; FIELDS.len()],
        };
        let a = [7; FIELDS.len()];
        assert_eq!(verdict(&[fp(0, a), fp(0, a)], 2, &on), Ok(()));
        assert_eq!(
            verdict(&[fp(0, a), fp(2, a)], 2, &on),
            Err("rank 1 has anyccl off (anyccl's kernels are not available for its device)".into())
        );
        assert_eq!(verdict(&[fp(0, a)], 2, &on), Err("the agreement round returned 1 fingerprints for 2 ranks".into()));
    }

    #[test]
    fn numbers_and_digests_never_collide() {
        assert_ne!(number(u64::MAX), text("x", "y"));
        assert_eq!(text("error", "a"), text("error", "a"));
        assert_ne!(text("error", "a"), text("error", "b"));
        assert_ne!(digest(&[b"ab", b"c"]), digest(&[b"a", b"bc"]));
    }
}
