//! NVLS (NVLink SHARP multicast) all-reduce plans: the block-pipeline and warp-pipeline variants over a multicast
//! object the platform sets up ([`GpuPlatform::nvls_setup`]), and the reasons each variant is refused.
//!
//! A plan is eligible only when all of these hold, each refusal naming its cause:
//! - the capability report has [`Capabilities::MULTICAST`] on: every device reports
//!   `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`, `NCCL_NVLS_ENABLE` is not `0`, and `ANYCCL_DISABLE` does not name
//!   `multicast`;
//! - the platform set the multicast object up for this communicator (CUDA with the `multicast` feature): for the
//!   ranks of one process in one call ([`GpuPlatform::nvls_setup`]), or, with one process per GPU, one rank at a
//!   time over the communicator's bootstrap ([`GpuPlatform::nvls_setup_rank`], which the ranks agree on: on
//!   everywhere or off everywhere); the default platform answer is "no multicast", so ROCm has nothing to
//!   implement;
//! - the call: sum of f32, f16 or bf16, whole 16-byte vectors, at most the staging size, 2 to 8 ranks.
//!
//! The zero-copy variant needs the caller's input and output themselves bound to the multicast object, at the same
//! offset on every rank, before the call. anyccl binds only its own staging buffers, so it is refused with that
//! reason (see [`ZERO_COPY_REFUSAL`]).
//!
//! The multicast object's resources live in [`NvlsMemory::resources`], which the platform tears down in its own
//! fixed order when dropped; the engine drops them after its kernels' module.

use std::ffi::{c_void, CString};

use anyccl_core::{Algorithm, Capabilities, CapabilityReport, DataType, Error, ReduceOp, Result};
use anyccl_kernels_common as common;

use crate::kernels::{ptrs, THREADS};
use crate::{GpuPlatform, StreamOf};

/// Vectors (16 bytes) per tile of the block pipeline (`ANYCCL_TILE_VECS` of the kernel source).
const BLOCK_TILE_VECS: usize = 4096;
/// Vectors per tile of the warp pipeline (`ANYCCL_WP_TILE_VECS`).
const WARP_TILE_VECS: usize = 8192;
/// Most blocks of an NVLS launch.
const MAX_NVLS_BLOCKS: usize = 64;

/// One rank's share of a multicast object set up by the platform: its unicast and multicast addresses of the
/// staging-in, staging-out and flag buffers bound to the object, and what keeps them alive.
pub struct NvlsMemory {
    /// This rank's staging-in buffer (unicast address).
    pub stage_in: u64,
    /// This rank's staging-out buffer (unicast address).
    pub stage_out: u64,
    /// This rank's flag array (unicast address, [`common::FLAG_BYTES`] bytes, zeroed).
    pub flags: u64,
    /// The multicast address of the ranks' staging-in buffers.
    pub stage_in_mc: u64,
    /// The multicast address of the ranks' staging-out buffers.
    pub stage_out_mc: u64,
    /// The multicast address of the ranks' flag arrays.
    pub flags_mc: u64,
    /// Bytes of each staging buffer (the largest message).
    pub capacity: usize,
    /// The platform's resources (multicast object, bindings, mappings, allocations), torn down when dropped.
    pub resources: Box<dyn Send + Sync>,
}

impl std::fmt::Debug for NvlsMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvlsMemory")
            .field("stage_in", &self.stage_in)
            .field("stage_out", &self.stage_out)
            .field("flags", &self.flags)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

/// Why `nvls-zero-copy` is refused. The variant reduces straight from the callers' buffers through the multicast
/// address, so every rank's input and output must be physical allocations (`cuMemCreate`, multicast granularity:
/// 2 MiB or more) bound to one multicast object at the same offset on all ranks. What anyccl is handed is neither:
/// an engine's tensors and graph inputs come from its own allocator (`cuMemAlloc` or a caching pool) and cannot be
/// bound; binding needs every rank to agree on offsets, which only a collective registration can do, and
/// `cuMulticastBindMem` may not run during capture, where graph inputs are first seen. A registration call for
/// buffers anyccl allocates itself (as NCCL's windows are) would make it possible; until then the staged variants
/// run instead.
pub const ZERO_COPY_REFUSAL: &str = "nvls-zero-copy needs the caller's input and output bound to the multicast \
    object (cuMemCreate allocations bound at the same offset on every rank, before any capture); anyccl binds only \
    its own staging buffers, so nvls-block-pipeline and nvls-warp-pipeline run instead";

/// One agreement round over `bootstrap`: every rank sends its outcome (`Ok` with a payload, or `Err` with why),
/// and every rank gets every rank's payload (index = rank), or, where any rank failed, the first failing rank's
/// reason as `"rank R: why"`, alike on every rank (a peer's text is sanitised). `what` names the step for a
/// failed exchange. Collective.
pub fn agree(
    bootstrap: &mut dyn anyccl_core::Bootstrap,
    mine: std::result::Result<Vec<u8>, String>,
    what: &str,
) -> std::result::Result<Vec<Vec<u8>>, String> {
    let me = bootstrap.rank();
    let msg = match &mine {
        Ok(payload) => [&[1u8][..], payload].concat(),
        Err(why) => [&[0u8][..], why.as_bytes()].concat(),
    };
    let all = anyccl_core::bootstrap::checked_all_gather(bootstrap, &msg)
        .map_err(|e| format!("the ranks could not exchange {what} ({e})"))?;
    let mut out = Vec::with_capacity(all.len());
    for (q, m) in all.into_iter().enumerate() {
        match m.split_first() {
            Some((1, rest)) => out.push(rest.to_vec()),
            Some((_, rest)) if q == me => {
                return Err(format!("rank {q}: {}", mine.err().unwrap_or_else(|| String::from_utf8_lossy(rest).into())))
            }
            Some((_, rest)) => return Err(format!("rank {q}: {}", anyccl_core::text::sanitize_bytes(rest, 400))),
            None => return Err(format!("rank {q} sent nothing for {what}")),
        }
    }
    Ok(out)
}

/// Whether `algorithm` is one of the NVLS variants.
pub fn is_nvls(algorithm: Algorithm) -> bool {
    matches!(algorithm, Algorithm::NvlsZeroCopy | Algorithm::NvlsWarpPipeline | Algorithm::NvlsBlockPipeline)
}

/// The multicast kernel of `algorithm` for `dtype` (`anyccl_nvls_block_pipeline_mc_bf16`).
pub fn kernel_name(algorithm: Algorithm, dtype: DataType) -> Option<String> {
    use anyccl_kernels_common::catalogue::{self, Family, NvlsVariant};
    let variant = match algorithm {
        Algorithm::NvlsZeroCopy => NvlsVariant::ZeroCopy,
        Algorithm::NvlsWarpPipeline => NvlsVariant::WarpPipeline,
        Algorithm::NvlsBlockPipeline => NvlsVariant::BlockPipeline,
        _ => return None,
    };
    catalogue::kernel_name(Family::Nvls { variant, multicast: true }, crate::kernels::catalogue_dtype(dtype)?)
}

/// The element types of the NVLS kernels, in [`NvlsState`]'s function order.
const DTYPES: [DataType; 3] = [DataType::F32, DataType::F16, DataType::Bf16];
/// The staged variants, in [`NvlsState`]'s function order.
const STAGED: [Algorithm; 2] = [Algorithm::NvlsBlockPipeline, Algorithm::NvlsWarpPipeline];

/// The NVLS kernels and multicast memory of one rank.
pub(crate) struct NvlsState<P: GpuPlatform> {
    /// Staged variants × element types; looked up once. Declared before the module, so nothing outlives it.
    functions: [Option<P::Function>; STAGED.len() * DTYPES.len()],
    _module: P::Module,
    /// Declared last: torn down after the module.
    memory: NvlsMemory,
}

/// The NVLS state of a communicator: set up, or why not.
pub(crate) struct Nvls<P: GpuPlatform>(std::result::Result<NvlsState<P>, String>);

impl<P: GpuPlatform> Nvls<P> {
    /// Off, with the reason.
    pub(crate) fn off(why: String) -> Self {
        Nvls(Err(why))
    }

    /// Why NVLS is off on this communicator, or `None` when it is set up.
    pub(crate) fn off_reason(&self) -> Option<&str> {
        self.0.as_ref().err().map(String::as_str)
    }

    /// Sets NVLS up for the ranks of one process (`runtimes[rank]`), after the gate: nothing multicast is asked of
    /// the platform unless `caps` has [`Capabilities::MULTICAST`] and the world and kernels fit. One answer per
    /// rank, alike on every rank (the setup is one call for all of them).
    pub(crate) fn setup_all(
        runtimes: &[&P::Runtime],
        caps: &CapabilityReport,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<Self> {
        let world = runtimes.len();
        let all_off = |why: String| (0..world).map(|_| Nvls::off(why.clone())).collect();
        if let Err(e) = caps.require(Capabilities::MULTICAST) {
            return all_off(e.to_string());
        }
        if let Some(why) = crate::kernels::unavailable::<P>(world) {
            return all_off(why);
        }
        let capacity = match crate::comm::custom_capacity(env) {
            Ok(c) => c,
            Err(e) => return all_off(e.to_string()),
        };
        let memories = match P::nvls_setup(runtimes, capacity, env) {
            Ok(m) if m.len() == world => m,
            Ok(m) => return all_off(format!("the platform set up {} of {world} ranks", m.len())),
            Err(why) => return all_off(why),
        };
        let states: Vec<std::result::Result<NvlsState<P>, String>> = runtimes
            .iter()
            .zip(memories)
            .map(|(rt, memory)| load::<P>(rt, memory).map_err(|e| e.to_string()))
            .collect();
        // On everywhere or off everywhere: a rank whose kernels failed to load turns NVLS off on every rank (the
        // others' memory is dropped, and torn down, with their states).
        if let Some(why) = states.iter().find_map(|s| s.as_ref().err().cloned()) {
            return all_off(format!("off: the NVLS kernels could not be loaded ({why})"));
        }
        tracing::info!(world, capacity, "NVLS multicast set up");
        states.into_iter().map(Nvls).collect()
    }

    /// Sets NVLS up for this rank of a communicator of one process per GPU, over `bootstrap` (this communicator's
    /// group): the ranks first agree that every one has multicast in its capability report, the kernels and the
    /// same staging size, then the platform sets the object up ([`GpuPlatform::nvls_setup_rank`], agreed inside),
    /// then every rank loads its kernels and the ranks agree once more. On everywhere or off everywhere, with the
    /// first failing rank's reason. Collective.
    pub(crate) fn setup_rank(
        runtime: &P::Runtime,
        caps: &CapabilityReport,
        bootstrap: &mut dyn anyccl_core::Bootstrap,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Self {
        let world = bootstrap.world();
        let local = (|| -> std::result::Result<usize, String> {
            caps.require(Capabilities::MULTICAST).map_err(|e| e.to_string())?;
            if let Some(why) = crate::kernels::unavailable::<P>(world) {
                return Err(why);
            }
            crate::comm::custom_capacity(env).map_err(|e| e.to_string())
        })();
        let capacity = local.as_ref().ok().copied().unwrap_or(0);
        match agree(bootstrap, local.map(|c| (c as u64).to_le_bytes().to_vec()), "the NVLS preconditions") {
            Err(why) => return Nvls::off(format!("off on every rank: {why}")),
            Ok(all) if all.iter().any(|a| a[..] != (capacity as u64).to_le_bytes()) => {
                return Nvls::off("off: the ranks disagree on ANYCCL_CUSTOM_MAX_BYTES (the NVLS staging size)".into())
            }
            Ok(_) => {}
        }
        let memory = match P::nvls_setup_rank(runtime, bootstrap, capacity, env) {
            Ok(m) => m,
            Err(why) => return Nvls::off(why),
        };
        let state = load::<P>(runtime, memory).map_err(|e| e.to_string());
        let loaded = state.as_ref().map(|_| Vec::new()).map_err(Clone::clone);
        match agree(bootstrap, loaded, "the NVLS kernels' loading") {
            Ok(_) => {
                tracing::info!(world, capacity, "NVLS multicast set up across processes");
                Nvls(state)
            }
            // This rank's memory (if any) is torn down with its state here.
            Err(why) => Nvls::off(format!("off: the NVLS kernels could not be loaded ({why})")),
        }
    }

    /// Whether `algorithm` (an NVLS variant) can run `call` on this communicator of `world` ranks.
    pub(crate) fn eligible(
        &self,
        algorithm: Algorithm,
        call: &anyccl_core::comm::AllReduceCall,
        world: usize,
    ) -> std::result::Result<(), String> {
        let st = self.0.as_ref().map_err(Clone::clone)?;
        if algorithm == Algorithm::NvlsZeroCopy {
            return Err(ZERO_COPY_REFUSAL.into());
        }
        if call.op != ReduceOp::Sum {
            return Err(format!("the NVLS kernels implement sum, not {}", call.op));
        }
        if !(2..=common::MAX_RANKS).contains(&world) {
            return Err(format!("world {world} is outside 2..={}", common::MAX_RANKS));
        }
        if st.function(algorithm, call.dtype).is_none() {
            return Err(format!("no NVLS kernel for {} in the loaded module", call.dtype));
        }
        if !call.bytes.is_multiple_of(common::VECTOR_BYTES) {
            return Err(format!(
                "{} bytes is not a multiple of {} (16-byte vectors)",
                call.bytes,
                common::VECTOR_BYTES
            ));
        }
        if call.bytes > st.memory.capacity {
            return Err(format!(
                "{} bytes exceed the NVLS staging buffers ({} bytes; ANYCCL_CUSTOM_MAX_BYTES)",
                call.bytes, st.memory.capacity
            ));
        }
        Ok(())
    }

    /// Launches `algorithm` (eligible for this call) as rank `rank` of `world`: the kernel copies `src` into this
    /// rank's staging-in, reduce-loads its part through the multicast address, broadcast-stores it into every
    /// rank's staging-out, and copies the result into `dst`.
    ///
    /// # Safety
    /// `src` and `dst` hold `bytes` bytes of this device's memory; every rank of the multicast object makes the
    /// same calls in the same order (a collective), on different devices.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch(
        &self,
        runtime: &P::Runtime,
        algorithm: Algorithm,
        dtype: DataType,
        src: u64,
        dst: u64,
        bytes: usize,
        rank: usize,
        world: usize,
        stream: &StreamOf<P>,
    ) -> Result<()> {
        let not = |why: String| Error::AlgorithmNotEligible { algorithm, why };
        let st = self.0.as_ref().map_err(|why| not(why.clone()))?;
        let f = st.function(algorithm, dtype).ok_or_else(|| not(format!("no NVLS kernel for {dtype}")))?;
        if bytes == 0 {
            return Ok(());
        }
        if bytes > st.memory.capacity || !bytes.is_multiple_of(common::VECTOR_BYTES) {
            return Err(not(format!("{bytes} bytes do not fit the NVLS staging buffers")));
        }
        let m = &st.memory;
        let n_vec = (bytes / common::VECTOR_BYTES) as u64;
        let tile = if algorithm == Algorithm::NvlsWarpPipeline { WARP_TILE_VECS } else { BLOCK_TILE_VECS };
        let blocks = (bytes / common::VECTOR_BYTES).div_ceil(tile).clamp(1, MAX_NVLS_BLOCKS) as u32;
        let mut own = vec![0u64; world];
        if let Some(slot) = own.get_mut(rank) {
            *slot = m.flags;
        }
        let (mut a_in, mut a_out, mut a_sin, mut a_sout) = (src, dst, m.stage_in, m.stage_out);
        let (mut a_sin_mc, mut a_sout_mc, mut a_flags_mc) = (m.stage_in_mc, m.stage_out_mc, m.flags_mc);
        let mut a_flags = ptrs(&own);
        let mut a_rank = i32::try_from(rank).map_err(|_| not(format!("rank {rank}")))?;
        let mut a_world = i32::try_from(world).map_err(|_| not(format!("world {world}")))?;
        let mut a_n = n_vec;
        let mut params: [*mut c_void; 11] = [
            (&mut a_in as *mut u64).cast(),
            (&mut a_out as *mut u64).cast(),
            (&mut a_sin as *mut u64).cast(),
            (&mut a_sout as *mut u64).cast(),
            (&mut a_sin_mc as *mut u64).cast(),
            (&mut a_sout_mc as *mut u64).cast(),
            (&mut a_flags_mc as *mut u64).cast(),
            (&mut a_flags as *mut crate::kernels::Ptrs).cast(),
            (&mut a_rank as *mut i32).cast(),
            (&mut a_world as *mut i32).cast(),
            (&mut a_n as *mut u64).cast(),
        ];
        tracing::trace!(%algorithm, %dtype, bytes, blocks, "NVLS launch");
        // SAFETY: the parameters match the staged `_mc` kernels' signature (in, out, my_stage_in, my_stage_out,
        // stage_in_mc, stage_out_mc, flags_mc, FlagPtrs, rank, world, n_vec) and live across the call; the staging
        // and flag buffers are bound to the multicast object and hold `capacity >= bytes`; the caller guarantees
        // `src`, `dst` and the collective order.
        unsafe { P::launch(runtime, f, (blocks, 1, 1), (THREADS, 1, 1), stream, &mut params) }
    }
}

impl<P: GpuPlatform> NvlsState<P> {
    fn function(&self, algorithm: Algorithm, dtype: DataType) -> Option<P::Function> {
        let a = STAGED.iter().position(|x| *x == algorithm)?;
        let d = DTYPES.iter().position(|x| *x == dtype)?;
        self.functions.get(a * DTYPES.len() + d).copied().flatten()
    }
}

/// Loads the kernels' module on `runtime`'s device and looks the staged multicast kernels up.
fn load<P: GpuPlatform>(runtime: &P::Runtime, memory: NvlsMemory) -> Result<NvlsState<P>> {
    let module = P::load_module(runtime, P::kernel_image(runtime)?)?;
    let mut functions = [None; STAGED.len() * DTYPES.len()];
    for (a, algorithm) in STAGED.iter().enumerate() {
        for (d, dtype) in DTYPES.iter().enumerate() {
            let Some(name) = kernel_name(*algorithm, *dtype) else { continue };
            let name = CString::new(name).map_err(|e| Error::backend(P::NAME, "nvls", None, e.to_string()))?;
            if let Some(slot) = functions.get_mut(a * DTYPES.len() + d) {
                *slot = P::function(runtime, &module, &name).ok();
            }
        }
    }
    if functions.iter().all(Option::is_none) {
        return Err(Error::backend(P::NAME, "nvls", None, "the module has no multicast NVLS kernel (sm_90+ only)"));
    }
    Ok(NvlsState { functions, _module: module, memory })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `agree` on `world` ranks as threads, rank r sending `mine(r)`; every rank's answer.
    fn agree_all(
        world: usize,
        mine: impl Fn(usize) -> std::result::Result<Vec<u8>, String> + Sync,
    ) -> Vec<std::result::Result<Vec<Vec<u8>>, String>> {
        let group = anyccl_core::bootstrap::LocalGroup::new(world, std::time::Duration::from_secs(20));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let mut me = group.member(r);
                    let mine = &mine;
                    s.spawn(move || agree(&mut me, mine(r), "a test step"))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        })
    }

    #[test]
    fn the_ranks_agree_on_every_payload_or_on_the_first_failure() {
        let all = agree_all(3, |r| Ok(vec![r as u8; r]));
        for got in all {
            assert_eq!(got.expect("all ok"), vec![vec![], vec![1], vec![2, 2]]);
        }
        // Ranks 1 and 2 fail: every rank, rank 0 included, gets rank 1's reason (a peer's text sanitised).
        let all = agree_all(3, |r| if r == 0 { Ok(vec![7]) } else { Err(format!("no\x1b[31m luck on {r}")) });
        for (r, got) in all.into_iter().enumerate() {
            let why = got.expect_err("one rank failed");
            assert!(why.starts_with("rank 1: no") && why.ends_with("luck on 1"), "rank {r}: {why}");
            assert_eq!(why.contains('\x1b'), r == 1, "rank {r}: only a peer's text is sanitised: {why:?}");
        }
    }

    #[test]
    fn kernel_names_follow_the_kernel_source() {
        assert_eq!(
            kernel_name(Algorithm::NvlsBlockPipeline, DataType::Bf16).as_deref(),
            Some("anyccl_nvls_block_pipeline_mc_bf16")
        );
        assert_eq!(
            kernel_name(Algorithm::NvlsWarpPipeline, DataType::F32).as_deref(),
            Some("anyccl_nvls_warp_pipeline_mc_f32")
        );
        assert_eq!(kernel_name(Algorithm::OneShot, DataType::F32), None);
        assert_eq!(kernel_name(Algorithm::NvlsZeroCopy, DataType::I32), None);
        assert!(is_nvls(Algorithm::NvlsZeroCopy) && !is_nvls(Algorithm::TwoShot));
    }
}
