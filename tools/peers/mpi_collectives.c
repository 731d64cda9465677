/* mpi_collectives.c - nccl-tests style Open MPI benchmark of one collective (float32),
 * the peer of `ferroccl bench COLLECTIVE` in tools/compare-peers.
 * build: mpicc -O2 -o mpi_collectives mpi_collectives.c
 * run:   mpirun --allow-run-as-root --oversubscribe -np N ./mpi_collectives COLLECTIVE
 *            [min_bytes] [max_bytes] [step_factor]
 * COLLECTIVE: all_reduce (in place, sum), broadcast (in place), reduce (sum, out of
 * place), reduce_scatter (MPI_Reduce_scatter_block, sum), all_gather, gather, scatter,
 * all_to_all, sendrecv (each rank sends right and receives from the left). Root 0.
 * Sizes are ferroccl bench's: the whole buffer (all-gather and gather: the gathered
 * one, reduce-scatter and scatter: the one split in N blocks, all-to-all: each rank's
 * N blocks, sendrecv: one message). Per iteration: barrier, time the call, max over
 * ranks; report the median over iterations, and busbw = S/t x factor (all_reduce
 * 2(N-1)/N; reduce_scatter, all_gather, gather, scatter, all_to_all (N-1)/N;
 * broadcast, reduce, sendrecv 1). Before timing, one call is checked against the
 * definition on every rank (exact small integers). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum coll { ALLREDUCE, BCAST, REDUCE, RSCATTER, ALLGATHER, GATHER, SCATTER, ALLTOALL, SENDRECV };
static const char *names[] = {"all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather",
                              "gather", "scatter", "all_to_all", "sendrecv"};

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Element i of what rank r contributes: small integers, exact in float sums. */
static float val(int r, size_t i) { return (float)((r * 7 + i * 3) % 61); }

static int n, rank;

/* Fills the input of collective c for cnt elements (the whole buffer; blk = cnt / n). */
static void fill(enum coll c, float *send, float *recv, size_t cnt, size_t blk) {
  size_t len = (c == ALLGATHER || c == GATHER) ? blk : cnt;
  for (size_t i = 0; i < len; i++) send[i] = val(rank, i);
  if (c == ALLREDUCE || c == BCAST)
    for (size_t i = 0; i < cnt; i++) recv[i] = rank == 0 || c == ALLREDUCE ? val(rank, i) : -1.0f;
}

static void call(enum coll c, float *send, float *recv, size_t cnt, size_t blk) {
  int right = (rank + 1) % n, left = (rank + n - 1) % n;
  switch (c) {
  case ALLREDUCE: MPI_Allreduce(MPI_IN_PLACE, recv, (int)cnt, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); break;
  case BCAST: MPI_Bcast(recv, (int)cnt, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
  case REDUCE: MPI_Reduce(send, recv, (int)cnt, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD); break;
  case RSCATTER:
    MPI_Reduce_scatter_block(send, recv, (int)blk, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    break;
  case ALLGATHER: MPI_Allgather(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, MPI_COMM_WORLD); break;
  case GATHER: MPI_Gather(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
  case SCATTER: MPI_Scatter(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, 0, MPI_COMM_WORLD); break;
  case ALLTOALL: MPI_Alltoall(send, (int)blk, MPI_FLOAT, recv, (int)blk, MPI_FLOAT, MPI_COMM_WORLD); break;
  case SENDRECV:
    MPI_Sendrecv(send, (int)cnt, MPI_FLOAT, right, 0, recv, (int)cnt, MPI_FLOAT, left, 0, MPI_COMM_WORLD,
                 MPI_STATUS_IGNORE);
    break;
  }
}

/* Whether this rank's result of one call is the definition. */
static int check(enum coll c, const float *recv, size_t cnt, size_t blk) {
  for (size_t i = 0; i < cnt; i++) {
    float want;
    size_t q = i / blk, k = i % blk;
    switch (c) {
    case ALLREDUCE:
    case REDUCE:
      if (c == REDUCE && rank != 0) return 1;
      want = 0;
      for (int r = 0; r < n; r++) want += val(r, i);
      break;
    case BCAST: want = val(0, i); break;
    case RSCATTER:
      if (i >= blk) return 1;
      want = 0;
      for (int r = 0; r < n; r++) want += val(r, rank * blk + i);
      break;
    case ALLGATHER: want = val((int)q, k); break;
    case GATHER:
      if (rank != 0) return 1;
      want = val((int)q, k);
      break;
    case SCATTER:
      if (i >= blk) return 1;
      want = val(0, rank * blk + i);
      break;
    case ALLTOALL: want = val((int)q, rank * blk + k); break;
    case SENDRECV: want = val((rank + n - 1) % n, i); break;
    default: return 0;
    }
    if (recv[i] != want) return 0;
  }
  return 1;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  int c = -1;
  for (int k = 0; argc > 1 && k < (int)(sizeof names / sizeof *names); k++)
    if (!strcmp(argv[1], names[k])) c = k;
  if (c < 0) {
    if (rank == 0) fprintf(stderr, "usage: mpi_collectives COLLECTIVE [min] [max] [factor]\n");
    MPI_Finalize();
    return 2;
  }
  size_t minb = argc > 2 ? strtoull(argv[2], 0, 0) : 1024;
  size_t maxb = argc > 3 ? strtoull(argv[3], 0, 0) : (64u << 20);
  int step = argc > 4 ? atoi(argv[4]) : 4;
  double budget = getenv("BENCH_BUDGET_S") ? atof(getenv("BENCH_BUDGET_S")) : 2.0;
  double factor = c == ALLREDUCE ? 2.0 * (n - 1) / n
                  : (c == BCAST || c == REDUCE || c == SENDRECV) ? 1.0
                                                                 : (double)(n - 1) / n;
  float *send = malloc(maxb + 64), *recv = malloc(maxb + 64);
  double *ts = malloc(sizeof(double) * 1000), *tmax = malloc(sizeof(double) * 1000);
  if (rank == 0)
    printf("# MPI %s float32, nranks=%d\n%12s %8s %6s %12s %12s %10s %10s %s\n", names[c], n,
           "size_bytes", "count", "iters", "time_us_med", "time_us_min", "algbw_GB/s", "busbw_GB/s",
           "check");
  for (size_t sz = minb; sz <= maxb; sz *= step) {
    int blocked = !(c == ALLREDUCE || c == BCAST || c == REDUCE || c == SENDRECV);
    size_t cnt = sz / sizeof(float), blk = blocked ? cnt / n : cnt;
    if (blk == 0) continue;
    if (blocked) cnt = blk * n;
    fill(c, send, recv, cnt, blk);
    call(c, send, recv, cnt, blk);
    int ok = check(c, recv, cnt, blk), allok;
    MPI_Allreduce(&ok, &allok, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    call(c, send, recv, cnt, blk);
    double probe = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &probe, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    int iters = (int)(budget / (probe > 1e-7 ? probe : 1e-7));
    if (iters > 200) iters = 200;
    if (iters < 5) iters = 5;
    int warm = iters / 10 < 2 ? 2 : iters / 10;
    /* all-reduce in place: zeros keep the values from growing over iterations */
    if (c == ALLREDUCE) memset(recv, 0, cnt * sizeof(float));
    for (int i = 0; i < warm; i++) call(c, send, recv, cnt, blk);
    for (int i = 0; i < iters; i++) {
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = MPI_Wtime();
      call(c, send, recv, cnt, blk);
      ts[i] = MPI_Wtime() - t0;
    }
    MPI_Allreduce(ts, tmax, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    qsort(tmax, iters, sizeof(double), cmp);
    double med = tmax[iters / 2], mn = tmax[0];
    size_t bytes = cnt * sizeof(float);
    double alg = bytes / med / 1e9, bus = alg * factor;
    if (rank == 0)
      printf("%12zu %8zu %6d %12.3f %12.3f %10.3f %10.3f %s\n", bytes, cnt, iters, med * 1e6, mn * 1e6,
             alg, bus, allok ? "OK" : "FAIL");
    fflush(stdout);
  }
  free(send);
  free(recv);
  MPI_Finalize();
  return 0;
}
