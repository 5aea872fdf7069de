/* Preloaded into a child of dropin/tests/accel.rs: getenv answers values set per thread, so that ranks run as
 * threads of one process can act as if on different hosts (ANYCCL_HOST_ID) or with different settings
 * (ANYCCL_CUSTOM_MAX_BYTES, ANYCCL_DISABLE, ANYCCL_TUNE_FILE, ...): the drop-in reads them through getenv on the
 * thread of each rank's call. Every other name, and a thread that set nothing, gets the C library's answer. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#define MAX_VARS 8

/* This thread's overrides: names and values (the strings must outlive the thread's use of them). */
static __thread const char* names[MAX_VARS];
static __thread const char* values[MAX_VARS];

/* Sets this thread's answer for `name` (NULL value: the C library's answer again). Returns 0, or -1 when the
 * thread already overrides MAX_VARS other names. */
int threadenv_set(const char* name, const char* value) {
    int free_slot = -1;
    for (int i = 0; i < MAX_VARS; i++) {
        if (names[i] && strcmp(names[i], name) == 0) {
            values[i] = value;
            if (!value) names[i] = NULL;
            return 0;
        }
        if (!names[i] && free_slot < 0) free_slot = i;
    }
    if (!value) return 0;
    if (free_slot < 0) return -1;
    names[free_slot] = name;
    values[free_slot] = value;
    return 0;
}

/* Sets this thread's ANYCCL_HOST_ID (the first user's entry point). */
void threadenv_set_host_id(const char* value) { (void)threadenv_set("ANYCCL_HOST_ID", value); }

char* getenv(const char* name) {
    static char* (*real)(const char*);
    if (name)
        for (int i = 0; i < MAX_VARS; i++)
            if (names[i] && strcmp(names[i], name) == 0) return (char*)values[i];
    if (!real) real = (char* (*)(const char*))dlsym(RTLD_NEXT, "getenv");
    return real ? real(name) : NULL;
}
