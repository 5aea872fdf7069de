// anyccl fused push one-shot: the push-mode one-shot's exchange (push.h: every rank writes its input into its slot
// of every peer's receive buffer; completion by Lamport sentinels, no barrier round) followed, in the same kernel,
// by the residual add + RMSNorm of fused.h (norm_row). Include after allreduce.h, fused.h and push.h.
//
// Bits: row element i is reduced exactly as push_one_shot (and so reduce_vec, the barrier one-shot) reduces it:
// load rank 0's vector, add ranks 1..W-1 in order in f32, round to T; then norm_row does the rest. The result is
// therefore bit for bit the fused one-shot's (NaN payloads aside, as for the push one-shot).
//
// Protocol: the receive buffers, their two sets, the epoch in the control words, the sentinel resets and the abort
// word are push.h's, through the same functions (push_begin, push_out, push_reduce_vec, push_end), so push one-shot
// calls and fused push calls may share one set of receive buffers and follow each other in any order (each call is
// one "push call" of that protocol). Every block pushes its share of the input (a grid-stride loop over every
// vector), then block b normalises rows b, b + gridDim.x, ...; blocks beyond the row count only push. Messages
// (tokens × hidden × sizeof(T)) up to ANYCCL_PUSH_MAX_BYTES.
//
// Programmatic dependent launch (sm_90+): nothing before push_begin's dependency wait reads the input, the residual
// or the epoch, or writes anything; dependents may launch once this kernel's pushes are out (they wait for its
// completion before they read what it writes).

#pragma once

template <typename T, int W>
__device__ __forceinline__ void fused_push_one_shot(const void* in, const NormArgs& a, const RankPtrs& recv,
                                                    const uint32_t* my_flags, int rank) {
    const size_t hv = a.hidden_vec;
    const size_t n_vec = (size_t)a.tokens * hv;
    const PushCall c = push_begin(recv, rank);
    const anyccl_vec16* src = reinterpret_cast<const anyccl_vec16*>(in);
    push_out<W>(src, recv, rank, c.set_vecs, c.first, c.stride, n_vec);
    anyccl_launch_dependents();
    bool stop = false;
    for (size_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
        // norm_row asks for each vector j of the row once, from the thread that owns it.
        const auto reduced = [&](uint32_t j) {
            return push_reduce_vec<T, W>(src, c.slots, rank, row * hv + j, my_flags, stop);
        };
        anyccl_vec16* res = vec_at(a.residual, row * hv);
        norm_row<T>(reduced, res, res, nullptr, byte_at(a.out, row * out_row_bytes(a)), nullptr, a);
    }
    push_end(c);
}

// The fused push one-shot kernel of element type T (f16 or bf16), named by NAME; launch with ANYCCL_NORM_THREADS
// threads per block. `recv`, `my_flags`: as for anyccl_push_one_shot_*; `in`: this rank's input rows.
#define ANYCCL_FUSED_PUSH_KERNELS(NAME, T)                                                                           \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_fused_push_one_shot_##NAME(                               \
        const void* in, NormArgs args, RankPtrs recv, const uint32_t* my_flags, int rank, int world) {               \
        ANYCCL_DISPATCH(fused_push_one_shot, T, in, args, recv, my_flags, rank)                                      \
    }
