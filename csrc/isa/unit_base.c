/* The kernels for the "base" instruction set, compiled by setup.py with no SIMD flags (any x86-64 or other CPU): the plain C loops. */
#define PK_MAKER pk_make_base
#include "isa/unit.h"
