/* A row's stored K-quant super-block rebuilt from its 8-row record (csrc/pk_r8k.h has the layouts):
 * the prompt panels (pk_k8i.h) decode the records of a matrix repacked by 8, so its stored rows are
 * read once at load (the repack) and their pages released: one copy resident, not two (1B Q4_K_M
 * 1606 MB with both). The bytes are the stored ones exactly, so the panels are too. Included by
 * pk_k8i.h. */
#ifndef PK_R8K_SB_H
#define PK_R8K_SB_H

#define R8K_REC 1184  /* Q4_K: 8 rows x 144 bytes + 32 */
#define R8K6_REC 1680 /* Q6_K: 8 rows x 210 bytes */

/* the 144 (Q4_K) or 210 (Q6_K) stored bytes of row `row`, super-block sb into p, from the records rk
 * of a matrix of nsb super-blocks a row */
static inline void r8k_sb(int kind, const uint8_t *rk, int64_t nsb, int64_t row, int64_t sb, uint8_t *p) {
    const int r = (int)(row % 8);
    if (kind == K_Q4_K) {
        const uint8_t *R = rk + (row / 8 * nsb + sb) * R8K_REC;
        uint8_t sc[8], mn[8];
        memcpy(p, R + 2 * r, 2);      /* d */
        memcpy(p + 2, R + 16 + 2 * r, 2); /* dmin */
        for (int j = 0; j < 8; j++) sc[j] = R[32 + 8 * j + r];
        for (int i = 0; i < 4; i++) { mn[2 * i] = R[96 + 16 * i + 2 * r]; mn[2 * i + 1] = R[96 + 16 * i + 2 * r + 1]; }
        for (int j = 0; j < 4; j++) { /* the 12 bytes of 6-bit scales and mins (pk_k8.h k8_scales) */
            p[4 + j] = (uint8_t)((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
            p[8 + j] = (uint8_t)((mn[j] & 63) | (mn[j + 4] >> 4) << 6);
            p[12 + j] = (uint8_t)((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
        }
        for (int v = 0; v < 32; v++) memcpy(p + 16 + 4 * v, R + 160 + 32 * v + 4 * r, 4); /* byte 32 i + 4 t + b */
    } else { /* K_Q6_K */
        const uint8_t *R = rk + (row / 8 * nsb + sb) * R8K6_REC;
        for (int v = 0; v < 32; v++) memcpy(p + 4 * v, R + 144 + 32 * v + 4 * r, 4);        /* ql */
        for (int v = 0; v < 16; v++) memcpy(p + 128 + 4 * v, R + 1168 + 32 * v + 4 * r, 4); /* qh */
        for (int i = 0; i < 8; i++) memcpy(p + 192 + 2 * i, R + 16 + 16 * i + 2 * r, 2);    /* int8 scales */
        memcpy(p + 208, R + 2 * r, 2);                                                       /* d */
    }
}

#endif /* PK_R8K_SB_H */
