/* mremap'd memory. (1) A region the parent grew and moved with mremap
 * before cloning is served at its new address (its grown, untouched tail
 * reads zero). (2) In the clone, a region moved before any of its pages
 * was fetched (a REMAP event) still reads the template's data at its new
 * address, and again after growing it. */
#define _GNU_SOURCE
#include "sftest.h"
#include <stdint.h>
#include <sys/mman.h>

#define PAGE 4096UL

static uint64_t word(uint64_t region, size_t i) { return (region << 48) ^ (i * 0x9e3779b97f4a7c15ULL) ^ 1; }

/* A free address range of len bytes (reserved PROT_NONE, to be replaced with MREMAP_FIXED). */
static void *reserve(size_t len) {
    void *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

int main(void) {
    /* (1) 16 pages written, grown to 64 pages at another address, pages 16..31 written there. */
    uint64_t *a = mmap(NULL, 16 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    PCHECK(a != MAP_FAILED);
    for (size_t i = 0; i < 16 * PAGE / 8; i++) a[i] = word(1, i);
    void *to = reserve(64 * PAGE);
    PCHECK(to != NULL);
    uint64_t *moved = mremap(a, 16 * PAGE, 64 * PAGE, MREMAP_MAYMOVE | MREMAP_FIXED, to);
    PCHECK(moved == to);
    for (size_t i = 16 * PAGE / 8; i < 32 * PAGE / 8; i++) moved[i] = word(1, i);
    /* (2) 256 pages the clone will move before touching them. */
    size_t n2 = 256 * PAGE;
    uint64_t *b = mmap(NULL, n2, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    PCHECK(b != MAP_FAILED);
    for (size_t i = 0; i < n2 / 8; i++) b[i] = word(2, i);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        for (size_t i = 0; i < 32 * PAGE / 8; i++) CHECK(moved[i] == word(1, i));
        for (size_t i = 32 * PAGE / 8; i < 64 * PAGE / 8; i++) CHECK(moved[i] == 0);
        void *dest = reserve(n2);
        CHECK(dest != NULL);
        uint64_t *c = mremap(b, n2, n2, MREMAP_MAYMOVE | MREMAP_FIXED, dest);
        CHECK(c == dest);
        for (size_t i = 0; i < n2 / 8; i += 7) CHECK(c[i] == word(2, i));
        /* grow it (it may move again): the old part keeps its data, the new part is zero */
        uint64_t *d = mremap(c, n2, 2 * n2, MREMAP_MAYMOVE);
        CHECK(d != MAP_FAILED);
        for (size_t i = 0; i < n2 / 8; i++) CHECK(d[i] == word(2, i));
        for (size_t i = n2 / 8; i < 2 * n2 / 8; i += 512) CHECK(d[i] == 0);
        sf_exit(0);
    }
    sft_join(t, 2);
    for (size_t i = 0; i < n2 / 8; i += 512) PCHECK(b[i] == word(2, i));
    PCHECK(moved[0] == word(1, 0));
    printf("PASS mremap\n");
    return 0;
}
