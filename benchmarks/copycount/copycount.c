/* Counts, from inside a process, the bytes it copies with memcpy/memmove and the bytes of the
   blocks it allocates, in calls of at least HPS_COPYCOUNT_MIN bytes (default 4096), into four
   u64 counters in a file HPS_COPYCOUNT_DIR/<pid> that another process reads while this one runs:
     [0] bytes memcpy'd or memmove'd   [1] such calls
     [2] bytes allocated               [3] such allocations
   Loaded with LD_PRELOAD by benchmarks/copies.py (built there with cc; Linux, glibc). The
   early buffer serves dlsym's own allocations before the real functions are known. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static volatile uint64_t dummy[4];
static volatile uint64_t *counters = dummy;
static size_t THRESH = 4096;
static void *(*real_memcpy)(void *, const void *, size_t);
static void *(*real_memmove)(void *, const void *, size_t);
static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static char early[1 << 16];
static size_t early_used;
static int resolving;

static void resolve(void) {
    if (real_malloc || resolving) return;
    resolving = 1;
    real_memcpy = dlsym(RTLD_NEXT, "memcpy");
    real_memmove = dlsym(RTLD_NEXT, "memmove");
    real_calloc = dlsym(RTLD_NEXT, "calloc");
    real_realloc = dlsym(RTLD_NEXT, "realloc");
    real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
    real_malloc = dlsym(RTLD_NEXT, "malloc");
    resolving = 0;
}

__attribute__((constructor)) static void init(void) {
    resolve();
    const char *min = getenv("HPS_COPYCOUNT_MIN");
    if (min) THRESH = (size_t)strtoull(min, NULL, 10);
    const char *dir = getenv("HPS_COPYCOUNT_DIR");
    if (!dir) return;
    char path[4096];
    snprintf(path, sizeof path, "%s/%d", dir, (int)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    if (ftruncate(fd, 4096) == 0) {
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p != MAP_FAILED) counters = p;
    }
    close(fd);
}

/* The calling thread's own counts, the same four: a line tracer in Python reads them
   (ctypes) to say which source line copied (copies.py --sites). */
static __thread uint64_t mine[4];
uint64_t *copycount_thread(void) { return mine; }

static inline void big_copy(size_t n) {
    if (n >= THRESH) {
        __atomic_add_fetch(&counters[0], n, __ATOMIC_RELAXED);
        __atomic_add_fetch(&counters[1], 1, __ATOMIC_RELAXED);
        mine[0] += n;
        mine[1]++;
    }
}
static inline void big_alloc(size_t n) {
    if (n >= THRESH) {
        __atomic_add_fetch(&counters[2], n, __ATOMIC_RELAXED);
        __atomic_add_fetch(&counters[3], 1, __ATOMIC_RELAXED);
        mine[2] += n;
        mine[3]++;
    }
}

void *memcpy(void *d, const void *s, size_t n) {
    if (!real_memcpy) { char *dd = d; const char *ss = s; while (n--) *dd++ = *ss++; return d; }
    big_copy(n);
    return real_memcpy(d, s, n);
}
void *memmove(void *d, const void *s, size_t n) {
    if (!real_memmove) { char *dd = d; const char *ss = s; if (dd < ss) while (n--) *dd++ = *ss++; else { dd += n; ss += n; while (n--) *--dd = *--ss; } return d; }
    big_copy(n);
    return real_memmove(d, s, n);
}
void *malloc(size_t n) {
    resolve();
    if (!real_malloc) { void *p = early + early_used; early_used += (n + 15) & ~(size_t)15; return p; }
    big_alloc(n);
    return real_malloc(n);
}
void *calloc(size_t a, size_t b) {
    resolve();
    if (!real_calloc) { void *p = early + early_used; early_used += (a * b + 15) & ~(size_t)15; return p; }
    big_alloc(a * b);
    return real_calloc(a, b);
}
void *realloc(void *p, size_t n) {
    resolve();
    big_alloc(n);
    return real_realloc(p, n);
}
int posix_memalign(void **p, size_t a, size_t n) {
    resolve();
    big_alloc(n);
    return real_posix_memalign(p, a, n);
}
void *aligned_alloc(size_t a, size_t n) {
    resolve();
    big_alloc(n);
    return real_aligned_alloc(a, n);
}
static void (*real_free)(void *);
void free(void *p) {
    if ((char *)p >= early && (char *)p < early + sizeof early) return;
    if (!real_free) real_free = dlsym(RTLD_NEXT, "free");
    real_free(p);
}
