/* Shared by the drop-in's timing programs (host_time.c, host_time_cpu.c): opening a library privately and looking up
 * its symbols, exiting with a message on failure. Included by path next to them; a header only, nothing to link. */
#ifndef ANYCCL_DROPIN_BENCH_LIB_H
#define ANYCCL_DROPIN_BENCH_LIB_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

/* `name` in the library `handle` (opened from `lib`, named in the error), or exit(1) when it does not export it. */
static void* sym(void* handle, const char* lib, const char* name) {
    void* p = dlsym(handle, name);
    if (!p) {
        fprintf(stderr, "error: %s does not export %s\n", lib, name);
        exit(1);
    }
    return p;
}

/* `path` opened with dlopen(RTLD_NOW | RTLD_LOCAL), so its symbols stay out of the global scope and each name is
 * looked up in this library only; exit(1) with dlerror's text when it cannot be opened. */
static void* open_local(const char* path) {
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fprintf(stderr, "error: dlopen(%s): %s\n", path, dlerror());
        exit(1);
    }
    return handle;
}

#endif
