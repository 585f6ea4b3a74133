/* One decode step of a span of Llama-shaped blocks in one call (swarmlm's own code): per block, RMSNorm, the q/k/v
 * products, rotary embedding, the new key and value written into each row's cache, attention over the row's cached
 * positions, the output product and residual, RMSNorm, SiLU-gated MLP and residual. Llama, Mistral and Qwen2 blocks
 * (and Qwen3 with its per-head query and key norms) compute exactly this (model/decode_span.py checks a span first). The products are packed_matmul's (the
 * weights in their GGUF blocks, split between the kernels' threads); everything else is float32 here, in the order
 * transformers computes it, so a step equals the blocks' own forward up to float32 summation order (the products'
 * own rounding included: the blocks' PackedLinear layers call the same kernels).
 *
 * Why: a decode step of a small model is mostly the framework's per-operation cost (SmolLM2: ~30 torch operations
 * and module calls per block, ~250 us, against ~400 us of weights); here a whole span costs one call.
 *
 * Rows are independent sequences (one session's rows, or several sessions' batched): row r has its own cache
 * buffers (keys of block l, kv head h at kbase[r] + l * layer_stride[r] + h * cap[r] * head_dim), its own committed
 * length len[r] (the new token goes to position len[r]) and its own 0/1 mask over positions 0..len[r] (0 = padding:
 * never attended, as transformers gives it exactly zero weight; the new token's own entry is 1: the caller checks).
 *
 * Rotary positions come from the same masks, as transformers derives them (families/base.py padded_positions): a
 * query row's position is the number of real tokens at positions 0..len[r] (its own included) - 1; its cos and sin
 * are that row of a table of the rotary module's values (rotary: cos rows, then sin rows, rope_rows each). A rotary
 * whose values are not a table of positions (dynamic, longrope) gives one row per query row instead (rope_by_row).
 *
 * The caches hold float32 or float16 (D->kv_half; server/kv_cache.py): a new key and value are rounded to float16
 * (to nearest even, as torch's .half()) when written, and every cached one is widened once as attention loads it
 * (F16C's vcvtph2ps), so the attention reads half the bytes; everything it computes stays float32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

int packed_matmul_again(int ggml_type, const uint8_t *w, int64_t row_bytes, const float *x, int64_t rows, int64_t k,
                        float *y, int64_t n, int64_t min_weights, int again);

typedef struct {
    int64_t type;  /* ggml type id (packed.c) */
    const uint8_t *w;
    int64_t row_bytes, n, k;
    const float *bias;  /* [n] or NULL */
} span_linear;

typedef struct {
    span_linear q, k, v, o, gate, up, down;
    const float *norm_in, *norm_post;  /* RMSNorm weights [hidden] */
    int64_t window;  /* sliding window: a token attends to the last `window` positions, itself included; 0 = all */
    const float *q_norm, *k_norm;  /* Qwen3: RMSNorm of each head's query and key [head_dim] before rotary, or NULL */
} span_block;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;  /* RMSNorm epsilon; attention's score scale (head_dim ** -0.5) */
    int64_t min_weights;  /* products at least this large are split between threads */
    int64_t kv_half;  /* 1: the caches hold float16 (_Float16), 0: float32 */
} span_dims;

/* again: x is the previous product's input, unchanged (k and v after q, up after gate): its preparation is shared */
static int linear(const span_linear *L, const float *x, int64_t rows, float *y, int64_t min_weights, int again) {
    if (packed_matmul_again((int)L->type, L->w, L->row_bytes, x, rows, L->k, y, L->n, min_weights, again) != 0)
        return -1;
    if (L->bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < L->n; i++) y[r * L->n + i] += L->bias[i];
    return 0;
}

/* exp(x) for x in [-87, 88] to ~2 ulp, in plain arithmetic so loops of it vectorize (libm's expf is a call per
 * element: 1M calls, ~15 ms, in an 8-row step of a 1B model's MLP): x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for e^r (Cephes' coefficients), 2^n from the exponent bits. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = __builtin_roundevenf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln2 split in two: r exact to float32 */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t i; float f; } scale = {.i = (uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* transformers' LlamaRMSNorm in float32: x * rsqrt(mean(x^2) + eps), then times the weight */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* rotate_half convention: pairs (i, i + d/2) */
static void rope(float *v, int64_t heads, int64_t d, const float *cos, const float *sin) {
    const int64_t h2 = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *p = v + h * d;
        for (int64_t i = 0; i < h2; i++) {
            const float a = p[i], b = p[i + h2];
            p[i] = a * cos[i] - b * sin[i];
            p[i + h2] = b * cos[i + h2] + a * sin[i + h2];
        }
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

#if defined(__AVX512F__)
/* exp_approx of 16 floats: the same steps in vector form (gcc left the scalar loop below unvectorized: the exponent
 * loop ran one position at a time, ~40 % of attention's time at 1024 positions, round 13) */
static inline __m512 exp_approx16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                     _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* positions t0..t0 + 15 (of at most `m`) that the 0/1 int64 mask lets through */
static inline __mmask16 mask16(const int64_t *mask, int64_t t0, int64_t m) {
    const __mmask16 in = (__mmask16)(m >= 16 ? 0xffff : (1u << m) - 1);
    const __mmask8 lo = _mm512_mask_test_epi64_mask((__mmask8)in, _mm512_maskz_loadu_epi64((__mmask8)in, mask + t0),
                                                    _mm512_set1_epi64(-1));
    const __mmask8 hi = _mm512_mask_test_epi64_mask((__mmask8)(in >> 8),
                                                    _mm512_maskz_loadu_epi64((__mmask8)(in >> 8), mask + t0 + 8),
                                                    _mm512_set1_epi64(-1));
    return (__mmask16)(lo | (hi << 8));
}
#endif

/* one head's scores over positions [first, n_pos) -> their softmax weights in place (masked positions 0) */
static void softmax_weights(float *scores, const int64_t *mask, int64_t first, int64_t n_pos) {
#if defined(__AVX512F__)
    /* 16 positions at a time; a masked position's score may be anything (its key is never written): never used */
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    for (int64_t t0 = first; t0 < n_pos; t0 += 16) {
        const __mmask16 k = mask16(mask, t0, n_pos - t0);
        top16 = _mm512_mask_max_ps(top16, k, top16, _mm512_maskz_loadu_ps(k, scores + t0));
    }
    const __m512 top_v = _mm512_set1_ps(_mm512_reduce_max_ps(top16));
    __m512 total16 = _mm512_setzero_ps();
    for (int64_t t0 = first; t0 < n_pos; t0 += 16) {
        const int64_t m = n_pos - t0;
        const __mmask16 in = (__mmask16)(m >= 16 ? 0xffff : (1u << m) - 1), k = mask16(mask, t0, m);
        const __m512 e = _mm512_maskz_mov_ps(k, exp_approx16(_mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, scores + t0),
                                                                                  top_v)));
        _mm512_mask_storeu_ps(scores + t0, in, e);
        total16 = _mm512_add_ps(total16, e);
    }
    const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(total16));
    for (int64_t t0 = first; t0 < n_pos; t0 += 16) {
        const int64_t m = n_pos - t0;
        const __mmask16 in = (__mmask16)(m >= 16 ? 0xffff : (1u << m) - 1);
        _mm512_mask_storeu_ps(scores + t0, in, _mm512_div_ps(_mm512_maskz_loadu_ps(in, scores + t0), total));
    }
#else
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t t = first; t < n_pos; t++) {
        const float s = mask[t] ? scores[t] : -INFINITY;
        top = s > top ? s : top;
    }
    float total = 0.0f;
    /* no branch in the loop, meant to let it vectorize (gcc 12 still runs it one position at a time: hence the AVX-512
     * version above); a masked position's score may be anything (its key is never written): its exponent is of 0 */
#pragma omp simd reduction(+ : total)
    for (int64_t t = first; t < n_pos; t++) {
        const float e = exp_approx(mask[t] ? scores[t] - top : 0.0f);
        scores[t] = mask[t] ? e : 0.0f;
        total += scores[t];
    }
#pragma omp simd
    for (int64_t t = first; t < n_pos; t++) scores[t] = scores[t] / total;
#endif
}

#if defined(__AVX512F__)
/* lane j = the sum of v[j]'s lanes: a transpose-add tree, ~3 vector operations per vector instead of a reduction's 8 */
static inline __attribute__((always_inline)) __m512 lane_sums16(const __m512 v[16]) {
    __m512 a[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* per 128 bits: v[2i]'s pair sums, v[2i + 1]'s, interleaved */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128 bits: the sums of v[4i..4i + 3] there */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  /* 128-bit quarters 0, 2 and 1, 3 added */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* G query heads of one kv head, C x 16 dimensions each: each head's scores 16 positions at a time (one vector of
 * partial sums each, added by lane_sums16) and their softmax, then the G heads' weighted values together: a
 * position's value vectors loaded once for the G heads, G x C accumulators. The plain loops below reduced every score
 * alone and read and wrote the output per position: ~2.5x the operations. One head at a time, the values' pass was
 * C accumulators each waiting for its previous multiply-add (4 cycles here, AMD Zen 5) at every position; with the
 * group's heads together it is G x C independent ones. Each head's sums are added in the same order as one head at a
 * time (the same bits). scores: G rows of `stride` floats. */
/* 16 cached floats at element i of a key or value buffer: float32 as they are, float16 widened (HALF: float16) */
static inline __attribute__((always_inline)) __m512 load_kv(const int HALF, const void *p, int64_t i) {
    return HALF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline)) void attend_heads(const int HALF, const int C, const int G, const float *q,
                                                               const void *K, const void *V, int64_t first, int64_t n_pos,
                                                               const int64_t *mask, float scale, float *scores,
                                                               int64_t stride, float *o) {
    for (int g = 0; g < G; g++) {
        float *sc = scores + g * stride;
        __m512 qv[8];
        for (int c = 0; c < C; c++) qv[c] = _mm512_loadu_ps(q + g * 16 * C + 16 * c);
        for (int64_t t0 = first; t0 < n_pos; t0 += 16) {
            const int64_t m = n_pos - t0 < 16 ? n_pos - t0 : 16;
            __m512 dots[16];
            for (int j = 0; j < 16; j++) {
                dots[j] = _mm512_setzero_ps();
                if (j < m)
                    for (int c = 0; c < C; c++)
                        dots[j] = _mm512_fmadd_ps(qv[c], load_kv(HALF, K, (t0 + j) * 16 * C + 16 * c), dots[j]);
            }
            _mm512_mask_storeu_ps(sc + t0, (__mmask16)((1u << m) - 1),
                                  _mm512_mul_ps(lane_sums16(dots), _mm512_set1_ps(scale)));
        }
        softmax_weights(sc, mask, first, n_pos);
    }
    __m512 acc[4][8];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = first; t < n_pos; t++) {
        if (!mask[t]) continue;  /* a padding position's value is never read (it may be anything) */
        __m512 v[8];
        for (int c = 0; c < C; c++) v[c] = load_kv(HALF, V, t * 16 * C + 16 * c);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * stride + t]);
            for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(o + g * 16 * C + 16 * c, acc[g][c]);
}

#define ATTEND_GROUP 4  /* query heads taken together at most (16 accumulators at 64 dimensions; 8 vectors: 2) */

/* heads [h, h + G) of one kv head, d = 16 C; K, V: float16 (half) or float32 */
static void attend_group(int half, int64_t d, int64_t G, const float *q, const void *K, const void *V, int64_t first,
                         int64_t n_pos, const int64_t *mask, float scale, float *scores, int64_t stride, float *o) {
#define HEADS(C, G_)                                                                                \
    if (half) attend_heads(1, C, G_, q, K, V, first, n_pos, mask, scale, scores, stride, o);       \
    else attend_heads(0, C, G_, q, K, V, first, n_pos, mask, scale, scores, stride, o);           \
    return
#define GROUPS(C) switch (G) { case 1: HEADS(C, 1); case 2: HEADS(C, 2); case 3: HEADS(C, 3); default: HEADS(C, 4); }
    switch (d) {
        case 16: GROUPS(1);
        case 32: GROUPS(2);
        case 64: GROUPS(4);
        default: if (G == 1) { HEADS(8, 1); } HEADS(8, 2);
    }
#undef GROUPS
#undef HEADS
}
#endif

/* element i of a cache buffer, float32 or float16 */
static inline float kv_at(int half, const void *p, int64_t i) {
    return half ? (float)((const _Float16 *)p)[i] : ((const float *)p)[i];
}

/* one row's attention for every head: out [heads * d]; keys, values: the row's buffers of this block (D->kv_half) */
static void attend(const span_dims *D, const float *q, const void *keys, const void *values, int64_t cap,
                   int64_t n_pos, int64_t window, const int64_t *mask, float *scores, float *out) {
    const int half = D->kv_half != 0;
    const int64_t es = half ? 2 : 4;  /* bytes per cached element */
    const int64_t d = D->head_dim, group = D->heads / D->kv_heads;
    const int64_t first = window && n_pos > window ? n_pos - window : 0;
#if defined(__AVX512F__)
    if (d == 16 || d == 32 || d == 64 || d == 128) {  /* head sizes of 1, 2, 4 or 8 vectors (SmolLM2: 64) */
        const int64_t most = d == 128 ? 2 : ATTEND_GROUP;
        for (int64_t h = 0; h < D->heads;) {
            const int64_t kv = h / group, end = (kv + 1) * group, G = end - h < most ? end - h : most;
            attend_group(half, d, G, q + h * d, (const char *)keys + kv * cap * d * es,
                         (const char *)values + kv * cap * d * es, first, n_pos, mask, D->scale, scores, n_pos,
                         out + h * d);
            h += G;
        }
        return;
    }
#endif
    for (int64_t h = 0; h < D->heads; h++) {
        const void *K = (const char *)keys + (h / group) * cap * d * es, *V = (const char *)values + (h / group) * cap * d * es;
        const float *qh = q + h * d;
        float *o = out + h * d;
        for (int64_t t = first; t < n_pos; t++) {
            if (!mask[t]) continue;
            if (!half) {
                scores[t] = dot(qh, (const float *)K + t * d, d) * D->scale;
                continue;
            }
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; i++) s += qh[i] * kv_at(1, K, t * d + i);
            scores[t] = s * D->scale;
        }
        softmax_weights(scores, mask, first, n_pos);
        memset(o, 0, sizeof(float) * d);
        for (int64_t t = first; t < n_pos; t++) {
            if (!mask[t]) continue;
            const float p = scores[t];
#pragma omp simd
            for (int64_t i = 0; i < d; i++) o[i] += p * kv_at(half, V, t * d + i);
        }
    }
}

#if defined(__AVX512F__)
#define ATTEND_SCORES ATTEND_GROUP  /* attend's scores: a row per head taken together */
#else
#define ATTEND_SCORES 1
#endif

#define MAX_QUERY_ROWS 256  /* query rows of one call at most (model/decode_span.py sends at most DIRECT_ROWS, 64) */

/* a thread's scratch buffer of at least `need` floats (64-byte aligned), kept between calls and grown when short (a
 * call of its own would be an allocation and a release per step); 0 if out of memory */
static float *scratch(int64_t need) {
    static _Thread_local float *buffer;
    static _Thread_local int64_t held;
    if (need > held) {
        free(buffer);
        buffer = aligned_alloc(64, sizeof(float) * need);
        held = buffer ? need : 0;
    }
    return buffer;
}

/* x [rows, hidden] in place through n_blocks blocks; 0 on success, -1 if a product was refused, -2 out of memory,
 * -3 if a query row is padding (its own mask entry 0: transformers' business; nothing is written), -4 if a row's
 * position is past the rotary table or rows are too many (nothing is written) */
int decode_span(const span_dims *D, const span_block *blocks, int64_t n_blocks, float *x, int64_t rows,
                void *const *kbase, void *const *vbase, const int64_t *layer_stride, const int64_t *cap,
                const int64_t *len, const int64_t *const *mask, const float *rotary, int64_t rope_rows,
                int64_t rope_by_row) {
    const int64_t H = D->hidden, d = D->head_dim, qn = D->heads * d, kvn = D->kv_heads * d, I = D->inter;
    const int64_t es = D->kv_half ? 2 : 4;  /* bytes per cached element */
    if (rows > MAX_QUERY_ROWS || (rope_by_row && rows > rope_rows)) return -4;
    int64_t longest = 0, table_row[MAX_QUERY_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        if (!mask[r][len[r]]) return -3;
        longest = len[r] + 1 > longest ? len[r] + 1 : longest;
        if (rope_by_row) {
            table_row[r] = r;
            continue;
        }
        /* a row's next token (same mask, one position on) adds its own entry; any other row counts its mask */
        if (r > 0 && mask[r] == mask[r - 1] && len[r] == len[r - 1] + 1) {
            table_row[r] = table_row[r - 1] + 1;
        } else {
            int64_t real = 0;
            for (int64_t t = 0; t <= len[r]; t++) real += mask[r][t] != 0;
            table_row[r] = real - 1;
        }
        if (table_row[r] >= rope_rows) return -4;
    }
    /* every buffer starts on a 64-byte line: the products' vector loads of a misaligned row span two lines (malloc's
     * 16-byte alignment made an 8-row step of a 1B model ~15 % slower than the same products from torch's tensors) */
    const int64_t sizes[10] = {rows * H, rows * qn, rows * kvn, rows * kvn, rows * qn, rows * H, rows * I, rows * I,
                               rows * H, ATTEND_SCORES * longest};
    int64_t need = 0;
    for (int i = 0; i < 10; i++) need += (sizes[i] + 15) / 16 * 16;
    float *buf = scratch(need);
    if (!buf) return -2;
    float *part[10];
    int64_t at = 0;
    for (int i = 0; i < 10; at += (sizes[i] + 15) / 16 * 16, i++) part[i] = buf + at;
    float *xn = part[0], *q = part[1], *k = part[2], *v = part[3], *att = part[4], *o = part[5], *gate = part[6],
          *up = part[7], *down = part[8], *scores = part[9];
    int status = 0;
    for (int64_t l = 0; l < n_blocks && !status; l++) {
        const span_block *B = blocks + l;
        for (int64_t r = 0; r < rows; r++) rms_norm(x + r * H, B->norm_in, H, D->eps, xn + r * H);
        if (linear(&B->q, xn, rows, q, D->min_weights, 0) || linear(&B->k, xn, rows, k, D->min_weights, 1) ||
            linear(&B->v, xn, rows, v, D->min_weights, 1)) {
            status = -1;
            break;
        }
        for (int64_t r = 0; r < rows; r++) {
            if (B->q_norm)
                for (int64_t h = 0; h < D->heads; h++) rms_norm(q + r * qn + h * d, B->q_norm, d, D->eps, q + r * qn + h * d);
            if (B->k_norm)
                for (int64_t h = 0; h < D->kv_heads; h++)
                    rms_norm(k + r * kvn + h * d, B->k_norm, d, D->eps, k + r * kvn + h * d);
            const float *cos = rotary + table_row[r] * d, *sin = rotary + (rope_rows + table_row[r]) * d;
            rope(q + r * qn, D->heads, d, cos, sin);
            rope(k + r * kvn, D->kv_heads, d, cos, sin);
            /* layer_stride, cap, len: in elements of the cache's type */
            void *K = (char *)kbase[r] + l * layer_stride[r] * es, *V = (char *)vbase[r] + l * layer_stride[r] * es;
            for (int64_t h = 0; h < D->kv_heads; h++) {  /* the new token's key and value at position len[r] */
                const int64_t at = (h * cap[r] + len[r]) * d;
                const float *kh = k + r * kvn + h * d, *vh = v + r * kvn + h * d;
                if (D->kv_half) {
                    _Float16 *Kh = (_Float16 *)K + at, *Vh = (_Float16 *)V + at;
#pragma omp simd
                    for (int64_t i = 0; i < d; i++) {
                        Kh[i] = (_Float16)kh[i];
                        Vh[i] = (_Float16)vh[i];
                    }
                } else {
                    memcpy((float *)K + at, kh, sizeof(float) * d);
                    memcpy((float *)V + at, vh, sizeof(float) * d);
                }
            }
            attend(D, q + r * qn, K, V, cap[r], len[r] + 1, B->window, mask[r], scores, att + r * qn);
        }
        if (linear(&B->o, att, rows, o, D->min_weights, 0)) {
            status = -1;
            break;
        }
        for (int64_t i = 0; i < rows * H; i++) x[i] += o[i];
        for (int64_t r = 0; r < rows; r++) rms_norm(x + r * H, B->norm_post, H, D->eps, xn + r * H);
        if (linear(&B->gate, xn, rows, gate, D->min_weights, 0) || linear(&B->up, xn, rows, up, D->min_weights, 1)) {
            status = -1;
            break;
        }
#pragma omp simd
        for (int64_t i = 0; i < rows * I; i++) gate[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
        if (linear(&B->down, gate, rows, down, D->min_weights, 0)) {
            status = -1;
            break;
        }
        for (int64_t i = 0; i < rows * H; i++) x[i] += down[i];
    }
    return status;
}
