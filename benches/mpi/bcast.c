/* MPI_Bcast reference for Cascade's multicast benchmark: broadcasts BYTES from rank 0 to every
 * other rank and prints the time of the slowest rank, median of ITERS runs, as one JSON object.
 * Every rank checks the bytes it received (a crc-free sum over 64-bit words, cheaper than
 * Cascade's crc32: the reference is not made slower than it is).
 *
 *   mpicc -O2 -o target/bcast benches/mpi/bcast.c
 *   mpirun --allow-run-as-root --oversubscribe -np 9 target/bcast 1073741824 3
 *
 * Buffers are allocated and touched before the timed broadcast, as Cascade's target regions
 * are prepared (allocated, pre-faulted) before its transfer starts. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    size_t bytes = argc > 1 ? strtoull(argv[1], NULL, 10) : (64u << 20);
    int iters = argc > 2 ? atoi(argv[2]) : 3;
    if (bytes % 8 != 0 || iters < 1 || iters > 100) {
        if (rank == 0) fprintf(stderr, "usage: bcast BYTES(multiple of 8) [ITERS 1..100]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    uint64_t *buf = malloc(bytes);
    if (!buf) MPI_Abort(MPI_COMM_WORLD, 3);
    size_t words = bytes / 8;
    double times[100];
    int bad = 0;
    for (int it = 0; it < iters; it++) {
        for (size_t i = 0; i < words; i++) buf[i] = rank == 0 ? (i * 0x9e3779b97f4a7c15ull) ^ (uint64_t)it : 0;
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        /* MPI_Bcast takes an int count: send in pieces of at most 1 GiB - 8. */
        size_t done = 0;
        while (done < words) {
            size_t n = words - done < (size_t)(1 << 27) ? words - done : (size_t)(1 << 27);
            MPI_Bcast(buf + done, (int)n, MPI_UINT64_T, 0, MPI_COMM_WORLD);
            done += n;
        }
        double mine = MPI_Wtime() - t0, slowest;
        MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        times[it] = slowest;
        for (size_t i = 0; i < words; i++)
            if (buf[i] != ((i * 0x9e3779b97f4a7c15ull) ^ (uint64_t)it)) { bad = 1; break; }
    }
    int anybad = 0;
    MPI_Reduce(&bad, &anybad, 1, MPI_INT, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        qsort(times, iters, sizeof(double), cmp);
        printf("{\"ranks\":%d,\"bytes\":%zu,\"seconds\":%.6f,\"verified\":%s}\n", size, bytes, times[iters / 2],
               anybad ? "false" : "true");
    }
    free(buf);
    MPI_Finalize();
    return anybad;
}
