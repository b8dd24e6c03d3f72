/* Memory sf_clone cannot clone is refused before anything is launched,
 * with an error naming the mapping. MODE hugetlb: a MAP_HUGETLB mapping
 * (needs a free huge page: the test reserves one). Device/IO (VM_IO,
 * VM_PFNMAP) mappings that fork() copies need /dev/mem or a device BAR,
 * which the test machines lack; the ones a process can make without a
 * device (perf ring buffers) are also VM_DONTCOPY, so they never reach the
 * template (dontfork.c): that refusal is tested on dump() directly
 * (tests/stages.rs). Prints "MAPPING <start>" (hex, as /proc/self/maps
 * writes it) and "REFUSED: <sf_last_error()>"; exit 0 if refused, 1 if a
 * clone ran. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include "starling.h"

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    void *m = MAP_FAILED;
    if (strcmp(mode, "hugetlb") == 0) {
        m = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
        if (m != MAP_FAILED) memset(m, 0x5a, 2 << 20);
    } else {
        fprintf(stderr, "usage: refused hugetlb\n");
        return 2;
    }
    if (m == MAP_FAILED) { perror("mmap"); return 2; }
    printf("MAPPING %lx\n", (unsigned long)m);
    fflush(stdout);
    sf_ticket_t *t = sf_request_ticket(2, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id > 0) { printf("CLONE RAN %d\n", id); sf_exit(0); }
    if (id == 0) { sf_join(t); printf("UNEXPECTED: sf_clone succeeded\n"); return 1; }
    printf("REFUSED: %s\n", sf_last_error());
    return 0;
}
