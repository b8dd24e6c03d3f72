/* Clones that sleep: for the lost-host, kill -9 and sf_kill tests.
 * Usage: linger CLONES SECONDS MODE [hier]   (MODE: join | kill; hier: hierarchical ticket)
 * Prints "CLONE id host pid" lines (flushed) as clones start, then
 * "JOIN rc why" after sf_join, and "STATE id state status" per clone after
 * sf_join/sf_kill. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/utsname.h>
#include "starling.h"

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2;
    int secs = argc > 2 ? atoi(argv[2]) : 30;
    const char *mode = argc > 3 ? argv[3] : "join";
    setvbuf(stdout, NULL, _IOLBF, 0);
    sf_ticket_t *t = sf_request_ticket(n, argc > 4 && strcmp(argv[4], "hier") == 0);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    printf("PARENT pid=%d allocation=%d\n", getpid(), m);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        struct utsname u;
        uname(&u);
        printf("CLONE %d %s\n", id, u.nodename);
        for (int i = 0; i < secs * 10; i++) usleep(100000);
        sf_exit(7);
    }
    if (strcmp(mode, "kill") == 0) {
        sleep(2);
        if (sf_kill(t) != 0) { fprintf(stderr, "kill: %s\n", sf_last_error()); return 3; }
    } else {
        /* clones exit 7, so sf_join reports failure: print why and go on */
        int rc = sf_join(t);
        printf("JOIN %d %s\n", rc, rc ? sf_last_error() : "");
    }
    for (int i = 1; i <= m; i++) printf("STATE %d %d %d\n", i, sf_clone_state(t, i), sf_clone_status(t, i));
    return 0;
}
