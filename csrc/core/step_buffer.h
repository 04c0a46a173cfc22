/* The fused step's scratch (decode/run.h carves it), kept between calls in the calling thread.
 * A malloc and free per call landed in the heap, and each call asked a few KiB more than the last
 * (the scores grow with the position): when a small object was allocated above the freed block,
 * the next call could not reuse it and the heap grew by another block. A 1023-token SmolLM2
 * prefill's peak RSS moved between 220 and 253 MiB from run to run that way. Mapped outside the
 * heap, grown with headroom, unmapped when the thread exits. */
#ifndef POLY_CORE_STEP_BUFFER_H
#define POLY_CORE_STEP_BUFFER_H
#include <pthread.h>
#include <sys/mman.h>
#include <stddef.h>

typedef struct {
    void *p;
    size_t cap;
} step_buf_t;

static __thread step_buf_t sb_mine;
static pthread_key_t sb_key;
static pthread_once_t sb_once = PTHREAD_ONCE_INIT;

static void sb_release(void *arg) {
    step_buf_t *b = arg;
    if (b && b->p) munmap(b->p, b->cap);
    if (b) b->p = NULL, b->cap = 0;
}

static void sb_make_key(void) { (void)pthread_key_create(&sb_key, sb_release); }

/* `bytes` of page-aligned scratch (zeroed only when first mapped), NULL when the mapping fails */
static float *step_buffer(size_t bytes) {
    if (bytes <= sb_mine.cap) return sb_mine.p;
    sb_release(&sb_mine);
    const size_t unit = (size_t)2 << 20; /* whole 2 MiB: a step a little longer reuses it */
    const size_t cap = (bytes + bytes / 8 + unit - 1) / unit * unit;
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    sb_mine.p = p, sb_mine.cap = cap;
    (void)pthread_once(&sb_once, sb_make_key);
    (void)pthread_setspecific(sb_key, &sb_mine);
    return p;
}

#endif /* POLY_CORE_STEP_BUFFER_H */
