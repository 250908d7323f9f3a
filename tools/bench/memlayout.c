// What the vLLM-shaped batch's layout costs the memory system alone, with no
// socket and no kvrail: the same bytes copied contiguously and as loadgen's
// vLLM batch lays them out (LAYERS x K/V x BLOCKS of 4 KiB, blocks picked at
// random from a pool twice as large on each side), directly and through a
// small per-thread bounce buffer (the two copies loopback TCP makes: into a
// socket buffer, then out of it). Threads split the work in 1 MiB slices,
// as the sidecar's connections do.
//
//   ./memlayout THREADS [RUNS]       (two regions of 640 MiB, populated)
// Built and run by tools/bench/floors.sh (`floors.sh memlayout ...`).
//
// Prints one JSON line per pattern: best and median GB/s over RUNS.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define LAYERS 80
#define BLOCKS 512
#define BLOCK (4096UL)
#define POOL (BLOCKS * 2)
#define PLANES (LAYERS * 2)
#define PIECES ((size_t)PLANES * BLOCKS)
#define TOTAL (PIECES * BLOCK)
#define SLICE (1UL << 20)
#define PER_SLICE (SLICE / BLOCK)
#define SLICES (TOTAL / SLICE)
#define BOUNCE (64UL << 10)

static char *src, *dst;
static size_t *src_off, *dst_off;
static int threads;
static int pattern;
static pthread_barrier_t start_line;

enum { CONTIG, PIECES_DIRECT, CONTIG_BOUNCE, PIECES_BOUNCE, NPATTERNS };
static const char *names[] = {"contiguous", "vllm_pieces", "contiguous_via_bounce", "vllm_pieces_via_bounce"};

static void shuffle_pick(size_t *out, unsigned seed) {
    size_t ids[POOL];
    for (size_t i = 0; i < POOL; i++) ids[i] = i;
    srand(seed);
    for (size_t i = POOL - 1; i > 0; i--) {
        size_t j = (size_t)rand() % (i + 1);
        size_t t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    for (size_t plane = 0; plane < PLANES; plane++)
        for (size_t b = 0; b < BLOCKS; b++) out[plane * BLOCKS + b] = (plane * POOL + ids[b]) * BLOCK;
}

static void *worker(void *arg) {
    size_t me = (size_t)arg;
    char *bounce = aligned_alloc(4096, BOUNCE);
    memset(bounce, 1, BOUNCE);
    pthread_barrier_wait(&start_line);
    for (size_t s = me; s < SLICES; s += (size_t)threads) {
        size_t first = s * PER_SLICE;
        switch (pattern) {
        case CONTIG:
            memcpy(dst + s * SLICE, src + s * SLICE, SLICE);
            break;
        case PIECES_DIRECT:
            for (size_t p = first; p < first + PER_SLICE; p++) memcpy(dst + dst_off[p], src + src_off[p], BLOCK);
            break;
        case CONTIG_BOUNCE:
            for (size_t o = 0; o < SLICE; o += BOUNCE) {
                memcpy(bounce, src + s * SLICE + o, BOUNCE);
                memcpy(dst + s * SLICE + o, bounce, BOUNCE);
            }
            break;
        case PIECES_BOUNCE:
            for (size_t p = first; p < first + PER_SLICE; p += BOUNCE / BLOCK) {
                for (size_t q = 0; q < BOUNCE / BLOCK; q++) memcpy(bounce + q * BLOCK, src + src_off[p + q], BLOCK);
                for (size_t q = 0; q < BOUNCE / BLOCK; q++) memcpy(dst + dst_off[p + q], bounce + q * BLOCK, BLOCK);
            }
            break;
        }
    }
    free(bounce);
    return NULL;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    threads = argc > 1 ? atoi(argv[1]) : 8;
    int runs = argc > 2 ? atoi(argv[2]) : 5;
    if (threads < 1 || threads > 256 || runs < 1 || runs > 100) {
        fprintf(stderr, "usage: memlayout THREADS(1-256) [RUNS(1-100)]\n");
        return 2;
    }
    size_t region = (size_t)PLANES * POOL * BLOCK;
    src = mmap(NULL, region, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    dst = mmap(NULL, region, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    src_off = malloc(PIECES * sizeof(size_t));
    dst_off = malloc(PIECES * sizeof(size_t));
    if (src == MAP_FAILED || dst == MAP_FAILED || !src_off || !dst_off) {
        perror("alloc");
        return 1;
    }
    // Keep huge pages out, as /dev/shm regions have none by default.
    madvise(src, region, MADV_NOHUGEPAGE);
    madvise(dst, region, MADV_NOHUGEPAGE);
    memset(src, 7, region);
    memset(dst, 0, region);
    shuffle_pick(src_off, 11);
    shuffle_pick(dst_off, 12);
    for (pattern = 0; pattern < NPATTERNS; pattern++) {
        double rates[100];
        for (int r = 0; r < runs; r++) {
            pthread_t t[256];
            pthread_barrier_init(&start_line, NULL, (unsigned)threads + 1);
            for (size_t i = 0; i < (size_t)threads; i++) pthread_create(&t[i], NULL, worker, (void *)i);
            pthread_barrier_wait(&start_line);
            double t0 = now_s();
            for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
            rates[r] = (double)TOTAL / (now_s() - t0) / 1e9;
            pthread_barrier_destroy(&start_line);
        }
        qsort(rates, (size_t)runs, sizeof(double), cmp);
        printf("{\"pattern\":\"%s\",\"threads\":%d,\"bytes\":%zu,\"best_gbps\":%.2f,\"median_gbps\":%.2f,\"worst_gbps\":%.2f}\n",
               names[pattern], threads, (size_t)TOTAL, rates[runs - 1], rates[runs / 2], rates[0]);
    }
    return 0;
}
