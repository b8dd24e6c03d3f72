/* brk heap, mmap'ed malloc chunks, and a 1 GiB heap of which the template
 * wrote 64 MiB: a clone reading 4 MiB of it fetches about 4 MiB. */
#include "sftest.h"
#include <stdint.h>

#define GIB (1UL << 30)
#define MIB (1UL << 20)

int main(void) {
    char *small = malloc(100);                 /* brk heap */
    strcpy(small, "brk-heap-string");
    size_t big_n = 8 * MIB;                    /* mmap'ed chunk */
    uint32_t *big = malloc(big_n);
    for (size_t i = 0; i < big_n / 4; i++) big[i] = (uint32_t)(i * 2654435761u);
    unsigned char *huge = malloc(GIB);         /* 1 GiB, partly touched */
    PCHECK(huge != NULL);
    for (size_t i = 0; i < 64 * MIB; i++) huge[i] = (unsigned char)(i * 7 + 3);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        CHECK(strcmp(small, "brk-heap-string") == 0);
        for (size_t i = 0; i < big_n / 4; i += big_n / 64) CHECK(big[i] == (uint32_t)(i * 2654435761u));
        /* read 4 MiB of the written part, starting at 16 MiB */
        unsigned long sum = 0, expect = 0;
        for (size_t i = 16 * MIB; i < 20 * MIB; i++) { sum += huge[i]; expect += (unsigned char)(i * 7 + 3); }
        CHECK(sum == expect);
        /* untouched part reads as zero without fetching */
        for (size_t i = 512 * MIB; i < 516 * MIB; i += 4096) CHECK(huge[i] == 0);
        /* memory allocated after the fork is local */
        char *fresh = malloc(32 * MIB);
        CHECK(fresh != NULL);
        memset(fresh, 0x5a, 32 * MIB);
        CHECK(fresh[32 * MIB - 1] == 0x5a);
        /* writes are private to the clone */
        small[0] = 'X';
        huge[16 * MIB] = 0xff;
        sf_exit(0);
    }
    sft_join(t, 2);
    PCHECK(small[0] == 'b');
    long long fetched = sf_clone_stat(t, 1, 1);
    long long want = 4 * MIB / 4096;           /* 1024 pages */
    printf("clone touched 4 MiB of a 1 GiB heap: fetched %lld pages (%.2f MiB)\n", fetched, fetched * 4096.0 / MIB);
    PCHECK(fetched >= want);
    /* plus the few other pages the clone touches (stack, libc data, the
     * small heap, 16 samples of the 8 MiB chunk) and prefetch overshoot */
    PCHECK(fetched <= want + 400);
    printf("PASS heap\n");
    return 0;
}
