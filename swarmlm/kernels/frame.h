/* Compact frames in C (wire/compact.py is their Python twin and their definition; docs/PROTOCOL.md "Framed steps"):
   a STEP's and an ANSWER's header, values and keyed BLAKE2b MAC (RFC 7693: key, 16-byte digest, personalisation) built
   or checked in one call each, for the ends that move a decode step without Python between the socket and the
   kernel (a client's relayed hops, a server's step of a packed span). Every multi-byte header field is big-endian;
   the values are float32 in the machine's (little-endian x86) order, as a Tensor's bytes. */
#ifndef SWARMLM_FRAME_H
#define SWARMLM_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define FRAME_MAC 16     /* keyed BLAKE2b digest (session_keys.MAC_BYTES) */
#define FRAME_HEADER 5   /* body length u32 + kind u8 (frames.HEADER) */
#define FRAME_STEP_HEAD 16    /* step id u64, B u16, T u16, H u32 (compact.STEP_HEAD) */
#define FRAME_ANSWER_HEAD 49  /* step id u64, position u32, batched u32, flags u8, queued, compute, parse, encode f64 */
#define FRAME_KIND_STEP 7
#define FRAME_KIND_ANSWER 8
#define FRAME_KIND_PUSH_STEP 9
#define FRAME_ANSWER_PUSHED 1 /* an ANSWER's flag: the server pushed this step's output on */

/* what `frame_open_*` return */
#define FRAME_OK 0
#define FRAME_TAMPERED 1   /* no MAC, or not the MAC of the bytes before it under the key */
#define FRAME_LENGTH 2     /* MAC good, but the body's length is not its header's dims' (or the expected count's) */

/* A session's MAC context: its key (32 bytes in swarmlm, at most 64) and its id (ASCII), which every MAC covers. */
struct frame_key {
    const uint8_t *key;
    int64_t key_len;
    const uint8_t *sid;
    int64_t sid_len;
};

struct frame_step_head {
    uint64_t step_id;
    int64_t b, t, h;
};

struct frame_answer_head {
    uint64_t step_id;
    int64_t position, batched, flags;
    double queued_s, compute_s, parse_s, encode_s;
};

/* The 16-byte MAC wire/compact.py's `_tag` takes: keyed BLAKE2b (key, digest 16, personalisation `person`, at most
   16 bytes, zero-padded) of sid + "\n" + data[0:len]. */
void frame_mac(const struct frame_key *k, const char *person, const uint8_t *data, int64_t len, uint8_t *out);

/* A whole STEP frame (frame header, STEP header, b*t*h values, MAC) written at `out`, which holds
   FRAME_HEADER + FRAME_STEP_HEAD + 4*b*t*h + FRAME_MAC bytes. Returns that size, or -1 if a dim is out of its field. */
int64_t frame_step(const struct frame_key *k, const struct frame_step_head *head, const float *values, uint8_t *out);

/* A STEP body (what follows the frame header): its MAC under k ("swarmlm-step"), then its header into `head`, then
   its length against the header's dims. FRAME_OK, FRAME_TAMPERED or FRAME_LENGTH; the values start at
   body + FRAME_STEP_HEAD. */
int frame_open_step(const struct frame_key *k, const uint8_t *body, int64_t len, struct frame_step_head *head);

/* A whole ANSWER frame for `count` values at `out` (FRAME_HEADER + FRAME_ANSWER_HEAD + 4*count + FRAME_MAC bytes).
   Returns that size. */
int64_t frame_answer(const struct frame_key *k, const struct frame_answer_head *head, const float *values,
                     int64_t count, uint8_t *out);

/* An ANSWER body: its MAC under k ("swarmlm-answer"), then its length for `count` values, then its header into
   `head`. FRAME_OK, FRAME_TAMPERED or FRAME_LENGTH; the values start at body + FRAME_ANSWER_HEAD. */
int frame_open_answer(const struct frame_key *k, const uint8_t *body, int64_t len, int64_t count,
                      struct frame_answer_head *head);

#define FRAME_SECRET 16   /* a session's secret (sessions.SECRET_BYTES), carried by a PUSH_STEP */
#define FRAME_OTHER 3      /* (frame_open_push_step) a PUSH_STEP into another session, or of too short a body */

/* A whole PUSH_STEP frame into the session k names (k: its push key and id; `secret`: its 16-byte secret) at `out`,
   which holds FRAME_HEADER + 1 + sid_len + FRAME_SECRET + FRAME_STEP_HEAD + 4*b*t*h + FRAME_MAC bytes. Returns that
   size, or -1 if a dim is out of its field or the id is longer than 255 bytes. */
int64_t frame_push_step(const struct frame_key *k, const uint8_t *secret, const struct frame_step_head *head,
                        const float *values, uint8_t *out);

/* A PUSH_STEP body into the session k names (`secret` its secret): the session id and secret (FRAME_OTHER if either
   is not this session's: compared in constant time), its MAC under k ("swarmlm-push"), its STEP header into `head`,
   its length against the header's dims. FRAME_OK (the values at body + *values_at), FRAME_OTHER, FRAME_TAMPERED or
   FRAME_LENGTH. */
int frame_open_push_step(const struct frame_key *k, const uint8_t *secret, const uint8_t *body, int64_t len,
                         struct frame_step_head *head, int64_t *values_at);

/* Are all n values finite (no NaN, no infinity)? 1 or 0. */
int frame_finite(const float *values, int64_t n);

#endif
