/* float16 <-> float32 of one value (F16C on the SIMD builds, bit arithmetic on the base build). */
#ifndef POLY_CORE_HALF_H
#define POLY_CORE_HALF_H
#include "core/common.h"

static inline float h2f(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if PK_SIMD
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, f = h & 1023, u;
    if (e == 31) u = s | 0x7F800000u | (f << 13);
    else if (e) u = s | ((e + 112) << 23) | (f << 13);
    else { float v = (float)f * 5.9604644775390625e-08f; memcpy(&u, &v, 4); u |= s; }
    float r; memcpy(&r, &u, 4); return r;
#endif
}

/* float -> float16 bits, rounded to nearest even like numpy's astype(float16) (subnormals
 * included, overflow to infinity, NaN kept quiet) */
static inline uint16_t f2h(float f) {
#if PK_SIMD
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t s = (uint16_t)((u >> 16) & 0x8000);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return s | 0x7E00 | ((a >> 13) & 0x3FF); /* NaN */
    if (a >= 0x477FF000u) return s | 0x7C00;                     /* rounds to 65520 or more: inf */
    if (a >= 0x38800000u) {                                        /* normal: rebias, round 13 bits */
        const uint32_t m = a - (112u << 23);
        return s | (uint16_t)((m + 0xFFFu + ((m >> 13) & 1)) >> 13);
    }
    if (a <= 0x33000000u) return s; /* 2^-25 or less: zero (the tie goes to even) */
    const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u, sh = 126 - (a >> 23); /* sh in 14..24 */
    uint32_t r = mant >> sh;
    const uint32_t rem = mant & ((1u << sh) - 1), half = 1u << (sh - 1);
    r += rem > half || (rem == half && (r & 1));
    return s | (uint16_t)r;
#endif
}

#endif /* POLY_CORE_HALF_H */
