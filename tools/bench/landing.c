// What landing received bytes in a region costs: THREADS threads, each copying
// CHUNK-byte pieces of a warm buffer into its own REGION-byte region, round
// after round, with memcpy (every destination line read for ownership first)
// and with SSE2 streaming stores (what kvrail_shm::copy_streaming does on
// x86-64). Prints one JSON line per mode.
//
//   landing [THREADS [CHUNK [REGION [ROUNDS]]]]   defaults: 1 65536 268435456 8
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#ifdef __x86_64__
#include <emmintrin.h>
#endif

static size_t region_bytes = 256ul << 20, chunk = 65536;
static int rounds = 8, streaming;

static double now(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

#ifdef __x86_64__
// dst 64-byte aligned (regions are page aligned, chunks multiples of 64).
static void copy_stream(char *dst, const char *src, size_t n) {
	size_t i = 0;
	for (; i + 64 <= n; i += 64) {
		__m128i a = _mm_loadu_si128((const __m128i *)(src + i));
		__m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
		__m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
		__m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
		_mm_stream_si128((__m128i *)(dst + i), a);
		_mm_stream_si128((__m128i *)(dst + i + 16), b);
		_mm_stream_si128((__m128i *)(dst + i + 32), c);
		_mm_stream_si128((__m128i *)(dst + i + 48), d);
	}
	_mm_sfence();
	memcpy(dst + i, src + i, n - i);
}
#endif

static void *worker(void *out) {
	char *region = mmap(0, region_bytes, PROT_READ | PROT_WRITE,
			    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	char *buf = aligned_alloc(64, chunk);
	if (region == MAP_FAILED || !buf) {
		perror("landing: memory");
		exit(1);
	}
	memset(buf, 1, chunk);
	double t0 = now();
	for (int r = 0; r < rounds; r++)
		for (size_t o = 0; o + chunk <= region_bytes; o += chunk) {
			buf[(o / chunk) % chunk]++; // as if freshly received
#ifdef __x86_64__
			if (streaming)
				copy_stream(region + o, buf, chunk);
			else
#endif
				memcpy(region + o, buf, chunk);
		}
	*(double *)out = (double)(region_bytes / chunk * chunk) * rounds / (now() - t0) / 1e9;
	munmap(region, region_bytes);
	free(buf);
	return NULL;
}

int main(int argc, char **argv) {
	int threads = argc > 1 ? atoi(argv[1]) : 1;
	if (argc > 2) chunk = strtoul(argv[2], 0, 0);
	if (argc > 3) region_bytes = strtoul(argv[3], 0, 0);
	if (argc > 4) rounds = atoi(argv[4]);
	if (threads < 1 || threads > 1024 || chunk < 64 || chunk % 64 || region_bytes < chunk || rounds < 1) {
		fprintf(stderr, "usage: landing [THREADS [CHUNK (a multiple of 64) [REGION [ROUNDS]]]]\n");
		return 2;
	}
	pthread_t t[1024];
	double gbps[1024];
	int modes = 1;
#ifdef __x86_64__
	modes = 2;
#endif
	for (streaming = 0; streaming < modes; streaming++) {
		for (int i = 0; i < threads; i++) pthread_create(&t[i], 0, worker, &gbps[i]);
		double sum = 0;
		for (int i = 0; i < threads; i++) {
			pthread_join(t[i], 0);
			sum += gbps[i];
		}
		printf("{\"mode\":\"%s\",\"threads\":%d,\"chunk\":%zu,\"region\":%zu,\"GBps\":%.2f}\n",
		       streaming ? "streaming" : "memcpy", threads, chunk, region_bytes, sum);
		fflush(stdout);
	}
	return 0;
}
