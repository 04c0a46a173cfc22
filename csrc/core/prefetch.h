/* Prefetching the weight rows a kernel streams: one cache line, or a line into L2 only. */
#ifndef POLY_CORE_PREFETCH_H
#define POLY_CORE_PREFETCH_H

/* Rows are streamed once: ask for a row a few ahead so its cache-line misses overlap the
 * decoding of this one (the hardware prefetcher alone left the 4-bit kernels at ~4 GB/s). */
#ifndef PF_LOC
#define PF_LOC 3
#endif
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif
/* gcc 12 deletes a loop whose body is only __builtin_prefetch (it has no side effects to
 * keep), so the x86 build issues the instruction with volatile asm. */
static inline void prefetch_line(const char *p) {
#if defined(__x86_64__) || defined(__i386__)
#if PF_LOC == 0
    __asm__ volatile("prefetchnta %0" : : "m"(*p));
#else
    __asm__ volatile("prefetcht0 %0" : : "m"(*p));
#endif
#else
    __builtin_prefetch(p, 0, PF_LOC);
#endif
}

/* a line into L2 only: bytes wanted a while ahead, which in L1 would evict the ones in use */
static inline void prefetch_l2(const char *p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__ volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
}

#endif /* POLY_CORE_PREFETCH_H */
