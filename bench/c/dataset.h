/* The page-distinct dataset the remote-fork programs read, and its checksum
 * (bench/c/mcdist_work.c, tests/fork/shared_host.c): page p holds a xorshift
 * stream seeded by p, so a page installed at the wrong address, torn, or
 * answered for another request changes the sums a clone prints. */
#ifndef STARLING_BENCH_DATASET_H
#define STARLING_BENCH_DATASET_H
#include <stddef.h>
#include <stdint.h>

#define PAGE 4096UL
#define CHUNK (1UL << 20)

static uint64_t mix(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

/* Page `index` of the dataset, written at p. */
static void fill_page(uint64_t *p, uint64_t index) {
    uint64_t s = mix(index + 0x9e3779b97f4a7c15ULL) | 1;
    for (size_t i = 0; i < PAGE / 8; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        p[i] = s;
    }
}

/* Order- and position-sensitive checksum of n bytes at a. */
static uint64_t sum_range(const unsigned char *a, size_t n, uint64_t seed) {
    const uint64_t *w = (const uint64_t *)a;
    uint64_t h = seed;
    for (size_t i = 0; i < n / 8; i++) h = mix(h ^ w[i]) + i;
    return h;
}
#endif
