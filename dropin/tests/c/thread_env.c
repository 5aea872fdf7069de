/* Preloaded into a child of dropin/tests/accel.rs: getenv("ANYCCL_HOST_ID") answers a value set per thread, so that
 * ranks run as threads of one process can act as if on different hosts (the drop-in reads the variable through
 * getenv when its custom kernels are set up, on the thread of each rank's call). Every other name, and a thread
 * that set nothing, gets the C library's answer. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

static __thread const char* host_id;

/* Sets this thread's answer (the string must outlive the thread's use of it; NULL: the C library's answer). */
void threadenv_set_host_id(const char* value) { host_id = value; }

char* getenv(const char* name) {
    static char* (*real)(const char*);
    if (host_id && name && strcmp(name, "ANYCCL_HOST_ID") == 0) return (char*)host_id;
    if (!real) real = (char* (*)(const char*))dlsym(RTLD_NEXT, "getenv");
    return real ? real(name) : NULL;
}
