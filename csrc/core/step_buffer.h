/* Kept buffers of the calling thread, one per slot, held between calls: the fused step's scratch
 * (decode/run.h carves it) and a gemm's padded copy of its inputs (gemm/gemm.h), which for the
 * prompt attention's scores grows with the context. A malloc and free per call landed in the
 * heap, and each call asked a few KiB more than the last: when a small object was allocated above
 * the freed block, the next call could not reuse it and the heap grew by another block, so a
 * prefill's peak RSS moved from run to run (docs/performance.md, sessions 17-18). Mapped outside
 * the heap, grown with headroom, unmapped when the thread exits. */
#ifndef POLY_CORE_STEP_BUFFER_H
#define POLY_CORE_STEP_BUFFER_H
#include <pthread.h>
#include <sys/mman.h>
#include <stddef.h>

enum { KEPT_STEP, KEPT_GEMM_X, KEPT_SLOTS }; /* a slot's buffer is in use by one caller at a time */

typedef struct {
    void *p;
    size_t cap;
} step_buf_t;

static __thread step_buf_t sb_mine[KEPT_SLOTS];
static pthread_key_t sb_key;
static pthread_once_t sb_once = PTHREAD_ONCE_INIT;

static void sb_release(step_buf_t *b) {
    if (b->p) munmap(b->p, b->cap);
    b->p = NULL, b->cap = 0;
}

static void sb_release_all(void *arg) {
    step_buf_t *slots = arg;
    for (int i = 0; slots && i < KEPT_SLOTS; i++) sb_release(&slots[i]);
}

static void sb_make_key(void) { (void)pthread_key_create(&sb_key, sb_release_all); }

/* `bytes` of page-aligned memory in this thread's `slot` (zeroed only when first mapped), NULL when
 * the mapping fails */
static void *kept_buffer(int slot, size_t bytes) {
    step_buf_t *b = &sb_mine[slot];
    if (bytes <= b->cap) return b->p;
    sb_release(b);
    const size_t unit = (size_t)2 << 20; /* whole 2 MiB: a call a little larger reuses it */
    const size_t cap = (bytes + bytes / 8 + unit - 1) / unit * unit;
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    b->p = p, b->cap = cap;
    (void)pthread_once(&sb_once, sb_make_key);
    (void)pthread_setspecific(sb_key, sb_mine);
    return p;
}

static float *step_buffer(size_t bytes) { return kept_buffer(KEPT_STEP, bytes); }

#endif /* POLY_CORE_STEP_BUFFER_H */
