/* Clones of one ticket sharing their hosts (tests/test_fork_share.py).
 *
 * Usage: shared_host N HIERARCHICAL(0|1) VICTIM DATA_MIB
 *
 * The parent builds a page-distinct dataset (page p holds a xorshift stream
 * seeded by p, so a page installed at the wrong address, torn, or from
 * another clone's request gone wrong changes the sums) and a global array,
 * then clones N times. Every clone prints its host, reads the whole dataset
 * and prints a checksum per 1 MiB chunk and of the globals (CSUM), then
 * exits 0 — except clone VICTIM (0: none), which reads with two threads
 * (forwards and backwards, so faults are in flight) and SIGKILLs itself a
 * quarter of the way through. The parent prints its own checksums (PSUM),
 * joins, and prints per clone its status and fault-handler counters (STAT)
 * and the ticket's sender-side counters (WIRE). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/utsname.h>
#include <unistd.h>
#include "starling.h"
#include "../../bench/c/dataset.h"

static unsigned char *data;
static size_t data_bytes;
static uint64_t globals[32 * 1024]; /* 256 KiB in .bss, written before the fork */
static volatile uint64_t sink;

/* The victim's second reader: backwards from the end, page by page. */
static void *read_backwards(void *arg) {
    (void)arg;
    for (size_t off = data_bytes; off >= PAGE; off -= PAGE) sink += data[off - PAGE];
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: shared_host N HIERARCHICAL VICTIM DATA_MIB\n"); return 2; }
    int n = atoi(argv[1]), victim = atoi(argv[3]);
    data_bytes = (size_t)atol(argv[4]) << 20;
    setvbuf(stdout, NULL, _IOLBF, 0);
    data = aligned_alloc(PAGE, data_bytes);
    if (!data) { fprintf(stderr, "out of memory\n"); return 2; }
    for (size_t p = 0; p < data_bytes / PAGE; p++) fill_page((uint64_t *)(data + p * PAGE), p);
    for (size_t i = 0; i < sizeof globals / 8; i++) globals[i] = mix(i * 7 + 1);
    sf_ticket_t *t = sf_request_ticket(n, atoi(argv[2]) != 0);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        struct utsname u;
        uname(&u);
        printf("CLONE id=%d host=%s\n", id, u.nodename);
        if (id == victim) {
            pthread_t th;
            if (pthread_create(&th, NULL, read_backwards, NULL) != 0) sf_exit(90);
            for (size_t off = 0; off < data_bytes / 4; off += PAGE) sink += data[off];
            raise(SIGKILL);
        }
        for (size_t off = 0; off < data_bytes; off += CHUNK) {
            size_t len = data_bytes - off < CHUNK ? data_bytes - off : CHUNK;
            printf("CSUM id=%d chunk=%zu sum=%016llx\n", id, off / CHUNK, (unsigned long long)sum_range(data + off, len, off));
        }
        printf("CSUM id=%d chunk=globals sum=%016llx\n", id, (unsigned long long)sum_range((void *)globals, sizeof globals, 0));
        sf_exit(0);
    }
    /* The parent never writes the dataset after the fork: its memory is the clones' image. */
    for (size_t off = 0; off < data_bytes; off += CHUNK) {
        size_t len = data_bytes - off < CHUNK ? data_bytes - off : CHUNK;
        printf("PSUM chunk=%zu sum=%016llx\n", off / CHUNK, (unsigned long long)sum_range(data + off, len, off));
    }
    printf("PSUM chunk=globals sum=%016llx\n", (unsigned long long)sum_range((void *)globals, sizeof globals, 0));
    int joined = sf_join(t);
    printf("PARENT clones=%d joined=%d descriptor_bytes=%lld\n", m, joined, sf_descriptor_bytes(t));
    for (int i = 1; i <= m; i++)
        printf("STAT id=%d status=%d state=%d fetched=%lld mode=%lld unsolicited=%lld\n", i, sf_clone_status(t, i),
               sf_clone_state(t, i), sf_clone_stat(t, i, 1), sf_clone_stat(t, i, 6), sf_clone_stat(t, i, 7));
    printf("WIRE descriptor_pages_sent=%lld mc_receivers=%lld bytes_multicast=%lld bytes_tcp=%lld\n",
           sf_ticket_stat(t, SF_STAT_DESCRIPTOR_PAGES_SENT), sf_ticket_stat(t, SF_STAT_MC_RECEIVERS),
           sf_ticket_stat(t, SF_STAT_BYTES_MULTICAST), sf_ticket_stat(t, SF_STAT_BYTES_TCP));
    sf_release_ticket(t);
    return 0;
}
