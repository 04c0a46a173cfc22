/* A matmul's rows split over the threads, each range through its range function. */
#ifndef POLY_ROWS_RUN_H
#define POLY_ROWS_RUN_H
#include "core/common.h"
#include "rows/ranges.h"

/* rows [0, m) split over nt threads, each range through the fused step's range function f
 * (pairs and quads of rows as there, so both give the same sums) */
static void run_rows(range_fn f, const mm_args *A, int nt) {
#pragma omp parallel num_threads(nt)
    {
        const int tid = pk_tid(), nth = pk_nth();
        f(A, A->m * tid / nth, A->m * (tid + 1) / nth);
    }
}

#endif /* POLY_ROWS_RUN_H */
