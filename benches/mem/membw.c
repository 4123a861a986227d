/* Aggregate memory-copy rate of this machine with T threads, each copying its own 512 MiB buffer
 * into another (pages touched first), best of three; the ceiling for T concurrent shm multicast
 * hops, each of which copies its chunk once. Prints one JSON line per T.
 *
 *   gcc -O2 -pthread -o target/membw benches/mem/membw.c && target/membw 1 2 4 8 16 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BYTES ((size_t)512 << 20)

static pthread_barrier_t start, stop;

static void *worker(void *arg) {
    char *src = malloc(BYTES), *dst = malloc(BYTES);
    if (!src || !dst) abort();
    memset(src, (int)(size_t)arg, BYTES);
    memset(dst, 0, BYTES);
    for (int i = 0; i < 3; i++) {
        pthread_barrier_wait(&start);
        memcpy(dst, src, BYTES);
        pthread_barrier_wait(&stop);
    }
    if (dst[BYTES - 1] != src[BYTES - 1]) abort();
    free(src);
    free(dst);
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    for (int a = 1; a < argc; a++) {
        int n = atoi(argv[a]);
        if (n < 1 || n > 256) return 2;
        pthread_t th[256];
        pthread_barrier_init(&start, NULL, n + 1);
        pthread_barrier_init(&stop, NULL, n + 1);
        for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, worker, (void *)(size_t)(i + 1));
        double best = 1e9;
        for (int r = 0; r < 3; r++) {
            pthread_barrier_wait(&start);
            double t0 = now();
            pthread_barrier_wait(&stop);
            double dt = now() - t0;
            if (dt < best) best = dt;
        }
        for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
        pthread_barrier_destroy(&start);
        pthread_barrier_destroy(&stop);
        printf("{\"threads\":%d,\"copied_gb_s\":%.1f}\n", n, n * (double)BYTES / best / 1e9);
    }
    return 0;
}
