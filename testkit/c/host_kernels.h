/* The host runner of anyccl's kernels (host_kernels.cpp): the kernel source of kernels-common compiled for the CPU,
 * which the fake HIP runtime (and the fake CUDA driver over it) calls to run a launch. */
#ifndef ANYCCL_HOST_KERNELS_H
#define ANYCCL_HOST_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One run of a launch: what the runner needs from the caller, and what it reports. */
struct anyccl_host_run {
    /* This rank's abort word (NULL: the kernel has none): read through anyccl_ld_volatile. */
    const uint32_t* abort_word;
    /* How long a block may wait for its peers without progress before the runner stops it (its abort word then
     * reads as set). */
    int timeout_ms;
    /* Set by the runner: the kernel read its abort word set (1); a block gave up waiting (1). */
    int aborted, timed_out;
    /* Waits up to `ms` milliseconds for a store of another run (or a host write of an abort word), unless
     * `*stores` (the runner's count of stores, atomic) differs from `seen` once the caller counts as a sleeper. */
    void (*sleep)(int ms, const unsigned* stores, unsigned seen);
    /* A block starts (+1) or stops (-1) waiting for its peers. */
    void (*waiting)(int delta);
    /* A store peers may poll for was made (after `*stores` moved on): wakes the sleepers. */
    void (*stored)(void);
};

/* Runs the kernel `name` (an anyccl kernel of kernels-common) with kernelParams-style `params` (one pointer per
 * parameter, in the kernel's order) on `grid` blocks of `block` threads, in the calling thread (each block on its own
 * OS thread when `parallel`). 0 when it ran to its end; -1: no such kernel; -2: a bad block size; -3: out of
 * memory or threads. */
int anyccl_host_launch(const char* name, void** params, unsigned grid, unsigned block, int parallel,
                       struct anyccl_host_run* run);

#ifdef __cplusplus
}
#endif

#endif
