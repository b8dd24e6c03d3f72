/* Per-clone exit statuses, hierarchical or not: clone i exits 10+i, except
 * clone 3 which kills itself (SIGKILL). Each clone prints its host and PID;
 * the parent prints every clone's status after sf_join.
 * Usage: statuses N HIERARCHICAL(0|1) */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <unistd.h>
#include "starling.h"

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: statuses N HIERARCHICAL\n"); return 2; }
    int n = atoi(argv[1]);
    sf_ticket_t *t = sf_request_ticket(n, atoi(argv[2]) != 0);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        struct utsname u;
        uname(&u);
        /* glibc's cached TID (pthread internals) must name this process */
        printf("CLONE %d host %s pid %d tid %ld\n", id, u.nodename, getpid(), (long)syscall(SYS_gettid));
        fflush(stdout);
        if (id == 3) raise(SIGKILL);
        sf_exit(10 + id);
    }
    if (sf_join(t) == 0) { fprintf(stderr, "sf_join reported success despite failing clones\n"); return 3; }
    printf("GRANTED %d\n", m);
    for (int i = 1; i <= m; i++) printf("STATUS %d %d\n", i, sf_clone_status(t, i));
    return 0;
}
