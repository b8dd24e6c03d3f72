/* Remote-fork micro-benchmark, driven by bench/fork_bench.py.
 * Usage: fork_bench CLONES HEAP_MIB PROBES
 * The parent writes HEAP_MIB MiB (its resident footprint), then clones.
 * Each clone prints when it started running (CLOCK_REALTIME: the emulated
 * hosts share this machine's clock) and the time of PROBES first touches of
 * heap pages 64 pages apart (each one a userfault served over TCP: the
 * fault-service time as the clone sees it, prefetch never hides it).
 * The parent prints the time sf_clone took, then per clone the fault
 * handler's counters. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "starling.h"

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static long rss_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %ld kB", &v) == 1) break;
    if (f) fclose(f);
    return v;
}

static int cmp_ll(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    size_t heap_mib = (size_t)atol(argv[2]);
    int probes = atoi(argv[3]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    unsigned char *heap = malloc(heap_mib << 20);
    for (size_t i = 0; i < (heap_mib << 20); i += 4096) heap[i] = (unsigned char)(i >> 12) | 1;
    long long *lat = calloc(probes, sizeof *lat);
    sf_ticket_t *t = sf_request_ticket(n, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    long rss = rss_kib();
    long long t0 = now_ns();
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        long long started = now_ns();
        size_t pages = (heap_mib << 20) / 4096;
        unsigned long sum = 0;
        for (int i = 0; i < probes; i++) {
            size_t page = ((size_t)i * 64 + (size_t)id * 7) % pages;
            long long a = now_ns();
            sum += heap[page * 4096];
            lat[i] = now_ns() - a;
        }
        qsort(lat, probes, sizeof *lat, cmp_ll);
        printf("CLONE id=%d start_ns=%lld median_ns=%lld p99_ns=%lld sum=%lu\n", id, started - t0,
               lat[probes / 2], lat[(probes * 99) / 100], sum);
        sf_exit(0);
    }
    long long returned = now_ns();
    if (sf_join(t) != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    long long joined = now_ns();
    printf("PARENT clones=%d clone_call_ns=%lld join_ns=%lld descriptor_bytes=%lld rss_kib=%ld\n", m, returned - t0,
           joined - t0, sf_descriptor_bytes(t), rss);
    for (int i = 1; i <= m; i++)
        printf("STAT id=%d status=%d faults=%lld fetched=%lld zero=%lld file=%lld requests=%lld\n", i,
               sf_clone_status(t, i), sf_clone_stat(t, i, 0), sf_clone_stat(t, i, 1), sf_clone_stat(t, i, 2),
               sf_clone_stat(t, i, 3), sf_clone_stat(t, i, 4));
    return 0;
}
