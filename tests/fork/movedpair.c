/* Two clones of one ticket, the first moved by `starling migrate` (issue 12:
 * the ticket's other clones must let a moved clone in, wherever it went).
 * Clone 1 (the one moved: a task holding a socket cannot move, so it holds
 * none between its asks) prints
 *   SELF 1 IP
 * and clone 2 listens on a port of its own and prints
 *   LISTEN 2 IP:PORT
 * (IP: the clone's host's address as its parent sees it). Each then asks its
 * parent, once per 200 ms over a new connection, "?": the parent answers
 * "wait" until a line arrives on its stdin, then "go" followed by that line's
 * words (targets, IP:PORT). Each clone connects to every target but clone 2's
 * own listener and prints
 *   REACH id IP:PORT ok|ERRNO
 * Clone 1 then tells its parent it is done ("d"); clone 2 keeps its listener
 * open until it is ("e" answered "end"). Usage: movedpair   (then prints
 * "STATUS id s" for both) */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "starling.h"
#include "netprobe.h"

#define CLONES 2

static volatile int go, done;
static char targets[512];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* "?": "go TARGETS" once the test said so, else "wait"; "d": clone 1 is done; "e": "end" once it is. */
static void *serve(void *conn) {
    int c = (int)(long)conn;
    char q[8], a[600];
    if (read_line(c, q, sizeof q, WAIT_MS) > 0) {
        pthread_mutex_lock(&lock);
        if (q[0] == '?') snprintf(a, sizeof a, go ? "go %s\n" : "wait\n", targets);
        else if (q[0] == 'd') { done++; snprintf(a, sizeof a, "ok\n"); }
        else snprintf(a, sizeof a, done ? "end\n" : "wait\n");
        pthread_mutex_unlock(&lock);
        (void)!write(c, a, strlen(a));
    }
    close(c);
    return NULL;
}

/* Send q to the parent and read its one-line answer into a: its length, or -1 (it could not be asked). */
static int ask(const char *parent, int port, const char *q, char *a, size_t n) {
    int s = dial(parent, port);
    if (s < 0) return -1;
    int rc = -1;
    if (write(s, q, strlen(q)) == (ssize_t)strlen(q)) rc = read_line(s, a, n, WAIT_MS);
    close(s);
    return rc;
}

/* Ask q until the answer starts with want (a failed ask, the clone mid-move, is asked again for
 * WAIT_MS in a row at most): 0, or -1. */
static int ask_until(const char *parent, int port, const char *q, const char *want, char *a, size_t n) {
    struct timespec pause = {0, 200 * 1000 * 1000};
    int failed = 0, r;
    while ((r = ask(parent, port, q, a, n)) < 0 || strncmp(a, want, strlen(want)) != 0) {
        failed = r < 0 ? failed + 1 : 0;
        if (failed > WAIT_MS / 200) return -1;
        nanosleep(&pause, NULL);
    }
    return 0;
}

static int clone_main(int id, int parent_port) {
    const char *parent = sf_parent_host();
    int port = 0, l = -1;
    if (id == 2 && (l = listen_at(&port, 16, "clone listener")) < 0) return 2;
    int s = dial(parent, parent_port);
    char self[64] = "", mine[96] = "", a[600];
    if (s < 0 || self_ip(s, self, sizeof self) < 0) { printf("REACH %d parent failed\n", id); return 6; }
    close(s);
    if (l >= 0) {
        snprintf(mine, sizeof mine, "%s:%d", self, port);
        printf("LISTEN %d %s\n", id, mine);
    } else printf("SELF %d %s\n", id, self);
    fflush(stdout);
    if (ask_until(parent, parent_port, "?\n", "go", a, sizeof a) < 0) { printf("REACH %d parent failed\n", id); return 6; }
    char label[16];
    snprintf(label, sizeof label, "%d", id);
    for (char *save = NULL, *t = strtok_r(a + 2, " ", &save); t; t = strtok_r(NULL, " ", &save)) {
        if (strcmp(t, mine) != 0) reach_targets(label, &t, 1);
    }
    int rc = l < 0 ? ask(parent, parent_port, "d\n", a, sizeof a) : ask_until(parent, parent_port, "e\n", "end", a, sizeof a);
    if (rc < 0) { printf("REACH %d parent failed\n", id); return 6; }
    if (l >= 0) close(l);
    return 0;
}

int main(void) {
    int parent_port = 0;
    int l = listen_at(&parent_port, 16, "parent listener");
    if (l < 0) return 2;
    sf_ticket_t *t = sf_request_ticket(CLONES, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        int rc = clone_main(id, parent_port);
        fflush(stdout);
        sf_exit(rc);
    }
    pthread_t th;
    pthread_create(&th, NULL, accept_loop, (void *)(long)l);
    char line[sizeof targets];
    if (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        pthread_mutex_lock(&lock);
        snprintf(targets, sizeof targets, "%s", line);
        go = 1;
        pthread_mutex_unlock(&lock);
    }
    return join_and_report(t, CLONES);
}
