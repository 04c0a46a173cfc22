/* The kernels for the "avx2" instruction set, compiled by setup.py with -mavx2 -mfma -mf16c: the 8-lane kernels. */
#define PK_MAKER pk_make_avx2
#include "isa/unit.h"
