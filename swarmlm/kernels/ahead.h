/* Asking for weights ahead of their use, shared by packed.c and act16.c. */
#ifndef SWARMLM_AHEAD_H
#define SWARMLM_AHEAD_H
#include <stdint.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#ifndef AHEAD
#define AHEAD 16384  /* bytes asked for ahead of their use (into L2); 8-32 KiB read alike here, 4 KiB ~10 % slower */
#endif

/* A tile's weight rows are one contiguous stretch of `bytes`, read in `steps` equal steps: at step s, ask for the
 * stretch's share of that step AHEAD bytes on, into L2 (T1: into L1 would tie up the line fill buffers the loads
 * need). Asking evenly over the whole stretch -- scales, and the rows of the next tiles, included -- read
 * Llama-3.2-1B's Q4_0 blocks ~1.25x faster than asking for each row's nibbles alone (the hardware prefetcher stops at
 * every 4 KiB page). Asking past the weights is harmless: a prefetch never faults. */
static inline __attribute__((always_inline)) void ask_ahead(const uint8_t *start, int64_t bytes, int64_t steps,
                                                            int64_t s) {
#if defined(__SSE2__)
    const int64_t share = bytes / steps;
    const char *at = (const char *)start + AHEAD + share * s;
    for (int64_t b = 0; b < share + 63; b += 64) _mm_prefetch(at + b, _MM_HINT_T1);
#else
    (void)start, (void)bytes, (void)steps, (void)s;
#endif
}
#endif
