/* One build of all the kernels (matmul, dequantize, the fused decode step) for one instruction
 * set: each csrc/pk_isa_*.c defines PK_MAKER and includes this file, and setup.py compiles it
 * with that set's flags. Every function is static, so the builds never share a symbol; only
 * PK_MAKER (which creates the module object) is visible to csrc/pk_module.c. */
#ifndef PK_MAKER
#error "define PK_MAKER before including pk_unity.h"
#endif
#include <Python.h>
PyObject *PK_MAKER(void);
#include "poly_kernels.c"
#include "pk_gemm.h"
#include "pk_decode.c"
#include "pk_decode_args.c"
#include "pk_rope.h"
#include "pk_softmax.h"
