/* Two (or more) builds of the packed kernels side by side in one process: Q4_1 products as decode.c calls them
 * (packed_matmul_again, one thread, k / v after q and up after gate sharing their input's preparation), rounds
 * alternated between the builds, medians of thread CPU time. Not part of the package: a tool for kernel work.
 *
 *   cc -O2 benchmarks/products_ab.c -o /tmp/products_ab -ldl
 *   # another tree's kernels (e.g. git archive main | tar x -C /tmp/old), built by that tree itself (its flags),
 *   # copied to a file of their own; likewise this tree's to /tmp/new.so:
 *   cp "$(cd /tmp/old && PYTHONPATH=$PWD python -c 'from swarmlm.kernels import library; print(library()._name)')" \
 *       /tmp/old.so
 *   /tmp/products_ab step 1,2,3,4,5,8 9 /tmp/old.so /tmp/new.so        # SmolLM2's 30 blocks x 7 products
 *   /tmp/products_ab hot:576:1536 1,4 9 /tmp/old.so /tmp/new.so         # one N x K product over and over (in L2)
 *   AMX_OFF=1 /tmp/products_ab step 8 9 /tmp/a.so /tmp/b.so             # builds 1 (digits: indices) without AMX
 *
 * Each build must be its own file (dlopen gives one path's library once). Weights: random nibbles and fp16 scales in
 * the split layout (timing only: the values are not a real model's). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*matmul_fn)(int, const uint8_t *, int64_t, const float *, int64_t, int64_t, float *, int64_t, int64_t, int);
typedef int64_t (*row_bytes_fn)(int, int64_t);
typedef int (*set_fn)(int);
typedef struct { int64_t n, k; int again; uint8_t *w; } product;

static double cpu_s(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int by_value(const void *a, const void *b) { const double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
static uint32_t seed = 12345;
static uint32_t next_random(void) { return (seed = seed * 1664525u + 1013904223u) >> 8; }

static uint8_t *q4_1_weights(int64_t n, int64_t k, int64_t row_bytes) {  /* [nibbles x nb][d x nb][m x nb] per row */
    uint8_t *w = aligned_alloc(64, (n * row_bytes + 63) / 64 * 64);
    const int64_t nb = k / 32;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *row = w + i * row_bytes;
        for (int64_t b = 0; b < 16 * nb; b++) row[b] = (uint8_t)next_random();
        uint16_t *scales = (uint16_t *)(row + 16 * nb);
        for (int64_t b = 0; b < 2 * nb; b++) scales[b] = (uint16_t)(0x1c00 + (next_random() & 0x3ff) + (b >= nb ? 0x8000 : 0));
    }
    return w;
}

int main(int argc, char **argv) {
    if (argc < 5 || argc > 12) { fprintf(stderr, "usage: %s step|hot:N:K ROWS,... ROUNDS a.so [b.so ...]\n", argv[0]); return 2; }
    const char *mode = argv[1];
    const int rounds = atoi(argv[3]), builds = argc - 4;
    matmul_fn matmul[8];
    row_bytes_fn row_bytes = 0;
    for (int b = 0; b < builds; b++) {
        void *h = dlopen(argv[4 + b], RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        matmul[b] = (matmul_fn)dlsym(h, "packed_matmul_again");
        row_bytes = (row_bytes_fn)dlsym(h, "packed_row_bytes");
        ((set_fn)dlsym(h, "packed_set_threads"))(1);
        if (getenv("AMX_OFF") && strchr(getenv("AMX_OFF"), '0' + b)) ((set_fn)dlsym(h, "packed_set_amx"))(0);
    }
    product ps[30 * 7];
    int np = 0;
    if (!strcmp(mode, "step")) {  /* SmolLM2's block: q, k, v (sharing q's input), o, gate, up (gate's), down */
        const int64_t shapes[7][3] = {{576, 576, 0}, {192, 576, 1}, {192, 576, 1}, {576, 576, 0}, {1536, 576, 0},
                                      {1536, 576, 1}, {576, 1536, 0}};
        for (int block = 0; block < 30; block++)
            for (int j = 0; j < 7; j++, np++)
                ps[np] = (product){shapes[j][0], shapes[j][1], (int)shapes[j][2],
                                   q4_1_weights(shapes[j][0], shapes[j][1], row_bytes(3, shapes[j][1]))};
    } else {
        int64_t n = 0, k = 0;
        if (sscanf(mode, "hot:%ld:%ld", &n, &k) != 2 || n < 1 || k < 32 || k % 32) { fprintf(stderr, "bad %s\n", mode); return 2; }
        ps[np++] = (product){n, k, 0, q4_1_weights(n, k, row_bytes(3, k))};
    }
    double macs = 0, widest = 0;
    for (int p = 0; p < np; p++) {
        macs += (double)ps[p].n * ps[p].k;
        widest = ps[p].n > widest ? ps[p].n : widest;
        widest = ps[p].k > widest ? ps[p].k : widest;
    }
    const int repeats = np == 1 ? (int)(2e8 / macs) + 1 : 5;
    char list[256];
    snprintf(list, sizeof list, "%s", argv[2]);
    for (char *tok = strtok(list, ","); tok; tok = strtok(0, ",")) {
        const int rows = atoi(tok);
        float *x = aligned_alloc(64, (size_t)(rows * widest * 4 + 63) / 64 * 64);
        float *y = aligned_alloc(64, (size_t)(rows * widest * 4 + 63) / 64 * 64);
        for (int i = 0; i < rows * widest; i++) x[i] = (float)((int)(next_random() % 2001) - 1000) / 1000.0f;
        double times[8][64];
        for (int r = 0; r < rounds && r < 64; r++)
            for (int j = 0; j < builds; j++) {
                const int b = r % 2 ? builds - 1 - j : j;  /* alternated: every build sees the same load */
                const double t0 = cpu_s();
                for (int e = 0; e < repeats; e++)
                    for (int p = 0; p < np; p++)
                        matmul[b](3, ps[p].w, row_bytes(3, ps[p].k), x, rows, ps[p].k, y, ps[p].n, 1LL << 60, ps[p].again);
                times[b][r] = (cpu_s() - t0) / repeats;
            }
        printf("%s rows %d:", mode, rows);
        double first = 0;
        for (int b = 0; b < builds; b++) {
            qsort(times[b], rounds < 64 ? rounds : 64, sizeof(double), by_value);
            const double m = times[b][(rounds < 64 ? rounds : 64) / 2];
            first = b ? first : m;
            printf("  [%d] %.3f ms %.1f GMAC/s (%.2fx)", b, m * 1e3, macs * rows / m / 1e9, first / m);
        }
        printf("\n");
        fflush(stdout);
        free(x);
        free(y);
    }
    return 0;
}
