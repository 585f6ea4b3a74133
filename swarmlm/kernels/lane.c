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

/* `data` (n bytes, as read from the socket): if it is exactly one STEP frame of this session's next step, its ANSWER
   frame is written at `out` (FRAME_HEADER + FRAME_ANSWER_HEAD + 4 * rows * hidden + FRAME_MAC bytes) and its size
   returned; -1 if it is anything else (nothing changed); -2 if the kernel refused the step (nothing committed: the
   caller disarms and the step goes the usual way, which refuses it or runs it through transformers). */
int64_t lane_take(struct lane *L, const uint8_t *data, int64_t n, uint8_t *out) {
    double t0 = now();
    if (n < FRAME_HEADER || data[4] != FRAME_KIND_STEP) return -1;
    int64_t body = (int64_t)data[0] << 24 | (int64_t)data[1] << 16 | (int64_t)data[2] << 8 | (int64_t)data[3];
    if (body != n - FRAME_HEADER) return -1;
    struct frame_step_head h;
    if (frame_open_step(&L->client, data + FRAME_HEADER, body, &h) != FRAME_OK) return -1;
    if (h.step_id != (uint64_t)L->next_id || h.b != L->rows || h.t != 1 || h.h != L->hidden) return -1;
    int64_t pos = L->position;
    if (pos >= L->positions || pos >= L->rope_rows) return -1;
    const float *values = (const float *)(data + FRAME_HEADER + FRAME_STEP_HEAD);
    int64_t count = L->rows * L->hidden;
    if (!frame_finite(values, count)) return -1;
    memcpy(L->x, values, (size_t)count * 4);
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
    L->position = pos + 1;
    L->next_id += 1;
    L->steps += 1;
    L->compute_s += t2 - t1;
    struct frame_answer_head a = {h.step_id, pos + 1, 1, 0, 0.0, t2 - t1, t1 - t0, 0.0};
    int64_t size = frame_answer(&L->server, &a, L->x, count, out);
    return size;
}
