/* Matrix products straight from GGUF's quantized blocks (swarmlm's own code; layouts as gguf-py documents them).
 *
 * A weight matrix W [N, K] is N rows of K/QK blocks, each block exactly as the file stores it. Every function here
 * computes y[r, n] = sum_k x[r, k] * W[n, k] for float32 activations x [R, K]: a block is turned into QK floats in
 * registers or a small L1 buffer and multiplied in float32, so the result is the dequantized weights' product up
 * to float32 summation order -- except Q4_0, Q4_1, Q8_0 and the K-quants (Q4_K, Q5_K, Q6_K), whose activations are
 * first rounded to int16 per block of 32 and multiplied in integers at every row count (act16.c; the plain-C build
 * multiplies the same rounded activations by the dequantized blocks). Decoding is memory-bound, so reading 4-8x
 * fewer bytes than float32 is the whole gain; the unpacking must only keep up with memory.
 *
 * Per type one function turns a block into floats (`dq_*`), the same values gguf-py's dequantize gives. Q4_0, Q4_1
 * and Q8_0 (the common files; the llama-1b / llama-8b presets) are kept "split" (packed_repack): a row's quants for
 * all its blocks first, then its scales (and Q4_1's mins) as the file's fp16 -- the file's bytes exactly -- so
 * act16.c reads a chunk's nibbles as one vector. The K-quants (the "K_M" files) are split too (split_q45_k_row,
 * split_q6_k_row: Q4_0's nibble order, their high bits in act16's word order, scales as bytes; 1.03x, 1.02x and 1x
 * the file). Q8_M (swarmlm's own int8) is unpacked in AVX-512 / AVX2 registers by the float tiles below; every other
 * type keeps the file's own block layout and is unpacked through a block buffer.
 * Each fast tile is compiled once per type (the type a constant: no branch per block, ~2x on one row).
 * `packed_matmul_threads` splits a product's rows between this library's own worker threads (packed_set_threads).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include "ahead.h"

#define QK 32
#define QK_K 256

/* act16.c: Q4_0 / Q4_1 / Q8_0 / Q4_K products with activations rounded to int16 blocks (in integers where the vector unit can) */
int act16_rounds(int ggml_type);
int64_t act16_integer_rows(int ggml_type);
const void *act16_prepare_rows(int ggml_type, const float *x, int64_t rows, int64_t k);
int act16_one_lane(int ggml_type, int64_t nb);
const float *act16_round_rows(const float *x, int64_t rows, int64_t k);
int act16_layout(int ggml_type, int64_t rows, int64_t k);
void act16_product(int ggml_type, const uint8_t *w, int64_t row_bytes, const void *prepared, int64_t rows, int64_t k,
                   float *y, int64_t n, int64_t n0, int64_t n1);
int64_t act16_row_group(const void *prepared);

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- one block -> floats (the reference every fast path must equal) ---- */

static void dq_q4_0(const uint8_t *b, float *y) {  /* d fp16, 16 bytes: low nibbles w0..15, high w16..31 */
    const float d = fp16(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 0xf) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static void dq_q4_1(const uint8_t *b, float *y) {  /* d, m fp16, 16 bytes */
    const float d = fp16(b), m = fp16(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 0xf) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static void dq_q5_0(const uint8_t *b, float *y) {  /* d fp16, qh u32 (bit j: 5th bit of w_j), 16 bytes */
    const float d = fp16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((int)((b[6 + j] & 0xf) | (((qh >> j) & 1) << 4)) - 16);
        y[j + 16] = d * (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}

static void dq_q5_1(const uint8_t *b, float *y) {  /* d, m fp16, qh u32, 16 bytes */
    const float d = fp16(b), m = fp16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[8 + j] & 0xf) | (((qh >> j) & 1) << 4)) + m;
        y[j + 16] = d * (float)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
}

static void dq_q8_0(const uint8_t *b, float *y) {  /* d fp16, 32 int8 */
    const float d = fp16(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = d * (float)q[j];
}

/* K-quants' 6-bit sub-block scales and mins, 8 of each in 12 bytes */
static inline void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* the 6-bit scale and min of sub-block g alone (k_scales decodes all eight) */
static inline void k_scale(const uint8_t *k, int g, int *sc, int *mn) {
    const int i = g & 3;
    *sc = g < 4 ? k[i] & 63 : (k[i + 8] & 0xf) | ((k[i] >> 2) & 0x30);
    *mn = g < 4 ? k[i + 4] & 63 : (k[i + 8] >> 4) | ((k[i + 4] >> 2) & 0x30);
}

static void dq_f16(const uint8_t *b, float *y) {
    for (int j = 0; j < QK; j++) y[j] = fp16(b + 2 * j);
}

/* Q8_M, swarmlm's own (not a GGUF type): float32 d, float32 m, 32 uint8 -- asymmetric 8-bit, weight = d q + m. What
 * --quant int8 makes of a float checkpoint: the block's full range in 256 steps (Q8_0's symmetric 255 steps of
 * +-absmax waste half of them on a skewed block). Its value is fma(d, q, m): one rounding on every path. */
#define Q8_M 1001
static void dq_q8_m(const uint8_t *b, float *y) {
    float d, m;
    memcpy(&d, b, 4);
    memcpy(&m, b + 4, 4);
    for (int j = 0; j < 32; j++) y[j] = __builtin_fmaf(d, (float)b[8 + j], m);  /* one rounding, as the AVX-512 path */
}

static void dq_bf16(const uint8_t *b, float *y) {
    for (int j = 0; j < QK; j++) y[j] = bf16(b + 2 * j);
}

typedef void (*dq_fn)(const uint8_t *, float *);

typedef struct {
    int ggml_type;      /* GGMLQuantizationType's number */
    int block_weights;  /* QK or QK_K (F16/BF16 are cut into blocks of 32 here) */
    int block_bytes;
    dq_fn dq;
} block_type;

static const block_type TYPES[] = {
    {2, QK, 18, dq_q4_0},     {3, QK, 20, dq_q4_1},     {6, QK, 22, dq_q5_0},     {7, QK, 24, dq_q5_1},
    {8, QK, 34, dq_q8_0},     {12, QK_K, 144, 0 /* split at load: split_dq_q4_k */}, {13, QK_K, 176, 0 /* split at load: split_dq_q45_k */}, {14, QK_K, 210, 0 /* split at load: split_dq_q6_k */},
    {1, QK, 64, dq_f16},      {30, QK, 64, dq_bf16},    {Q8_M, QK, 40, dq_q8_m},
};

static const block_type *find_type(int ggml_type) {
    for (unsigned i = 0; i < sizeof(TYPES) / sizeof(TYPES[0]); i++)
        if (TYPES[i].ggml_type == ggml_type) return &TYPES[i];
    return 0;
}

/* ---- the split layout of Q4_0 / Q4_1 / Q8_0: [quants of every block][d x nb][m x nb (Q4_1)], the scales as the
 * file keeps them (fp16: the file's bytes exactly; Q8_M's float32); Q8_0's quants in act16's order within chunks of
 * 4 blocks (q8_0_at) ---- */

static int split_quant_bytes(int ggml_type) {  /* bytes of one block's quants; 0 = not a split type */
    return ggml_type == 2 || ggml_type == 3 ? 16 : ggml_type == 8 || ggml_type == Q8_M ? 32 : 0;
}

static int split_scales(int ggml_type) { return ggml_type == 3 || ggml_type == Q8_M ? 2 : 1; }

static int split_scale_bytes(int ggml_type) { return ggml_type == Q8_M ? 4 : 2; }

static inline float load_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

/* scale i of a split row's scales (d of block i, or m of block i - nb) */
static inline float split_scale(int ggml_type, const uint8_t *scales, int64_t i) {
    return ggml_type == Q8_M ? load_f32(scales + 4 * i) : fp16(scales + 2 * i);
}

/* Q8_0's quants are kept in act16's order: a chunk of 4 blocks (fewer at a row's end: cn) is 4 quarters of 8 cn
 * bytes, quarter v byte 8 c + t = block c's weight WEIGHT_OF[v][t] (act16.c), so that one sign extension gives
 * the integer products a vector; a one-lane row's (act16_one_lane) whole super-chunks of 16 blocks are 16 groups of
 * 32 bytes instead, one sign extension giving a vector whose lane i holds two of block i's weights. Where weight j
 * of a block sits in act16's word order: vector v (WEIGHT_OF's row), word t; and in the row (q8_0_at): */
static inline int act16_vector(int j) { return (j & 1) * 2 + (j >= 16); }
static inline int act16_word(int j) { return (j & 15) >> 1; }

static inline int64_t q8_0_at(int64_t nb, int64_t b, int j) {
    if (act16_one_lane(8, nb) && b < 16 * (nb / 16))  /* one lane per block: a super-chunk's 16 groups of 32 bytes,
                                                       * group t byte 2 i + e = block 16 s + i's weight 2 t + e */
        return 512 * (b / 16) + 32 * (j / 2) + 2 * (b % 16) + j % 2;
    const int64_t chunk = b / 4, cn = nb - 4 * chunk < 4 ? nb - 4 * chunk : 4;
    return 128 * chunk + 8 * cn * act16_vector(j) + 8 * (b % 4) + act16_word(j);
}

/* One-lane Q4_0 / Q4_1 rows (act16_one_lane: rows of 16 blocks or more, on the AVX-512 builds): the row's whole
 * super-chunks one lane per block -- super-chunk s = blocks 16 s .. 16 s + 15 is 256 bytes, 4 groups of 64; in group g,
 * 16-bit word 2 j + e (e = 0, 1) holds block 16 s + j's weights 8 g + e, 8 g + e + 2, 8 g + e + 4, 8 g + e + 6 in its
 * nibbles from bit 0 up -- and its tail (fewer than 16 blocks) where the split layout has it (16 bytes per block, in
 * place). Where weight w of a super-chunk's block b is (byte of the row, and the nibble's shift in it): */
static inline int64_t one_lane_at(int64_t b, int w, int *shift) {
    const int g = w / 8, e = w % 2, t = (w % 8) / 2;
    *shift = 4 * (t % 2);
    return 256 * (b / 16) + 64 * g + 4 * (b % 16) + 2 * e + t / 2;
}

/* block b of a split row (nb blocks) -> 32 floats, the values dq_* gives for the file's block */
static void split_dq(int ggml_type, const uint8_t *row, int64_t nb, int64_t b, float *y) {
    const int qb = split_quant_bytes(ggml_type);
    const uint8_t *q = row + b * qb, *scales = row + nb * qb;
    const float d = split_scale(ggml_type, scales, b);
    if (ggml_type == 8) {
        for (int j = 0; j < 32; j++) y[j] = d * (float)((const int8_t *)row)[q8_0_at(nb, b, j)];
        return;
    }
    if (ggml_type == Q8_M) {
        const float m = split_scale(ggml_type, scales, nb + b);
        for (int j = 0; j < 32; j++) y[j] = __builtin_fmaf(d, (float)q[j], m);
        return;
    }
    const float m = ggml_type == 3 ? split_scale(ggml_type, scales, nb + b) : -8.0f * d;
    if (act16_one_lane(ggml_type, nb) && b < 16 * (nb / 16)) {
        for (int j = 0; j < 32; j++) {
            int shift;
            const int64_t at = one_lane_at(b, j, &shift);
            y[j] = d * (float)((row[at] >> shift) & 0xf) + m;
        }
        return;
    }
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(q[j] & 0xf) + m;
        y[j + 16] = d * (float)(q[j] >> 4) + m;
    }
}

/* a row of file blocks -> the split row */
static void split_row(int ggml_type, const uint8_t *src, int64_t nb, uint8_t *dst) {
    const block_type *t = find_type(ggml_type);
    const int qb = split_quant_bytes(ggml_type), head = t->block_bytes - qb;  /* d (and m) precede the quants */
    const int sb = split_scale_bytes(ggml_type);
    uint8_t *scales = dst + nb * qb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = src + b * t->block_bytes;
        if (ggml_type == 8)
            for (int j = 0; j < 32; j++) dst[q8_0_at(nb, b, j)] = blk[head + j];
        else if (act16_one_lane(ggml_type, nb) && b < 16 * (nb / 16))
            for (int j = 0; j < 32; j++) {  /* GGUF: weight j in the low nibble of byte j, j + 16 in the high */
                int shift;
                const int64_t at = one_lane_at(b, j, &shift);
                const uint8_t q = j < 16 ? blk[head + j] & 0xf : blk[head + j - 16] >> 4;
                dst[at] = (uint8_t)((dst[at] & ~(0xf << shift)) | (q << shift));
            }
        else
            memcpy(dst + b * qb, blk + head, qb);
        memcpy(scales + sb * b, blk, sb);  /* copied as they are */
        if (ggml_type == 3 || ggml_type == Q8_M) memcpy(scales + sb * (nb + b), blk + sb, sb);
    }
}

/* ---- Q4_K / Q5_K split: [nibbles of every sub-block of 32, in Q4_0's order (byte j: weight j low, j + 16 high)]
 * [Q5_K: the fifth bits, 4 bytes per sub-block: chunk of 4 sub-blocks ch, word w = 8 c + t of act16's order has bit
 * v of nibble w / 16 of byte 16 ch + w % 16 for its vector v's weight][6-bit scales, one byte each][6-bit mins]
 * [d per super-block of 256][dmin per super-block], both the file's fp16: 148 bytes per 256 weights (Q4_K's file:
 * 144, its 6-bit scales and mins packed in 12 bytes), 180 (Q5_K's: 176), the nibbles laid out as act16's integer
 * products read Q4_0's. ---- */
static inline int64_t k_high_bytes(int ggml_type) { return ggml_type == 13 ? 4 : 0; }  /* per sub-block */
static inline int64_t q45_k_row_bytes(int ggml_type, int64_t k) {
    return k / QK * (18 + k_high_bytes(ggml_type)) + k / QK_K * 4;
}

/* super-block u of a split Q4_K / Q5_K row (nsub sub-blocks) -> 256 floats, the values dq_q4_k / dq_q5_k give */
static void split_dq_q45_k(int ggml_type, const uint8_t *row, int64_t nsub, int64_t u, float *y) {
    const uint8_t *high = row + 16 * nsub, *rest = high + k_high_bytes(ggml_type) * nsub;
    const float d = fp16(rest + 2 * nsub + 2 * u), dmin = fp16(rest + 2 * nsub + 2 * (nsub / 8 + u));
    for (int64_t s = 8 * u; s < 8 * u + 8; s++, y += 32) {
        const uint8_t *q = row + 16 * s;
        const float d1 = d * rest[s], m1 = dmin * rest[nsub + s];
        for (int j = 0; j < 32; j++) {
            const int w = 8 * (int)(s % 4) + act16_word(j);
            const int fifth = ggml_type == 13 ? (high[16 * (s / 4) + w % 16] >> (4 * (w / 16) + act16_vector(j))) & 1 : 0;
            y[j] = d1 * (float)((j < 16 ? q[j] & 0xf : q[j - 16] >> 4) | (fifth << 4)) - m1;
        }
    }
}

/* a row of the file's Q4_K / Q5_K super-blocks (nsub / 8 of them) -> the split row */
static void split_q45_k_row(int ggml_type, const uint8_t *src, int64_t nsub, uint8_t *dst) {
    const int five = ggml_type == 13, size = five ? 176 : 144;
    uint8_t *high = dst + 16 * nsub, *rest = high + k_high_bytes(ggml_type) * nsub;
    memset(high, 0, k_high_bytes(ggml_type) * nsub);
    for (int64_t u = 0; u < nsub / 8; u++) {
        const uint8_t *b = src + size * u, *q = b + (five ? 48 : 16), *qh = b + 16;
        uint8_t sc[8], mn[8];
        k_scales(b + 4, sc, mn);
        memcpy(rest + 2 * nsub + 2 * u, b, 2);  /* d and dmin: the file's fp16 */
        memcpy(rest + 2 * nsub + 2 * (nsub / 8 + u), b + 2, 2);
        for (int g = 0; g < 8; g++) {  /* sub-block g: the low (g even) or high nibbles of bytes 32 (g / 2) .. +31 */
            const int64_t s = 8 * u + g;
            rest[s] = sc[g];
            rest[nsub + s] = mn[g];
            uint8_t w[32];
            for (int l = 0; l < 32; l++) w[l] = g & 1 ? q[32 * (g / 2) + l] >> 4 : q[32 * (g / 2) + l] & 0xf;
            for (int j = 0; j < 16; j++) dst[16 * s + j] = (uint8_t)(w[j] | (w[j + 16] << 4));
            if (five)  /* Q5_K's fifth bit of weight l of sub-block g: bit g of qh[l] */
                for (int j = 0; j < 32; j++) {
                    const int word = 8 * (int)(s % 4) + act16_word(j);
                    high[16 * (s / 4) + word % 16] |= (uint8_t)(((qh[j] >> g) & 1) << (4 * (word / 16) + act16_vector(j)));
                }
        }
    }
}

/* ---- Q6_K split: [the 4 low bits of every sub-block of 32, in Q4_0's order][the 2 high bits, 8 bytes per sub-block
 * in act16's word order: chunk of 4 sub-blocks ch, byte 32 ch + 8 c + t holds, from bit 2 v up, those of sub-block
 * c's weight WEIGHT_OF[v][t]][the two int8 scales of each sub-block (its weights 0-15, 16-31)][d fp16 per super-block
 * of 256]: 210 bytes per 256 weights, the file's. The quants are unsigned 6-bit (the value is d sc (q - 32)). ---- */
static inline int64_t q6_k_row_bytes(int64_t k) { return k / QK * 26 + k / QK_K * 2; }

/* the file's Q6_K super-block -> its 256 unsigned 6-bit quants, in weight order (as dq_q6_k reads them) */
static void q6_k_quants(const uint8_t *b, uint8_t *q) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            q[128 * h + l] = (ql[64 * h + l] & 0xf) | ((qh[32 * h + l] & 3) << 4);
            q[128 * h + 32 + l] = (ql[64 * h + 32 + l] & 0xf) | (((qh[32 * h + l] >> 2) & 3) << 4);
            q[128 * h + 64 + l] = (ql[64 * h + l] >> 4) | (((qh[32 * h + l] >> 4) & 3) << 4);
            q[128 * h + 96 + l] = (ql[64 * h + 32 + l] >> 4) | (((qh[32 * h + l] >> 6) & 3) << 4);
        }
}

/* a row of the file's Q6_K super-blocks (nsub / 8 of them) -> the split row */
static void split_q6_k_row(const uint8_t *src, int64_t nsub, uint8_t *dst) {
    uint8_t *high = dst + 16 * nsub, *scales = dst + 24 * nsub, *d = dst + 26 * nsub;
    memset(high, 0, 8 * nsub);
    for (int64_t u = 0; u < nsub / 8; u++) {
        const uint8_t *b = src + 210 * u;
        uint8_t q[QK_K];
        q6_k_quants(b, q);
        memcpy(d + 2 * u, b + 208, 2);
        for (int g = 0; g < 8; g++) {
            const int64_t s = 8 * u + g;
            const uint8_t *w = q + 32 * g;
            for (int j = 0; j < 16; j++) dst[16 * s + j] = (uint8_t)((w[j] & 0xf) | ((w[j + 16] & 0xf) << 4));
            for (int j = 0; j < 32; j++)
                high[32 * (s / 4) + 8 * (s % 4) + act16_word(j)] |= (uint8_t)((w[j] >> 4) << (2 * act16_vector(j)));
            scales[2 * s] = b[192 + 2 * g];  /* the file's scale i covers weights 16 i .. 16 i + 15 */
            scales[2 * s + 1] = b[192 + 2 * g + 1];
        }
    }
}

/* super-block u of a split Q6_K row (nsub sub-blocks) -> 256 floats, the values dq_q6_k gives ((d sc) (q - 32)) */
static void split_dq_q6_k(const uint8_t *row, int64_t nsub, int64_t u, float *y) {
    const uint8_t *high = row + 16 * nsub;
    const int8_t *scales = (const int8_t *)(row + 24 * nsub);
    const float d = fp16(row + 26 * nsub + 2 * u);
    for (int64_t s = 8 * u; s < 8 * u + 8; s++, y += 32)
        for (int j = 0; j < 32; j++) {
            const int low = j < 16 ? row[16 * s + j] & 0xf : row[16 * s + j - 16] >> 4;
            const int h = (high[32 * (s / 4) + 8 * (s % 4) + act16_word(j)] >> (2 * act16_vector(j))) & 3;
            y[j] = (d * (float)scales[2 * s + (j >= 16)]) * (float)((low | (h << 4)) - 32);
        }
}

/* the types the vector builds unpack in registers (rows_fast); Q8_0 and the K-quants: act16.c's integer products
 * at every row count */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
static int has_fast_path(int ggml_type) { return ggml_type == Q8_M; }
#endif

/* ---- dot products of a float block with R activation rows ---- */

#define RMAX 8  /* activation rows handled per pass over a weight row (more rows: the caller loops) */

#if defined(__AVX512F__)
typedef __m512 vf;
#define VL 16
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vsum(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
#define VL 8
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
typedef float vf;
#define VL 1
#define vzero() 0.0f
#define vload(p) (*(p))
#define vfma(a, b, c) ((a) * (b) + (c))
#define vsum(v) (v)
#endif

/* block b of row `row` (nb blocks) as floats, whatever the layout */
static inline void row_block(const block_type *t, const uint8_t *row, int64_t nb, int64_t b, float *y) {
    if (split_quant_bytes(t->ggml_type)) split_dq(t->ggml_type, row, nb, b, y);
    else if (t->ggml_type == 12 || t->ggml_type == 13) split_dq_q45_k(t->ggml_type, row, 8 * nb, b, y);
    else if (t->ggml_type == 14) split_dq_q6_k(row, 8 * nb, b, y);
    else t->dq(row + b * t->block_bytes, y);
}

/* generic: each block unpacked into an L1 buffer, then multiplied with every activation row */
static void rows_generic(const block_type *t, const uint8_t *w, int64_t row_bytes, const float *x, int64_t rows,
                         int64_t k, float *y, int64_t n, int64_t n0, int64_t n1) {
    float buf[QK_K] __attribute__((aligned(64)));
    const int64_t nb = k / t->block_weights;
    for (int64_t i = n0; i < n1; i++) {
        const uint8_t *row = w + i * row_bytes;
        for (int64_t r0 = 0; r0 < rows; r0 += RMAX) {
            const int64_t nr = rows - r0 < RMAX ? rows - r0 : RMAX;
            vf acc[RMAX];
            for (int r = 0; r < nr; r++) acc[r] = vzero();
            for (int64_t b = 0; b < nb; b++) {
                row_block(t, row, nb, b, buf);
                const float *xb = x + r0 * k + b * t->block_weights;
                for (int r = 0; r < nr; r++)
                    for (int j = 0; j < t->block_weights; j += VL)
                        acc[r] = vfma(vload(buf + j), vload(xb + r * k + j), acc[r]);
            }
            for (int r = 0; r < nr; r++) y[(r0 + r) * n + i] = vsum(acc[r]);
        }
    }
}


#if defined(__AVX512F__)
/* block b of a split row -> two vectors of 16 floats (weights 0-15, 16-31) */
static inline void split_block(int ggml_type, const uint8_t *row, int64_t nb, int64_t b, __m512 *lo, __m512 *hi) {
    const int qb = split_quant_bytes(ggml_type);
    const uint8_t *q = row + b * qb, *scales = row + nb * qb;
    const __m512 d = _mm512_set1_ps(split_scale(ggml_type, scales, b));
    const __m512 m = _mm512_set1_ps(split_scale(ggml_type, scales, nb + b));  /* Q8_M: d q + m, q unsigned */
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q))), d, m);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), d, m);
}

static inline void fast_block(int ggml_type, const uint8_t *row, int64_t nb, int64_t b, __m512 *lo, __m512 *hi) {
    split_block(ggml_type, row, nb, b, lo, hi);
}

/* A tile: W weight rows x R activation rows; a block of each weight row is unpacked once and used for all R
 * activation rows. Up to 4 activation rows, each (weight row, activation row) pair keeps two accumulators (a
 * block's low and high halves: independent FMA chains hide the FMA's latency); more rows make enough chains with
 * one. Two weight rows at a time: from memory, 4 rows' streams ran ~1.3x slower than 2 here. Called with constant
 * W, R and SPLIT, so the compiler keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void tile(int ggml_type, const uint8_t *w, int64_t row_bytes,
                                                       int64_t nb, const float *x, int64_t k, float *y, int64_t n,
                                                       int64_t i, int64_t r0, const int W, const int R,
                                                       const int SPLIT) {
    __m512 acc[2][8], acc_hi[2][4];
    for (int a = 0; a < W; a++)
        for (int r = 0; r < R; r++) {
            acc[a][r] = _mm512_setzero_ps();
            if (SPLIT) acc_hi[a][r] = _mm512_setzero_ps();
        }
    const uint8_t *row0 = w + i * row_bytes;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + r0 * k + b * QK;
        ask_ahead(row0, W * row_bytes, nb, b);
        __m512 lo[2], hi[2];
        for (int a = 0; a < W; a++) fast_block(ggml_type, row0 + a * row_bytes, nb, b, &lo[a], &hi[a]);
        for (int r = 0; r < R; r++) {  /* each activation row's block loaded once for the W weight rows */
            const __m512 x0 = _mm512_loadu_ps(xb + r * k), x1 = _mm512_loadu_ps(xb + r * k + 16);
            for (int a = 0; a < W; a++) {
                if (SPLIT) {
                    acc[a][r] = _mm512_fmadd_ps(lo[a], x0, acc[a][r]);
                    acc_hi[a][r] = _mm512_fmadd_ps(hi[a], x1, acc_hi[a][r]);
                } else {
                    acc[a][r] = _mm512_fmadd_ps(hi[a], x1, _mm512_fmadd_ps(lo[a], x0, acc[a][r]));
                }
            }
        }
    }
    for (int a = 0; a < W; a++)
        for (int r = 0; r < R; r++)
            y[(r0 + r) * n + i + a] = _mm512_reduce_add_ps(SPLIT ? _mm512_add_ps(acc[a][r], acc_hi[a][r]) : acc[a][r]);
}

/* one tile function per (type, W, R): the type a constant too, so a block's unpacking has no branch left */
#define TILE(T, W, R, SPLIT) \
    static void tile_##T##_##W##_##R(const uint8_t *w, int64_t rb, int64_t nb, const float *x, int64_t k, \
                                     float *y, int64_t n, int64_t i, int64_t r0) { \
        tile(T, w, rb, nb, x, k, y, n, i, r0, W, R, SPLIT); \
    }
#define TILES(T) \
    TILE(T, 2, 1, 1) TILE(T, 2, 2, 1) TILE(T, 2, 3, 1) TILE(T, 2, 4, 1) TILE(T, 2, 5, 0) TILE(T, 2, 6, 0) \
    TILE(T, 2, 7, 0) TILE(T, 2, 8, 0) TILE(T, 1, 1, 1) TILE(T, 1, 2, 1) TILE(T, 1, 3, 1) TILE(T, 1, 4, 1) \
    TILE(T, 1, 5, 0) TILE(T, 1, 6, 0) TILE(T, 1, 7, 0) TILE(T, 1, 8, 0) \
    static const tile_fn WIDE_##T[9] = {0, tile_##T##_2_1, tile_##T##_2_2, tile_##T##_2_3, tile_##T##_2_4, \
                                        tile_##T##_2_5, tile_##T##_2_6, tile_##T##_2_7, tile_##T##_2_8}; \
    static const tile_fn NARROW_##T[9] = {0, tile_##T##_1_1, tile_##T##_1_2, tile_##T##_1_3, tile_##T##_1_4, \
                                          tile_##T##_1_5, tile_##T##_1_6, tile_##T##_1_7, tile_##T##_1_8};

typedef void (*tile_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int64_t, int64_t, int64_t);
TILES(1001)

static void rows_fast(int ggml_type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t rows, int64_t k,
                      float *y, int64_t n, int64_t n0, int64_t n1) {
    const int64_t nb = k / QK;
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {  /* activation rows, 8 at a time */
        const int nr = rows - r0 < 8 ? (int)(rows - r0) : 8;
        const tile_fn *wide = WIDE_1001, *narrow = NARROW_1001;  /* (Q8_M: the only type rows_fast is for) */
        int64_t i = n0;
        for (; i + 2 <= n1; i += 2) wide[nr](w, row_bytes, nb, x, k, y, n, i, r0);
        for (; i < n1; i++) narrow[nr](w, row_bytes, nb, x, k, y, n, i, r0);
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2 + FMA (CPUs without AVX-512): the split types unpacked in registers, 8 floats a vector. Block b of a split
 * row -> four vectors (weights 0-7, 8-15, 16-23, 24-31), each value rounded once as split_dq rounds it. */
static inline __attribute__((always_inline)) void split_block8(const int T, const uint8_t *row, int64_t nb, int64_t b,
                                                                __m256 w[4]) {
    const int qb = split_quant_bytes(T);
    const uint8_t *q = row + b * qb, *scales = row + nb * qb;
    const __m256 d = _mm256_set1_ps(split_scale(T, scales, b));
    const __m256 m = _mm256_set1_ps(split_scale(T, scales, nb + b));  /* Q8_M: d q + m (q unsigned) */
    for (int j = 0; j < 4; j++) {
        const __m128i v = _mm_loadl_epi64((const __m128i *)(q + 8 * j));
        w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d, m);
    }
}

static inline __attribute__((always_inline)) void fast_block8(const int T, const uint8_t *row, int64_t nb, int64_t b,
                                                               __m256 w[4]) {
    split_block8(T, row, nb, b, w);
}

/* W (1-2) weight rows x R (1-2) activation rows; two accumulators per pair (16 ymm registers in all) */
static inline __attribute__((always_inline)) void tile8(const int T, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                         const float *x, int64_t k, float *y, int64_t n, int64_t i,
                                                         int64_t r0, const int W, const int R) {
    __m256 acc[2][2][2];
    for (int a = 0; a < W; a++)
        for (int r = 0; r < R; r++) acc[a][r][0] = acc[a][r][1] = _mm256_setzero_ps();
    const uint8_t *row0 = w + i * row_bytes;
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[2][4];
        ask_ahead(row0, W * row_bytes, nb, b);
        for (int a = 0; a < W; a++) fast_block8(T, row0 + a * row_bytes, nb, b, v[a]);
        for (int r = 0; r < R; r++) {
            const float *xb = x + (r0 + r) * k + b * QK;
            for (int a = 0; a < W; a++) {
                acc[a][r][0] = _mm256_fmadd_ps(v[a][0], _mm256_loadu_ps(xb), acc[a][r][0]);
                acc[a][r][1] = _mm256_fmadd_ps(v[a][1], _mm256_loadu_ps(xb + 8), acc[a][r][1]);
                acc[a][r][0] = _mm256_fmadd_ps(v[a][2], _mm256_loadu_ps(xb + 16), acc[a][r][0]);
                acc[a][r][1] = _mm256_fmadd_ps(v[a][3], _mm256_loadu_ps(xb + 24), acc[a][r][1]);
            }
        }
    }
    for (int a = 0; a < W; a++)
        for (int r = 0; r < R; r++) y[(r0 + r) * n + i + a] = vsum(_mm256_add_ps(acc[a][r][0], acc[a][r][1]));
}

typedef void (*tile8_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int64_t, int64_t,
                         int64_t);
#define TILE8(T, W, R) \
    static void tile8_##T##_##W##_##R(const uint8_t *w, int64_t rb, int64_t nb, const float *x, int64_t k, \
                                      float *y, int64_t n, int64_t i, int64_t r0) { \
        tile8(T, w, rb, nb, x, k, y, n, i, r0, W, R); \
    }
#define TILES8(T) \
    TILE8(T, 2, 1) TILE8(T, 2, 2) TILE8(T, 1, 1) TILE8(T, 1, 2) \
    static const tile8_fn TILES8_##T[2][3] = {{0, tile8_##T##_1_1, tile8_##T##_1_2}, \
                                               {0, tile8_##T##_2_1, tile8_##T##_2_2}};
TILES8(1001)

/* weight rows two at a time, each pair against every activation row (two at a time) while it is in L1 */
static void rows_fast(int ggml_type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t rows, int64_t k,
                      float *y, int64_t n, int64_t n0, int64_t n1) {
    const int64_t nb = k / QK;
    const tile8_fn (*tiles)[3] = TILES8_1001;  /* (Q8_M: the only type rows_fast is for) */
    for (int64_t i = n0; i < n1; i += 2) {
        const int wide = i + 2 <= n1;
        for (int64_t r0 = 0; r0 < rows; r0 += 2)
            tiles[wide][rows - r0 < 2 ? 1 : 2](w, row_bytes, nb, x, k, y, n, i, r0);
    }
}
#endif

/* ---- the entry points (ctypes): 0 on success, -1 for a type this file does not know ---- */

/* bytes of one row of k weights as held in memory (split types: their split layout); 0 = unknown type or k not a
 * whole number of blocks */
int64_t packed_row_bytes(int ggml_type, int64_t k) {
    const block_type *t = find_type(ggml_type);
    if (!t || k <= 0 || k % t->block_weights) return 0;
    const int qb = split_quant_bytes(ggml_type);
    if (ggml_type == 12 || ggml_type == 13) return q45_k_row_bytes(ggml_type, k);
    if (ggml_type == 14) return q6_k_row_bytes(k);
    return qb ? k / QK * (qb + split_scale_bytes(ggml_type) * split_scales(ggml_type)) : k / t->block_weights * t->block_bytes;
}

/* rows of the file's blocks (src_row_bytes each) -> rows as held in memory (packed_row_bytes each) */
int packed_repack(int ggml_type, const uint8_t *src, int64_t src_row_bytes, int64_t rows, int64_t k, uint8_t *dst) {
    const block_type *t = find_type(ggml_type);
    const int64_t out_bytes = packed_row_bytes(ggml_type, k);
    if (!out_bytes || src_row_bytes != k / t->block_weights * t->block_bytes) return -1;
    for (int64_t i = 0; i < rows; i++) {
        if (split_quant_bytes(ggml_type)) split_row(ggml_type, src + i * src_row_bytes, k / QK, dst + i * out_bytes);
        else if (ggml_type == 12 || ggml_type == 13) split_q45_k_row(ggml_type, src + i * src_row_bytes, k / QK, dst + i * out_bytes);
        else if (ggml_type == 14) split_q6_k_row(src + i * src_row_bytes, k / QK, dst + i * out_bytes);
        else memcpy(dst + i * out_bytes, src + i * src_row_bytes, src_row_bytes);
    }
    return 0;
}

/* The activations as a type's product reads them: x itself, or (types act16 rounds) prepared for the integer
 * products (*prepared) or rounded to int16 blocks in floats; 0 when out of memory. Prepared once per product, or
 * once for products that share their input: `again` = x is unchanged since this thread's previous product (decode.c's
 * k and v after q, up after gate), whose preparation is then taken as it is if it was of the same x laid out alike. */
static const float *activations(int ggml_type, const float *x, int64_t rows, int64_t k, int again,
                                const void **prepared) {
    static _Thread_local struct { const float *x, *xa; const void *prepared; int64_t rows, k; int layout; } last;
    *prepared = 0;
    if (!act16_rounds(ggml_type)) {
        last.xa = 0;  /* what a later `again` would find is no longer this thread's previous preparation */
        return x;
    }
    const int layout = act16_layout(ggml_type, rows, k);
    if (again && last.xa && last.x == x && last.rows == rows && last.k == k && last.layout == layout) {
        *prepared = last.prepared;
        return last.xa;
    }
    const float *xa = rows > act16_integer_rows(ggml_type) ? act16_round_rows(x, rows, k) : x;
    if (xa == x) {
        *prepared = act16_prepare_rows(ggml_type, x, rows, k);
        if (!*prepared) xa = 0;
    }
    last.x = x, last.xa = xa, last.prepared = *prepared, last.rows = rows, last.k = k, last.layout = layout;
    return xa;
}

/* columns [n0, n1) of y [rows, n] from activations as `activations` gave them */
static void product_columns(const block_type *t, const uint8_t *w, int64_t row_bytes, const float *x,
                            const void *prepared, int64_t rows, int64_t k, float *y, int64_t n, int64_t n0, int64_t n1) {
    if (prepared) {
        act16_product(t->ggml_type, w, row_bytes, prepared, rows, k, y, n, n0, n1);
        return;
    }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (has_fast_path(t->ggml_type)) {
        rows_fast(t->ggml_type, w, row_bytes, x, rows, k, y, n, n0, n1);
        return;
    }
#endif
    rows_generic(t, w, row_bytes, x, rows, k, y, n, n0, n1);
}

/* y [rows, n] = x [rows, k] @ W[n0:n1].T ; W is n rows of row_bytes bytes; only columns [n0, n1) of y are written.
 * 0, or -1 for a call that does not fit the type, -2 when out of memory */
int packed_matmul(int ggml_type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t rows, int64_t k,
                  float *y, int64_t n, int64_t n0, int64_t n1) {
    const block_type *t = find_type(ggml_type);
    if (!t || row_bytes != packed_row_bytes(ggml_type, k)) return -1;
    const void *prepared;
    const float *xa = activations(ggml_type, x, rows, k, 0, &prepared);
    if (!xa) return -2;
    product_columns(t, w, row_bytes, xa, prepared, rows, k, y, n, n0, n1);
    return 0;
}

/* ---- worker threads: a product's rows split between the caller and n - 1 workers ----
 * A worker spins briefly for the next product (the products of one block come microseconds apart), then sleeps on
 * a condition variable (between tokens, while torch runs the rest of the layer). One product at a time: a caller
 * that finds the pool busy (another Python thread's product) computes alone. */
#define MAX_THREADS 64
#define SPIN_ROUNDS 2000

typedef struct {
    const block_type *t;
    const uint8_t *w;
    int64_t row_bytes, rows, k, n;
    const float *x;
    float *y;
    int64_t chunk_rows;  /* rows taken at a time (even: tiles are two rows) */
    const void *prepared;  /* x prepared for act16's integer products (once, by the caller), or 0 */
} product;

static product job;
static pthread_mutex_t pool_busy = PTHREAD_MUTEX_INITIALIZER, wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_int generation;
static atomic_llong next_row, rows_done;  /* of the product running: (its generation << 32) | the next row to take,
                                           * and rows finished */
#define ROW_MASK 0xffffffffLL
static int workers;  /* started so far (the pool only grows) */
static int threads_wanted = 1;

/* take chunks of rows of product `gen` until none is left: a thread the OS delays (a shared machine) holds back one
 * chunk at most. A thread still here from an earlier product (delayed between its last chunk and its last look)
 * takes nothing of a later one: next_row carries the generation of the product its rows belong to, and a chunk is
 * taken only by a compare-and-swap on both, so no row is taken (nor counted) but by a thread of its own product. */
static void take_rows(const product *p, unsigned gen) {
    long long v = atomic_load_explicit(&next_row, memory_order_acquire);
    for (;;) {
        if ((unsigned)((unsigned long long)v >> 32) != gen || (v & ROW_MASK) >= p->n) return;
        if (!atomic_compare_exchange_weak_explicit(&next_row, &v, v + p->chunk_rows, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        const int64_t n0 = v & ROW_MASK;
        const int64_t n1 = n0 + p->chunk_rows < p->n ? n0 + p->chunk_rows : p->n;
        product_columns(p->t, p->w, p->row_bytes, p->x, p->prepared, p->rows, p->k, p->y, p->n, n0, n1);
        atomic_fetch_add_explicit(&rows_done, n1 - n0, memory_order_release);
        v = atomic_load_explicit(&next_row, memory_order_acquire);
    }
}

static int pool_generation;  /* the generation when the pool last grew: where a new worker starts counting */

static void *worker(void *arg) {
    const int part = (int)(intptr_t)arg;
    int seen = pool_generation;  /* not `generation`: a product may start before this thread first runs */
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < SPIN_ROUNDS) {
#if defined(__SSE2__)
                _mm_pause();
#endif
                continue;
            }
            pthread_mutex_lock(&wake_lock);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &wake_lock);
            pthread_mutex_unlock(&wake_lock);
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        if (part < threads_wanted) take_rows(&job, (unsigned)seen);
    }
    return 0;
}

/* the number of threads a product may use (the caller included); 0 on success */
int packed_set_threads(int n) {
    if (n < 1 || n > MAX_THREADS) return -1;
    pthread_mutex_lock(&pool_busy);
    pool_generation = atomic_load(&generation);
    for (; workers < n - 1; workers++) {
        pthread_t t;
        if (pthread_create(&t, 0, worker, (void *)(intptr_t)(workers + 1)) != 0) break;
        pthread_detach(t);
    }
    threads_wanted = n <= workers + 1 ? n : workers + 1;
    pthread_mutex_unlock(&pool_busy);
    return 0;
}

/* the number of threads a product may use now (the caller included) */
int packed_threads(void) {
    return threads_wanted;
}

/* packed_matmul over all n rows, split between the threads when the product is large enough to pay for it; again:
 * x unchanged since this thread's previous product (`activations`) */
int packed_matmul_again(int ggml_type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t rows, int64_t k,
                        float *y, int64_t n, int64_t min_weights, int again) {
    const block_type *t = find_type(ggml_type);
    if (!t || row_bytes != packed_row_bytes(ggml_type, k)) return -1;
    const void *prepared;
    const float *xa = activations(ggml_type, x, rows, k, again, &prepared);
    if (!xa) return -2;
    if (threads_wanted < 2 || n * k < min_weights || n < 4 || pthread_mutex_trylock(&pool_busy) != 0) {
        product_columns(t, w, row_bytes, xa, prepared, rows, k, y, n, 0, n);
        return 0;
    }
    const int64_t group = act16_row_group(prepared);  /* whole tiles: 2 weight rows, 16 on AMX */
    const int64_t chunk = ((n + 16 * threads_wanted - 1) / (16 * threads_wanted) + group - 1) / group * group;
    job = (product){t, w, row_bytes, rows, k, n, xa, y, chunk, prepared};
    atomic_store(&rows_done, 0);
    const unsigned gen = (unsigned)atomic_load(&generation) + 1;  /* (only pool_busy's holder changes it) */
    atomic_store_explicit(&next_row, (long long)((unsigned long long)gen << 32), memory_order_release);
    pthread_mutex_lock(&wake_lock);
    atomic_store_explicit(&generation, (int)gen, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
    take_rows(&job, gen);
    while (atomic_load_explicit(&rows_done, memory_order_acquire) < n) {
#if defined(__SSE2__)
        _mm_pause();
#endif
    }
    pthread_mutex_unlock(&pool_busy);
    return 0;
}

int packed_matmul_threads(int ggml_type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t rows, int64_t k,
                          float *y, int64_t n, int64_t min_weights) {
    return packed_matmul_again(ggml_type, w, row_bytes, x, rows, k, y, n, min_weights, 0);
}

/* out [n1 - n0, k] = the float values of rows [n0, n1) */
int packed_dequantize(int ggml_type, const uint8_t *w, int64_t row_bytes, int64_t k, float *out, int64_t n0,
                      int64_t n1) {
    const block_type *t = find_type(ggml_type);
    if (!t || row_bytes != packed_row_bytes(ggml_type, k)) return -1;
    const int64_t nb = k / t->block_weights;
    for (int64_t i = n0; i < n1; i++)
        for (int64_t b = 0; b < nb; b++)
            row_block(t, w + i * row_bytes, nb, b, out + (i - n0) * k + b * t->block_weights);
    return 0;
}

/* the vector unit this build computes with: 3 = AVX-512 with VNNI (act16's vpdpwssd), 2 = AVX-512, 1 = AVX2 + FMA,
 * 0 = scalar C */
int packed_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 3;
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
