// The floor under a one-way push on loopback TCP, without kvrail: SIZE bytes
// split over K connections, each written by its own spinning thread and read
// by another (no wake-up, no scheduler: every thread spins on a shared
// generation counter), timed from the start signal until every reader has
// all of its share. Buffers stay the same across rounds (cache-hot), as in
// `loadgen bench --only latency`.
//
//   ./tcpfloor SIZE K ROUNDS      e.g. ./tcpfloor 1048576 4 2000
// Built and run by tools/bench/floors.sh (`floors.sh tcpfloor ...`).
//
// Prints one JSON line: p50, p99 and mean microseconds.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAXK 32
static size_t share;
static int k, rounds;
static int tx[MAXK], rx[MAXK];
static atomic_int generation, done;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void *sender(void *arg) {
    int i = (int)(long)arg;
    char *buf = malloc(share);
    memset(buf, 3, share);
    for (int g = 1; g <= rounds; g++) {
        while (atomic_load_explicit(&generation, memory_order_acquire) < g) {
        }
        for (size_t off = 0; off < share;) {
            ssize_t n = send(tx[i], buf + off, share - off, 0);
            if (n <= 0) die("send");
            off += (size_t)n;
        }
    }
    free(buf);
    return NULL;
}

static void *receiver(void *arg) {
    int i = (int)(long)arg;
    char *buf = malloc(share);
    for (int g = 1; g <= rounds; g++) {
        for (size_t off = 0; off < share;) {
            ssize_t n = recv(rx[i], buf + off, share - off, MSG_DONTWAIT);
            if (n > 0) off += (size_t)n;
            else if (n == 0) die("eof");
        }
        atomic_fetch_add_explicit(&done, 1, memory_order_release);
    }
    free(buf);
    return NULL;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: tcpfloor SIZE K ROUNDS\n");
        return 2;
    }
    size_t size = strtoull(argv[1], NULL, 10);
    k = atoi(argv[2]);
    rounds = atoi(argv[3]);
    if (k < 1 || k > MAXK || size < (size_t)k || rounds < 1) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    share = size / (size_t)k;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, MAXK) ||
        getsockname(l, (struct sockaddr *)&a, &alen))
        die("listen");
    int one = 1;
    for (int i = 0; i < k; i++) {
        tx[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(tx[i], (struct sockaddr *)&a, sizeof a)) die("connect");
        rx[i] = accept(l, NULL, NULL);
        if (rx[i] < 0) die("accept");
        setsockopt(tx[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    pthread_t t[2 * MAXK];
    for (long i = 0; i < k; i++) {
        pthread_create(&t[2 * i], NULL, sender, (void *)i);
        pthread_create(&t[2 * i + 1], NULL, receiver, (void *)i);
    }
    double *lat = malloc(sizeof(double) * (size_t)rounds);
    for (int g = 1; g <= rounds; g++) {
        double t0 = now_us();
        atomic_store_explicit(&generation, g, memory_order_release);
        while (atomic_load_explicit(&done, memory_order_acquire) < g * k) {
        }
        lat[g - 1] = now_us() - t0;
    }
    for (int i = 0; i < 2 * k; i++) pthread_join(t[i], NULL);
    double sum = 0;
    for (int i = 0; i < rounds; i++) sum += lat[i];
    qsort(lat, (size_t)rounds, sizeof(double), cmp);
    printf("{\"bytes\":%zu,\"connections\":%d,\"rounds\":%d,\"p50_us\":%.1f,\"p99_us\":%.1f,\"mean_us\":%.1f,\"gbps_at_p50\":%.2f}\n",
           size, k, rounds, lat[rounds / 2], lat[rounds * 99 / 100], sum / rounds, (double)size / (lat[rounds / 2] * 1e3));
    return 0;
}
