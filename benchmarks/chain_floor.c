/* The floor under a decode token split over servers: a bare C client and N server processes on loopback TCP
 * (TCP_NODELAY, blocking sockets, poll), no framework. A token: the client "computes" its own part (streams memory
 * for HEAD_MS: embeddings, LM head), then the hidden state (BYTES) goes through the servers, each "computing" its
 * share of the blocks (streams memory for COMPUTE_MS / N), and back. RELAYED (PUSH 0): the client sends to each server
 * in turn and waits for its reply; PUSHED (PUSH 1): server i sends its output on to server i + 1 itself, the last one
 * answers the client (MIDDLE 1: every middle server also sends its output to the client, as swarmlm's pushes do for
 * failover; the client reads them after the last). Each process streams its own 256 MiB buffer, continuing where its
 * last turn stopped, so every turn starts with caches full of someone else's data, as a forward streaming its
 * weights leaves them. Printed: one line per token, its wall time in ns. Compiled and driven by
 * benchmarks/chain_floor.py; not part of the package.
 *
 *   chain_floor SERVERS TOKENS WARMUP COMPUTE_MS HEAD_MS PUSH MIDDLE BYTES */
#define _GNU_SOURCE
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "floor_io.h"

#define MAX_SERVERS 8

static int listener_on(uint16_t *port) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) || listen(fd, 4) ||
        getsockname(fd, (struct sockaddr *)&addr, &len))
        die("listen");
    *port = ntohs(addr.sin_port);
    return fd;
}

/* A connection to a server, which learns who dialled it from the first byte: 'c' the client, 'p' its predecessor. */
static int connect_to(uint16_t port, char who) {
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int one = 1, fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr)) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    write_all(fd, &who, 1);
    return fd;
}

static int accept_one(int listener) {
    int one = 1, fd = accept(listener, NULL, NULL);
    if (fd < 0) die("accept");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* Server i: accepts the client and (pushed, not the first) its predecessor, in whatever order they come; connects
 * to its successor (pushed, not the last). A message from either peer is computed on and sent on (or back). */
static void server(int listener, int i, int n, uint16_t next_port, double ms, int push, int middle, size_t bytes) {
    int client = -1, prev = -1;
    for (int k = 0; k < (push && i > 0 ? 2 : 1); k++) {
        int fd = accept_one(listener);
        char who;
        read_all(fd, &who, 1);
        *(who == 'c' ? &client : &prev) = fd;
    }
    int next = push && i + 1 < n ? connect_to(next_port, 'p') : -1;
    volatile uint8_t *big = big_buffer();
    size_t cursor = 0;
    char *buf = malloc(bytes);
    struct pollfd fds[2] = {{.fd = client, .events = POLLIN}, {.fd = prev, .events = POLLIN}};
    for (;;) {
        if (poll(fds, prev >= 0 ? 2 : 1, -1) < 0) die("poll");
        int from = fds[0].revents ? client : prev;
        read_all(from, buf, bytes);
        stream_for(big, &cursor, (int64_t)(ms * 1e6));
        if (next >= 0) {
            write_all(next, buf, bytes);
            if (middle) write_all(client, buf, bytes);
        } else {
            write_all(client, buf, bytes);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 9) {
        fprintf(stderr, "usage: %s SERVERS TOKENS WARMUP COMPUTE_MS HEAD_MS PUSH MIDDLE BYTES\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]), tokens = atoi(argv[2]), warmup = atoi(argv[3]);
    double compute_ms = atof(argv[4]), head_ms = atof(argv[5]);
    int push = atoi(argv[6]), middle = atoi(argv[7]);
    size_t bytes = (size_t)atol(argv[8]);
    if (n < 1 || n > MAX_SERVERS || tokens < 1 || warmup < 0 || compute_ms < 0 || head_ms < 0 || bytes < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    uint16_t ports[MAX_SERVERS];
    int listeners[MAX_SERVERS];
    pid_t pids[MAX_SERVERS];
    for (int i = 0; i < n; i++) listeners[i] = listener_on(&ports[i]);
    for (int i = 0; i < n; i++) {
        if ((pids[i] = fork()) == 0) {
            for (int j = 0; j < n; j++)
                if (j != i) close(listeners[j]);
            server(listeners[i], i, n, i + 1 < n ? ports[i + 1] : 0, compute_ms / n, push, middle, bytes);
        }
    }
    int conns[MAX_SERVERS];
    for (int i = 0; i < n; i++) conns[i] = connect_to(ports[i], 'c');
    for (int i = 0; i < n; i++) close(listeners[i]);
    volatile uint8_t *big = big_buffer();
    size_t cursor = 0;
    char *buf = calloc(1, bytes);
    for (int t = 0; t < warmup + tokens; t++) {
        int64_t t0 = now_ns();
        stream_for(big, &cursor, (int64_t)(head_ms * 1e6));
        if (push) {
            write_all(conns[0], buf, bytes);
            read_all(conns[n - 1], buf, bytes);
            if (middle)
                for (int i = 0; i + 1 < n; i++) read_all(conns[i], buf, bytes);
        } else {
            for (int i = 0; i < n; i++) {
                write_all(conns[i], buf, bytes);
                read_all(conns[i], buf, bytes);
            }
        }
        if (t >= warmup) printf("%lld\n", (long long)(now_ns() - t0));
    }
    for (int i = 0; i < n; i++) close(conns[i]);
    for (int i = 0; i < n; i++) waitpid(pids[i], NULL, 0);
    return 0;
}
