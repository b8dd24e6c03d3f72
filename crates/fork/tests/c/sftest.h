/* Shared scaffolding of the restore-correctness suite: each program sets up
 * one kind of state, clones, checks it in every clone (exit status 0 = all
 * checks passed), and the parent joins and checks the statuses. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "starling.h"

static int sft_id;

#define CHECK(c) do { if (!(c)) { \
    fprintf(stderr, "[%s clone %d] CHECK failed at line %d: %s\n", __FILE__, sft_id, __LINE__, #c); \
    fflush(stderr); sf_exit(1); } } while (0)

#define PCHECK(c) do { if (!(c)) { \
    fprintf(stderr, "[%s parent] CHECK failed at line %d: %s\n", __FILE__, __LINE__, #c); \
    exit(1); } } while (0)

#ifdef SFT_MIGRATE
/* 1 where a check differs by design between a clone (a new process) and a moved process (the same one). */
#define SFT_MOVED 1
/* Built with -DSFT_MIGRATE (tests/test_migrate_suite.py), the same checks run in a process that
 * `starling migrate` moved instead of in a clone: sft_clone says "sft: ready" and waits for a line
 * on stdin, which the test sends once it has moved this process to another host; it then returns 1
 * and the clone's checks run on the new host. sf_exit(0) there says "sft: checked". */
static void sft_moved_exit(int status) {
    if (status == 0) printf("sft: checked\n");
    fflush(stdout);
    exit(status);
}
#define sf_exit(status) sft_moved_exit(status)

static int sft_clone(sf_ticket_t **t, int n) {
    (void)n;
    *t = NULL;
    printf("sft: ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) { fprintf(stderr, "sft: stdin closed before the move\n"); exit(5); }
    sft_id = 1;
    return 1;
}
#else
#define SFT_MOVED 0
/* Clone n times; returns the clone id (0 in the parent). SFT_HIERARCHICAL=1
 * asks for a hierarchical ticket (on a cluster: one restore per host, the
 * host's further clones forked from it). */
static int sft_clone(sf_ticket_t **t, int n) {
    const char *h = getenv("SFT_HIERARCHICAL");
    *t = sf_request_ticket(n, h && h[0] == '1');
    PCHECK(*t != NULL);
    PCHECK(sf_ticket_allocation(*t) == n);
    int id = sf_clone(*t);
    if (id < 0) { fprintf(stderr, "sf_clone failed: %s\n", sf_last_error()); exit(2); }
    sft_id = id;
    return id;
}
#endif

/* Parent: join and require every clone to have exited 0. */
static void sft_join(sf_ticket_t *t, int n) {
    if (sf_join(t) != 0) { fprintf(stderr, "sf_join failed: %s\n", sf_last_error()); exit(3); }
    for (int i = 1; i <= n; i++) {
        int st = sf_clone_status(t, i);
        if (st != 0) { fprintf(stderr, "clone %d exited with %d\n", i, st); exit(4); }
    }
    printf("descriptor=%lld bytes; clone 1: faults=%lld fetched=%lld zero=%lld file=%lld\n",
           sf_descriptor_bytes(t), sf_clone_stat(t, 1, 0), sf_clone_stat(t, 1, 1),
           sf_clone_stat(t, 1, 2), sf_clone_stat(t, 1, 3));
}
