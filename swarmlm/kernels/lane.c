/* A server's plain decode step of a packed span in one call (swarmlm's own code): a compact STEP's values checked
 * finite and copied into the decoder's work rows, `decode_span` (decode.c) through the span, and the whole ANSWER
 * frame (header with the step's timings, the output values, the session's MAC: frame.h) written where the server
 * sends it from as it is. What Python did around the kernel for such a step (a tensor made from the values, a
 * finiteness check in numpy, the output viewed as an array, the frame's header, join and MAC) cost ~10-30x its warm
 * time, as every call right after the server's wait does (docs/RESULTS-hop.md rounds 11-18); here it is C.
 *
 * The caller (model/decode_span.py `SpanDecoder.answer`) prepares the rows' cache pointers, lengths, mask rows and
 * rotary table exactly as for `decode_span` alone (one truth: `SpanDecoder._prepare`), and commits the caches only
 * when this returns a frame. */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "frame.h"

/* decode.c's (its dims and blocks are decode.c's structures: passed through as they come) */
int decode_span(const void *D, const void *blocks, int64_t n_blocks, float *x, int64_t rows, void *const *kbase,
                void *const *vbase, const int64_t *layer_stride, const int64_t *cap, const int64_t *len,
                const int64_t *const *mask, const float *rotary, int64_t rope_rows, int64_t rope_by_row);

#define LANE_NOT_FINITE (-100) /* a value is NaN or infinite: nothing computed, nothing written */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* `body`: a STEP's body, its rows x hidden float32 values from byte `at` (unaligned as they come; their count is the
 * caller's, checked against the body's length); `x`: the work rows the kernel
 * runs in place, then the ANSWER's values. `head`: the ANSWER's header as the caller knows it (step id, position,
 * batched, flags, queued_s, parse_s so far); its compute_s is set to the kernel's time, parse_s grows by the check
 * and the copy, encode_s is the time from the kernel's end to the frame's start (the frame's own writing and MAC,
 * like the Python frame's, are counted nowhere: they come after the header is fixed). Returns the frame's size at
 * `out` (FRAME_HEADER + FRAME_ANSWER_HEAD + 4 * rows * hidden + FRAME_MAC), LANE_NOT_FINITE, or decode_span's
 * negative code (nothing written to the caches unless the code is -1 or -2: a product refused, out of memory). */
int64_t lane_decode_answer(const void *D, const void *blocks, int64_t n_blocks, int64_t hidden, const uint8_t *body,
                           int64_t at, float *x, int64_t rows, void *const *kbase, void *const *vbase, const int64_t *layer_stride,
                           const int64_t *cap, const int64_t *len, const int64_t *const *mask, const float *rotary,
                           int64_t rope_rows, int64_t rope_by_row, const struct frame_key *key,
                           struct frame_answer_head *head, uint8_t *out) {
    const double started = now_s();
    const int64_t count = rows * hidden;
    const float *values = (const float *)(body + at);
    if (!frame_finite(values, count)) return LANE_NOT_FINITE;
    memcpy(x, values, sizeof(float) * count);
    const double copied = now_s();
    const int code = decode_span(D, blocks, n_blocks, x, rows, kbase, vbase, layer_stride, cap, len, mask, rotary,
                                 rope_rows, rope_by_row);
    if (code != 0) return code;
    const double computed = now_s();
    head->parse_s += copied - started;
    head->compute_s = computed - copied;
    head->encode_s = now_s() - computed;
    return frame_answer(key, head, x, count, out);
}
