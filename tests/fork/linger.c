/* Clones that sleep: for the lost-host, kill -9 and sf_kill tests.
 * Usage: linger CLONES SECONDS MODE [hier]   (MODE: join | kill; hier: hierarchical ticket)
 * Prints "CLONE id host pid" lines (flushed) as clones start, then
 * "JOIN rc why" after sf_join, and "STATE id state status" per clone after
 * sf_join/sf_kill. In kill mode every clone first connects to the parent
 * (at sf_parent_host()), and the parent kills once all of them have: the
 * clones are running, not still starting, when sf_kill hits them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include "starling.h"

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 2;
    int secs = argc > 2 ? atoi(argv[2]) : 30;
    const char *mode = argc > 3 ? argv[3] : "join";
    int kill_mode = strcmp(mode, "kill") == 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    sf_ticket_t *t = sf_request_ticket(n, argc > 4 && strcmp(argv[4], "hier") == 0);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    printf("PARENT pid=%d allocation=%d\n", getpid(), m);
    int ls = -1;
    struct sockaddr_in sa = { .sin_family = AF_INET };
    if (kill_mode) {
        const char *host = sf_parent_host();
        if (!host || inet_pton(AF_INET, host, &sa.sin_addr) != 1) { fprintf(stderr, "no parent host\n"); return 2; }
        socklen_t sl = sizeof sa;
        ls = socket(AF_INET, SOCK_STREAM, 0);
        if (bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(ls, 64) != 0 ||
            getsockname(ls, (struct sockaddr *)&sa, &sl) != 0) { perror("listen"); return 2; }
    }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        struct utsname u;
        uname(&u);
        printf("CLONE %d %s\n", id, u.nodename);
        if (kill_mode) {
            int s = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) { perror("clone connect"); sf_exit(6); }
        }
        for (int i = 0; i < secs * 10; i++) usleep(100000);
        sf_exit(7);
    }
    if (kill_mode) {
        for (int running = 0; running < m; running++) {
            struct pollfd p = { .fd = ls, .events = POLLIN };
            if (poll(&p, 1, 300 * 1000) <= 0) { fprintf(stderr, "only %d of %d clones connected\n", running, m); return 4; }
            if (accept(ls, NULL, NULL) < 0) { perror("accept"); return 4; }
        }
        if (sf_kill(t) != 0) { fprintf(stderr, "kill: %s\n", sf_last_error()); return 3; }
    } else {
        /* clones exit 7, so sf_join reports failure: print why and go on */
        int rc = sf_join(t);
        printf("JOIN %d %s\n", rc, rc ? sf_last_error() : "");
    }
    for (int i = 1; i <= m; i++) printf("STATE %d %d %d\n", i, sf_clone_state(t, i), sf_clone_status(t, i));
    return 0;
}
