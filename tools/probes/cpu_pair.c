/* cpu_pair.c - where a VM's host has put two of its vCPUs right now, as the two
 * numbers a small collective between two ranks pinned to them depends on.
 *
 * build: cc -O2 -pthread -o cpu_pair tools/probes/cpu_pair.c
 * run:   ./cpu_pair [seconds=10] [cpu_a=0] [cpu_b=1]
 *
 * Every half second it prints:
 *   hand-off  one 64 KiB buffer written by a thread on cpu_a, then read by one on
 *             cpu_b, in turns (the median turn, microseconds): fast when the two
 *             share a core's L2 (SMT siblings), slower through the L3 of two cores;
 *   together  64 KiB memcpy on both CPUs at once over memcpy on cpu_a alone: about
 *             1 on two cores, well above 1 on two hyperthreads of one core.
 * On a 2-vCPU cloud VM both move, every few seconds to minutes, as the host places
 * the vCPUs; a 64 KiB all-reduce between two ranks moves with them (see the book's
 * performance chapter). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BYTES (64 * 1024)
#define TURNS 1000

static char *shared_buf;
static _Atomic int turn;
static _Atomic int go;
static volatile long sink;
static int cpu_a, cpu_b;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (pthread_setaffinity_np(pthread_self(), sizeof s, &s) != 0) {
    fprintf(stderr, "cpu_pair: cannot run on cpu %d\n", cpu);
    exit(2);
  }
}

static int cmp(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return a < b ? -1 : a > b;
}

/* Reads the buffer each time it is its turn (cpu_b). */
static void *reader(void *arg) {
  (void)arg;
  pin(cpu_b);
  for (int r = 0; r < TURNS; r++) {
    while (atomic_load_explicit(&turn, memory_order_acquire) != 1) {
    }
    long s = 0;
    for (int i = 0; i < BYTES; i += 64) s += shared_buf[i];
    sink += s;
    atomic_store_explicit(&turn, 0, memory_order_release);
  }
  return NULL;
}

/* Median microseconds of one turn: cpu_a writes every line, cpu_b reads every line. */
static double hand_off(void) {
  static double t[TURNS];
  pthread_t th;
  atomic_store(&turn, 0);
  pin(cpu_a);
  pthread_create(&th, NULL, reader, NULL);
  for (int r = 0; r < TURNS; r++) {
    double t0 = now();
    for (int i = 0; i < BYTES; i += 64) shared_buf[i]++;
    atomic_store_explicit(&turn, 1, memory_order_release);
    while (atomic_load_explicit(&turn, memory_order_acquire) != 0) {
    }
    t[r] = now() - t0;
  }
  pthread_join(th, NULL);
  qsort(t, TURNS, sizeof t[0], cmp);
  return t[TURNS / 2] * 1e6;
}

/* Seconds per 64 KiB memcpy over `reps` copies on the calling thread. */
static double copies(int reps) {
  char *src = aligned_alloc(4096, BYTES), *dst = aligned_alloc(4096, BYTES);
  memset(src, 1, BYTES);
  memset(dst, 2, BYTES);
  double t0 = now();
  for (int i = 0; i < reps; i++) {
    memcpy(dst, src, BYTES);
    src[i & 4095]++;
  }
  double dt = (now() - t0) / reps;
  sink += dst[7];
  free(src);
  free(dst);
  return dt;
}

static void *copier(void *arg) {
  pin(cpu_b);
  while (!atomic_load(&go)) {
  }
  *(double *)arg = copies(20000);
  return NULL;
}

/* memcpy time with cpu_b copying at the same time, over memcpy time alone. */
static double together(void) {
  pin(cpu_a);
  double alone = copies(20000), other;
  pthread_t th;
  atomic_store(&go, 0);
  pthread_create(&th, NULL, copier, &other);
  atomic_store(&go, 1);
  double both = copies(20000);
  pthread_join(th, NULL);
  return both / alone;
}

int main(int argc, char **argv) {
  int secs = argc > 1 ? atoi(argv[1]) : 10;
  cpu_a = argc > 2 ? atoi(argv[2]) : 0;
  cpu_b = argc > 3 ? atoi(argv[3]) : 1;
  shared_buf = aligned_alloc(4096, BYTES);
  memset(shared_buf, 1, BYTES);
  printf("# cpus %d and %d: 64 KiB hand-off (us, median of %d) and memcpy together/alone\n",
         cpu_a, cpu_b, TURNS);
  double start = now();
  while (now() - start < secs) {
    double t = now() - start;
    double h = hand_off(), g = together();
    printf("%6.1f s  hand-off %5.2f us  together %4.2f\n", t, h, g);
    fflush(stdout);
    struct timespec z = {0, 400000000};
    nanosleep(&z, NULL);
  }
  return 0;
}
