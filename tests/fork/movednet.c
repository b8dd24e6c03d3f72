/* What a clone moved by `starling migrate` can reach (issue 12: a moved
 * clone must stay in its ticket's network). One clone; it connects to each
 * TARGET (IP:PORT) of the command line where it was cloned and prints
 *   REACH BEFORE IP:PORT ok|ERRNO
 * then prints "clone ready" and asks its parent, once per 200 ms over a new connection,
 * "?": the parent answers "wait" until a line arrives on its stdin (the
 * test sends one after moving the clone), then "go". The clone then
 * connects to each TARGET (IP:PORT) of the command line and prints
 *   REACH IP:PORT ok|ERRNO
 * and exits 0. Usage: movednet TARGET...   (also prints "STATUS 1 s") */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "starling.h"
#include "netprobe.h"

static volatile int go;

/* Answers one "?" with "go" once the test said so, else "wait". */
static void *serve(void *conn) {
    int c = (int)(long)conn;
    char q[4];
    if (read(c, q, 2) > 0) (void)!write(c, go ? "go\n" : "wait\n", go ? 3 : 5);
    close(c);
    return NULL;
}

/* Ask the parent once: 1 for "go", 0 for "wait", -1 when it could not be asked. */
static int ask(const char *parent, int port) {
    int s = dial(parent, port);
    if (s < 0) return -1;
    char b[8] = {0};
    int rc = -1;
    if (write(s, "?\n", 2) == 2) {
        struct pollfd p = {s, POLLIN, 0};
        if (poll(&p, 1, WAIT_MS) > 0 && read(s, b, sizeof b - 1) > 0) rc = b[0] == 'g';
    }
    close(s);
    return rc;
}

int main(int argc, char **argv) {
    int parent_port = 0;
    int l = listen_at(&parent_port, 16, "parent listener");
    if (l < 0) return 2;
    sf_ticket_t *t = sf_request_ticket(1, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        const char *parent = sf_parent_host();
        reach_targets("BEFORE", argv + 1, argc - 1);
        printf("clone ready\n");
        fflush(stdout);
        int r, failed = 0;
        struct timespec pause = {0, 200 * 1000 * 1000};
        /* A failed ask (the clone was mid-move) is asked again, for WAIT_MS in a row at most. */
        while ((r = ask(parent, parent_port)) != 1) {
            failed = r < 0 ? failed + 1 : 0;
            if (failed > WAIT_MS / 200) { printf("REACH parent failed\n"); fflush(stdout); sf_exit(6); }
            nanosleep(&pause, NULL);
        }
        reach_targets(NULL, argv + 1, argc - 1);
        sf_exit(0);
    }
    pthread_t th;
    pthread_create(&th, NULL, accept_loop, (void *)(long)l);
    char line[16];
    if (fgets(line, sizeof line, stdin)) go = 1;
    return join_and_report(t, 1);
}
