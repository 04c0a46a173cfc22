/* The kernels for the "avx512" instruction set, compiled by setup.py with AVX-512
 * F/BW/DQ/VL/VNNI on top of AVX2 + FMA + F16C: the same 8-lane kernels with EVEX encodings,
 * 32 vector registers and VNNI integer dot products (vpdpbusd). */
#define PK_MAKER pk_make_avx512
#include "isa/unit.h"
