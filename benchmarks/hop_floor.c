/* The floor under a decode hop: one client and one server process on loopback TCP (TCP_NODELAY, blocking sockets),
 * no framework. The client sends BYTES, blocks in recv; the server reads them, "computes" (none / sleeps / streams
 * memory), replies BYTES + its compute time in ns. Printed: one line per round trip, round trip minus the server's
 * compute and that compute, in ns. Compiled and driven by benchmarks/hop_floor.py (which parses the arguments and
 * takes the medians); not part of the package.
 *
 *   hop_floor BYTES ROUND_TRIPS WARMUP MODE MS PIN EVICT
 *     MODE 0 none, 1 sleep MS, 2 stream MS (reads of a 256 MiB buffer, continuing where the last turn stopped:
 *       every turn evicts L1, L2 and L3, as a forward streaming its weights does)
 *     PIN 1: the server on CPU 0, the client on CPU 1
 *     EVICT 1 (needs PIN): a third process on CPU 1 (the client's) streams the same kind of buffer for 0.8 MS of each
 *       server turn, started by the server when the request arrives, so the client sleeps in recv while its core's
 *       caches fill with someone else's data and is (mostly) alone on its CPU again when the reply comes. */
#define _GNU_SOURCE
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "floor_io.h"

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) die("sched_setaffinity");
}

static void evictor(int trigger_fd, double ms) {
    volatile uint8_t *big = big_buffer();
    size_t cursor = 0;
    char byte;
    while (read(trigger_fd, &byte, 1) == 1) stream_for(big, &cursor, (int64_t)(0.8 * ms * 1e6));
    exit(0);
}

static void server(int conn, size_t bytes, int mode, double ms, int trigger_fd) {
    volatile uint8_t *big = mode == 2 ? big_buffer() : NULL;
    size_t cursor = 0;
    char *buf = malloc(bytes + 8);
    for (;;) {
        read_all(conn, buf, bytes);
        int64_t t0 = now_ns();
        if (trigger_fd >= 0) write_all(trigger_fd, "x", 1);
        if (mode == 1) {
            struct timespec ts = {(time_t)(ms / 1000), (long)((ms - 1000 * (time_t)(ms / 1000)) * 1e6)};
            nanosleep(&ts, NULL);
        } else if (mode == 2) {
            stream_for(big, &cursor, (int64_t)(ms * 1e6));
        }
        int64_t compute = now_ns() - t0;
        memcpy(buf + bytes, &compute, 8);
        write_all(conn, buf, bytes + 8);
    }
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s BYTES ROUND_TRIPS WARMUP MODE MS PIN EVICT\n", argv[0]);
        return 2;
    }
    size_t bytes = (size_t)atol(argv[1]);
    int trips = atoi(argv[2]), warmup = atoi(argv[3]), mode = atoi(argv[4]);
    double ms = atof(argv[5]);
    int pinned = atoi(argv[6]), evict = atoi(argv[7]);
    if (bytes < 1 || trips < 1 || warmup < 0 || mode < 0 || mode > 2 || ms < 0 || (evict && !pinned)) {
        fprintf(stderr, "bad arguments (EVICT needs PIN)\n");
        return 2;
    }
    int one = 1;
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 1) ||
        getsockname(listener, (struct sockaddr *)&addr, &len))
        die("listen");

    int trigger[2] = {-1, -1};
    pid_t evictor_pid = 0;
    if (evict) {
        if (pipe(trigger)) die("pipe");
        if ((evictor_pid = fork()) == 0) {
            close(trigger[1]);
            close(listener);
            pin(1);
            evictor(trigger[0], ms);
        }
        close(trigger[0]);
    }
    pid_t server_pid = fork();
    if (server_pid == 0) {
        if (pinned) pin(0);
        int conn = accept(listener, NULL, NULL);
        if (conn < 0) die("accept");
        setsockopt(conn, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        server(conn, bytes, mode, ms, trigger[1]);
    }
    if (evict) close(trigger[1]);
    close(listener);
    if (pinned) pin(1);
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(s, (struct sockaddr *)&addr, sizeof addr)) die("connect");
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char *buf = calloc(1, bytes + 8);
    for (int i = 0; i < warmup + trips; i++) {
        int64_t t0 = now_ns();
        write_all(s, buf, bytes);
        read_all(s, buf, bytes + 8);
        int64_t t1 = now_ns(), compute;
        memcpy(&compute, buf + bytes, 8);
        if (i >= warmup) printf("%lld %lld\n", (long long)(t1 - t0 - compute), (long long)compute);
    }
    close(s);
    waitpid(server_pid, NULL, 0);
    if (evict) waitpid(evictor_pid, NULL, 0);
    return 0;
}
