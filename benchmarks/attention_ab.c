/* decode.c's attention alone, SmolLM2's shapes (9 query heads, 3 kv heads of 64 dimensions, 30 blocks, caches of
 * max(192, n_pos) positions of which n_pos are used; float32 caches, or float16 with `f16` and a decode.c that has them): per step and block, first 2.2 MB of "weights" read (a block's products stream
 * that much through the caches), then every row's attention over its own cache; thread CPU of the attention alone.
 * Not part of the package: a tool for kernel work. Build it once per decode.c to compare (any tree's file):
 *
 *   cc -O3 -march=native -std=gnu11 -fno-math-errno -fopenmp-simd -DDECODE_C='"/tmp/old/swarmlm/kernels/decode.c"' \
 *       benchmarks/attention_ab.c -o /tmp/attention_old -lm
 *   /tmp/attention_old 4 124        # rows, positions: ms per step and per row
 *   /tmp/attention_old 1 124 warm   # no weights read between blocks: the row's caches stay in L2 / L3
 *   /tmp/attention_new 1 1024 cold f16   # float16 caches (decode.c's span_dims.kv_half, round 13) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include DECODE_C

static double cpu_s(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int packed_matmul_again(int a, const uint8_t *w, int64_t rb, const float *x, int64_t rows, int64_t k, float *y, int64_t n,
                        int64_t mw, int again) {
    (void)a, (void)w, (void)rb, (void)x, (void)rows, (void)k, (void)y, (void)n, (void)mw, (void)again;
    return -1;  /* never called: only attend() runs here */
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s ROWS POSITIONS [warm|cold] [f16]\n", argv[0]); return 2; }
    const int rows = atoi(argv[1]), n_pos = atoi(argv[2]), warm = argc > 3 && !strcmp(argv[3], "warm");
    const int half = argc > 4 && !strcmp(argv[4], "f16"), es = half ? 2 : 4;
    const int blocks = 30, kv = 3, heads = 9, d = 64, cap = n_pos > 192 ? n_pos : 192, steps = 40;
    if (rows < 1 || n_pos < 1) { fprintf(stderr, "rows >= 1, positions >= 1\n"); return 2; }
    span_dims D = {.hidden = 576, .heads = heads, .kv_heads = kv, .head_dim = d, .inter = 1536, .eps = 1e-5f, .scale = 0.125f,
                   .kv_half = half};
    const int64_t block = (int64_t)kv * cap * d;
    char **K = malloc(rows * sizeof *K), **V = malloc(rows * sizeof *V);
    for (int r = 0; r < rows; r++) {
        K[r] = aligned_alloc(64, blocks * block * es);
        V[r] = aligned_alloc(64, blocks * block * es);
        for (int64_t i = 0; i < blocks * block; i++) {
            const float k = (i % 7) * 0.01f, v = (i % 5) * 0.01f;
            if (half) ((_Float16 *)K[r])[i] = (_Float16)k, ((_Float16 *)V[r])[i] = (_Float16)v;
            else ((float *)K[r])[i] = k, ((float *)V[r])[i] = v;
        }
    }
    int64_t *mask = malloc(cap * sizeof *mask);
    for (int i = 0; i < cap; i++) mask[i] = 1;
    float *q = aligned_alloc(64, heads * d * 4), *out = aligned_alloc(64, heads * d * 4);
    float *scores = aligned_alloc(64, 4 * (int64_t)cap * 4);  /* room for decode.c's groups of up to 4 heads */
    for (int i = 0; i < heads * d; i++) q[i] = 0.01f * (i % 13);
    const int64_t weights = warm ? 64 : 2200000;
    char *w = aligned_alloc(64, blocks * weights);
    for (int64_t i = 0; i < blocks * weights; i++) w[i] = (char)i;
    double spent = 0;
    volatile long sink = 0;
    for (int s = 0; s < steps; s++)
        for (int l = 0; l < blocks; l++) {
            long sum = 0;
            for (int64_t i = 0; i < weights; i += 64) sum += w[l * weights + i];
            sink += sum;
            const double t0 = cpu_s();
            for (int r = 0; r < rows; r++) attend(&D, q, K[r] + l * block * es, V[r] + l * block * es, cap, n_pos, 0, mask, scores, out);
            spent += cpu_s() - t0;
        }
    printf("rows %d, %d positions%s%s: attention %.3f ms a step, %.3f a row\n", rows, n_pos, warm ? " (warm)" : "",
           half ? ", float16" : "",
           spent / steps * 1e3, spent / steps * 1e3 / rows);
    return 0;
}
