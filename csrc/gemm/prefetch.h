/* Prefetch cursors of the gemm panels: where a panel's stored bytes start and the next chunk. */
#ifndef POLY_GEMM_PREFETCH_H
#define POLY_GEMM_PREFETCH_H
#include "formats/interleave16.h"
#include "gemm/dequant.h"
#include "gemm/panels.h"

/* where panel r0's stored bytes start, their stride and a row's length (rows repacked by 16: the
 * groups' records, one run) */
static inline pf_cur pf_panel(int kind, const dq_args *D, int64_t r0, int64_t rows) {
    pf_cur c = {0};
    if (r0 < 0) return c;
    if (D->rp) {
        const int64_t g = il16_rec(kind) * (D->k / 32);
        c.p = (const char *)D->rp + (r0 / 16) * g; c.bytes = (rows + 15) / 16 * g; c.rows = 1;
    } else {
        c.p = (const char *)D->w + r0 * D->rb; c.stride = D->rb; c.bytes = D->rb; c.rows = rows;
    }
    return c;
}

/* the chunk of float rows from column c1 on (past the last: the next panel's first chunk) */
static inline pf_cur pf_chunk(int kind, const dq_args *D, int64_t r0, int64_t rows, int64_t next, int64_t c1, int esz) {
    const int last = c1 >= D->k;
    const int64_t from = last ? 0 : c1;
    pf_cur c = pf_panel(kind, D, last ? next : r0, last ? GR : rows);
    if (c.rows) { c.p += esz * from; c.bytes = esz * (D->k - from < KC ? D->k - from : KC); }
    return c;
}

#endif /* POLY_GEMM_PREFETCH_H */
