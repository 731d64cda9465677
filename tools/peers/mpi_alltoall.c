/* mpi_alltoall.c - nccl-tests style MPI_Alltoall (float32, out of place) benchmark, the
 * peer of `ferroccl bench all_to_all` in tools/compare-peers.
 * build: mpicc -O2 -o mpi_alltoall mpi_alltoall.c
 * run:   mpirun --allow-run-as-root --oversubscribe -np N ./mpi_alltoall [min_bytes] [max_bytes] [step_factor]
 * Sizes are each rank's whole send buffer (N blocks). Per iteration: barrier, time
 * MPI_Alltoall, max over ranks; report the median over iterations, and busbw =
 * S/t x (n-1)/n. The check: block q of rank r's send holds r*1000+q; rank r's block q
 * must hold q*1000+r afterwards. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  size_t minb = argc > 1 ? strtoull(argv[1], 0, 0) : 1024;
  size_t maxb = argc > 2 ? strtoull(argv[2], 0, 0) : (64u << 20);
  int step = argc > 3 ? atoi(argv[3]) : 4;
  double budget = getenv("BENCH_BUDGET_S") ? atof(getenv("BENCH_BUDGET_S")) : 2.0;
  float *send = malloc(maxb), *recv = malloc(maxb);
  double *ts = malloc(sizeof(double) * 1000), *tmax = malloc(sizeof(double) * 1000);
  if (rank == 0)
    printf("# MPI_Alltoall float32 out-of-place, nranks=%d\n"
           "%12s %8s %6s %12s %12s %10s %10s %s\n", n, "size_bytes", "count", "iters",
           "time_us_med", "time_us_min", "algbw_GB/s", "busbw_GB/s", "check");
  for (size_t sz = minb; sz <= maxb; sz *= step) {
    size_t blk = sz / sizeof(float) / n;
    if (blk == 0) continue;
    size_t cnt = blk * n;
    for (size_t i = 0; i < cnt; i++) send[i] = (float)(rank * 1000 + i / blk);
    MPI_Alltoall(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, MPI_COMM_WORLD);
    int ok = 1, allok;
    for (size_t i = 0; i < cnt; i++)
      if (recv[i] != (float)((i / blk) * 1000 + rank)) { ok = 0; break; }
    MPI_Allreduce(&ok, &allok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    MPI_Alltoall(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, MPI_COMM_WORLD);
    double probe = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &probe, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    int iters = (int)(budget / (probe > 1e-7 ? probe : 1e-7));
    if (iters > 200) iters = 200;
    if (iters < 5) iters = 5;
    int warm = iters / 10 < 2 ? 2 : iters / 10;
    for (int i = 0; i < warm; i++)
      MPI_Alltoall(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, MPI_COMM_WORLD);
    for (int i = 0; i < iters; i++) {
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = MPI_Wtime();
      MPI_Alltoall(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, MPI_COMM_WORLD);
      ts[i] = MPI_Wtime() - t0;
    }
    MPI_Allreduce(ts, tmax, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    qsort(tmax, iters, sizeof(double), cmp);
    double med = tmax[iters / 2], mn = tmax[0];
    size_t bytes = cnt * sizeof(float);
    double alg = bytes / med / 1e9, bus = alg * (n - 1) / n;
    if (rank == 0)
      printf("%12zu %8zu %6d %12.1f %12.1f %10.3f %10.3f %s\n", bytes, cnt, iters, med * 1e6, mn * 1e6,
             alg, bus, allok ? "OK" : "FAIL");
    fflush(stdout);
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
