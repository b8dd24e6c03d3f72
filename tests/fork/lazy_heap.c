/* A 1 GiB heap, partly touched: each clone reads TOUCH_MIB MiB of it and
 * prints what its fault handler fetched (sf_clone_stat, reported by the
 * agent when the clone ends) next to what it touched.
 * Usage: lazy_heap CLONES TOUCH_MIB */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/mman.h>
#include "starling.h"

#define GIB (1UL << 30)

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2;
    long touch_mib = argc > 2 ? atol(argv[2]) : 16;
    unsigned char *heap = mmap(NULL, GIB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (heap == MAP_FAILED) { perror("mmap"); return 2; }
    /* The parent writes 64 MiB of it (resident), the rest stays untouched. */
    for (size_t i = 0; i < (64UL << 20); i += 4096) heap[i] = (unsigned char)(i >> 12) | 1;
    sf_ticket_t *t = sf_request_ticket(n, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        /* Each clone reads its own touch_mib slice of the written part. */
        size_t base = ((size_t)(id - 1) * (size_t)touch_mib << 20) % (64UL << 20);
        unsigned long sum = 0, bad = 0;
        for (size_t i = 0; i < ((size_t)touch_mib << 20); i += 4096) {
            size_t off = (base + i) % (64UL << 20);
            unsigned char want = (unsigned char)(off >> 12) | 1;
            if (heap[off] != want) bad++;
            sum += heap[off];
        }
        /* And one page far out in the untouched part: must read zero. */
        if (heap[GIB - 4096] != 0) bad++;
        printf("clone %d checked %ld MiB sum=%lu bad=%lu\n", id, touch_mib, sum, bad);
        fflush(stdout);
        sf_exit(bad ? 1 : 0);
    }
    if (sf_join(t) != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    int fails = 0;
    for (int i = 1; i <= m; i++) {
        printf("STAT clone=%d status=%d fetched=%lld zero=%lld file=%lld faults=%lld requests=%lld touched_pages=%ld\n",
               i, sf_clone_status(t, i), sf_clone_stat(t, i, 1), sf_clone_stat(t, i, 2), sf_clone_stat(t, i, 3),
               sf_clone_stat(t, i, 0), sf_clone_stat(t, i, 4), touch_mib * 256);
        printf("STAMPS clone=%d", i);
        for (int k = SF_CLONE_STAMP_TICKET; k <= SF_CLONE_STAMP_FIRST_PAGE; k++) printf(" %lld", sf_clone_stat(t, i, k));
        printf("\n");
        if (sf_clone_status(t, i) != 0) fails++;
    }
    printf("descriptor_bytes=%lld\n", sf_descriptor_bytes(t));
    return fails ? 1 : 0;
}
