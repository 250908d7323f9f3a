// Floor of kvrail's 4 KiB push path without kvrail, on the machine it runs on:
// bench process (worker A submits, worker D is notified) -> sidecar B (futex
// doorbell) -> loopback TCP -> sidecar C (blocking read) -> copies payload into
// shared memory, rings D's futex, answers a 16-byte Complete to B, which B reads
// on a second thread and posts to A's completion word (no wake if not waited).
// Results: docs/benchmarks.md ("Floors without kvrail").
//   ./chain [SIZE [ROUNDS [SPIN_US]]]          e.g. ./chain 4096 3000 0
// SPIN_US: bounded spin before each futex wait (0 = sleep at once).
// Built and run by tools/bench/floors.sh (`floors.sh chain ...`).
// Prints each process's CPU time on stderr and one JSON line: p50, p99 us.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

struct shared {
    _Atomic uint32_t sub;       // A -> B submission count
    _Atomic uint32_t sub_sleep; // B asleep
    _Atomic uint32_t note;      // C -> D notification count
    _Atomic uint32_t note_sleep;
    _Atomic uint32_t done;      // B -> A completion count (no wake)
    char payload[1 << 20];
    char dest[1 << 20];
};
static struct shared *S;
static size_t size;
static int rounds;
static long spin_ns;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + t.tv_nsec;
}
static void fwait(_Atomic uint32_t *w, uint32_t old) {
    syscall(SYS_futex, w, FUTEX_WAIT, old, NULL, NULL, 0);
}
static void fwake(_Atomic uint32_t *w) { syscall(SYS_futex, w, FUTEX_WAKE, 1, NULL, NULL, 0); }

// wait until *w != old: spin up to spin_ns, then sleep on the futex
static uint32_t await_change(_Atomic uint32_t *w, _Atomic uint32_t *sleeping, uint32_t old) {
    uint64_t t0 = now_ns();
    for (;;) {
        uint32_t v = atomic_load_explicit(w, memory_order_acquire);
        if (v != old) return v;
        if ((long)(now_ns() - t0) >= spin_ns) break;
        __builtin_ia32_pause();
    }
    for (;;) {
        atomic_store(sleeping, 1);
        uint32_t v = atomic_load(w);
        if (v != old) { atomic_store(sleeping, 0); return v; }
        fwait(w, old);
        atomic_store(sleeping, 0);
    }
}
static void post(_Atomic uint32_t *w, _Atomic uint32_t *sleeping) {
    atomic_fetch_add(w, 1);
    if (atomic_load(sleeping)) fwake(w);
}
static void readn(int fd, void *b, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)b + got, n - got);
        if (r <= 0) { perror("read"); exit(1); }
        got += r;
    }
}
static int b_sock;
static void *b_completions(void *arg) {
    (void)arg;
    char ack[16];
    for (int i = 0; i < rounds; i++) {
        readn(b_sock, ack, 16);
        atomic_fetch_add(&S->done, 1);
    }
    return NULL;
}
static void print_cpu(const char *who) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double us = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 + ru.ru_utime.tv_usec + ru.ru_stime.tv_usec;
    fprintf(stderr, "%s cpu per push %.1f us (user %.1f)\n", who, us / rounds,
            (ru.ru_utime.tv_sec * 1e6 + ru.ru_utime.tv_usec) / rounds);
}
static int cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}
int main(int argc, char **argv) {
    size = argc > 1 ? strtoul(argv[1], 0, 0) : 4096;
    rounds = argc > 2 ? atoi(argv[2]) : 3000;
    spin_ns = (argc > 3 ? atol(argv[3]) : 0) * 1000;
    if (size < 1 || size > sizeof S->payload || rounds < 1 || spin_ns < 0) {
        fprintf(stderr, "usage: chain [SIZE(1..1048576) [ROUNDS [SPIN_US]]]\n");
        return 2;
    }
    S = mmap(NULL, sizeof *S, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(l, (void *)&a, sizeof a);
    socklen_t al = sizeof a;
    getsockname(l, (void *)&a, &al);
    listen(l, 1);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    connect(c, (void *)&a, sizeof a);
    int s = accept(l, NULL, NULL);
    int one = 1;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, 4);
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, 4);
    if (fork() == 0) { // sidecar B
        close(s);
        b_sock = c;
        pthread_t t;
        pthread_create(&t, NULL, b_completions, NULL);
        char hdr[32] = {0};
        uint32_t seen = 0;
        for (int i = 0; i < rounds; i++) {
            seen = await_change(&S->sub, &S->sub_sleep, seen);
            struct iovec v[2] = {{hdr, 32}, {S->payload, size}};
            if (writev(c, v, 2) != (ssize_t)(32 + size)) { perror("writev"); exit(1); }
        }
        pthread_join(t, NULL);
        print_cpu("sidecar B");
        _exit(0);
    }
    if (fork() == 0) { // sidecar C
        close(c);
        char hdr[32], ack[16] = {0};
        for (int i = 0; i < rounds; i++) {
            readn(s, hdr, 32);
            readn(s, S->dest, size);
            post(&S->note, &S->note_sleep);
            if (write(s, ack, 16) != 16) { perror("write"); exit(1); }
        }
        print_cpu("sidecar C");
        _exit(0);
    }
    close(c);
    close(s);
    uint64_t *lat = malloc(rounds * sizeof *lat);
    uint32_t seen = 0;
    for (int i = 0; i < rounds; i++) {
        memset(S->payload, i, 64);
        uint64_t t0 = now_ns();
        post(&S->sub, &S->sub_sleep);
        seen = await_change(&S->note, &S->note_sleep, seen);
        lat[i] = now_ns() - t0;
    }
    while (wait(NULL) > 0) {}
    print_cpu("bench");
    qsort(lat, rounds, sizeof *lat, cmp);
    printf("{\"size\":%zu,\"spin_us\":%ld,\"p50_us\":%.1f,\"p99_us\":%.1f}\n", size, spin_ns / 1000,
           lat[rounds / 2] / 1e3, lat[rounds * 99 / 100] / 1e3);
}
