/* Compact frames in C: frame.h says what and why. BLAKE2b is RFC 7693's (sequential mode, a key, a 16-byte digest,
   a personalisation in the parameter block), written from the RFC: what hashlib.blake2b(data, digest_size=16, key=..,
   person=..) computes, which tests/test_frame_c.py checks byte for byte. */
#include "frame.h"

#include <string.h>

/* ---- BLAKE2b (RFC 7693) ------------------------------------------------------------------------------------ */

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

struct blake2b {
    uint64_t h[8];
    uint64_t t;        /* bytes compressed so far (a frame is far below 2^64) */
    uint8_t buf[128];  /* the block not yet compressed: always compressed only once more input follows (the last
                          block is compressed by `final`, flagged) */
    size_t fill;
};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);  /* little-endian words (x86) */
    return v;
}

static void compress(struct blake2b *s, const uint8_t *block, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) v[i] = s->h[i], v[i + 8] = IV[i];
    v[12] ^= s->t;
    if (last) v[14] = ~v[14];
#define G(a, b, c, d, x, y)                          \
    do {                                             \
        v[a] = v[a] + v[b] + (x); v[d] = rotr(v[d] ^ v[a], 32); \
        v[c] = v[c] + v[d];       v[b] = rotr(v[b] ^ v[c], 24); \
        v[a] = v[a] + v[b] + (y); v[d] = rotr(v[d] ^ v[a], 16); \
        v[c] = v[c] + v[d];       v[b] = rotr(v[b] ^ v[c], 63); \
    } while (0)
    for (int r = 0; r < 12; r++) {
        const uint8_t *s8 = SIGMA[r];
        G(0, 4, 8, 12, m[s8[0]], m[s8[1]]);
        G(1, 5, 9, 13, m[s8[2]], m[s8[3]]);
        G(2, 6, 10, 14, m[s8[4]], m[s8[5]]);
        G(3, 7, 11, 15, m[s8[6]], m[s8[7]]);
        G(0, 5, 10, 15, m[s8[8]], m[s8[9]]);
        G(1, 6, 11, 12, m[s8[10]], m[s8[11]]);
        G(2, 7, 8, 13, m[s8[12]], m[s8[13]]);
        G(3, 4, 9, 14, m[s8[14]], m[s8[15]]);
    }
#undef G
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void update(struct blake2b *s, const uint8_t *data, size_t len) {
    while (len > 0) {
        if (s->fill == 128) {  /* a full block with more input after it: not the last */
            s->t += 128;
            compress(s, s->buf, 0);
            s->fill = 0;
        }
        size_t take = 128 - s->fill < len ? 128 - s->fill : len;
        memcpy(s->buf + s->fill, data, take);
        s->fill += take;
        data += take;
        len -= take;
    }
}

/* keyed, a 16-byte digest, personalised (`person` at most 16 bytes, zero-padded in the parameter block) */
static void init(struct blake2b *s, const uint8_t *key, size_t key_len, const char *person) {
    uint8_t param[64] = {0};
    param[0] = FRAME_MAC;          /* digest length */
    param[1] = (uint8_t)key_len;   /* key length (<= 64) */
    param[2] = 1;                  /* fanout */
    param[3] = 1;                  /* depth */
    size_t n = strlen(person);
    memcpy(param + 48, person, n < 16 ? n : 16);
    for (int i = 0; i < 8; i++) s->h[i] = IV[i] ^ load64(param + 8 * i);
    s->t = 0;
    s->fill = 0;
    if (key_len > 0) {  /* the key, zero-padded, is the first block */
        uint8_t block[128] = {0};
        memcpy(block, key, key_len);
        update(s, block, 128);
    }
}

static void final(struct blake2b *s, uint8_t *out) {
    s->t += s->fill;
    memset(s->buf + s->fill, 0, 128 - s->fill);
    compress(s, s->buf, 1);
    memcpy(out, s->h, FRAME_MAC);  /* the digest: the state's first bytes, little-endian */
}

/* ---- the MAC of a compact frame --------------------------------------------------------------------------- */

void frame_mac(const struct frame_key *k, const char *person, const uint8_t *data, int64_t len, uint8_t *out) {
    struct blake2b s;
    init(&s, k->key, (size_t)(k->key_len > 64 ? 64 : k->key_len), person);
    update(&s, k->sid, (size_t)k->sid_len);
    update(&s, (const uint8_t *)"\n", 1);
    update(&s, data, (size_t)len);
    final(&s, out);
}

/* does body[0:size] end in... the MAC at body + size match? (constant time in its 16 bytes) */
static int mac_matches(const struct frame_key *k, const char *person, const uint8_t *body, int64_t size) {
    uint8_t tag[FRAME_MAC];
    frame_mac(k, person, body, size, tag);
    uint8_t diff = 0;
    for (int i = 0; i < FRAME_MAC; i++) diff |= (uint8_t)(tag[i] ^ body[size + i]);
    return diff == 0;
}

/* ---- big-endian fields ------------------------------------------------------------------------------------- */

static inline void put16(uint8_t *p, uint64_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static inline void put32(uint8_t *p, uint64_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (24 - 8 * i)); }
static inline void put64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i)); }
static inline uint64_t get16(const uint8_t *p) { return (uint64_t)p[0] << 8 | p[1]; }
static inline uint64_t get32(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 4; i++) v = v << 8 | p[i];
    return v;
}
static inline uint64_t get64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | p[i];
    return v;
}
static inline void put_double(uint8_t *p, double d) {
    uint64_t v;
    memcpy(&v, &d, 8);
    put64(p, v);
}
static inline double get_double(const uint8_t *p) {
    uint64_t v = get64(p);
    double d;
    memcpy(&d, &v, 8);
    return d;
}

/* ---- STEP and ANSWER --------------------------------------------------------------------------------------- */

/* A frame's header (its body's length, its kind) at `out`; where its body goes. */
static uint8_t *frame_header(uint8_t *out, uint8_t kind, int64_t body) {
    put32(out, (uint64_t)body);
    out[4] = kind;
    return out + FRAME_HEADER;
}

/* A STEP part's values' bytes for `head`'s dims, or -1 if a dim is out of its field or the body (`before` bytes
   ahead of the STEP part) would pass a u32 length. */
static int64_t step_values_bytes(const struct frame_step_head *head, int64_t before) {
    if (head->b <= 0 || head->b > 0xFFFF || head->t <= 0 || head->t > 0xFFFF || head->h <= 0 || head->h > 0xFFFFFFFFLL)
        return -1;
    unsigned __int128 values_bytes = (unsigned __int128)4 * (uint64_t)head->b * (uint64_t)head->t * (uint64_t)head->h;
    if (values_bytes > 0xFFFFFFFFULL - (uint64_t)before - FRAME_STEP_HEAD - FRAME_MAC) return -1;
    return (int64_t)values_bytes;
}

/* A STEP part (its header, then `nbytes` of values) at `p`: a STEP's body, or a PUSH_STEP's after its session part. */
static void write_step_part(uint8_t *p, const struct frame_step_head *head, const float *values, int64_t nbytes) {
    put64(p, head->step_id);
    put16(p + 8, (uint64_t)head->b);
    put16(p + 10, (uint64_t)head->t);
    put32(p + 12, (uint64_t)head->h);
    memcpy(p + FRAME_STEP_HEAD, values, (size_t)nbytes);
}

/* A STEP part's header into `head` and its length (`size` bytes up to the MAC) against the header's dims:
   FRAME_OK or FRAME_LENGTH. */
static int read_step_part(const uint8_t *p, int64_t size, struct frame_step_head *head) {
    head->step_id = get64(p);
    head->b = (int64_t)get16(p + 8);
    head->t = (int64_t)get16(p + 10);
    head->h = (int64_t)get32(p + 12);
    /* (b, t < 2^16 and h < 2^32: 4 b t h fits 128 bits, not 64) */
    unsigned __int128 expected = (unsigned __int128)4 * (uint64_t)head->b * (uint64_t)head->t * (uint64_t)head->h;
    return expected == (unsigned __int128)(size - FRAME_STEP_HEAD) ? FRAME_OK : FRAME_LENGTH;
}

int64_t frame_step(const struct frame_key *k, const struct frame_step_head *head, const float *values, uint8_t *out) {
    int64_t nbytes = step_values_bytes(head, 0);
    if (nbytes < 0) return -1;
    int64_t body = FRAME_STEP_HEAD + nbytes + FRAME_MAC;
    uint8_t *p = frame_header(out, FRAME_KIND_STEP, body);
    write_step_part(p, head, values, nbytes);
    frame_mac(k, "swarmlm-step", p, FRAME_STEP_HEAD + nbytes, p + FRAME_STEP_HEAD + nbytes);
    return FRAME_HEADER + body;
}

int frame_open_step(const struct frame_key *k, const uint8_t *body, int64_t len, struct frame_step_head *head) {
    int64_t size = len - FRAME_MAC;
    if (size < FRAME_STEP_HEAD || !mac_matches(k, "swarmlm-step", body, size)) return FRAME_TAMPERED;
    return read_step_part(body, size, head);
}

int64_t frame_answer(const struct frame_key *k, const struct frame_answer_head *head, const float *values,
                     int64_t count, uint8_t *out) {
    int64_t nbytes = 4 * count;
    int64_t body = FRAME_ANSWER_HEAD + nbytes + FRAME_MAC;
    uint8_t *p = frame_header(out, FRAME_KIND_ANSWER, body);
    put64(p, head->step_id);
    put32(p + 8, (uint64_t)head->position);
    put32(p + 12, (uint64_t)head->batched);
    p[16] = (uint8_t)head->flags;
    put_double(p + 17, head->queued_s);
    put_double(p + 25, head->compute_s);
    put_double(p + 33, head->parse_s);
    put_double(p + 41, head->encode_s);
    memcpy(p + FRAME_ANSWER_HEAD, values, (size_t)nbytes);
    frame_mac(k, "swarmlm-answer", p, FRAME_ANSWER_HEAD + nbytes, p + FRAME_ANSWER_HEAD + nbytes);
    return FRAME_HEADER + body;
}

int frame_open_answer(const struct frame_key *k, const uint8_t *body, int64_t len, int64_t count,
                      struct frame_answer_head *head) {
    int64_t size = len - FRAME_MAC;
    if (size < FRAME_ANSWER_HEAD || !mac_matches(k, "swarmlm-answer", body, size)) return FRAME_TAMPERED;
    if (size != FRAME_ANSWER_HEAD + 4 * count) return FRAME_LENGTH;
    head->step_id = get64(body);
    head->position = (int64_t)get32(body + 8);
    head->batched = (int64_t)get32(body + 12);
    head->flags = body[16];
    head->queued_s = get_double(body + 17);
    head->compute_s = get_double(body + 25);
    head->parse_s = get_double(body + 33);
    head->encode_s = get_double(body + 41);
    return FRAME_OK;
}

/* ---- PUSH_STEP (wire/compact.py push_frame, PushStep) ----------------------------------------------------- */

int64_t frame_push_step(const struct frame_key *k, const uint8_t *secret, const struct frame_step_head *head,
                        const float *values, uint8_t *out) {
    const int64_t at = 1 + k->sid_len + FRAME_SECRET;  /* where its STEP part starts */
    int64_t nbytes = k->sid_len > 255 ? -1 : step_values_bytes(head, at);
    if (nbytes < 0) return -1;
    int64_t body = at + FRAME_STEP_HEAD + nbytes + FRAME_MAC;
    uint8_t *p = frame_header(out, FRAME_KIND_PUSH_STEP, body);
    p[0] = (uint8_t)k->sid_len;
    memcpy(p + 1, k->sid, (size_t)k->sid_len);
    memcpy(p + 1 + k->sid_len, secret, FRAME_SECRET);
    write_step_part(p + at, head, values, nbytes);
    frame_mac(k, "swarmlm-push", p, body - FRAME_MAC, p + body - FRAME_MAC);
    return FRAME_HEADER + body;
}

int frame_open_push_step(const struct frame_key *k, const uint8_t *secret, const uint8_t *body, int64_t len,
                         struct frame_step_head *head, int64_t *values_at) {
    const int64_t at = 1 + k->sid_len + FRAME_SECRET;
    if (len < at + FRAME_STEP_HEAD + FRAME_MAC || body[0] != k->sid_len) return FRAME_OTHER;
    uint8_t diff = 0;  /* (the id and the secret in constant time: the secret is the session's password) */
    for (int64_t i = 0; i < k->sid_len; i++) diff |= (uint8_t)(body[1 + i] ^ k->sid[i]);
    for (int i = 0; i < FRAME_SECRET; i++) diff |= (uint8_t)(body[1 + k->sid_len + i] ^ secret[i]);
    if (diff) return FRAME_OTHER;
    int64_t size = len - FRAME_MAC;
    if (!mac_matches(k, "swarmlm-push", body, size)) return FRAME_TAMPERED;
    *values_at = at + FRAME_STEP_HEAD;
    return read_step_part(body + at, size - at, head);
}

int frame_finite(const float *values, int64_t n) {
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, values + i, 4);
        bad |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u);  /* exponent all ones: an infinity or a NaN */
    }
    return !bad;
}
