/* Mappings fork() does not copy (VM_DONTCOPY) are absent in a clone, as in
 * a fork() child: a perf_event ring buffer (which the kernel maps
 * VM_IO|VM_PFNMAP|VM_DONTCOPY) and memory the program marked
 * MADV_DONTFORK. Their addresses are unmapped in the clone (msync: ENOMEM)
 * while ordinary memory next to them is there with its data. */
#define _GNU_SOURCE
#include "sftest.h"
#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <linux/perf_event.h>

static int mapped(void *a) {
    errno = 0;
    if (msync(a, 4096, MS_ASYNC) == 0) return 1;
    return errno == ENOMEM ? 0 : -1;
}

int main(void) {
    struct perf_event_attr pa = { .size = sizeof pa, .type = PERF_TYPE_SOFTWARE, .config = PERF_COUNT_SW_DUMMY };
    int pfd = syscall(SYS_perf_event_open, &pa, 0, -1, -1, 0);
    PCHECK(pfd >= 0);
    void *ring = mmap(NULL, 2 * 4096, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
    PCHECK(ring != MAP_FAILED);
    char *kept = mmap(NULL, 3 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    PCHECK(kept != MAP_FAILED);
    memset(kept, 'k', 3 * 4096);
    char *dropped = kept + 4096;              /* the middle page only */
    PCHECK(madvise(dropped, 4096, MADV_DONTFORK) == 0);
    PCHECK(mapped(ring) == 1 && mapped(dropped) == 1);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        CHECK(mapped(ring) == 0);
        CHECK(mapped(dropped) == 0);
        CHECK(mapped(kept) == 1 && kept[0] == 'k');
        CHECK(mapped(kept + 2 * 4096) == 1 && kept[2 * 4096] == 'k');
        sf_exit(0);
    }
    sft_join(t, 2);
    PCHECK(mapped(ring) == 1 && dropped[0] == 'k');
    printf("PASS dontfork\n");
    return 0;
}
