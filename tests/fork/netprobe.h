/* What the ticket-network probes (ticketnet.c, twotickets.c, movednet.c,
 * mixednet.c) share: bounded reads and connects, listeners, a listener that
 * serves each connection on a thread of its own, the "REACH what ok|ERRNO"
 * lines, and the parent's join-and-report ending. Waits are bounded (WAIT_MS) so a peer
 * that should answer and does not fails the probe instead of hanging it; a
 * refused connection fails at once. */
#ifndef SF_NETPROBE_H
#define SF_NETPROBE_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "starling.h"

#define WAIT_MS 120000

/* One line into buf (no newline); wait_ms bounds each wait for a byte (-1: none).
 * Its length, or -1 (timeout, EOF, error). */
static inline int read_line(int fd, char *buf, size_t n, int wait_ms) {
    size_t got = 0;
    while (got + 1 < n) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, wait_ms) <= 0) return -1;
        ssize_t r = read(fd, buf + got, 1);
        if (r <= 0) return -1;
        if (buf[got] == '\n') break;
        got++;
    }
    buf[got] = 0;
    return (int)got;
}

/* Connect to ip:port; the socket, or -errno. */
static inline int dial(const char *ip, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) return -EINVAL;
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) return -errno;
    int fl = fcntl(s, F_GETFL);
    fcntl(s, F_SETFL, fl | O_NONBLOCK);
    if (connect(s, (struct sockaddr *)&a, sizeof a) < 0 && errno != EINPROGRESS) { int e = errno; close(s); return -e; }
    struct pollfd p = {s, POLLOUT, 0};
    if (poll(&p, 1, WAIT_MS) <= 0) { close(s); return -ETIMEDOUT; }
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err) { close(s); return -err; }
    fcntl(s, F_SETFL, fl);
    return s;
}

/* A TCP listener on port (0: an ephemeral one, written back to *port); -1 after perror(what). */
static inline int listen_at(int *port, int backlog, const char *what) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)*port)};
    socklen_t len = sizeof a;
    if (l < 0 || setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
        bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, backlog) < 0 ||
        getsockname(l, (struct sockaddr *)&a, &len) < 0) {
        perror(what);
        if (l >= 0) close(l);
        return -1;
    }
    *port = ntohs(a.sin_port);
    return l;
}

/* This end's address of connected socket s (a clone's host address as its peer sees it): 0 or -1. */
static inline int self_ip(int s, char *out, size_t n) {
    struct sockaddr_in a;
    socklen_t len = sizeof a;
    if (getsockname(s, (struct sockaddr *)&a, &len) < 0) return -1;
    inet_ntop(AF_INET, &a.sin_addr, out, (socklen_t)n);
    return 0;
}

/* One datagram to ip:port and one back: 0, or -errno. */
static inline int echo_udp(const char *ip, int port) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) return -EINVAL;
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0) return -errno;
    int rc = 0;
    char b[8];
    if (connect(s, (struct sockaddr *)&a, sizeof a) < 0 || send(s, "x", 1, 0) < 0) rc = -errno;
    else {
        struct pollfd p = {s, POLLIN, 0};
        int n = poll(&p, 1, WAIT_MS);
        if (n <= 0) rc = -ETIMEDOUT;
        else if (recv(s, b, sizeof b, 0) < 0) rc = -errno;
    }
    close(s);
    return rc;
}

/* "REACH what ok" for rc >= 0, else "REACH what ERRNO" (rc = -errno). */
static inline void say(const char *what, int rc) {
    if (rc >= 0) printf("REACH %s ok\n", what);
    else printf("REACH %s %d\n", what, -rc);
    fflush(stdout);
}

/* Try each target (IP:PORT: a TCP connect; udp:IP:PORT: one datagram that must come back) and say how
 * it went, each line's "what" being "LABEL TARGET" (or TARGET alone when label is NULL). */
static inline void reach_targets(const char *label, char **targets, int n) {
    for (int i = 0; i < n; i++) {
        char target[64], what[96];
        int udp = strncmp(targets[i], "udp:", 4) == 0;
        snprintf(target, sizeof target, "%s", targets[i] + (udp ? 4 : 0));
        char *colon = strchr(target, ':');
        if (!colon) continue;
        *colon = 0;
        int s = udp ? echo_udp(target, atoi(colon + 1)) : dial(target, atoi(colon + 1));
        if (label) snprintf(what, sizeof what, "%s %s", label, targets[i]);
        else snprintf(what, sizeof what, "%s", targets[i]);
        say(what, s);
        if (!udp && s >= 0) close(s);
    }
}

/* The parent's ending: join ticket t's m clones, print "STATUS id s" for each, and the exit code
 * (0 when the join succeeded). */
static inline int join_and_report(sf_ticket_t *t, int m) {
    int rc = sf_join(t);
    for (int i = 1; i <= m; i++) printf("STATUS %d %d\n", i, sf_clone_status(t, i));
    if (rc != 0) fprintf(stderr, "join: %s\n", sf_last_error());
    return rc ? 1 : 0;
}

/* Each program that includes this serves one accepted connection (given as
 * (void *)(long)fd) in serve(), which closes it. */
static void *serve(void *conn);

/* Serve every connection to a listener (given as (void *)(long)fd) on a thread of its own. */
static void *accept_loop(void *listener) {
    int l = (int)(long)listener;
    for (;;) {
        int c = accept(l, NULL, NULL);
        if (c < 0) continue;
        pthread_t t;
        pthread_create(&t, NULL, serve, (void *)(long)c);
        pthread_detach(t);
    }
    return NULL;
}
#endif
