/* Q4_0, Q4_1, Q8_0 and Q4_K products with int16 activations (swarmlm's own code): y[r, n] = sum_k x[r, k] * W[n, k].
 *
 * Why: unpacking nibbles into float32 and one FMA per weight tops out near 20 G weights/s on a core here, below what
 * memory delivers for 4-bit weights. Integer products are cheaper: a nibble is already a 16-bit integer after a
 * shift and a mask, and one instruction (AVX512-VNNI's vpdpwssd, or vpmaddwd + vpaddd on AVX2 and plain AVX-512)
 * multiplies 32 (16) pairs of 16-bit integers and adds them up in 32 bits, exactly.
 *
 * What it costs in accuracy: each block of 32 activations is rounded to int16 under its own scale (max |x| / 32767),
 * an error of at most 1/65534 of the block's largest value -- 256x finer than llama.cpp's int8 blocks, ~60x finer
 * than bfloat16's relative rounding for all but the smallest values. The integer products and their sums are exact,
 * so the result differs from the float32 product of the dequantized weights by that rounding alone (~3e-5 relative,
 * measured), the same on every x86 vector unit up to float32 summation order.
 *
 * Layout: weights as packed.c's split rows (16 bytes of nibbles per block, then the blocks' scales d as the file's
 * fp16, then Q4_1's mins m). A chunk is 4 blocks (128 weights, 64 bytes of nibbles); read as 32 16-bit words, word 8c + t of
 * block c's bytes 2t, 2t + 1 holds, from bit 0 up, the nibbles of weights 2t, 2t + 16, 2t + 1, 2t + 17 (GGUF keeps
 * weight j in the low nibble of byte j and weight j + 16 in its high nibble). So four shifts and masks give four
 * vectors of 32 weights each, and the activations are laid out once per call to match (act16_prepare): vector v word
 * 8c + t holds block c's activation WEIGHT_OF[v][t]. A vpdpwssd lane adds two neighbouring words, so lanes 4c..4c+3
 * only ever hold block c's products, and one float multiply-add per chunk applies each block's two scales. Q8_0's
 * quants are stored in that order already (packed.c, q8_0_at): a sign extension gives each vector. Q4_K is split at
 * load into Q4_0's nibble order with its 6-bit scales and mins as bytes (packed.c, split_q4_k_row): a chunk of 4
 * sub-blocks is Q4_1's, its scales d x sc and mins dmin x mn computed per chunk. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include "ahead.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ACT16_WIDE 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ACT16_WIDE 0
#endif

#define BLOCK_BYTES 16  /* a Q4 block's nibbles */
#define CHUNK_ROWS 4  /* activation rows of one tile over chunks of 4 blocks (act16_prepare's layout) */
#define TREE_ROWS_FROM 3  /* store_sums adds the lanes of 2 weight rows x this many activation rows (up to 4) as one tree */
#define LANE_ROWS 6   /* ... and over one-lane super-chunks (AVX-512): a weight group is unpacked once for them all.
                       * Not 8: a tile of 2 weight rows x R activation rows keeps 2R integer sums and 2R float sums
                       * (plus 8 unpacked weight vectors) in AVX-512's 32 registers; at 7-8 rows they spilled, and 8
                       * rows cost 2.2x 4 (AMD Zen 5, SmolLM2's products: 10.2-11.0 ms vs 4.4-4.8), as two tiles of 4
                       * 8.4-9.3 ms (docs/RESULTS-packed.md round 11) */

/* one chunk of one activation row, as the products read it */
typedef struct {
    int16_t q[128];      /* 4 vectors of 32 words: vector v word 8c + t = block c's weight WEIGHT_OF[v][t] */
    float scale[16];     /* lanes 4c..4c+3: block c's scale (max |x| / 32767) */
    int32_t offset[16];  /* lane 4c: -8 x the sum of block c's int16 values (Q4_0's weights are nibble - 8) */
    float sum[16];       /* lane 4c: scale x that sum (Q4_1's mins multiply it) */
} act_chunk;

/* one super-chunk of one activation row for one-lane products (act16_one_lane): 16 blocks, 512 activations */
typedef struct {
    int16_t q[16][32];   /* vector 4 g + v, lane j (words 2j, 2j + 1): block j's activations 8 g + 2 v, 8 g + 2 v + 1 */
    float scale[16];     /* lane j: block j's scale */
    int32_t offset[16];  /* lane j: -8 x the sum of block j's int16 values (Q4_0's weights are nibble - 8) */
    float sum[16];       /* lane j: scale x that sum (Q4_1's mins multiply it) */
} act_super;

typedef struct {
    const act_chunk *chunks;  /* rows x chunks_per_row (one-lane rows: only the tail's, from first_chunk on), or 0 */
    int64_t chunks_per_row, first_chunk;
    const act_super *supers;  /* rows x supers_per_row, for one-lane products (else 0) */
    int64_t supers_per_row;
    const void *amx;  /* the activations as amx.c's tiles read them, when amx.c computes the product (else 0) */
} act16;

/* amx.c: Q4_0 / Q4_1 products of 8 rows or more on AMX tiles, where the CPU and the OS allow them */
int amx_takes(int ggml_type, int64_t rows, int64_t nb);
const void *amx_prepare_rows(const float *x, int64_t rows, int64_t k);
void amx_product(int ggml_type, const uint8_t *w, int64_t row_bytes, const void *prepared, float *y, int64_t n,
                 int64_t n0, int64_t n1);

static const int WEIGHT_OF[4][8] = {{0, 2, 4, 6, 8, 10, 12, 14}, {16, 18, 20, 22, 24, 26, 28, 30},
                                    {1, 3, 5, 7, 9, 11, 13, 15}, {17, 19, 21, 23, 25, 27, 29, 31}};

/* Does this type's product round activations to int16 blocks? On every build, so that every build and every
 * batch shape computes the same function up to float32 summation order. */
int act16_rounds(int ggml_type) {
    return ggml_type == 2 || ggml_type == 3 || ggml_type == 8 || (ggml_type >= 12 && ggml_type <= 14);
}

/* Products of up to this many activation rows run in integers: every row count on the vector builds (8 rows of
 * Llama-3.2-1B's Q4_0 blocks: 1.21x packed.c's float tiles over the same rounded activations, which they replaced);
 * none in plain C, which multiplies the rounded activations (act16_round_rows) by the dequantized blocks. */
int64_t act16_integer_rows(int ggml_type) {
#if defined(ACT16_WIDE)
    (void)ggml_type;
    return INT64_MAX;
#else
    (void)ggml_type;
    return 0;
#endif
}

/* Are rows of nb blocks of this type laid out one lane per block (packed.c one_lane_at, q8_0_at)? Q4_0 / Q4_1 /
 * Q8_0 rows of at least one super-chunk (16 blocks, 512 weights) on the AVX-512 builds: in a row's whole super-chunks
 * a vpdpwssd lane adds all 32 products of one block, so the float work (convert, scale, add) is once per 16 blocks
 * instead of per 4 -- 1.2-1.5x the 4-lanes-per-block tiles at 1-8 rows, measured (docs/RESULTS-packed.md rounds 5,
 * 6); the rest of the row (its tail, fewer than 16 blocks) stays in chunks of 4. The K-quants and the other builds
 * keep chunks of 4. */
int act16_one_lane(int ggml_type, int64_t nb) {
#if defined(ACT16_WIDE) && ACT16_WIDE
    return (ggml_type == 2 || ggml_type == 3 || ggml_type == 8) && nb >= 16;
#else
    (void)ggml_type, (void)nb;
    return 0;
#endif
}

/* 32 activations -> their int16 values under the block's scale (returned), and the values' sum: the same on every
 * build (a float32 multiply, rounded to nearest even; the largest |x| exactly) */
static float round_block(const float *x, int16_t v[32], int32_t *total) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    _mm256_storeu_si256((__m256i *)v, _mm512_cvtepi32_epi16(qa));  /* |q| <= 32767: the narrowing is exact */
    _mm256_storeu_si256((__m256i *)(v + 16), _mm512_cvtepi32_epi16(qb));
    *total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
    float largest = 0.0f;
    for (int j = 0; j < 32; j++) largest = fabsf(x[j]) > largest ? fabsf(x[j]) : largest;
    const float inverse = largest > 0.0f ? 32767.0f / largest : 0.0f;
    *total = 0;
    for (int j = 0; j < 32; j++) {  /* lrintf: to nearest even, as the vector conversion */
        v[j] = (int16_t)lrintf(x[j] * inverse);
        *total += v[j];
    }
#endif
    return largest / 32767.0f;
}

/* block c of a chunk from its 32 activations */
static void prepare_block(const float *x, act_chunk *ch, int c) {
    int16_t v[32];
    int32_t total;
    const float scale = round_block(x, v, &total);
    for (int w = 0; w < 4; w++)
        for (int t = 0; t < 8; t++) ch->q[32 * w + 8 * c + t] = v[WEIGHT_OF[w][t]];
    for (int l = 0; l < 4; l++) ch->scale[4 * c + l] = scale;
    ch->offset[4 * c] = -8 * total;
    ch->sum[4 * c] = scale * (float)total;
}

/* a thread's buffer of at least `need` items of `size` bytes (64-byte aligned), grown when short; 0 if out of memory */
static int grown(void **buffer, int64_t *count, int64_t need, size_t size) {
    if (need <= *count) return 1;
    free(*buffer);
    *buffer = aligned_alloc(64, ((need * size + 63) / 64) * 64);
    *count = *buffer ? need : 0;
    return *buffer != 0;
}

static _Thread_local act_chunk *buffer;
static _Thread_local int64_t buffer_chunks;
static _Thread_local act_super *super_buffer;
static _Thread_local int64_t super_buffer_count;

static int act16_prepare(const float *x, int64_t rows, int64_t k, int64_t first_chunk, act16 *out);

/* x [rows, k] (k at least one super-chunk) -> the calling thread's one-lane buffers: the whole super-chunks one lane
 * per block, the tail in chunks of 4; 0 if out of memory */
static int act16_prepare_supers(const float *x, int64_t rows, int64_t k, act16 *out) {
    const int64_t blocks = k / 32, per_row = blocks / 16, need = rows * per_row;
    if (!grown((void **)&super_buffer, &super_buffer_count, need, sizeof(act_super))) return 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < 16 * per_row; b++) {
            act_super *a = super_buffer + r * per_row + b / 16;
            const int j = (int)(b % 16);
            int16_t v[32];
            int32_t total;
            a->scale[j] = round_block(x + r * k + 32 * b, v, &total);
            a->offset[j] = -8 * total;
            a->sum[j] = a->scale[j] * (float)total;
            for (int g = 0; g < 4; g++)
                for (int t = 0; t < 4; t++) {
                    a->q[4 * g + t][2 * j] = v[8 * g + 2 * t];
                    a->q[4 * g + t][2 * j + 1] = v[8 * g + 2 * t + 1];
                }
        }
    out->supers = super_buffer;
    out->supers_per_row = per_row;
    if (blocks % 16 == 0) {
        out->chunks = 0;
        out->chunks_per_row = out->first_chunk = 0;
        return 1;
    }
    return act16_prepare(x, rows, k, 4 * per_row, out);  /* the tail, in chunks of 4 */
}

/* x [rows, k] -> the calling thread's buffer of prepared chunks (valid until its next call), those from first_chunk
 * on; 0 if out of memory */
static int act16_prepare(const float *x, int64_t rows, int64_t k, int64_t first_chunk, act16 *out) {
    const int64_t blocks = k / 32, per_row = (blocks + 3) / 4, need = rows * per_row;
    if (!grown((void **)&buffer, &buffer_chunks, need, sizeof(act_chunk))) return 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t ch = first_chunk; ch < per_row; ch++) {
            act_chunk *chunk = buffer + r * per_row + ch;
            const int in_chunk = blocks - 4 * ch < 4 ? (int)(blocks - 4 * ch) : 4;
            if (in_chunk < 4) {
                memset(chunk, 0, sizeof *chunk);  /* a last chunk of fewer than 4 blocks: zeros past them */
            } else {
                memset(chunk->offset, 0, sizeof chunk->offset);
                memset(chunk->sum, 0, sizeof chunk->sum);
            }
            for (int c = 0; c < in_chunk; c++) prepare_block(x + r * k + 32 * (4 * ch + c), chunk, c);
            if (first_chunk && in_chunk <= 2)  /* a one-lane row's tail of 1-2 blocks, also in slots 2, 3: the two
                                                * weight rows of a tile share one chunk (pair_tail_sums); the tiles of
                                                * one weight row find zero weights and scales there */
                for (int c = 0; c < in_chunk; c++) prepare_block(x + r * k + 32 * (4 * ch + c), chunk, 2 + c);
        }
    out->chunks = buffer;
    out->chunks_per_row = per_row;
    out->first_chunk = first_chunk;
    if (!first_chunk) {
        out->supers = 0;
        out->supers_per_row = 0;
    }
    return 1;
}

#if defined(ACT16_WIDE) && ACT16_WIDE
/* the chunks from a->first_chunk on, W weight rows x R activation rows, added into total (lanes of one block's
 * partial sums); a chunk's nibbles are unpacked once for the R rows */
static inline __attribute__((always_inline)) void chunk_sums(const int T, const uint8_t *w, int64_t row_bytes,
                                                             int64_t nb, const act16 *a, int64_t i, int64_t r0,
                                                             const int W, const int R, __m512 total[2][LANE_ROWS]) {
    const __m512i low4 = _mm512_set1_epi16(0xf);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const uint8_t *row0 = w + i * row_bytes;
    for (int64_t ch = a->first_chunk; ch < a->chunks_per_row; ch++) {
        const int64_t left = nb - 4 * ch;
        const __mmask64 bytes = left >= 4 ? ~0ULL : (1ULL << (BLOCK_BYTES * left)) - 1;
        const __mmask16 blocks = left >= 4 ? 0xffff : (__mmask16)((1u << left) - 1);
        __m512i v[2][4];
        __m512 d[2], m[2];
        ask_ahead(row0, W * row_bytes, a->chunks_per_row, ch);
        for (int u = 0; u < W; u++) {
            const uint8_t *row = row0 + u * row_bytes;
            if (T == 8) {  /* 4 quarters of 8 cn bytes: one sign extension each */
                const int64_t cn = left >= 4 ? 4 : left;
                const __mmask32 quarter = (__mmask32)((1ULL << (8 * cn)) - 1);
                for (int q = 0; q < 4; q++)
                    v[u][q] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(quarter, row + 128 * ch + 8 * cn * q));
            } else {
                const __m512i q = _mm512_maskz_loadu_epi8(bytes, row + 64 * ch);
                v[u][0] = _mm512_and_si512(q, low4);
                v[u][1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
                v[u][2] = _mm512_and_si512(_mm512_srli_epi16(q, 8), low4);
                v[u][3] = _mm512_srli_epi16(q, 12);
                if (T == 14) {  /* split Q6_K: each weight's 2 high bits (bits 2v of its word's byte), then q - 32 */
                    const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + nb * BLOCK_BYTES + 32 * ch)));
                    const __m512i top = _mm512_set1_epi16(0x30), thirty_two = _mm512_set1_epi16(32);
                    v[u][0] = _mm512_sub_epi16(_mm512_or_si512(v[u][0], _mm512_and_si512(_mm512_slli_epi16(h, 4), top)), thirty_two);
                    v[u][1] = _mm512_sub_epi16(_mm512_or_si512(v[u][1], _mm512_and_si512(_mm512_slli_epi16(h, 2), top)), thirty_two);
                    v[u][2] = _mm512_sub_epi16(_mm512_or_si512(v[u][2], _mm512_and_si512(h, top)), thirty_two);
                    v[u][3] = _mm512_sub_epi16(_mm512_or_si512(v[u][3], _mm512_and_si512(_mm512_srli_epi16(h, 2), top)), thirty_two);
                }
                if (T == 13) {  /* split Q5_K: word w's 4 fifth bits (bit v: vector v's) in nibble w / 16 of byte w % 16 */
                    const __m128i bits = _mm_loadu_si128((const __m128i *)(row + nb * BLOCK_BYTES + 16 * ch));
                    const __m512i h = _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bits)),
                                                                         _mm512_setr_epi64(0, 0, 0, 0, 0x0004000400040004LL,
                                                                                           0x0004000400040004LL, 0x0004000400040004LL,
                                                                                           0x0004000400040004LL)),
                                                       low4);
                    const __m512i bit4 = _mm512_set1_epi16(16);
                    v[u][0] = _mm512_or_si512(v[u][0], _mm512_and_si512(_mm512_slli_epi16(h, 4), bit4));
                    v[u][1] = _mm512_or_si512(v[u][1], _mm512_and_si512(_mm512_slli_epi16(h, 3), bit4));
                    v[u][2] = _mm512_or_si512(v[u][2], _mm512_and_si512(_mm512_slli_epi16(h, 2), bit4));
                    v[u][3] = _mm512_or_si512(v[u][3], _mm512_and_si512(_mm512_slli_epi16(h, 1), bit4));
                }
            }
            if (T == 14) {  /* the chunk's 8 int8 scales (each block's weights 0-15, 16-31) x its super-block's d */
                const uint8_t *sc8 = row + nb * 24 + 8 * ch;
                const float dd = _cvtsh_ss(*(const uint16_t *)(row + nb * 26 + 2 * (ch / 2)));
                const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                    _mm_loadl_epi64((const __m128i *)sc8))));
                d[u] = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), sc);
                m[u] = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), sc);
            } else if (T == 12 || T == 13) {  /* packed.c's split Q4_K / Q5_K: a chunk's 6-bit scales and mins (bytes) x its
                                          * super-block's d, dmin (Q5_K: past its fifth bits) */
                const int64_t fifth = T == 13 ? 4 * nb : 0;
                const uint8_t *bytes6 = row + nb * BLOCK_BYTES + fifth + 4 * ch;
                const uint16_t *dd = (const uint16_t *)(row + nb * 18 + fifth) + ch / 2;  /* fp16 d, then dmin */
                const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(blocks, bytes6)));
                const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(blocks, bytes6 + nb)));
                d[u] = _mm512_permutexvar_ps(spread, _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(dd[0])), sc));
                m[u] = _mm512_permutexvar_ps(spread, _mm512_mul_ps(_mm512_set1_ps(-_cvtsh_ss(dd[nb / 8])), mn));
            } else {  /* the chunk's fp16 scales (and mins) -> 4 lanes each */
                const uint16_t *scales = (const uint16_t *)(row + nb * (T == 8 ? 32 : BLOCK_BYTES));
                d[u] = _mm512_permutexvar_ps(spread, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(blocks, scales + 4 * ch)));
                if (T == 3)
                    m[u] = _mm512_permutexvar_ps(spread,
                                                 _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(blocks, scales + nb + 4 * ch)));
            }
        }
        for (int r = 0; r < R; r++) {
            const act_chunk *x = a->chunks + (r0 + r) * a->chunks_per_row + ch;
            const __m512i x0 = _mm512_load_si512(x->q), x1 = _mm512_load_si512(x->q + 32);
            const __m512i x2 = _mm512_load_si512(x->q + 64), x3 = _mm512_load_si512(x->q + 96);
            const __m512 scale = _mm512_load_ps(x->scale);
            const __m512i start = T == 2 ? _mm512_load_si512(x->offset) : _mm512_setzero_si512();
            for (int u = 0; u < W; u++) {
                if (T == 14) {  /* two sums per block: its weights 0-15 (vectors 0, 2) and 16-31 (1, 3), own scales */
#if defined(__AVX512VNNI__)
                    const __m512i lo = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(start, v[u][0], x0), v[u][2], x2);
                    const __m512i hi = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(start, v[u][1], x1), v[u][3], x3);
#else
                    const __m512i lo = _mm512_add_epi32(_mm512_madd_epi16(v[u][0], x0), _mm512_madd_epi16(v[u][2], x2));
                    const __m512i hi = _mm512_add_epi32(_mm512_madd_epi16(v[u][1], x1), _mm512_madd_epi16(v[u][3], x3));
#endif
                    total[u][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(d[u], scale), total[u][r]);
                    total[u][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(m[u], scale), total[u][r]);
                    continue;
                }
#if defined(__AVX512VNNI__)
                __m512i acc = _mm512_dpwssd_epi32(start, v[u][0], x0);
                acc = _mm512_dpwssd_epi32(acc, v[u][1], x1);
                acc = _mm512_dpwssd_epi32(acc, v[u][2], x2);
                acc = _mm512_dpwssd_epi32(acc, v[u][3], x3);
#else
                __m512i acc = _mm512_add_epi32(_mm512_add_epi32(start, _mm512_madd_epi16(v[u][0], x0)),
                                               _mm512_madd_epi16(v[u][1], x1));
                acc = _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(v[u][2], x2),
                                                             _mm512_madd_epi16(v[u][3], x3)));
#endif
                total[u][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d[u], scale), total[u][r]);
                if (T == 3 || T == 12 || T == 13) total[u][r] = _mm512_fmadd_ps(m[u], _mm512_load_ps(x->sum), total[u][r]);
            }
        }
    }
}

/* y[r0 + r, i + u] = the sum of total[u][r]'s lanes. Two weight rows x 3-4 activation rows add their 8 vectors' lanes
 * as one tree: ~30 vector operations instead of 8 reductions of ~8 (by count ~1/7 of a 576-wide 2 x 4 tile's
 * operations), the additions in the same order, so the same bits */
static inline __attribute__((always_inline)) void store_sums(__m512 total[2][LANE_ROWS], float *y, int64_t n,
                                                             int64_t i, int64_t r0, const int W, const int R) {
    int r4 = 0;
    for (; W == 2 && r4 + TREE_ROWS_FROM <= R; r4 += 4) {
        const int m = R - r4 < 4 ? R - r4 : 4;  /* 2-3 rows: the tree over zeros for the rest (6 lane sums of 3 rows
                                                 * one by one cost ~1.6x the tree); the same bits for the rows kept */
        __m512 half[4], quarter[2];
        for (int r = 0; r < 4; r++)  /* vector k = 2 r + u: 256-bit halves added, (u = 0 | u = 1) */
            half[r] = r >= m ? _mm512_setzero_ps()
                             : _mm512_add_ps(_mm512_shuffle_f32x4(total[0][r4 + r], total[1][r4 + r], _MM_SHUFFLE(1, 0, 1, 0)),
                                             _mm512_shuffle_f32x4(total[0][r4 + r], total[1][r4 + r], _MM_SHUFFLE(3, 2, 3, 2)));
        for (int p = 0; p < 2; p++)  /* 128-bit quarter j: 4 partial sums of vector 4 p + j */
            quarter[p] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * p], half[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_f32x4(half[2 * p], half[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
        /* quarter j: lanes (vector j, vector 4 + j, ...) after interleaving, then each lane pair's other half added */
        const __m512 pairs = _mm512_add_ps(_mm512_unpacklo_ps(quarter[0], quarter[1]),
                                           _mm512_unpackhi_ps(quarter[0], quarter[1]));
        const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(1, 0, 3, 2)));
        /* lane 0 of quarter j: vector j; lane 1: vector 4 + j -> vectors 0..7 = (r, u) in order */
        const __m256 out = _mm512_castps512_ps256(
            _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), sums));
        const __m128 low = _mm256_castps256_ps128(out), high = _mm256_extractf128_ps(out, 1);
        float *at = y + (r0 + r4) * n + i;
        _mm_storel_pi((__m64 *)at, low);
        _mm_storeh_pi((__m64 *)(at + n), low);
        if (m > 2) _mm_storel_pi((__m64 *)(at + 2 * n), high);
        if (m > 3) _mm_storeh_pi((__m64 *)(at + 3 * n), high);
    }
    for (int u = 0; u < W; u++)
        for (int r = r4; r < R; r++) y[(r0 + r) * n + i + u] = _mm512_reduce_add_ps(total[u][r]);
}

/* a one-lane row's tail of 1-2 blocks (n), for two weight rows at once: row i's blocks in slots 0, 1 of one chunk,
 * row i + 1's in slots 2, 3, against the activations' tail chunk that holds the blocks in both (act16_prepare); lanes
 * 0-7 add into row i's sums, 8-15 into row i + 1's. Half the products and float work of a chunk per weight row. */
static inline __attribute__((always_inline)) void pair_tail_sums(const int T, const uint8_t *w, int64_t row_bytes,
                                                                 int64_t nb, const act16 *a, int64_t i, int64_t r0,
                                                                 const int R, __m512 total[2][LANE_ROWS]) {
    const int64_t ch = a->first_chunk, n = nb - 4 * ch;
    const uint8_t *u0 = w + i * row_bytes, *u1 = u0 + row_bytes;
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512i v[4];
    if (T == 8) {  /* quarter q: 8 n bytes of each row (act16's order), row i + 1's from byte 16 of the vector's 32 */
        const __mmask32 lo = (__mmask32)((1u << (8 * n)) - 1), hi = lo << 16;
        for (int q = 0; q < 4; q++) {
            const int64_t at = 128 * ch + 8 * n * q;
            v[q] = _mm512_cvtepi8_epi16(_mm256_mask_loadu_epi8(_mm256_maskz_loadu_epi8(lo, u0 + at), hi, u1 + at - 16));
        }
    } else {  /* 16 n bytes of nibbles of each row, row i + 1's from byte 32 */
        const __m512i low4 = _mm512_set1_epi16(0xf);
        const __mmask64 lo = (1ULL << (16 * n)) - 1, hi = lo << 32;
        const __m512i q = _mm512_mask_loadu_epi8(_mm512_maskz_loadu_epi8(lo, u0 + 64 * ch), hi, u1 + 64 * ch - 32);
        v[0] = _mm512_and_si512(q, low4);
        v[1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
        v[2] = _mm512_and_si512(_mm512_srli_epi16(q, 8), low4);
        v[3] = _mm512_srli_epi16(q, 12);
    }
    const __mmask8 lo = (__mmask8)((1u << n) - 1), hi = (__mmask8)(lo << 2);
    const uint16_t *d0 = (const uint16_t *)(u0 + nb * (T == 8 ? 32 : BLOCK_BYTES)) + 4 * ch;
    const uint16_t *d1 = (const uint16_t *)(u1 + nb * (T == 8 ? 32 : BLOCK_BYTES)) + 4 * ch;
    const __m512 d = _mm512_permutexvar_ps(spread, _mm512_cvtph_ps(_mm256_zextsi128_si256(
                                                       _mm_mask_loadu_epi16(_mm_maskz_loadu_epi16(lo, d0), hi, d1 - 2))));
    const __m512 m = T == 3 ? _mm512_permutexvar_ps(spread, _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_mask_loadu_epi16(
                                  _mm_maskz_loadu_epi16(lo, d0 + nb), hi, d1 + nb - 2))))
                            : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        const act_chunk *x = a->chunks + (r0 + r) * a->chunks_per_row + ch;
        __m512i acc = T == 2 ? _mm512_load_si512(x->offset) : _mm512_setzero_si512();
        for (int t = 0; t < 4; t++)
#if defined(__AVX512VNNI__)
            acc = _mm512_dpwssd_epi32(acc, v[t], _mm512_load_si512(x->q + 32 * t));
#else
            acc = _mm512_add_epi32(acc, _mm512_madd_epi16(v[t], _mm512_load_si512(x->q + 32 * t)));
#endif
        const __m512 products = _mm512_cvtepi32_ps(acc), dx = _mm512_mul_ps(d, _mm512_load_ps(x->scale));
        total[0][r] = _mm512_mask3_fmadd_ps(products, dx, total[0][r], 0x00ff);
        total[1][r] = _mm512_mask3_fmadd_ps(products, dx, total[1][r], 0xff00);
        if (T == 3) {
            const __m512 sum = _mm512_load_ps(x->sum);
            total[0][r] = _mm512_mask3_fmadd_ps(m, sum, total[0][r], 0x00ff);
            total[1][r] = _mm512_mask3_fmadd_ps(m, sum, total[1][r], 0xff00);
        }
    }
}

/* W weight rows x R activation rows; a chunk's nibbles are unpacked once for the R rows */
static inline __attribute__((always_inline)) void tile(const int T, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                       const act16 *a, float *y, int64_t n, int64_t i, int64_t r0,
                                                       const int W, const int R) {
    __m512 total[2][LANE_ROWS];
    for (int u = 0; u < W; u++)
        for (int r = 0; r < R; r++) total[u][r] = _mm512_setzero_ps();
    chunk_sums(T, w, row_bytes, nb, a, i, r0, W, R, total);
    store_sums(total, y, n, i, r0, W, R);
}
#elif defined(ACT16_WIDE)
/* AVX2: half a chunk (2 blocks, 32 bytes of nibbles) at a time; the same activation layout, read by halves */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void tile(const int T, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                       const act16 *a, float *y, int64_t n, int64_t i, int64_t r0,
                                                       const int W, const int R) {
    __m256 total[2][4];
    for (int u = 0; u < W; u++)
        for (int r = 0; r < R; r++) total[u][r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi16(0xf);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const uint8_t *row0 = w + i * row_bytes;
    for (int64_t half = 0; 2 * half < nb; half++) {
        const int two = 2 * half + 2 <= nb;  /* else one block left */
        const int64_t ch = half / 2, h = half % 2;
        __m256i v[2][4];
        __m256 d[2], m[2];
        ask_ahead(row0, W * row_bytes, (nb + 1) / 2, half);
        for (int u = 0; u < W; u++) {
            const uint8_t *row = row0 + u * row_bytes;
            if (T == 8) {  /* this half of each quarter (of 8 cn bytes): 16 bytes, or 8 for a last single block */
                const int64_t cn = nb - 4 * ch < 4 ? nb - 4 * ch : 4;
                for (int q = 0; q < 4; q++) {
                    const uint8_t *at = row + 128 * ch + 8 * cn * q + 16 * h;
                    v[u][q] = _mm256_cvtepi8_epi16(two ? _mm_loadu_si128((const __m128i *)at)
                                                       : _mm_loadl_epi64((const __m128i *)at));
                }
            } else {
                const __m256i q = two ? _mm256_loadu_si256((const __m256i *)(row + 32 * half))
                                      : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + 32 * half)));
                const __m256i qz = two ? q : _mm256_inserti128_si256(q, _mm_setzero_si128(), 1);
                v[u][0] = _mm256_and_si256(qz, low4);
                v[u][1] = _mm256_and_si256(_mm256_srli_epi16(qz, 4), low4);
                v[u][2] = _mm256_and_si256(_mm256_srli_epi16(qz, 8), low4);
                v[u][3] = _mm256_srli_epi16(qz, 12);
                if (T == 14) {  /* split Q6_K: the 2 high bits (this half's 16 bytes of them), then q - 32 */
                    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + nb * BLOCK_BYTES + 16 * half)));
                    const __m256i top = _mm256_set1_epi16(0x30), thirty_two = _mm256_set1_epi16(32);
                    v[u][0] = _mm256_sub_epi16(_mm256_or_si256(v[u][0], _mm256_and_si256(_mm256_slli_epi16(h, 4), top)), thirty_two);
                    v[u][1] = _mm256_sub_epi16(_mm256_or_si256(v[u][1], _mm256_and_si256(_mm256_slli_epi16(h, 2), top)), thirty_two);
                    v[u][2] = _mm256_sub_epi16(_mm256_or_si256(v[u][2], _mm256_and_si256(h, top)), thirty_two);
                    v[u][3] = _mm256_sub_epi16(_mm256_or_si256(v[u][3], _mm256_and_si256(_mm256_srli_epi16(h, 2), top)), thirty_two);
                }
                if (T == 13) {  /* split Q5_K: this half's words' fifth bits, nibble h of the chunk's 16 bytes */
                    const __m256i bits = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + nb * BLOCK_BYTES + 16 * ch)));
                    const __m256i hb = _mm256_and_si256(h ? _mm256_srli_epi16(bits, 4) : bits, low4);
                    const __m256i bit4 = _mm256_set1_epi16(16);
                    v[u][0] = _mm256_or_si256(v[u][0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
                    v[u][1] = _mm256_or_si256(v[u][1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
                    v[u][2] = _mm256_or_si256(v[u][2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bit4));
                    v[u][3] = _mm256_or_si256(v[u][3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), bit4));
                }
            }
            if (T == 14) {  /* this half's 2 blocks: scales of weights 0-15 and 16-31 x the super-block's d */
                const int8_t *sc8 = (const int8_t *)(row + nb * 24 + 4 * half);
                const float dd = _cvtsh_ss(*(const uint16_t *)(row + nb * 26 + 2 * (half / 4)));
                d[u] = _mm256_setr_ps(dd * sc8[0], dd * sc8[0], dd * sc8[0], dd * sc8[0], dd * sc8[2], dd * sc8[2],
                                      dd * sc8[2], dd * sc8[2]);
                m[u] = _mm256_setr_ps(dd * sc8[1], dd * sc8[1], dd * sc8[1], dd * sc8[1], dd * sc8[3], dd * sc8[3],
                                      dd * sc8[3], dd * sc8[3]);
            } else if (T == 12 || T == 13) {  /* split Q4_K / Q5_K: 6-bit scales and mins (bytes) x the super-block's d,
                                                 * dmin (a half: 2 groups) */
                const int64_t fifth = T == 13 ? 4 * nb : 0;
                const uint8_t *bytes6 = row + nb * BLOCK_BYTES + fifth + 2 * half;
                const uint16_t *dd = (const uint16_t *)(row + nb * 18 + fifth) + half / 4;  /* fp16 d, then dmin */
                const float d0 = _cvtsh_ss(dd[0]), m0 = _cvtsh_ss(dd[nb / 8]);
                d[u] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_setr_ps(d0 * bytes6[0], d0 * bytes6[1], 0, 0)),
                                                spread);
                m[u] = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_setr_ps(-(m0 * bytes6[nb]), -(m0 * bytes6[nb + 1]), 0, 0)), spread);
            } else {  /* fp16 scales (and mins) */
                const uint16_t *scales = (const uint16_t *)(row + nb * (T == 8 ? 32 : BLOCK_BYTES)) + 2 * half;
                const uint16_t *mins = scales + nb;
                d[u] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_setr_ps(
                    _cvtsh_ss(scales[0]), two ? _cvtsh_ss(scales[1]) : 0.0f, 0, 0)), spread);
                if (T == 3)
                    m[u] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_setr_ps(
                        _cvtsh_ss(mins[0]), two ? _cvtsh_ss(mins[1]) : 0.0f, 0, 0)), spread);
            }
        }
        for (int r = 0; r < R; r++) {
            const act_chunk *x = a->chunks + (r0 + r) * a->chunks_per_row + ch;
            const int16_t *xq = x->q + 16 * h;
            const __m256i x0 = _mm256_load_si256((const __m256i *)xq), x1 = _mm256_load_si256((const __m256i *)(xq + 32));
            const __m256i x2 = _mm256_load_si256((const __m256i *)(xq + 64));
            const __m256i x3 = _mm256_load_si256((const __m256i *)(xq + 96));
            const __m256 scale = _mm256_load_ps(x->scale + 8 * h);
            const __m256i start = T == 2 ? _mm256_load_si256((const __m256i *)(x->offset + 8 * h)) : _mm256_setzero_si256();
            for (int u = 0; u < W; u++) {
                if (T == 14) {  /* two sums per block: its weights 0-15 (vectors 0, 2) and 16-31 (1, 3), own scales */
                    const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(v[u][0], x0), _mm256_madd_epi16(v[u][2], x2));
                    const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(v[u][1], x1), _mm256_madd_epi16(v[u][3], x3));
                    total[u][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(d[u], scale), total[u][r]);
                    total[u][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(m[u], scale), total[u][r]);
                    continue;
                }
                __m256i acc = _mm256_add_epi32(_mm256_add_epi32(start, _mm256_madd_epi16(v[u][0], x0)),
                                               _mm256_madd_epi16(v[u][1], x1));
                acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(v[u][2], x2),
                                                             _mm256_madd_epi16(v[u][3], x3)));
                total[u][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(d[u], scale), total[u][r]);
                if (T == 3 || T == 12 || T == 13) total[u][r] = _mm256_fmadd_ps(m[u], _mm256_load_ps(x->sum + 8 * h), total[u][r]);
            }
        }
    }
    for (int u = 0; u < W; u++)
        for (int r = 0; r < R; r++) y[(r0 + r) * n + i + u] = sum8(total[u][r]);
}
#endif

#if defined(ACT16_WIDE)
typedef void (*tile_fn)(const uint8_t *, int64_t, int64_t, const act16 *, float *, int64_t, int64_t, int64_t);
#define TILE(T, W, R) \
    static void tile_##T##_##W##_##R(const uint8_t *w, int64_t rb, int64_t nb, const act16 *a, float *y, int64_t n, \
                                     int64_t i, int64_t r0) { tile(T, w, rb, nb, a, y, n, i, r0, W, R); }
#define TILES(T) \
    TILE(T, 2, 1) TILE(T, 2, 2) TILE(T, 2, 3) TILE(T, 2, 4) TILE(T, 1, 1) TILE(T, 1, 2) TILE(T, 1, 3) TILE(T, 1, 4) \
    static const tile_fn WIDE_##T[5] = {0, tile_##T##_2_1, tile_##T##_2_2, tile_##T##_2_3, tile_##T##_2_4}; \
    static const tile_fn NARROW_##T[5] = {0, tile_##T##_1_1, tile_##T##_1_2, tile_##T##_1_3, tile_##T##_1_4};
TILES(2) TILES(3) TILES(8) TILES(12) TILES(13) TILES(14)

/* columns [n0, n1) of y [rows, n] by a type's tiles (tables by activation rows, up to `most`): two weight rows at a
 * time, every activation row while they are in L1; the rows split evenly between ceil(rows / most) tiles (8 at most
 * 6: 4 + 4), worked out once (no division per tile) */
static void walk_rows(const tile_fn *wide, const tile_fn *narrow, int64_t most, const uint8_t *w, int64_t row_bytes,
                      const act16 *a, int64_t rows, int64_t k, float *y, int64_t n, int64_t n0, int64_t n1) {
    if (rows < 1) return;
    const int64_t nb = k / 32, tiles = (rows + most - 1) / most, base = rows / tiles, extra = rows % tiles;
    int64_t i = n0;
    for (; i + 2 <= n1; i += 2)
        for (int64_t t = 0, r0 = 0; t < tiles; r0 += base + (t < extra), t++)
            wide[base + (t < extra)](w, row_bytes, nb, a, y, n, i, r0);
    for (; i < n1; i++)
        for (int64_t t = 0, r0 = 0; t < tiles; r0 += base + (t < extra), t++)
            narrow[base + (t < extra)](w, row_bytes, nb, a, y, n, i, r0);
}
#endif

#if defined(ACT16_WIDE) && ACT16_WIDE
/* one-lane Q4_0 / Q4_1 / Q8_0 (act16_one_lane): W weight rows x R activation rows over a row's whole super-chunks;
 * group g of a super-chunk gives 4 vectors, lane j of vector t two of block j's weights -- Q4's 64 bytes after shifts
 * and masks (packed.c one_lane_at), Q8_0's 4 x 32 bytes by a sign extension each (packed.c q8_0_at) --; the scales
 * (and Q4_1's mins) are the row's fp16 ones, 16 per super-chunk */
static inline __attribute__((always_inline)) void lane_tile(const int T, const uint8_t *w, int64_t row_bytes,
                                                            int64_t nb, const act16 *a, float *y, int64_t n, int64_t i,
                                                            int64_t r0, const int W, const int R) {
    const int64_t ns = a->supers_per_row;
    __m512 total[2][LANE_ROWS];
    for (int u = 0; u < W; u++)
        for (int r = 0; r < R; r++) total[u][r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi16(0xf);
    const uint8_t *row0 = w + i * row_bytes;
    for (int64_t s = 0; s < ns; s++) {
        __m512i acc[2][LANE_ROWS];
        for (int r = 0; r < R; r++) {
            const __m512i start = T == 2 ? _mm512_load_si512(a->supers[(r0 + r) * ns + s].offset) : _mm512_setzero_si512();
            for (int u = 0; u < W; u++) acc[u][r] = start;
        }
        for (int g = 0; g < 4; g++) {
            __m512i v[2][4];
            ask_ahead(row0, W * row_bytes, 4 * ns, 4 * s + g);
            for (int u = 0; u < W; u++) {
                if (T == 8) {
                    for (int t = 0; t < 4; t++)
                        v[u][t] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                            (const __m256i *)(row0 + u * row_bytes + 512 * s + 128 * g + 32 * t)));
                    continue;
                }
                const __m512i q = _mm512_loadu_si512(row0 + u * row_bytes + 256 * s + 64 * g);
                v[u][0] = _mm512_and_si512(q, low4);
                v[u][1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
                v[u][2] = _mm512_and_si512(_mm512_srli_epi16(q, 8), low4);
                v[u][3] = _mm512_srli_epi16(q, 12);
            }
            for (int t = 0; t < 4; t++)  /* each accumulator's next product R x W instructions on (its latency) */
                for (int r = 0; r < R; r++) {
                    __m512i xv = _mm512_load_si512(a->supers[(r0 + r) * ns + s].q[4 * g + t]);
                    /* in a register, loaded once for the W weight rows: left alone, gcc 12 folded the load into each
                     * vpdpwssd, 2 loads of 64 bytes per product, and AMD Zen 5 loads 2 such a cycle: the loads, not
                     * the 2 vpdpwssd a cycle, were the limit (4-6 rows: 1.08-1.13x, docs/RESULTS-packed.md round
                     * 11). An empty asm that "changes" it ends the folding; it emits nothing. */
                    if (W == 2) __asm__("" : "+v"(xv));
                    for (int u = 0; u < W; u++)
#if defined(__AVX512VNNI__)
                        acc[u][r] = _mm512_dpwssd_epi32(acc[u][r], v[u][t], xv);
#else
                        acc[u][r] = _mm512_add_epi32(acc[u][r], _mm512_madd_epi16(v[u][t], xv));
#endif
                }
        }
        for (int u = 0; u < W; u++) {
            const uint8_t *scales = row0 + u * row_bytes + (T == 8 ? 32 : 16) * nb + 32 * s;  /* d x nb, Q4_1's m x nb */
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            const __m512 m = T == 3 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 2 * nb)))
                                    : _mm512_setzero_ps();
            for (int r = 0; r < R; r++) {
                const act_super *x = a->supers + (r0 + r) * ns + s;
                total[u][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[u][r]), _mm512_mul_ps(d, _mm512_load_ps(x->scale)),
                                              total[u][r]);
                if (T == 3) total[u][r] = _mm512_fmadd_ps(m, _mm512_load_ps(x->sum), total[u][r]);
            }
        }
    }
    if (a->chunks && W == 2 && nb - 4 * a->first_chunk <= 2)  /* the tail, from a->first_chunk on */
        pair_tail_sums(T, w, row_bytes, nb, a, i, r0, R, total);
    else if (a->chunks)
        chunk_sums(T, w, row_bytes, nb, a, i, r0, W, R, total);
    store_sums(total, y, n, i, r0, W, R);
}

#define LANE_TILE(T, W, R) \
    static void lane_##T##_##W##_##R(const uint8_t *w, int64_t rb, int64_t nb, const act16 *a, float *y, int64_t n, \
                                     int64_t i, int64_t r0) { lane_tile(T, w, rb, nb, a, y, n, i, r0, W, R); }
#define LANE_TILES(T) \
    LANE_TILE(T, 2, 1) LANE_TILE(T, 2, 2) LANE_TILE(T, 2, 3) LANE_TILE(T, 2, 4) LANE_TILE(T, 2, 5) LANE_TILE(T, 2, 6) \
    LANE_TILE(T, 1, 1) LANE_TILE(T, 1, 2) LANE_TILE(T, 1, 3) LANE_TILE(T, 1, 4) LANE_TILE(T, 1, 5) LANE_TILE(T, 1, 6) \
    static const tile_fn LANE_WIDE_##T[LANE_ROWS + 1] = {0, lane_##T##_2_1, lane_##T##_2_2, lane_##T##_2_3, \
        lane_##T##_2_4, lane_##T##_2_5, lane_##T##_2_6}; \
    static const tile_fn LANE_NARROW_##T[LANE_ROWS + 1] = {0, lane_##T##_1_1, lane_##T##_1_2, lane_##T##_1_3, \
        lane_##T##_1_4, lane_##T##_1_5, lane_##T##_1_6};
LANE_TILES(2) LANE_TILES(3) LANE_TILES(8)

#endif

#if defined(ACT16_WIDE)
/* columns [n0, n1) of y [rows, n] as act16_prepare_rows laid the activations out: one-lane rows (a row's super-chunks,
 * then its tail in chunks of 4, into the same sums) or chunks of 4 */
static void act16_rows(int ggml_type, const uint8_t *w, int64_t row_bytes, const act16 *a, int64_t rows, int64_t k,
                       float *y, int64_t n, int64_t n0, int64_t n1) {
    const int t = ggml_type;
#if ACT16_WIDE
    if (a->supers) {
        walk_rows(t == 2 ? LANE_WIDE_2 : t == 3 ? LANE_WIDE_3 : LANE_WIDE_8,
                  t == 2 ? LANE_NARROW_2 : t == 3 ? LANE_NARROW_3 : LANE_NARROW_8, LANE_ROWS, w, row_bytes, a, rows, k,
                  y, n, n0, n1);
        return;
    }
#endif
    walk_rows(t == 2 ? WIDE_2 : t == 3 ? WIDE_3 : t == 8 ? WIDE_8 : t == 12 ? WIDE_12 : t == 13 ? WIDE_13 : WIDE_14,
              t == 2 ? NARROW_2 : t == 3 ? NARROW_3 : t == 8 ? NARROW_8 : t == 12 ? NARROW_12 : t == 13 ? NARROW_13
                                                                                         : NARROW_14,
              CHUNK_ROWS, w, row_bytes, a, rows, k, y, n, n0, n1);
}
#endif

/* ---- the entry points packed.c calls (for the types act16_rounds) ---- */

/* prepare x [rows, k] in the calling thread's buffer; returns it (opaque), or 0 when out of memory */
const void *act16_prepare_rows(int ggml_type, const float *x, int64_t rows, int64_t k) {
    static _Thread_local act16 prepared;
    if (amx_takes(ggml_type, rows, k / 32)) {
        prepared = (act16){.amx = amx_prepare_rows(x, rows, k)};
        return prepared.amx ? &prepared : 0;
    }
    prepared.amx = 0;
    const int ok = act16_one_lane(ggml_type, k / 32) ? act16_prepare_supers(x, rows, k, &prepared)
                                                     : act16_prepare(x, rows, k, 0, &prepared);
    return ok ? &prepared : 0;
}

/* the weight rows a thread should take together from these prepared activations: amx.c's tiles hold 16 */
int64_t act16_row_group(const void *prepared) {
    return prepared && ((const act16 *)prepared)->amx ? 16 : 2;
}

/* round_block for amx.c: its tiles hold the same int16 values */
float act16_round_block(const float *x, int16_t v[32], int32_t *total) {
    return round_block(x, v, total);
}

/* which form act16_prepare_rows / act16_round_rows give x [rows, k] for this type's products (types act16 rounds):
 * products whose forms are equal can share one preparation of the same x */
int act16_layout(int ggml_type, int64_t rows, int64_t k) {
    if (rows > act16_integer_rows(ggml_type)) return 1;
    if (amx_takes(ggml_type, rows, k / 32)) return 2;
    return act16_one_lane(ggml_type, k / 32) ? 3 : 4;
}

/* x [rows, k] rounded as the integer products round it (scale x its int16 value), in the calling thread's buffer
 * (valid until its next call); 0 when out of memory */
const float *act16_round_rows(const float *x, int64_t rows, int64_t k) {
    static _Thread_local float *rounded;
    static _Thread_local int64_t capacity;
    if (rows * k > capacity) {
        free(rounded);
        rounded = aligned_alloc(64, ((rows * k * sizeof(float) + 63) / 64) * 64);
        capacity = rounded ? rows * k : 0;
        if (!rounded) return 0;
    }
    for (int64_t b = 0; b < rows * k / 32; b++) {
        int16_t v[32];
        int32_t total;
        const float scale = round_block(x + 32 * b, v, &total);
        for (int j = 0; j < 32; j++) rounded[32 * b + j] = scale * (float)v[j];
    }
    return rounded;
}

void act16_product(int ggml_type, const uint8_t *w, int64_t row_bytes, const void *prepared, int64_t rows, int64_t k,
                   float *y, int64_t n, int64_t n0, int64_t n1) {
#if defined(ACT16_WIDE)
    const act16 *a = prepared;
    if (a->amx) {
        amx_product(ggml_type, w, row_bytes, a->amx, y, n, n0, n1);
        return;
    }
    act16_rows(ggml_type, w, row_bytes, a, rows, k, y, n, n0, n1);
#else
    (void)ggml_type, (void)w, (void)row_bytes, (void)prepared, (void)rows, (void)k, (void)y, (void)n, (void)n0, (void)n1;
#endif
}
