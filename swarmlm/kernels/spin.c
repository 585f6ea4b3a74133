/* A bounded spin before a blocking wait (swarmlm/wire/spin.py): poll file descriptors with a zero timeout, giving
 * the CPU away between polls, until one is ready or the budget is spent, all in one call. One call because ctypes
 * releases the GIL for it: a wait spun in Python would take the GIL back between polls and starve the process's
 * other threads (the server's compute thread needs it between its torch operations).
 *
 * Why spin at all: on a KVM guest whose idle vCPU halts, a process that slept through a 5-100 ms wait comes back to
 * caches, TLB and branch predictors holding someone else's work, and each Python call of the next message's path
 * then costs 10-40x its warm time (docs/RESULTS-hop.md, round 11). A thread spinning here keeps its CPU. It spins at
 * SCHED_IDLE (`idle` = 1; Linux: per thread) so that any runnable thread of the normal class preempts it at once,
 * and returns to its earlier class before it returns (the caller checked once that it may: spin.py). */
#define _GNU_SOURCE
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

static int64_t spin_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* > 0: that many descriptors are ready (revents set); 0: the budget is spent; -1: poll failed (a signal: the caller
 * goes on to its blocking wait, which sees it); -2: the thread could not return to its scheduling class. */
int spin_poll(struct pollfd *fds, int64_t n, int64_t budget_ns, int idle) {
    struct sched_param param = {0};
    int before = sched_getscheduler(0);
    int lowered = idle && before == SCHED_OTHER && sched_setscheduler(0, SCHED_IDLE, &param) == 0;
    int64_t deadline = spin_now_ns() + budget_ns;
    int ready;
    for (;;) {
        ready = poll(fds, (nfds_t)n, 0);
        if (ready != 0 || spin_now_ns() >= deadline)
            break;
        sched_yield();
    }
    if (lowered && sched_setscheduler(0, before, &param) != 0)
        return -2;
    return ready;
}
