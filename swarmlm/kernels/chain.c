/* A client's relayed decode step in one call (client/relay.py is its Python side, docs/ARCHITECTURE.md "The client's
   relayed step in C"): for each hop of the route, the STEP frame built from the step's input (hop 0: the caller's
   values; hop j > 0: hop j-1's checked output), written on the hop's framed stream (blocking, poll() bounded by the
   hop's hang timeout), its reply read until the whole frame is there, and taken only if it is the ANSWER expected:
   kind ANSWER, the step's length, the MAC under the server key, the step's id. Its values go to the caller's
   outs[j] and on to hop j+1.

   Anything else stops the chain at that hop and leaves it to the Python reader (client/frame_call.py), which then
   does exactly what it does without this call: the bytes read of that hop's reply are handed back (they go into
   its FrameCall's buffer), and no byte past the expected ANSWER's size is ever read (a recv asks for no more), so a
   REPLY refusal, a STATUS, a tampered or short frame, a closed connection are read and judged there. The caller's
   Python does each hop's bookkeeping (step ids, pending replies, timing, history) from what this call records.

   A pushed decode step on a kept route (`chain_pushed`, docs/PROTOCOL.md "Kept routes") is the same call's other
   shape: hop 0's STEP written, the servers push it on among themselves, one sleep until the last hop's answer, then
   every hop's ANSWER read and taken the same way. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "frame.h"

struct chain_hop {              /* one hop's stream (set once per stream), its step id and bound (set per step) */
    int64_t fd;                 /* the FrameCall's non-blocking socket */
    struct frame_key client;    /* the session's client key (STEP MAC) and id */
    struct frame_key server;    /* the session's server key (ANSWER MAC) and id */
    int64_t max_body;           /* the stream's max message bytes: a larger frame is the Python reader's to refuse */
    uint64_t step_id;           /* this step's id on the stream (advanced once its hop is answered: the next's) */
    double bound_s;             /* its hang timeout: no reply within it (or a write that takes nothing) stops */
};

struct chain_step {             /* a step's dims and buffers (set once per step shape: one argument, not nine) */
    int64_t n, b, t, h;         /* hops; the step's [B, T, H] */
    uint8_t *step;              /* a STEP frame of b*t*h values */
    uint8_t *reply;             /* an ANSWER frame of b*t*h values */
    int64_t *ints;              /* CHAIN_INTS per hop */
    double *times;              /* CHAIN_TIMES per hop */
    int64_t *stop;              /* CHAIN_STOP_SLOTS */
};

/* stop[]: where and why a chain stopped (what its Python side reads) */
#define CHAIN_STOP_HOP 0    /* hops answered (== n: all of them) */
#define CHAIN_STOP_STATE 1  /* CHAIN_* below */
#define CHAIN_STOP_ERRNO 2  /* a failed send's or recv's errno (0: none) */
#define CHAIN_STOP_GOT 3    /* bytes of the stopped hop's reply read (in `reply`, for its FrameCall's buffer) */
#define CHAIN_STOP_SLOTS 4

#define CHAIN_DONE 0          /* every hop answered */
#define CHAIN_WRITE_TIMEOUT 1 /* the socket took nothing for the bound: the STEP is not (wholly) written */
#define CHAIN_WRITE_ERROR 2   /* a send failed (errno): the STEP is not (wholly) written */
#define CHAIN_READ 3          /* the STEP written; its reply not taken here (timed out, broken, not the ANSWER) */

/* per hop j: ints[4j..]: the ANSWER's step id, position, batched steps, flags; times[8j..]: its queued, compute,
   parse, encode (s, the server's), then the client's perf_counter times: STEP build began, write began, reply
   whole, reply checked (a hop stopped in its read: when it stopped, and when its read and so its bound began) */
#define CHAIN_INTS 4
#define CHAIN_TIMES 8
#define CHAIN_MAX_PUSHED 65 /* a pushed route's hops: a step's 64 push targets (docs/PROTOCOL.md) and its first */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* (time.perf_counter's clock on Linux) */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ppoll's timeout of `s` seconds (at least 0) */
static struct timespec timespec_of(double s) {
    if (s < 0) s = 0;
    time_t whole = (time_t)s;
    return (struct timespec){.tv_sec = whole, .tv_nsec = (long)((s - (double)whole) * 1e9)};
}

/* Sleep until fd is ready for `events` or `timeout_s` passes: 1 ready (or broken: the next call says how), 0 timed
   out, -1 interrupted by a signal (the caller's Python handles it). */
static int wait_ready(int fd, short events, double timeout_s) {
    struct pollfd p = {.fd = fd, .events = events};
    struct timespec ts = timespec_of(timeout_s);
    int r = ppoll(&p, 1, &ts, NULL);
    if (r < 0) return errno == EINTR ? -1 : 1; /* (another error: the send / recv reports it) */
    return r > 0;
}

/* The whole frame written (as FrameCall.write_blocking: each wait for room bounded by the hop's bound). */
static int write_all(int fd, const uint8_t *data, int64_t len, double bound_s, int *err) {
    int64_t at = 0;
    while (at < len) {
        ssize_t sent = send(fd, data + at, (size_t)(len - at), MSG_NOSIGNAL);
        if (sent >= 0) {
            at += sent;
            continue;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *err = errno;
            return CHAIN_WRITE_ERROR;
        }
        int ready;
        while ((ready = wait_ready(fd, POLLOUT, bound_s)) < 0) {} /* (a signal mid-frame: the frame first) */
        if (!ready) return CHAIN_WRITE_TIMEOUT;
    }
    return CHAIN_DONE;
}

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Read hop's reply into `reply` until it is the whole expected ANSWER (`frame` bytes) or it cannot be one: CHAIN_DONE
   with *got == frame, or CHAIN_READ (*got bytes read, *err a recv's errno). Never reads past `frame` bytes. `there`:
   the reply is likely there already (a pushed step's, read after the sleep until the last hop's answer): recv first. */
static int read_answer(const struct chain_hop *hop, uint8_t *reply, int64_t frame, int64_t *got, int *err, int there) {
    double deadline = now_s() + hop->bound_s;
    int fd = (int)hop->fd;
    *got = 0;
    while (*got < frame) {
        /* poll first (a decode step's reply is never there as soon as its STEP is written), unless it is there */
        if (!there) {
            int ready = wait_ready(fd, POLLIN, deadline - now_s());
            if (ready <= 0) return CHAIN_READ; /* timed out, or a signal */
        }
        there = 0; /* (not all of it, or not at all: poll before the next recv) */
        ssize_t n = recv(fd, reply + *got, (size_t)(frame - *got), 0);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
            *err = errno;
            return CHAIN_READ;
        }
        if (n == 0) return CHAIN_READ; /* closed: the Python reader's recv sees the end again and names it */
        *got += n;
        if (*got >= FRAME_HEADER && (reply[4] != FRAME_KIND_ANSWER || be32(reply) != frame - FRAME_HEADER ||
                                     be32(reply) > hop->max_body))
            return CHAIN_READ; /* not the ANSWER of this step's length: a refusal, a status, garbage */
    }
    return CHAIN_DONE;
}

/* Record where and why the chain stopped (hop j, not taken: its reply's `got` bytes are in s->reply); returns j. */
static int64_t stopped(const struct chain_step *s, int64_t j, int state, int err, int64_t got) {
    s->stop[CHAIN_STOP_HOP] = j;
    s->stop[CHAIN_STOP_STATE] = state;
    s->stop[CHAIN_STOP_ERRNO] = err;
    s->stop[CHAIN_STOP_GOT] = got;
    return j;
}

/* Hop j's STEP built from `values` (its client key, its step id) and written: CHAIN_DONE or a write's stop state. */
static int write_step(struct chain_hop *hop, const struct chain_step *s, int64_t j, const float *values, int *err) {
    double *tm = &s->times[CHAIN_TIMES * j];
    tm[4] = now_s();
    struct frame_step_head head = {.step_id = hop->step_id, .b = s->b, .t = s->t, .h = s->h};
    int64_t size = frame_step(&hop->client, &head, values, s->step);
    if (size < 0) { /* (dims checked by the caller: never) */
        *err = EINVAL;
        return CHAIN_WRITE_ERROR;
    }
    tm[5] = now_s();
    return write_all((int)hop->fd, s->step, size, hop->bound_s, err);
}

/* Hop j's reply read (within its bound from now) and taken only if it is this step's ANSWER: kind, length, MAC under
   the server key, step id. Its values to outs[j], its header fields and the client's times recorded, the hop's step
   id advanced (the stream's next: a lane's next step sets none). CHAIN_DONE, or CHAIN_READ with *got bytes read (a
   stopped hop's times[7]: when its read began, the start of its bound). `there`: as read_answer's. */
static int take_answer(struct chain_hop *hop, const struct chain_step *s, int64_t j, float *outs, int64_t *got,
                       int *err, int there) {
    int64_t count = s->b * s->t * s->h;
    int64_t frame = FRAME_HEADER + FRAME_ANSWER_HEAD + 4 * count + FRAME_MAC;
    double *tm = &s->times[CHAIN_TIMES * j];
    tm[7] = now_s();
    int state = read_answer(hop, s->reply, frame, got, err, there);
    tm[6] = now_s();
    struct frame_answer_head answer;
    if (state != CHAIN_DONE || frame_open_answer(&hop->server, s->reply + FRAME_HEADER, frame - FRAME_HEADER, count,
                                                 &answer) != FRAME_OK || answer.step_id != hop->step_id)
        return CHAIN_READ; /* tampered, or another step's: the Python reader names it */
    memcpy(outs + j * count, s->reply + FRAME_HEADER + FRAME_ANSWER_HEAD, 4 * (size_t)count);
    int64_t *in = &s->ints[CHAIN_INTS * j];
    in[0] = (int64_t)answer.step_id;
    in[1] = answer.position;
    in[2] = answer.batched;
    in[3] = answer.flags;
    tm[0] = answer.queued_s;
    tm[1] = answer.compute_s;
    tm[2] = answer.parse_s;
    tm[3] = answer.encode_s;
    tm[7] = now_s();
    hop->step_id++;
    return CHAIN_DONE;
}

/* The step's n hops, relayed: x holds b*t*h float32 (hop 0's input), outs n*b*t*h (hop j's output at j*b*t*h);
   s->step and s->reply hold a STEP and an ANSWER frame of b*t*h values. Returns the hops answered; s->stop[] says
   where and why it stopped, s->ints[] and s->times[] what each hop's answer and the client's clock said. */
int64_t chain_relay(struct chain_hop *hops, const struct chain_step *s, const float *x, float *outs) {
    int64_t n = s->n, count = s->b * s->t * s->h;
    memset(s->stop, 0, CHAIN_STOP_SLOTS * sizeof *s->stop);
    for (int64_t j = 0; j < n; j++) {
        int err = 0;
        int64_t got = 0;
        int state = write_step(&hops[j], s, j, j ? outs + (j - 1) * count : x, &err);
        if (state == CHAIN_DONE) state = take_answer(&hops[j], s, j, outs, &got, &err, 0);
        if (state != CHAIN_DONE) return stopped(s, j, state, err, got);
    }
    s->stop[CHAIN_STOP_HOP] = n;
    return n;
}

/* Sleep until the last hop's socket has bytes to read or another hop's connection ends (a middle server that broke),
   at most timeout_s; reads nothing (FrameCall.wait_last's rule: the middle hops' answers, coming meanwhile, do not
   wake the caller). Timed out or interrupted, the reads after it say what came. */
static void wait_last(const struct chain_hop *hops, int64_t n, double timeout_s) {
    struct pollfd p[CHAIN_MAX_PUSHED];
    for (int64_t j = 0; j < n; j++)
        p[j] = (struct pollfd){.fd = (int)hops[j].fd, .events = POLLRDHUP | (j == n - 1 ? POLLIN : 0)};
    struct timespec ts = timespec_of(timeout_s);
    ppoll(p, (nfds_t)n, &ts, NULL);
}

/* The step's n hops, pushed on a kept route (docs/PROTOCOL.md "Kept routes"): hop 0's STEP built from x and written
   (as chain_relay's), which its server pushes on to hop 1 and so on; then one sleep until the last hop's answer
   (bounded by the hops' bounds summed), then every hop's reply read in order, each within its own bound, and taken
   as chain_relay takes it (a hop j > 0 answers the step id its stream awaits: hops[j].step_id). Buffers, outs and
   records as chain_relay's; a hop j > 0 has no STEP of its own: its times[4..5] are hop 0's write's. Stopped at a
   hop j > 0, its state is CHAIN_READ (its STEP was pushed, not written here). n is at most CHAIN_MAX_PUSHED. */
int64_t chain_pushed(struct chain_hop *hops, const struct chain_step *s, const float *x, float *outs) {
    int64_t n = s->n;
    memset(s->stop, 0, CHAIN_STOP_SLOTS * sizeof *s->stop);
    if (n > CHAIN_MAX_PUSHED) return stopped(s, 0, CHAIN_WRITE_ERROR, EINVAL, 0); /* (the caller's check: never) */
    int err = 0;
    int state = write_step(&hops[0], s, 0, x, &err);
    if (state != CHAIN_DONE) return stopped(s, 0, state, err, 0);
    double bound_s = 0, written = s->times[5];
    for (int64_t j = 0; j < n; j++) bound_s += hops[j].bound_s;
    wait_last(hops, n, bound_s);
    for (int64_t j = 0; j < n; j++) {
        int64_t got = 0;
        if (j) s->times[CHAIN_TIMES * j + 4] = s->times[CHAIN_TIMES * j + 5] = written;
        if (take_answer(&hops[j], s, j, outs, &got, &err, 1) != CHAIN_DONE) return stopped(s, j, CHAIN_READ, err, got);
    }
    s->stop[CHAIN_STOP_HOP] = n;
    return n;
}
