/* What benchmarks/hop_floor.c and chain_floor.c share: a clock, whole reads and writes, and the memory stream that
 * stands in for a forward (every cache level evicted). Included by both; not part of the package. */
#ifndef SWARMLM_FLOOR_IO_H
#define SWARMLM_FLOOR_IO_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BIG_BYTES ((size_t)256 << 20)
#define LINE 64

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* all n bytes, or exit: the peer gone ends the process quietly (the client closes at the end) */
static void read_all(int fd, char *buf, size_t n) {
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r <= 0) exit(0);
        got += (size_t)r;
    }
}

static void write_all(int fd, const char *buf, size_t n) {
    for (size_t put = 0; put < n;) {
        ssize_t w = write(fd, buf + put, n - put);
        if (w <= 0) die("write");
        put += (size_t)w;
    }
}

/* A buffer the size of no cache, touched once so its pages exist before the first turn. */
static volatile uint8_t *big_buffer(void) {
    uint8_t *big = malloc(BIG_BYTES);
    if (!big) die("malloc");
    memset(big, 1, BIG_BYTES);
    return big;
}

/* Read one byte per cache line from where the last call stopped, for `ns` (checked every 64 KiB). */
static void stream_for(volatile uint8_t *big, size_t *cursor, int64_t ns) {
    int64_t end = now_ns() + ns;
    unsigned sum = 0;
    while (now_ns() < end) {
        for (size_t i = 0; i < (64 << 10); i += LINE) sum += big[(*cursor + i) % BIG_BYTES];
        *cursor = (*cursor + (64 << 10)) % BIG_BYTES;
    }
    big[0] = (uint8_t)sum; /* the reads are used: not optimised away */
}
#endif
