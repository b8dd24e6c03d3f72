/* Remote-fork micro-benchmark, driven by bench/fork_bench.py.
 * Usage: fork_bench CLONES HEAP_MIB PROBES SETTLE_MS HIERARCHICAL
 *
 * The parent writes HEAP_MIB MiB (its resident footprint), requests a ticket
 * for CLONES clones (HIERARCHICAL 0/1 is passed to sf_request_ticket), then
 * clones. t0 is the parent's CLOCK_REALTIME just before sf_clone; the emulated
 * hosts are namespaces on this machine, so every clone reads the same clock,
 * and t0 reaches the clones in the memory they inherit.
 *
 * Creation and work are kept apart: each clone notes when it started running
 * (start_ns, relative to t0), then sleeps until t0 + SETTLE_MS before its
 * PROBES first touches of heap pages 64 pages apart (each one a userfault
 * served over TCP: the fault-service time as the clone sees it, prefetch never
 * hides it; total_ns is their sum). Without the settle, clones that started early would probe while
 * later ones are still being created and steal the CPU their creation needs:
 * the clone time of N would then include other clones' work. A clone that
 * starts after the deadline prints late=1 (SETTLE_MS too short).
 *
 * CPU spent creating the clones: the parent reads the machine-wide busy
 * jiffies of /proc/stat (user+nice+system+irq+softirq) just before sf_clone
 * and then every SAMPLE_MS until the settle deadline, and prints the series
 * (CPU lines) after sf_join; the script takes the first sample at or after the
 * last clone's start. Waiting clones and the parent sleep (clock_nanosleep on
 * an absolute deadline), so they add nothing to it. Before the ticket the
 * parent also measures the machine's background load over BG_MS (other
 * programs on this machine count in the machine-wide figure too).
 *
 * Output: CLONE lines (one per clone), then PARENT, CPU and STAT lines. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "starling.h"

#define SAMPLE_MS 5
#define BG_MS 500

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Sleep until CLOCK_REALTIME reaches at_ns (no busy wait: waiting clones must
 * leave the cores to the clones still being created). */
static void sleep_until(long long at_ns) {
    struct timespec ts = {.tv_sec = at_ns / 1000000000LL, .tv_nsec = at_ns % 1000000000LL};
    while (clock_nanosleep(CLOCK_REALTIME, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* Machine-wide busy time in clock ticks (USER_HZ): user+nice+system+irq+
 * softirq of the aggregate "cpu" line of /proc/stat; -1 if unreadable. */
static long long busy_ticks(void) {
    FILE *f = fopen("/proc/stat", "r");
    unsigned long long user, nice, sys, idle, iowait, irq, softirq;
    long long v = -1;
    if (f && fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &sys, &idle, &iowait, &irq,
                    &softirq) == 7)
        v = (long long)(user + nice + sys + irq + softirq);
    if (f) fclose(f);
    return v;
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
    if (argc != 6) {
        fprintf(stderr, "usage: %s CLONES HEAP_MIB PROBES SETTLE_MS HIERARCHICAL(0|1)\n", argv[0]);
        return 1;
    }
    int n = atoi(argv[1]);
    size_t heap_mib = (size_t)atol(argv[2]);
    int probes = atoi(argv[3]);
    long long settle_ns = atoll(argv[4]) * 1000000LL;
    bool hierarchical = atoi(argv[5]) != 0;
    if (n < 1 || heap_mib < 1 || probes < 1 || settle_ns < 0) {
        fprintf(stderr, "bad arguments\n");
        return 1;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    unsigned char *heap = malloc(heap_mib << 20);
    long long *lat = calloc(probes, sizeof *lat);
    /* Samples of (time since t0, busy ticks) during the settle window. */
    int max_samples = (int)(settle_ns / (SAMPLE_MS * 1000000LL)) + 2;
    long long *sample_t = calloc(max_samples, sizeof *sample_t);
    long long *sample_busy = calloc(max_samples, sizeof *sample_busy);
    if (!heap || !lat || !sample_t || !sample_busy) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < (heap_mib << 20); i += 4096) heap[i] = (unsigned char)(i >> 12) | 1;

    long long bg_start = now_ns(), bg_busy0 = busy_ticks();
    sleep_until(bg_start + BG_MS * 1000000LL);
    long long bg_busy1 = busy_ticks(), bg_end = now_ns();

    sf_ticket_t *t = sf_request_ticket(n, hierarchical);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    long rss = rss_kib();
    long long busy0 = busy_ticks();
    long long t0 = now_ns();
    long long deadline = t0 + settle_ns;
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        long long started = now_ns();
        int late = started > deadline;
        sleep_until(deadline);
        long long probing = now_ns();
        size_t pages = (heap_mib << 20) / 4096;
        unsigned long sum = 0;
        long long total = 0;
        for (int i = 0; i < probes; i++) {
            size_t page = ((size_t)i * 64 + (size_t)id * 7) % pages;
            long long a = now_ns();
            sum += heap[page * 4096];
            lat[i] = now_ns() - a;
            total += lat[i];
        }
        qsort(lat, probes, sizeof *lat, cmp_ll);
        printf("CLONE id=%d start_ns=%lld probe_ns=%lld late=%d median_ns=%lld p99_ns=%lld total_ns=%lld sum=%lu\n", id,
               started - t0, probing - t0, late, lat[probes / 2], lat[(probes * 99) / 100], total, sum);
        sf_exit(0);
    }
    long long returned = now_ns();
    /* Sample the busy ticks until the settle deadline (clones are either
     * being created or asleep in this window). */
    int samples = 0;
    for (long long at = returned; samples < max_samples; at += SAMPLE_MS * 1000000LL) {
        if (at > deadline) at = deadline;
        sleep_until(at);
        sample_t[samples] = now_ns() - t0;
        sample_busy[samples] = busy_ticks();
        samples++;
        if (at >= deadline) break;
    }
    if (sf_join(t) != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    long long joined = now_ns();
    printf("PARENT clones=%d hierarchical=%d clone_call_ns=%lld join_ns=%lld descriptor_bytes=%lld rss_kib=%ld "
           "settle_ns=%lld cores=%ld clk_tck=%ld busy0=%lld bg_ns=%lld bg_ticks=%lld t0_real_ns=%lld\n",
           m, hierarchical ? 1 : 0, returned - t0, joined - t0, sf_descriptor_bytes(t), rss, settle_ns,
           sysconf(_SC_NPROCESSORS_ONLN), sysconf(_SC_CLK_TCK), busy0, bg_end - bg_start, bg_busy1 - bg_busy0, t0);
    for (int i = 0; i < samples; i++) printf("CPU t_ns=%lld busy=%lld\n", sample_t[i], sample_busy[i]);
    for (int i = 1; i <= m; i++)
        printf("STAT id=%d status=%d faults=%lld fetched=%lld zero=%lld file=%lld requests=%lld dist=%lld\n", i,
               sf_clone_status(t, i), sf_clone_stat(t, i, 0), sf_clone_stat(t, i, 1), sf_clone_stat(t, i, 2),
               sf_clone_stat(t, i, 3), sf_clone_stat(t, i, 4), sf_clone_stat(t, i, 6));
    /* Each clone's critical-path stamps (CLOCK_REALTIME ns, as t0). */
    for (int i = 1; i <= m; i++)
        printf("STAMPS id=%d ticket=%lld template=%lld descriptor=%lld placed=%lld launch_received=%lld "
               "view_mounted=%lld sandbox_ready=%lld restorer_running=%lld first_page=%lld\n", i,
               sf_clone_stat(t, i, SF_CLONE_STAMP_TICKET), sf_clone_stat(t, i, SF_CLONE_STAMP_TEMPLATE),
               sf_clone_stat(t, i, SF_CLONE_STAMP_DESCRIPTOR), sf_clone_stat(t, i, SF_CLONE_STAMP_PLACED),
               sf_clone_stat(t, i, SF_CLONE_STAMP_LAUNCH_RECEIVED), sf_clone_stat(t, i, SF_CLONE_STAMP_VIEW_MOUNTED),
               sf_clone_stat(t, i, SF_CLONE_STAMP_SANDBOX_READY), sf_clone_stat(t, i, SF_CLONE_STAMP_RESTORER_RUNNING),
               sf_clone_stat(t, i, SF_CLONE_STAMP_FIRST_PAGE));
    return 0;
}
