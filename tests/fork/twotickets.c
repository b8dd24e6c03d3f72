/* Two tickets' clones on one host (issue 12, SnowFlock's network per
 * ticket): ticket T's one clone listens on PORT on its host and answers each
 * connection "T"; then ticket U's clones (one per host, spread) start, and the
 * one on T's host connects to T's listener at that host's address and at
 * 127.0.0.1. T's clone connects to its own listener both ways too. The parent
 * relays where T listens: each clone dials it and sends one line:
 *   "T IP"   T's clone says where it listens; answered "ok", and later
 *            "done" once U's clones ended (T's clone then exits)
 *   "U"      a U clone asks; answered T's "IP"
 * Every attempt prints one line (ERRNO of the failed connect or read):
 *   REACH T-self-host|T-self-lo|U-host|U-lo ok|ERRNO
 * and each clone "SELF T|U id IP". Usage:
 *   twotickets PORT U_CLONES   (also prints "STATUS T|U id s") */
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
#include <unistd.h>
#include "starling.h"
#include "netprobe.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t known = PTHREAD_COND_INITIALIZER;
static char t_ip[64];
static int t_conn = -1;

static void *serve(void *arg) {
    int c = (int)(long)arg;
    char line[128];
    if (read_line(c, line, sizeof line, WAIT_MS) < 0) { close(c); return NULL; }
    if (line[0] == 'T') {
        pthread_mutex_lock(&lock);
        snprintf(t_ip, sizeof t_ip, "%s", line + 2);
        t_conn = c; /* kept: "done" goes out on it */
        pthread_cond_broadcast(&known);
        pthread_mutex_unlock(&lock);
        (void)!write(c, "ok\n", 3);
        return NULL;
    }
    pthread_mutex_lock(&lock);
    while (!t_ip[0]) pthread_cond_wait(&known, &lock);
    char out[80];
    int n = snprintf(out, sizeof out, "%s\n", t_ip);
    pthread_mutex_unlock(&lock);
    (void)!write(c, out, (size_t)n);
    close(c);
    return NULL;
}

/* Reach T's listener at ip:port: "ok" only if it answered "T". */
static void reach(const char *what, const char *ip, int port) {
    char line[16];
    int s = dial(ip, port);
    int rc = s;
    if (s >= 0) {
        if (read_line(s, line, sizeof line, WAIT_MS) < 0 || strcmp(line, "T") != 0) rc = -EPROTO;
        close(s);
    }
    say(what, rc);
}

static void *answer_t(void *arg) {
    int l = (int)(long)arg;
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0) continue;
        (void)!write(c, "T\n", 2);
        close(c);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: twotickets PORT U_CLONES\n"); return 2; }
    int port = atoi(argv[1]);
    int parent_port = 0;
    int l = listen_at(&parent_port, 16, "parent listener");
    if (l < 0) return 2;
    const char *parent = NULL;

    sf_ticket_t *t = sf_request_ticket(1, false);
    if (!t) { fprintf(stderr, "ticket T: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone T: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        char me[64] = "?", line[128];
        parent = sf_parent_host();
        int p = dial(parent, parent_port);
        if (p < 0) { printf("REACH T-parent %d\n", -p); fflush(stdout); sf_exit(3); }
        self_ip(p, me, sizeof me);
        printf("SELF T %d %s\n", id, me);
        fflush(stdout);
        int s = listen_at(&port, 16, "T's listener");
        if (s < 0) sf_exit(4);
        pthread_t th;
        pthread_create(&th, NULL, answer_t, (void *)(long)s);
        reach("T-self-host", me, port);
        reach("T-self-lo", "127.0.0.1", port);
        int n = snprintf(line, sizeof line, "T %s\n", me);
        (void)!write(p, line, (size_t)n);
        /* "ok", then "done" when U's clones ended: no bound, the parent decides. */
        if (read_line(p, line, sizeof line, WAIT_MS) < 0) sf_exit(5);
        read_line(p, line, sizeof line, -1);
        sf_exit(0);
    }
    pthread_t th;
    pthread_create(&th, NULL, accept_loop, (void *)(long)l);
    pthread_mutex_lock(&lock);
    while (!t_ip[0]) pthread_cond_wait(&known, &lock);
    pthread_mutex_unlock(&lock);

    sf_ticket_t *u = sf_request_ticket(atoi(argv[2]), false);
    if (!u) { fprintf(stderr, "ticket U: %s\n", sf_last_error()); return 2; }
    int mu = sf_ticket_allocation(u);
    id = sf_clone(u);
    if (id < 0) { fprintf(stderr, "sf_clone U: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        char me[64] = "?", ip[64];
        parent = sf_parent_host();
        int p = dial(parent, parent_port);
        if (p < 0) { printf("REACH U-parent %d\n", -p); fflush(stdout); sf_exit(3); }
        self_ip(p, me, sizeof me);
        printf("SELF U %d %s\n", id, me);
        fflush(stdout);
        (void)!write(p, "U\n", 2);
        if (read_line(p, ip, sizeof ip, WAIT_MS) < 0) sf_exit(5);
        if (strcmp(ip, me) == 0) {
            reach("U-host", ip, port);
            reach("U-lo", "127.0.0.1", port);
        }
        sf_exit(0);
    }
    int rc_u = sf_join(u);
    pthread_mutex_lock(&lock);
    int c = t_conn;
    pthread_mutex_unlock(&lock);
    (void)!write(c, "done\n", 5);
    int rc_t = sf_join(t);
    printf("STATUS T 1 %d\n", sf_clone_status(t, 1));
    for (int i = 1; i <= mu; i++) printf("STATUS U %d %d\n", i, sf_clone_status(u, i));
    if (rc_u != 0 || rc_t != 0) fprintf(stderr, "join: %s\n", sf_last_error());
    return rc_u || rc_t ? 1 : 0;
}
