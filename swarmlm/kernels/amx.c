/* Q4_0 / Q4_1 products of 8 or more activation rows on AMX's int8 tiles (swarmlm's own code), with act16.c's
 * rounding: the same int16 activations, the same integer sum per block, scaled in float32 as act16.c scales it.
 *
 * Why: act16.c's vpdpwssd multiplies 32 int16 pairs per instruction; one AMX tile product (TDPBSSD) multiplies
 * 16 x 16 x 64 int8 pairs. An int16 activation a is exactly 256 hi + lo (hi its signed high byte, lo its unsigned low
 * byte), and a weight's nibble (0..15) is a signed byte, so a block's integer sum is 256 x (TDPBSSD's hi sum) +
 * (TDPBUSD's lo sum), exact in int32 (|sum| < 2^24). Every block of 32 weights has its own scale, so each block's
 * sums leave the tile (a store, then vector loads) and are scaled in float32 -- that, and turning the nibbles into
 * the tile's layout, are most of the time. Measured against act16.c (docs/RESULTS-packed.md round 7, packed_bench.py
 * amx): SmolLM2's 210 products of a step, each its own weights (from memory, as a server reads them), 1.14x at 8 rows
 * and 1.39x at 16 (0.99-1.01x at 5); one product over and over (weights in L2) 1.25-1.54x at 8 rows, 1.5-2x at 16.
 *
 * Tiles: B = 16 weight rows, A = 8 activation rows, two blocks per product (K = 64): A's rows 0-7 hold block 2p's
 * 32 activations in bytes 0-31 (zeros after), rows 8-15 block 2p + 1's in bytes 32-63 (zeros before); B's rows 0-7
 * block 2p's weights, 8-15 block 2p + 1's (4 weights of one weight row per 32-bit column). So C's row q is block 2p's
 * sums of activation row q for the 16 weight rows, row 8 + q block 2p + 1's: one vector each, scaled by the 16
 * weight rows' d (and Q4_1's m) as a vector and the activation row's scale as a broadcast.
 * Weights: the one-lane layout (packed.c one_lane_at), unchanged -- a super-chunk's group g of a row is 16 dwords, one
 * per block; 16 rows' groups transposed (16 x 16 dwords) give each block's dword of 16 rows, its low nibbles one B
 * row (weights 8g + 0, 4, 1, 5) and its high nibbles the next (8g + 2, 6, 3, 7). A row's tail (fewer than 16 blocks)
 * is GGUF's order: 4 dwords per block, gathered from the 16 rows, low nibbles weights 4q + i, high 16 + 4q + i. The
 * activations are laid out once per call in the same orders.
 *
 * Linux lends the tiles' 8 KiB of state only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); amx_ready()
 * asks once per process (cpuid first) and the products fall back to act16.c where it fails or the build lacks AMX. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__F16C__) && defined(__linux__)
#define AMX_BUILD 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define AHEAD_ROWS 32  /* weight rows ahead whose bytes are asked for into L2 (64 read alike) */
#define AMX_MIN_ROWS 8  /* 5-7 rows: no faster than act16.c over a model's weights (0.99x at 5), slower at 3-4 */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_wanted = 1;  /* packed_set_amx: tests compare both paths in one process */

/* 32 activations -> int16 values under the block's scale, as act16.c rounds them (act16.c) */
float act16_round_block(const float *x, int16_t v[32], int32_t *total);

#if defined(AMX_BUILD)
/* the CPU has AMX-INT8 and the kernel lent this process the tiles (asked once) */
static int amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned a, b, c, d;
        const int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1);
        ready = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}
#else
static int amx_ready(void) { return 0; }
#endif

/* switch the AMX products on or off (where they can run); returns whether they run now */
int packed_set_amx(int on) {
    amx_wanted = on != 0;
    return amx_wanted && amx_ready();
}

/* Do 8-row Q4_0 / Q4_1 products run on AMX here? (machine.py names it in every benchmark's line) */
int packed_amx(void) {
    return amx_wanted && amx_ready();
}

/* Does a product of `rows` activation rows of this type (rows of nb blocks) run here? */
int amx_takes(int ggml_type, int64_t rows, int64_t nb) {
    return (ggml_type == 2 || ggml_type == 3) && nb >= 16 && rows >= AMX_MIN_ROWS && amx_wanted && amx_ready();
}

#if defined(AMX_BUILD)
/* the activations as the tiles read them: groups of 8 rows; pair p of group G is a 1 KiB A tile of high bytes at
 * hi + (G np + p) 1024 and one of low bytes at lo + the same; per block b and row r (stride `stride` = 8 x groups):
 * the scale, Q4_0's offset (-8 x the sum of the int16 values) and Q4_1's sum (scale x that sum) */
typedef struct {
    int64_t rows, nb, np, stride;
    int8_t *hi;
    uint8_t *lo;
    float *scale, *sum;
    int32_t *offset;
} amx_act;

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

static int grow(void **buffer, int64_t *have, int64_t bytes) {
    if (bytes <= *have) return 1;
    free(*buffer);
    *buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
    *have = *buffer ? bytes : 0;
    return *buffer != 0;
}

/* x [rows, k] -> the calling thread's tile-ordered activations (valid until its next call); 0 if out of memory */
const void *amx_prepare_rows(const float *x, int64_t rows, int64_t k) {
    static _Thread_local amx_act a;
    static _Thread_local void *tiles, *numbers;
    static _Thread_local int64_t tiles_bytes, numbers_bytes;
    const int64_t nb = k / 32, ns = nb / 16, np = (nb + 1) / 2, groups = (rows + 7) / 8, stride = 8 * groups;
    if (!grow(&tiles, &tiles_bytes, 2 * groups * np * 1024) || !grow(&numbers, &numbers_bytes, 12 * nb * stride))
        return 0;
    a = (amx_act){rows, nb, np, stride, tiles, (uint8_t *)tiles + groups * np * 1024, numbers,
                  (float *)numbers + nb * stride, (int32_t *)numbers + 2 * nb * stride};
    static const int PAIRED[2][4] = {{0, 4, 1, 5}, {2, 6, 3, 7}};  /* a super-chunk's B row 2g + h, byte i */
    int16_t order[32];
    for (int kp = 0; kp < 32; kp++) order[kp] = (int16_t)(8 * (kp / 8) + PAIRED[(kp / 4) % 2][kp % 4]);
    const __m512i super_order = _mm512_loadu_si512(order), low_byte = _mm512_set1_epi16(0xff);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            int16_t v[32];
            int32_t total;
            const float scale = act16_round_block(x + r * k + 32 * b, v, &total);
            a.scale[b * stride + r] = scale;
            a.offset[b * stride + r] = -8 * total;
            a.sum[b * stride + r] = scale * (float)total;
            __m512i q = _mm512_loadu_si512(v);
            if (b < 16 * ns) q = _mm512_permutexvar_epi16(super_order, q);  /* the tail keeps GGUF's order */
            const int half = (int)(b % 2);
            const int64_t at = ((r / 8) * np + b / 2) * 1024 + 64 * (8 * half + r % 8);
            _mm256_store_si256((__m256i *)(a.hi + at + 32 * half), _mm512_cvtepi16_epi8(_mm512_srai_epi16(q, 8)));
            _mm256_store_si256((__m256i *)(a.lo + at + 32 * half), _mm512_cvtepi16_epi8(_mm512_and_si512(q, low_byte)));
            _mm256_store_si256((__m256i *)(a.hi + at + 32 - 32 * half), _mm256_setzero_si256());
            _mm256_store_si256((__m256i *)(a.lo + at + 32 - 32 * half), _mm256_setzero_si256());
        }
    return &a;
}

static inline void transpose16(__m512i r[16]) {  /* a 16 x 16 matrix of dwords, in place */
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* the weights of `valid` rows from row0 (the rest zero) for one super-chunk: B rows of its 16 blocks (512 bytes
 * each) and their d (and Q4_1's m) as vectors over the 16 rows */
static void super_chunk_weights(const int T, const uint8_t *row0, int64_t rb, int valid, int64_t nb, int64_t s,
                                uint8_t b_rows[16][512], __m512 d[16], __m512 m[16]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < 4; g++) {
        __m512i v[16];
        for (int u = 0; u < 16; u++)
            v[u] = u < valid ? _mm512_loadu_si512(row0 + u * rb + 256 * s + 64 * g) : _mm512_setzero_si512();
        transpose16(v);
        for (int j = 0; j < 16; j++) {
            _mm512_store_si512(b_rows[j] + 128 * g, _mm512_and_si512(v[j], low4));
            _mm512_store_si512(b_rows[j] + 128 * g + 64, _mm512_and_si512(_mm512_srli_epi16(v[j], 4), low4));
        }
    }
    for (int which = 0; which < (T == 3 ? 2 : 1); which++) {  /* d at 16 nb, Q4_1's m at 18 nb: fp16, 16 per chunk */
        __m512i v[16];
        for (int u = 0; u < 16; u++)
            v[u] = u < valid ? _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(
                                   (const __m256i *)(row0 + u * rb + (16 + 2 * which) * nb + 32 * s))))
                             : _mm512_setzero_si512();
        transpose16(v);
        for (int j = 0; j < 16; j++) (which ? m : d)[j] = _mm512_castsi512_ps(v[j]);
    }
}

/* the same for a row's tail blocks [16 ns, nb): 4 dwords per block gathered from the 16 rows */
static void tail_weights(const int T, const uint8_t *row0, int64_t rb, int valid, int64_t nb, uint8_t b_rows[16][512],
                         __m512 d[16], __m512 m[16]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)rb));
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const int64_t first = 16 * (nb / 16), tail = nb - first;
    memset(b_rows, 0, 512 * ((tail + 1) & ~1));  /* an odd tail's last pair: the second block's rows zero */
    for (int64_t t = 0; t < tail; t++) {
        const int64_t b = first + t;
        for (int q = 0; q < 4; q++) {
            const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, row0 + 16 * b + 4 * q, 1);
            _mm512_store_si512(b_rows[t] + 64 * q, _mm512_and_si512(g, low4));
            _mm512_store_si512(b_rows[t] + 256 + 64 * q, _mm512_and_si512(_mm512_srli_epi16(g, 4), low4));
        }
        for (int which = 0; which < (T == 3 ? 2 : 1); which++) {  /* the fp16 in the high half of a dword */
            const __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows,
                                                          row0 + (16 + 2 * which) * nb + 2 * b - 2, 1);
            (which ? m : d)[t] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
        }
    }
}

/* block b's sums of rows q < R of group G (C rows `row` + q at c: high-byte sums, then 256 ints on, low-byte sums)
 * into total[q] */
static inline __attribute__((always_inline)) void block_sums(const int T, const amx_act *a, int64_t G, int64_t b,
                                                             const int32_t *c, int row, __m512 d, __m512 m,
                                                             __m512 *total, const int R) {
    const int64_t at = b * a->stride + 8 * G;
    for (int q = 0; q < R; q++) {
        __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * (row + q)), 8),
                                        _mm512_load_si512(c + 256 + 16 * (row + q)));
        if (T == 2) sums = _mm512_add_epi32(sums, _mm512_set1_epi32(a->offset[at + q]));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a->scale[at + q]));
        total[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, total[q]);
        if (T == 3) total[q] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->sum[at + q]), total[q]);
    }
}

/* the weights of the rows AHEAD_ROWS on, asked for into L2 a share at a time, one share per pair of blocks: asking for
 * a group's 16 rows at once (as act16.c's ask_ahead asks for a step's share) overflows the queue of misses, and the
 * dropped requests left the products over a model's weights at 0.8-0.9x act16.c instead of 1.05-1.2x (round 7) */
typedef struct {
    const char *at;
    int64_t share;
} ahead;

static inline void ask_share(ahead *next) {
    for (int64_t b = 0; b < next->share; b += 64) _mm_prefetch(next->at + b, _MM_HINT_T1);
    next->at += next->share;
}

#define PAIR_PRODUCTS(TB, TH, TL, b_tile, a_hi, a_lo) do { \
        _tile_loadd(TB, b_tile, 64); _tile_loadd(1, a_hi, 64); _tile_zero(TH); _tile_dpbssd(TH, 1, TB); \
        _tile_loadd(2, a_lo, 64); _tile_zero(TL); _tile_dpbusd(TL, 2, TB); } while (0)

/* blocks [b0, b0 + count) (b0 even) of group G's R rows, B rows at b_rows: pair p's products are asked for before
 * pair p - 1's sums are scaled, so the tile unit and the vector unit overlap (tiles 0, 3, 4 and 5, 6, 7 alternate) */
static inline __attribute__((always_inline)) void blocks(const int T, const amx_act *a, int64_t G, int64_t b0,
                                                         int64_t count, uint8_t b_rows[16][512], const __m512 *d,
                                                         const __m512 *m, __m512 *total, const int R, ahead *next) {
    _Alignas(64) int32_t c[2][512];
    const int64_t np = (count + 1) / 2, first = (G * a->np + b0 / 2) * 1024;
    for (int64_t p = 0; p <= np; p++) {
        if (p < np && p % 2) PAIR_PRODUCTS(5, 6, 7, b_rows[2 * p], a->hi + first + 1024 * p, a->lo + first + 1024 * p);
        else if (p < np) PAIR_PRODUCTS(0, 3, 4, b_rows[2 * p], a->hi + first + 1024 * p, a->lo + first + 1024 * p);
        if (next) ask_share(next);
        if (p > 0) {
            const int64_t j = 2 * (p - 1);
            block_sums(T, a, G, b0 + j, c[(p - 1) % 2], 0, d[j], m[j], total, R);
            if (j + 1 < count) block_sums(T, a, G, b0 + j + 1, c[(p - 1) % 2], 8, d[j + 1], m[j + 1], total, R);
        }
        if (p < np && p % 2) {
            _tile_stored(6, c[1], 64);
            _tile_stored(7, c[1] + 256, 64);
        } else if (p < np) {
            _tile_stored(3, c[0], 64);
            _tile_stored(4, c[0] + 256, 64);
        }
    }
}

/* y[r, i + u] for u < valid (<= 16 weight rows) and rows r of groups [G0, G1), the last group's rows R */
static inline __attribute__((always_inline)) void weight_rows(const int T, const uint8_t *w, int64_t rb,
                                                              const amx_act *a, float *y, int64_t n, int64_t i,
                                                              int valid, int64_t G0, int64_t G1, const int R) {
    const int64_t nb = a->nb, ns = nb / 16;
    _Alignas(64) uint8_t b_rows[16][512];
    __m512 total[16], d[16], m[16];
    for (int q = 0; q < 16; q++) total[q] = _mm512_setzero_ps(), m[q] = _mm512_setzero_ps();
    const uint8_t *row0 = w + i * rb;
    const int64_t pairs = ns * 8 + (nb % 16 + 1) / 2;  /* of the first group: the ones that ask ahead */
    ahead next = {(const char *)row0 + AHEAD_ROWS * rb, (16 * rb + pairs - 1) / pairs};
    for (int64_t s = 0; s <= ns; s++) {
        if (s == ns && nb == 16 * ns) break;
        if (s < ns) {
            super_chunk_weights(T, row0, rb, valid, nb, s, b_rows, d, m);
        } else {
            tail_weights(T, row0, rb, valid, nb, b_rows, d, m);
        }
        const int64_t count = s < ns ? 16 : nb - 16 * ns;
        for (int64_t G = G0; G < G1; G++)
            if (G == G1 - 1) blocks(T, a, G, 16 * s, count, b_rows, d, m, total + 8 * (G - G0), R, G == G0 ? &next : 0);
            else blocks(T, a, G, 16 * s, count, b_rows, d, m, total + 8 * (G - G0), 8, G == G0 ? &next : 0);
    }
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    for (int64_t r = 8 * G0; r < 8 * G0 + 8 * (G1 - G0 - 1) + R; r++)
        _mm512_mask_storeu_ps(y + r * n + i, mask, total[r - 8 * G0]);
}

typedef void (*rows_fn)(const uint8_t *, int64_t, const amx_act *, float *, int64_t, int64_t, int, int64_t, int64_t);
#define ROWS(T, R) \
    static void rows_##T##_##R(const uint8_t *w, int64_t rb, const amx_act *a, float *y, int64_t n, int64_t i, \
                               int valid, int64_t G0, int64_t G1) { \
        weight_rows(T, w, rb, a, y, n, i, valid, G0, G1, R); \
    }
#define ALL_ROWS(T) ROWS(T, 1) ROWS(T, 2) ROWS(T, 3) ROWS(T, 4) ROWS(T, 5) ROWS(T, 6) ROWS(T, 7) ROWS(T, 8) \
    static const rows_fn ROWS_##T[9] = {0, rows_##T##_1, rows_##T##_2, rows_##T##_3, rows_##T##_4, rows_##T##_5, \
                                        rows_##T##_6, rows_##T##_7, rows_##T##_8};
ALL_ROWS(2) ALL_ROWS(3)

/* columns [n0, n1) of y [rows, n]: 16 weight rows at a time, for 16 activation rows (2 groups) at a time */
void amx_product(int ggml_type, const uint8_t *w, int64_t row_bytes, const void *prepared, float *y, int64_t n,
                 int64_t n0, int64_t n1) {
    const amx_act *a = prepared;
    tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
    const int64_t groups = (a->rows + 7) / 8;
    const int last = (int)(a->rows - 8 * (groups - 1));
    for (int64_t i = n0; i < n1; i += 16)
        for (int64_t G0 = 0; G0 < groups; G0 += 2) {
            const int64_t G1 = G0 + 2 < groups ? G0 + 2 : groups;
            const int R = G1 == groups ? last : 8;
            (ggml_type == 2 ? ROWS_2 : ROWS_3)[R](w, row_bytes, a, y, n, i, (int)(n1 - i < 16 ? n1 - i : 16), G0, G1);
        }
    _tile_release();
}
#else
const void *amx_prepare_rows(const float *x, int64_t rows, int64_t k) {
    (void)x, (void)rows, (void)k;
    return 0;
}

void amx_product(int ggml_type, const uint8_t *w, int64_t row_bytes, const void *prepared, float *y, int64_t n,
                 int64_t n0, int64_t n1) {
    (void)ggml_type, (void)w, (void)row_bytes, (void)prepared, (void)y, (void)n, (void)n0, (void)n1;
}
#endif
