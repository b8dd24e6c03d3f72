/* What the ticket-network probes (ticketnet.c, twotickets.c, movednet.c)
 * share: bounded reads and connects, and a listener that serves each
 * connection on a thread of its own. Waits are bounded (WAIT_MS) so a peer
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
#include <sys/socket.h>
#include <unistd.h>

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
