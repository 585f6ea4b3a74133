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
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
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

/* ---- the step lane (server/lane.py) --------------------------------------------------------------------------
   The plain decode steps of a lone keyed session taken as their frame arrives, with no Python between the socket and
   the kernel: the frame and its MAC (frame.h), the step's order, dims, room and finiteness (`lane_open`), then for a
   packed span `lane_decode_answer` above (`lane_take`), or for blocks transformers runs the caller's forward and
   `lane_answer`. It takes a step only when that step is exactly one whole STEP frame the usual path would take and
   answer the same way (server/lane.py arms a lane only while every other rule holds); anything else changes nothing,
   and the bytes go the usual way. */

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
    int64_t steps;                    /* steps taken since armed (counted before each ANSWER is sent) */
    double last_s;                    /* when the last step taken ended (CLOCK_MONOTONIC: Python's time.monotonic) */
    /* kept routes (protocol 4; server/lane.py): the frames it takes, and where their outputs go on */
    int64_t from_push;                /* 1: a push connection's PUSH_STEPs (under push_in); 0: the stream's STEPs */
    struct frame_key push_in;         /* (from_push) the session's push key and id */
    const uint8_t *secret;            /* (from_push) the session's secret */
    struct frame_key push_out;        /* a route kept: the next session's push key and id (key_len 0: none) */
    const uint8_t *out_secret;        /* its secret */
    int64_t out_next_id;              /* the step id the next push takes there */
    uint8_t *push_frame;              /* where each push is built */
};

/* The frame kind the lane takes: a push connection's PUSH_STEP, or the stream's STEP. */
static int lane_kind(const struct lane *L) { return L->from_push ? FRAME_KIND_PUSH_STEP : FRAME_KIND_STEP; }

/* Is `data` (n bytes, as read from the socket) exactly one frame of this session's next step: a STEP with its MAC
   under the client key, or (from_push) a PUSH_STEP into this session with its secret and its MAC under the push
   key; its id, its rows and hidden size, room for it? 1 (its header in `h`; its values at data + *values_at) or 0.
   Nothing changes either way. */
static int lane_frame(const struct lane *L, const uint8_t *data, int64_t n, struct frame_step_head *h,
                      int64_t *values_at) {
    if (n < FRAME_HEADER || data[4] != lane_kind(L)) return 0;
    int64_t body = (int64_t)data[0] << 24 | (int64_t)data[1] << 16 | (int64_t)data[2] << 8 | (int64_t)data[3];
    if (body != n - FRAME_HEADER) return 0;
    if (L->from_push) {
        int64_t at = 0;
        if (frame_open_push_step(&L->push_in, L->secret, data + FRAME_HEADER, body, h, &at) != FRAME_OK) return 0;
        *values_at = FRAME_HEADER + at;
    } else {
        if (frame_open_step(&L->client, data + FRAME_HEADER, body, h) != FRAME_OK) return 0;
        *values_at = FRAME_HEADER + FRAME_STEP_HEAD;
    }
    if (h->step_id != (uint64_t)L->next_id || h->b != L->rows || h->t != 1 || h->h != L->hidden) return 0;
    return L->position < L->positions && L->position < L->rope_rows;
}

/* `lane_frame`, and its values finite: the step a caller may compute (then `lane_answer`). */
static int lane_open(const struct lane *L, const uint8_t *data, int64_t n, struct frame_step_head *h) {
    int64_t values_at = 0;
    return lane_frame(L, data, n, h, &values_at) &&
           frame_finite((const float *)(data + values_at), L->rows * L->hidden);
}

/* The lane past a step it answered. */
static void lane_advance(struct lane *L) {
    L->position += 1;
    L->next_id += 1;
    L->steps += 1;
    L->last_s = now_s();
}

/* The ANSWER to the step `lane_open` took, its output `values` (rows x hidden float32) computed (and committed) by
   the caller, at `out`; the lane moves on to the next step. Returns the frame's size. */
static int64_t lane_answer(struct lane *L, const float *values, double compute_s, double parse_s, uint8_t *out) {
    const int64_t flags = L->push_out.key_len ? FRAME_ANSWER_PUSHED : 0;
    struct frame_answer_head a = {(uint64_t)L->next_id, L->position + 1, 1, flags, 0.0, compute_s, parse_s, 0.0};
    lane_advance(L);
    return frame_answer(&L->server, &a, values, L->rows * L->hidden, out);
}

/* `lane_frame`, then the span's decode on the session's caches and its ANSWER (`lane_decode_answer`, which checks the
   values finite first): the ANSWER's size at `out`; -1 if the bytes are not the lane's (or a value is not finite:
   nothing computed), -2 if the kernel refused the step (nothing committed either way: the caller disarms and the
   bytes go the usual way, which refuses the step or runs it through transformers). */
static int64_t lane_take(struct lane *L, const uint8_t *data, int64_t n, uint8_t *out) {
    double t0 = now_s();
    struct frame_step_head h;
    int64_t values_at = 0;
    if (!lane_frame(L, data, n, &h, &values_at)) return -1;
    int64_t pos = L->position;
    for (int64_t r = 0; r < L->rows; r++) {
        L->len[r] = pos;
        L->mask_rows[r] = L->mask + r * L->positions;
        L->mask_rows[r][pos] = 1;
    }
    const int64_t flags = L->push_out.key_len ? FRAME_ANSWER_PUSHED : 0;
    struct frame_answer_head a = {h.step_id, pos + 1, 1, flags, 0.0, 0.0, now_s() - t0, 0.0};
    int64_t size = lane_decode_answer(L->dims, L->blocks, L->n_blocks, L->hidden, data + FRAME_HEADER,
                                      values_at - FRAME_HEADER, L->x, L->rows, L->kbase, L->vbase, L->layer_stride,
                                      L->cap, L->len, (const int64_t *const *)L->mask_rows, L->rope, L->rope_rows, 0,
                                      &L->server, &a, out);
    if (size < 0) {
        for (int64_t r = 0; r < L->rows; r++) L->mask_rows[r][pos] = 0;
        return size == LANE_NOT_FINITE ? -1 : -2;
    }
    lane_advance(L);
    return size;
}

/* The step just taken pushed on along the kept route: its output `values` (rows x hidden) as a PUSH_STEP into the
   next session, with the next step id there, at L->push_frame. Returns its size (0: no route kept). */
static int64_t lane_push(struct lane *L, const float *values) {
    if (!L->push_out.key_len) return 0;
    struct frame_step_head h = {(uint64_t)L->out_next_id, L->rows, 1, L->hidden};
    int64_t size = frame_push_step(&L->push_out, L->out_secret, &h, values, L->push_frame);
    L->out_next_id += 1;  /* (taken: the step is committed, whether its push gets out or not) */
    return size;
}

/* ---- the lane's own thread (server/lane.py `StepLane`'s thread) ---------------------------------------------
   While a lane is armed its connection's reads are the lane's: the event loop stops reading the socket, and the
   lane's thread blocks on it here (on a duplicate of its descriptor), so a step's frame wakes the thread that computes
   it and its ANSWER is sent from there, with no event loop and no Python between the socket and the kernel. It reads
   no byte past the lane's STEP frame; whatever is not such a frame stops it, and what it read (`got` bytes at `in`)
   goes to the usual path as if the connection had just received it. An ANSWER the socket does not take whole (a
   client that does not read) stops it too, the rest (`out[sent:size]`) for the event loop's transport to write. */

/* what the thread's Python side (server/lane.py `_LaneIO`) fills in and reads back */
struct lane_io {
    int64_t fd;       /* the connection's socket (a duplicate: the thread's own; non-blocking, as the loop's) */
    int64_t wake_fd;  /* readable when the lane is to stop (the loop's `disarm`) */
    double stall_s;   /* how long the rest of a begun frame may take before the usual path takes it */
    int64_t got;      /* after a stop: the bytes read at `in` and not taken */
    int64_t sent;     /* after LANE_UNSENT: the ANSWER's bytes sent ... */
    int64_t size;     /* ... of its size at `out` */
    int64_t err;      /* a failed recv's or send's errno (0: none) */
    int64_t answer_fd;   /* where ANSWERs go: the session's stream (fd itself, unless the lane reads pushes) */
    int64_t push_fd;     /* (a route kept) the push connection to the next server; -1: none */
    int64_t push_sent;   /* after LANE_UNSENT: the push's bytes sent ... */
    int64_t push_size;   /* ... of its size at L->push_frame (0: no push this step); its ANSWER not sent at all */
};

#define LANE_STOPPED 1   /* wake_fd: the loop disarms the lane */
#define LANE_DECLINED 2  /* the bytes are not the lane's STEP (another frame, a bad MAC, a wrong id, a NaN, no room, a
                            begun frame stalled, the kernel refused): the usual path takes them */
#define LANE_ENDED 3     /* the peer ended the connection (EOF) or it failed (err): the usual path sees it */
#define LANE_UNSENT 4    /* an ANSWER not wholly sent: the loop's transport writes the rest */
#define LANE_FRAME 5     /* (lane_next) the lane's STEP is at `in`, checked: the caller computes, then lane_reply */

static int64_t lane_step_bytes(const struct lane *L) {
    const int64_t route = L->from_push ? 1 + L->push_in.sid_len + FRAME_SECRET : 0;  /* a PUSH_STEP's session part */
    return FRAME_HEADER + route + FRAME_STEP_HEAD + 4 * L->rows * L->hidden + FRAME_MAC;
}

/* Wait for the lane's next whole STEP frame at `in` (never reading past it): LANE_FRAME (io->got its size), or why
   not (io->got the bytes read). The first byte may take forever; the rest of a begun frame at most io->stall_s. */
static int lane_read(const struct lane *L, struct lane_io *io, uint8_t *in) {
    const int64_t want = lane_step_bytes(L);
    double deadline = 0;
    io->got = 0;
    for (;;) {
        struct pollfd p[2] = {{.fd = (int)io->fd, .events = POLLIN}, {.fd = (int)io->wake_fd, .events = POLLIN}};
        int timeout_ms = -1;
        if (io->got > 0) {
            double left = deadline - now_s();
            if (left <= 0) return LANE_DECLINED;
            timeout_ms = (int)(left * 1000) + 1;
        }
        int r = poll(p, 2, timeout_ms);
        if (r < 0) {
            if (errno == EINTR) continue;
            io->err = errno;
            return LANE_ENDED;
        }
        if (p[1].revents) return LANE_STOPPED;
        if (r == 0) continue; /* (the deadline: checked above) */
        ssize_t n = recv((int)io->fd, in + io->got, (size_t)(want - io->got), 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
            io->err = errno;
            return LANE_ENDED;
        }
        if (n == 0) return LANE_ENDED;
        if (io->got == 0) deadline = now_s() + io->stall_s;
        io->got += n;
        if (io->got >= FRAME_HEADER && (in[4] != lane_kind(L) ||
                                        ((int64_t)in[0] << 24 | (int64_t)in[1] << 16 | (int64_t)in[2] << 8 |
                                         (int64_t)in[3]) != want - FRAME_HEADER))
            return LANE_DECLINED; /* not a frame of the lane's kind and size: the usual path reads and judges it */
        if (io->got == want) return LANE_FRAME;
    }
}

/* `size` bytes at `out` to socket `fd`, as far as it takes them without waiting (`*sent` counts them): 0, or
   LANE_UNSENT (the rest for the loop's transport) or LANE_ENDED (io->err). */
static int send_frame(struct lane_io *io, int64_t fd, const uint8_t *out, int64_t size, int64_t *sent) {
    *sent = 0;
    while (*sent < size) {
        ssize_t n = send((int)fd, out + *sent, (size_t)(size - *sent), MSG_NOSIGNAL);
        if (n >= 0) {
            *sent += n;
            continue;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return LANE_UNSENT;
        io->err = errno;
        return LANE_ENDED;
    }
    return 0;
}

/* The ANSWER of `size` bytes at `out` to the stream: 0, or LANE_UNSENT (io->sent, io->size say what is left) or
   LANE_ENDED (err). */
static int lane_send(struct lane_io *io, const uint8_t *out, int64_t size) {
    io->size = size;
    return send_frame(io, io->answer_fd, out, size, &io->sent);
}

/* A step's output `values` on: a route kept, the push first (the next server waits for it; the client reads this
   ANSWER only after the route's last one), then the ANSWER (`size` bytes at `out`); a push not wholly written leaves
   its ANSWER unsent too. 0, LANE_UNSENT or LANE_ENDED (io says what is left). */
static int lane_deliver(struct lane *L, struct lane_io *io, const float *values, uint8_t *out, int64_t size) {
    io->push_size = lane_push(L, values);
    if (io->push_size) {
        int state = send_frame(io, io->push_fd, L->push_frame, io->push_size, &io->push_sent);
        if (state) {
            io->sent = 0;
            io->size = size;
            return state;
        }
        io->push_size = 0;
    }
    return lane_send(io, out, size);
}

/* A packed span's lane: each STEP read, taken (`lane_take`: checked, computed, committed, answered) and its ANSWER
   sent, until something else comes. Returns why it stopped (never LANE_FRAME). */
int64_t lane_serve(struct lane *L, struct lane_io *io, uint8_t *in, uint8_t *out) {
    io->err = 0;
    for (;;) {
        int state = lane_read(L, io, in);
        if (state != LANE_FRAME) return state;
        int64_t size = lane_take(L, in, io->got, out);
        if (size < 0) return LANE_DECLINED; /* (nothing computed or committed: the usual path answers or refuses) */
        io->got = 0;
        state = lane_deliver(L, io, L->x, out, size);
        if (state) return state;
    }
}

/* Blocks transformers runs: the next STEP read and checked (`lane_open`: its MAC, id, dims, room, finite values) for
   the caller to compute; LANE_FRAME or why not. */
int64_t lane_next(struct lane *L, struct lane_io *io, uint8_t *in, struct frame_step_head *h) {
    io->err = 0;
    int state = lane_read(L, io, in);
    if (state != LANE_FRAME) return state;
    return lane_open(L, in, io->got, h) ? LANE_FRAME : LANE_DECLINED;
}

/* ... and its ANSWER (`lane_answer`: the lane moves on) sent: 0, LANE_UNSENT or LANE_ENDED. */
int64_t lane_reply(struct lane *L, struct lane_io *io, const float *values, double compute_s, double parse_s,
                   uint8_t *out) {
    int64_t size = lane_answer(L, values, compute_s, parse_s, out);
    io->got = 0;
    return lane_deliver(L, io, values, out, size);
}
