// anyccl push-mode one-shot all-reduce, written once for every vendor over the vendor layer (vendor_cuda.h,
// vendor_hip.h) and allreduce.h (RankPtrs, pick, aborted, Vec, ANYCCL_DISPATCH), which the including source has
// included first. For small messages (at most ANYCCL_PUSH_MAX_BYTES): it has the latency of one write across the
// links instead of today's one-shot's two barrier rounds plus the reads.
//
// Push: every rank writes its input into slot [set][its rank] of every peer's receive buffer (one store per
// vector, no flags), then reduces the W slots [set][0..W) of its own receive buffer (its own slot is its input,
// read directly) in rank order 0..W-1 with the same Vec<T> loads and adds as reduce_vec: the result's bits equal
// today's one-shot's (NaN payloads aside, below).
//
// Completion is flag-free (Lamport-style): every 32-bit word of a receive buffer holds ANYCCL_PUSH_SENTINEL
// (0xFFFFFFFF) until a peer's value lands there. A reader polls each 16-byte vector of a slot until none of its
// four words is the sentinel (each word is checked on its own, so a vector store that lands in parts is fine),
// uses it, and writes the sentinel back, so the slot is ready for a later call. 0xFFFFFFFF is a NaN in every
// element type (one f32 NaN, two f16 NaNs, two bf16 NaNs), so a finite input never has it; an input word that
// has it anyway (such NaNs) is written as ANYCCL_PUSH_CANONICAL (0x7FFF7FFF, again a NaN in every element type)
// instead, so a reader never waits for a value that has already arrived. A sum with a NaN is a NaN either way
// (on NVIDIA GPUs the f32 add returns the canonical NaN, so even the bits match today's one-shot).
//
// Buffer sets: a receive buffer holds ANYCCL_PUSH_SETS (2) sets of ANYCCL_MAX_RANKS slots of
// ANYCCL_PUSH_MAX_BYTES each, then ANYCCL_PUSH_CTRL_WORDS control words: [0] the call counter (the epoch; call k
// uses set k mod 2), [1] the arrival counter of this call's blocks. Every block reads the epoch at its start; the
// last block to finish (the arrival counter reaches gridDim.x) resets the arrivals and increments the epoch, so
// all blocks of a call use the same set even when the grid size changes between calls, and graph replays keep
// counting. Why two sets suffice: a peer writes set s in call k + 2 only after it finished call k + 1, which
// needed this rank's call-(k + 1) pushes, which this rank makes only after its call k completed (stream order;
// with programmatic dependent launch, after anyccl_grid_dependency_wait): so every slot of set s that call k read
// has been reset before any call-(k + 2) write to it. Call k + 1 uses the other set, so a peer one call ahead
// never writes into a slot this rank has yet to read.
//
// Programmatic dependent launch (sm_90+, through the launch attribute): everything before
// anyccl_grid_dependency_wait runs while the previous kernel of the stream still finishes; nothing before it reads
// the input or the epoch, or writes anything a peer reads. The kernel lets its own dependents launch once its
// pushes are out. HIP: both are no-ops.
//
// Stopping: a poll that has spun ANYCCL_ABORT_CHECK times looks at this rank's abort word (allreduce.h,
// "Stopping") every ANYCCL_ABORT_CHECK spins; once it is set the thread stops waiting for the rest of the call,
// and the kernel runs to its end with garbage results (the receive buffers are then unusable too: the caller is
// done with the custom kernels for good, as for the others).
//
// The layout constants are mirrored in Rust by anyccl-kernels-common (src/push.rs), whose test reads them here.

#pragma once

// Largest message the receive buffers are sized for: 256 KiB (16384 vectors of 16 bytes) per slot.
#define ANYCCL_PUSH_SLOT_VECS 16384
#define ANYCCL_PUSH_MAX_BYTES (ANYCCL_PUSH_SLOT_VECS * 16)
#define ANYCCL_PUSH_SETS 2
// Byte offset of the control words in a receive buffer (after the sets), and their count (32-bit words; 4 keeps
// the buffer a whole number of vectors).
#define ANYCCL_PUSH_CTRL (ANYCCL_PUSH_SETS * ANYCCL_MAX_RANKS * ANYCCL_PUSH_MAX_BYTES)
#define ANYCCL_PUSH_CTRL_WORDS 4
#define ANYCCL_PUSH_SENTINEL 0xFFFFFFFFu
#define ANYCCL_PUSH_CANONICAL 0x7FFF7FFFu

__device__ __forceinline__ uint32_t push_word(uint32_t w) {
    return w == ANYCCL_PUSH_SENTINEL ? ANYCCL_PUSH_CANONICAL : w;
}

// The input vector as it is pushed: any word equal to the sentinel replaced by the canonical NaN.
__device__ __forceinline__ anyccl_vec16 push_canonical(anyccl_vec16 v) {
    v.x = push_word(v.x);
    v.y = push_word(v.y);
    v.z = push_word(v.z);
    v.w = push_word(v.w);
    return v;
}

// A receive slot's vector before a peer wrote it (and after it was read): every word the sentinel.
__device__ __forceinline__ anyccl_vec16 push_empty() {
    const anyccl_vec16 v = {ANYCCL_PUSH_SENTINEL, ANYCCL_PUSH_SENTINEL, ANYCCL_PUSH_SENTINEL, ANYCCL_PUSH_SENTINEL};
    return v;
}

__device__ __forceinline__ bool push_pending(const anyccl_vec16& v) {
    return v.x == ANYCCL_PUSH_SENTINEL || v.y == ANYCCL_PUSH_SENTINEL || v.z == ANYCCL_PUSH_SENTINEL ||
           v.w == ANYCCL_PUSH_SENTINEL;
}

// `v` (a first load of `slot`) once none of its words is the sentinel: polls `slot` until then, or until this
// rank's abort word is set (then `stop` is set, and later waits of the thread return at once).
__device__ __forceinline__ anyccl_vec16 push_wait(const anyccl_vec16* slot, anyccl_vec16 v, const uint32_t* my_flags,
                                                  bool& stop) {
    for (uint32_t spins = 1; push_pending(v) && !stop; spins++) {
        if (spins % ANYCCL_ABORT_CHECK == 0 && aborted(my_flags)) {
            stop = true;
            break;
        }
        anyccl_spin_pause();
        v = anyccl_ld_vec_volatile(slot);
    }
    return v;
}

// The steps of a push call, shared by the push one-shot below and the fused push one-shot (fused_push.h), so that
// both follow one protocol on the same receive buffers.

// This call's epoch (the call counter in the control words `ctrl`), read by every block after
// anyccl_grid_dependency_wait and returned to every thread of the block.
__device__ __forceinline__ uint32_t push_epoch(const uint32_t* ctrl) {
    __shared__ uint32_t epoch;
    if (threadIdx.x == 0) epoch = anyccl_ld_volatile(ctrl);
    __syncthreads();
    return epoch;
}

// Vector offset of the set call `epoch` uses in a receive buffer.
__device__ __forceinline__ size_t push_set_vecs(uint32_t epoch) {
    return (size_t)(epoch % ANYCCL_PUSH_SETS) * ANYCCL_MAX_RANKS * ANYCCL_PUSH_SLOT_VECS;
}

// One thread's view of a push call, from push_begin to push_end.
struct PushCall {
    // This rank's receive buffer and its control words.
    char* mine;
    uint32_t* ctrl;
    // The call's epoch, and the vector offset of the set it uses in every receive buffer.
    uint32_t epoch;
    size_t set_vecs;
    // This rank's slots of that set in `mine` (slot r: vectors [r × ANYCCL_PUSH_SLOT_VECS, ...)).
    anyccl_vec16* slots;
    // This thread's grid-stride loop: vectors first, first + stride, ...
    size_t first;
    size_t stride;
};

// Starts a push call on this rank's receive buffer `recv.p[rank]`. Waits for the stream's previous kernel
// (programmatic dependent launch) before it reads the epoch: nothing before that wait reads or writes memory.
__device__ __forceinline__ PushCall push_begin(const RankPtrs& recv, int rank) {
    PushCall c;
    c.mine = reinterpret_cast<char*>(const_cast<void*>(pick(recv, rank)));
    c.ctrl = reinterpret_cast<uint32_t*>(c.mine + ANYCCL_PUSH_CTRL);
    c.first = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    c.stride = (size_t)gridDim.x * blockDim.x;
    anyccl_grid_dependency_wait();
    c.epoch = push_epoch(c.ctrl);
    c.set_vecs = push_set_vecs(c.epoch);
    c.slots = reinterpret_cast<anyccl_vec16*>(c.mine) + c.set_vecs;
    return c;
}

// Pushes this thread's vectors (first, first + stride, ... below n_vec) of the input `src` into slot [set][rank]
// of every peer's receive buffer.
template <int W>
__device__ __forceinline__ void push_out(const anyccl_vec16* src, const RankPtrs& recv, int rank, size_t set_vecs,
                                         size_t first, size_t stride, size_t n_vec) {
    const size_t my_slot = set_vecs + (size_t)rank * ANYCCL_PUSH_SLOT_VECS;
    for (size_t i = first; i < n_vec; i += stride) {
        const anyccl_vec16 v = push_canonical(src[i]);
#pragma unroll
        for (int r = 0; r < W; r++)
            if (r != rank)
                anyccl_st_vec_volatile(
                    reinterpret_cast<anyccl_vec16*>(const_cast<void*>(recv.p[r])) + my_slot + i, v);
    }
}

// Vector i of the sum in rank order 0..W-1 (reduce_vec's loads and adds): this rank's from its input `src`, every
// peer's from its slot of this rank's set `slots` once it arrived, each slot reset to the sentinel after use.
template <typename T, int W>
__device__ __forceinline__ anyccl_vec16 push_reduce_vec(const anyccl_vec16* src, anyccl_vec16* slots, int rank,
                                                        size_t i, const uint32_t* my_flags, bool& stop) {
    anyccl_vec16 v[W];
    // All W loads in flight before the first wait.
#pragma unroll
    for (int r = 0; r < W; r++)
        v[r] = r == rank ? src[i] : anyccl_ld_vec_volatile(slots + (size_t)r * ANYCCL_PUSH_SLOT_VECS + i);
#pragma unroll
    for (int r = 0; r < W; r++)
        if (r != rank) v[r] = push_wait(slots + (size_t)r * ANYCCL_PUSH_SLOT_VECS + i, v[r], my_flags, stop);
    float acc[Vec<T>::N];
    Vec<T>::load(v[0], acc);
#pragma unroll
    for (int r = 1; r < W; r++) Vec<T>::add(v[r], acc);
    const anyccl_vec16 empty = push_empty();
#pragma unroll
    for (int r = 0; r < W; r++)
        if (r != rank) anyccl_st_vec_volatile(slots + (size_t)r * ANYCCL_PUSH_SLOT_VECS + i, empty);
    return Vec<T>::store(acc);
}

// The end of a call: the last block of the call moves the epoch on (every block has read it by then).
__device__ __forceinline__ void push_end(const PushCall& c) {
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(c.ctrl + 1, 1u) == gridDim.x - 1) {
        c.ctrl[1] = 0;
        c.ctrl[0] = c.epoch + 1;
    }
}

// `recv.p[r]`: rank r's receive buffer as mapped here (ANYCCL_PUSH_CTRL + 4 × ANYCCL_PUSH_CTRL_WORDS bytes, the
// sets filled with the sentinel and the control words zeroed before first use); `my_flags`: this rank's flag array
// (only its abort word is used).
template <typename T, int W>
__device__ __forceinline__ void push_one_shot(const void* in, void* out, const RankPtrs& recv,
                                              const uint32_t* my_flags, int rank, size_t n_vec) {
    const PushCall c = push_begin(recv, rank);
    const anyccl_vec16* src = reinterpret_cast<const anyccl_vec16*>(in);
    // Push: this rank's slot of the set in every peer's receive buffer.
    push_out<W>(src, recv, rank, c.set_vecs, c.first, c.stride, n_vec);
    anyccl_launch_dependents();
    // Reduce this rank's slots in rank order, resetting each to the sentinel once read.
    anyccl_vec16* o = reinterpret_cast<anyccl_vec16*>(out);
    bool stop = false;
    for (size_t i = c.first; i < n_vec; i += c.stride)
        o[i] = push_reduce_vec<T, W>(src, c.slots, rank, i, my_flags, stop);
    push_end(c);
}

// The push two-shot: the push protocol on the same receive buffers (same sets, epoch, sentinels, abort word), in
// two hops instead of one, for messages where the one-shot's W - 1 full copies per rank cost more than a second
// hop. The message's n_vec vectors are split into W chunks of ceil(n_vec / W) (the last ones shorter or empty);
// rank q owns chunk q.
//   1. scatter: every rank writes chunk q of its input into the first half of slot [set][its rank] of rank q's
//      receive buffer (for every q != rank);
//   2. reduce: rank q sums its chunk in rank order 0..W-1 (its own part read from its input: reduce_vec's loads
//      and adds, so the bits of the one-shot's result), writes it to its output and into the second half of slot
//      [set][q] of every peer's receive buffer;
//   3. gather: every rank copies the other chunks from the second halves of its slots into its output.
// Each rank moves 2 (W - 1) / W of the message across the links instead of W - 1 times it. Every slot read is
// reset to the sentinel, as in the one-shot. Thread i of the grid handles vector i of every chunk in every step,
// so a rank's blocks never wait for each other, only for peers. Why two sets still suffice: a rank finishes call
// k + 1 only after every chunk of call k + 1 was reduced, which needs every rank's call-(k + 1) scatter, which a
// rank makes only after its call k is complete: so no peer writes a set this rank has yet to read. A reduced word
// equal to the sentinel (a NaN payload no add produces on NVIDIA) would be sent as the canonical NaN, as inputs are.
// Messages up to ANYCCL_PUSH_MAX_BYTES (a chunk fits half a slot for W >= 2).
#define ANYCCL_PUSH_HALF_VECS 8192
static_assert(2 * ANYCCL_PUSH_HALF_VECS == ANYCCL_PUSH_SLOT_VECS, "the two-shot's halves split a slot");

template <typename T, int W>
__device__ __forceinline__ void push_two_shot(const void* in, void* out, const RankPtrs& recv,
                                              const uint32_t* my_flags, int rank, size_t n_vec) {
    const PushCall c = push_begin(recv, rank);
    const size_t first = c.first, stride = c.stride;
    const size_t chunk = (n_vec + W - 1) / W;
    const anyccl_vec16* src = reinterpret_cast<const anyccl_vec16*>(in);
    anyccl_vec16* o = reinterpret_cast<anyccl_vec16*>(out);
    // Vector i of rank r's slot of this call's set in `buf`, first or second half.
    const auto slot_of = [&](const void* buf, int r, size_t half, size_t i) {
        return reinterpret_cast<anyccl_vec16*>(const_cast<void*>(buf)) + c.set_vecs +
               (size_t)r * ANYCCL_PUSH_SLOT_VECS + half + i;
    };
    // 1. Scatter: chunk q of the input to its owner q.
    for (size_t i = first; i < chunk; i += stride) {
#pragma unroll
        for (int q = 0; q < W; q++) {
            const size_t v = (size_t)q * chunk + i;
            if (q != rank && v < n_vec) anyccl_st_vec_volatile(slot_of(recv.p[q], rank, 0, i), push_canonical(src[v]));
        }
    }
    anyccl_launch_dependents();
    bool stop = false;
    const size_t mine_start = (size_t)rank * chunk;
    const size_t mine_len = mine_start < n_vec ? anyccl_min_size(chunk, n_vec - mine_start) : 0;
    // 2. Reduce this rank's chunk (the peers' parts from the first halves of its slots), keep it, send it.
    for (size_t i = first; i < mine_len; i += stride) {
        // push_reduce_vec's slots are the first halves of this set's slots, indexed by the chunk's vector i; its
        // own part is its input at the chunk's offset.
        const anyccl_vec16 sum = push_reduce_vec<T, W>(src + mine_start, c.slots, rank, i, my_flags, stop);
        o[mine_start + i] = sum;
        const anyccl_vec16 sent = push_canonical(sum);
#pragma unroll
        for (int q = 0; q < W; q++)
            if (q != rank) anyccl_st_vec_volatile(slot_of(recv.p[q], rank, ANYCCL_PUSH_HALF_VECS, i), sent);
    }
    // 3. Gather the other chunks from the second halves of this rank's slots.
    const anyccl_vec16 empty = push_empty();
    for (size_t i = first; i < chunk; i += stride) {
        anyccl_vec16 v[W];
        // All loads in flight before the first wait.
#pragma unroll
        for (int q = 0; q < W; q++)
            if (q != rank && (size_t)q * chunk + i < n_vec)
                v[q] = anyccl_ld_vec_volatile(slot_of(c.mine, q, ANYCCL_PUSH_HALF_VECS, i));
#pragma unroll
        for (int q = 0; q < W; q++) {
            const size_t at = (size_t)q * chunk + i;
            if (q == rank || at >= n_vec) continue;
            anyccl_vec16* s = slot_of(c.mine, q, ANYCCL_PUSH_HALF_VECS, i);
            o[at] = push_wait(s, v[q], my_flags, stop);
            anyccl_st_vec_volatile(s, empty);
        }
    }
    push_end(c);
}

// The push one-shot and push two-shot kernels of element type T, named by NAME; the same names and parameters on
// every vendor.
#define ANYCCL_PUSH_KERNELS(NAME, T)                                                                                 \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_push_one_shot_##NAME(                                     \
        const void* in, void* out, RankPtrs recv, const uint32_t* my_flags, int rank, int world, size_t n_vec) {     \
        ANYCCL_DISPATCH(push_one_shot, T, in, out, recv, my_flags, rank, n_vec)                                      \
    }                                                                                                                \
    extern "C" __global__ void ANYCCL_LAUNCH_BOUNDS anyccl_push_two_shot_##NAME(                                     \
        const void* in, void* out, RankPtrs recv, const uint32_t* my_flags, int rank, int world, size_t n_vec) {     \
        ANYCCL_DISPATCH(push_two_shot, T, in, out, recv, my_flags, rank, n_vec)                                      \
    }
