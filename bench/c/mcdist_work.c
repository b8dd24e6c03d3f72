/* Workloads for bench/mcdist_bench.py and tests/test_mcdist.py (SnowFlock §5:
 * SHRiMP-like and BLAST-like runs over an in-memory dataset built before the fork).
 *
 * Usage: mcdist_work MODE CLONES DATA_MIB SCRATCH_MIB
 *   MODE shrimp  every clone scans the WHOLE dataset in the same order (hash
 *                per page) and fills a SCRATCH_MIB table the parent allocated
 *                but never touched (zero pages: what the avoidance heuristics
 *                save);
 *   MODE blast   clone i of m scans only slice i of m of the dataset (disjoint
 *                reads: the heuristic-adverse case, nothing shared);
 *   MODE verify  as shrimp, and every clone prints a checksum per 1 MiB chunk
 *                of what it read (dataset, plus a global array); the parent
 *                prints its own for the same chunks (tests compare them).
 *
 * The dataset is page-distinct: page p holds a xorshift stream seeded by p,
 * so a page installed at the wrong address or a torn page changes the sums.
 * Output lines (key=value): CLONE (per clone: start/end ns since the parent
 * called sf_clone, CLOCK_REALTIME — the emulated hosts share this clock),
 * PARENT (timings), STAT (per clone fault-handler counters), WIRE (the
 * ticket's sender-side counters, sf_ticket_stat), CSUM/PSUM (verify). */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "starling.h"
#include "dataset.h"

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint64_t globals[64 * 1024]; /* 512 KiB in .bss, written before the fork */

int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage: %s shrimp|blast|verify CLONES DATA_MIB SCRATCH_MIB\n", argv[0]); return 2; }
    const char *mode = argv[1];
    int n = atoi(argv[2]);
    size_t data_bytes = (size_t)atol(argv[3]) << 20, scratch_bytes = (size_t)atol(argv[4]) << 20;
    int verify = !strcmp(mode, "verify"), blast = !strcmp(mode, "blast");
    setvbuf(stdout, NULL, _IOLBF, 0);
    unsigned char *data = aligned_alloc(PAGE, data_bytes);
    unsigned char *scratch = scratch_bytes ? calloc(1, scratch_bytes) : NULL; /* untouched: zero pages */
    if (!data || (scratch_bytes && !scratch)) { fprintf(stderr, "out of memory\n"); return 2; }
    for (size_t p = 0; p < data_bytes / PAGE; p++) fill_page((uint64_t *)(data + p * PAGE), p);
    for (size_t i = 0; i < sizeof globals / 8; i++) globals[i] = mix(i * 7 + 1);
    sf_ticket_t *t = sf_request_ticket(n, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    long long t0 = now_ns();
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        long long started = now_ns() - t0;
        size_t from = 0, to = data_bytes;
        if (blast) {
            size_t per = (data_bytes / PAGE + m - 1) / m * PAGE;
            from = per * (id - 1) < data_bytes ? per * (id - 1) : data_bytes;
            to = from + per < data_bytes ? from + per : data_bytes;
        }
        uint64_t h = 0;
        for (size_t off = from; off < to; off += CHUNK) {
            size_t len = to - off < CHUNK ? to - off : CHUNK;
            uint64_t c = sum_range(data + off, len, off);
            if (verify) printf("CSUM id=%d chunk=%zu sum=%016llx\n", id, off / CHUNK, (unsigned long long)c);
            h ^= c;
        }
        if (verify)
            printf("CSUM id=%d chunk=globals sum=%016llx\n", id, (unsigned long long)sum_range((void *)globals, sizeof globals, 0));
        /* SHRiMP's per-run tables: written in full by every clone. */
        for (size_t off = 0; off < scratch_bytes; off += PAGE) scratch[off] = (unsigned char)(h + off / PAGE);
        long long ended = now_ns() - t0;
        printf("CLONE id=%d start_ns=%lld end_ns=%lld bytes=%zu hash=%016llx\n", id, started, ended, to - from,
               (unsigned long long)h);
        sf_exit(0);
    }
    long long returned = now_ns() - t0;
    if (verify) {
        /* The parent never writes the dataset after the fork: its memory is the clones' image. */
        for (size_t off = 0; off < data_bytes; off += CHUNK) {
            size_t len = data_bytes - off < CHUNK ? data_bytes - off : CHUNK;
            printf("PSUM chunk=%zu sum=%016llx\n", off / CHUNK, (unsigned long long)sum_range(data + off, len, off));
        }
        printf("PSUM chunk=globals sum=%016llx\n", (unsigned long long)sum_range((void *)globals, sizeof globals, 0));
    }
    if (sf_join(t) != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    long long joined = now_ns() - t0;
    printf("PARENT clones=%d clone_call_ns=%lld join_ns=%lld descriptor_bytes=%lld\n", m, returned, joined,
           sf_descriptor_bytes(t));
    for (int i = 1; i <= m; i++)
        printf("STAT id=%d status=%d faults=%lld fetched=%lld zero=%lld file=%lld requests=%lld mode=%lld unsolicited=%lld\n",
               i, sf_clone_status(t, i), sf_clone_stat(t, i, 0), sf_clone_stat(t, i, 1), sf_clone_stat(t, i, 2),
               sf_clone_stat(t, i, 3), sf_clone_stat(t, i, 4), sf_clone_stat(t, i, 6), sf_clone_stat(t, i, 7));
    printf("WIRE bytes_wire=%lld bytes_tcp=%lld bytes_multicast=%lld pages_requested=%lld pages_served=%lld "
           "rate_cuts=%lld implicit_losses=%lld lockstep_suppressed=%lld pages_pushed=%lld rate_min=%lld rate_now=%lld "
           "descriptor_pages_sent=%lld mc_data_pages=%lld mc_data_datagrams=%lld mc_mtu=%lld\n",
           sf_ticket_stat(t, SF_STAT_BYTES_WIRE), sf_ticket_stat(t, SF_STAT_BYTES_TCP),
           sf_ticket_stat(t, SF_STAT_BYTES_MULTICAST), sf_ticket_stat(t, SF_STAT_PAGES_REQUESTED),
           sf_ticket_stat(t, SF_STAT_PAGES_SERVED), sf_ticket_stat(t, SF_STAT_RATE_CUTS),
           sf_ticket_stat(t, SF_STAT_IMPLICIT_LOSSES), sf_ticket_stat(t, SF_STAT_LOCKSTEP_SUPPRESSED),
           sf_ticket_stat(t, SF_STAT_PAGES_PUSHED), sf_ticket_stat(t, SF_STAT_RATE_MIN), sf_ticket_stat(t, SF_STAT_RATE_NOW),
           sf_ticket_stat(t, SF_STAT_DESCRIPTOR_PAGES_SENT), sf_ticket_stat(t, SF_STAT_MC_DATA_PAGES),
           sf_ticket_stat(t, SF_STAT_MC_DATA_DATAGRAMS), sf_ticket_stat(t, SF_STAT_MC_MTU));
    sf_release_ticket(t);
    return 0;
}
