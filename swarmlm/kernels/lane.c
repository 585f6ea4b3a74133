/* A server's step lane (server/lane.py): the plain decode step of a lone keyed session on a packed span, taken in one
   call from the bytes the framed connection just read, with no Python between the socket and the kernel: the frame
   and its MAC (frame.h), the step's order, dims and finiteness, the span's decode (decode.c) and the ANSWER.

   It takes a step only when that step is exactly one whole STEP frame that today's path would take and answer the
   same way (server/lane.py arms a lane only when every other rule -- the session's limits, the scheduler, the
   route -- is known to hold until it is disarmed); anything else returns -1 having changed nothing, and the bytes go
   the usual way. Why: per step the server's Python costs ~0.3 ms of CPU on cold caches around a ~1 ms kernel
   (docs/RESULTS-hop.md round 19). */
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "frame.h"

int decode_span(const void *dims, const void *blocks, int64_t n_blocks, float *x, int64_t rows, void *const *kbase,
                void *const *vbase, const int64_t *layer_stride, const int64_t *cap, const int64_t *len,
                const int64_t *const *mask, const float *rotary, int64_t rope_rows, int64_t rope_by_row);

/* what server/lane.py's StepLane fills in (its ctypes twin, _LaneState: the same fields in the same order) */
struct lane {
    struct frame_key client, server;  /* the session's client key (STEPs) and server key (ANSWERs), and its id */
    const void *dims, *blocks;        /* the span's SpanDecoder: its dims and blocks */
    int64_t n_blocks;
    float *x;                         /* [rows, hidden]: the step's input, the kernel's output in place */
    int64_t rows, hidden;
    void **kbase, **vbase;            /* per row: its cache's K / V for the span's first block ... */
    int64_t *layer_stride, *cap, *len;
    int64_t **mask_rows;              /* ... its length this step, and its mask row */
    int64_t *mask;                    /* [rows, positions]: the session's padding mask, 1 = token */
    int64_t positions;                /* how far the mask, the caches and the rotary table reach: the lane's end */
    const float *rope;                /* the rotary table, rope_rows positions */
    int64_t rope_rows;
    int64_t next_id;                  /* the step id it takes next */
    int64_t position;                 /* the session's position (its tokens so far) */
    int64_t steps;                    /* steps taken since armed */
    double compute_s;                 /* their kernel time */
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Is `data` (n bytes, as read from the socket) exactly one STEP frame of this session's next step: its MAC under the
   client key, its id, its rows and hidden size, room for it, finite values? 1 (its header in `h`; its values at
   data + FRAME_HEADER + FRAME_STEP_HEAD) or 0. Nothing changes either way. */
int lane_open(const struct lane *L, const uint8_t *data, int64_t n, struct frame_step_head *h) {
    if (n < FRAME_HEADER || data[4] != FRAME_KIND_STEP) return 0;
    int64_t body = (int64_t)data[0] << 24 | (int64_t)data[1] << 16 | (int64_t)data[2] << 8 | (int64_t)data[3];
    if (body != n - FRAME_HEADER) return 0;
    if (frame_open_step(&L->client, data + FRAME_HEADER, body, h) != FRAME_OK) return 0;
    if (h->step_id != (uint64_t)L->next_id || h->b != L->rows || h->t != 1 || h->h != L->hidden) return 0;
    if (L->position >= L->positions || L->position >= L->rope_rows) return 0;
    return frame_finite((const float *)(data + FRAME_HEADER + FRAME_STEP_HEAD), L->rows * L->hidden);
}

/* The ANSWER to the step `lane_open` took, its output `values` (rows x hidden float32) computed (and committed) by
   the caller, at `out`; the lane moves on to the next step. Returns the frame's size. */
int64_t lane_answer(struct lane *L, const float *values, double compute_s, double parse_s, uint8_t *out) {
    struct frame_answer_head a = {(uint64_t)L->next_id, L->position + 1, 1, 0, 0.0, compute_s, parse_s, 0.0};
    L->position += 1;
    L->next_id += 1;
    L->steps += 1;
    L->compute_s += compute_s;
    return frame_answer(&L->server, &a, values, L->rows * L->hidden, out);
}

/* `lane_open`, then the span's decode on the session's caches and its `lane_answer` (a packed span's lane): the
   ANSWER's size at `out`; -1 if `lane_open` refused the bytes, -2 if the kernel refused the step (nothing committed
   either way: the caller disarms and the bytes go the usual way, which refuses the step or runs it through
   transformers). */
int64_t lane_take(struct lane *L, const uint8_t *data, int64_t n, uint8_t *out) {
    double t0 = now();
    struct frame_step_head h;
    if (!lane_open(L, data, n, &h)) return -1;
    int64_t pos = L->position;
    memcpy(L->x, data + FRAME_HEADER + FRAME_STEP_HEAD, (size_t)(L->rows * L->hidden) * 4);
    for (int64_t r = 0; r < L->rows; r++) {
        L->len[r] = pos;
        L->mask_rows[r] = L->mask + r * L->positions;
        L->mask_rows[r][pos] = 1;
    }
    double t1 = now();
    int code = decode_span(L->dims, L->blocks, L->n_blocks, L->x, L->rows, L->kbase, L->vbase, L->layer_stride,
                           L->cap, L->len, (const int64_t *const *)L->mask_rows, L->rope, L->rope_rows, 0);
    double t2 = now();
    if (code != 0) {
        for (int64_t r = 0; r < L->rows; r++) L->mask_rows[r][pos] = 0;
        return -2;
    }
    return lane_answer(L, L->x, t2 - t1, t1 - t0, out);
}
