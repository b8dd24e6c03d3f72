/* A clone that holds a connection to its parent until the test lets it go,
 * then asks its parent over a fresh connection every 200 ms (as movednet.c)
 * until told to finish: a test moves it while it holds the connection (the
 * move is refused, naming the socket) and again after (the move must not
 * wait for the refused one: the clone's memory became its own at the first).
 * The clone prints "clone holding" once its connection is up, "clone
 * released" when the parent closed it, and exits 0 after a "go". The parent
 * reads its stdin: the first line closes the held connection, the second
 * makes it answer "go"; it prints "STATUS 1 s" after the join.
 * Usage: heldnet */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include "starling.h"
#include "netprobe.h"

static volatile int go;
static int held = -1;
static pthread_mutex_t held_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t held_set = PTHREAD_COND_INITIALIZER;

/* "hold": keep the connection (the parent closes it when told); "?": "go" or "wait". */
static void *serve(void *conn) {
    int c = (int)(long)conn;
    char q[8];
    if (read_line(c, q, sizeof q, WAIT_MS) < 0) { close(c); return NULL; }
    if (strcmp(q, "hold") == 0) {
        pthread_mutex_lock(&held_lock);
        held = c;
        pthread_cond_broadcast(&held_set);
        pthread_mutex_unlock(&held_lock);
        return NULL;
    }
    (void)!write(c, go ? "go\n" : "wait\n", go ? 3 : 5);
    close(c);
    return NULL;
}

/* Ask the parent once: 1 for "go", 0 for "wait", -1 when it could not be asked. */
static int ask(const char *parent, int port) {
    int s = dial(parent, port);
    if (s < 0) return -1;
    char b[8];
    int rc = -1;
    if (write(s, "?\n", 2) == 2 && read_line(s, b, sizeof b, WAIT_MS) >= 0) rc = strcmp(b, "go") == 0;
    close(s);
    return rc;
}

int main(void) {
    int parent_port = 0;
    int l = listen_at(&parent_port, 16, "parent listener");
    if (l < 0) return 2;
    sf_ticket_t *t = sf_request_ticket(1, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        const char *parent = sf_parent_host();
        int s = dial(parent, parent_port);
        if (s < 0 || write(s, "hold\n", 5) != 5) { printf("clone could not connect: %d\n", s); fflush(stdout); sf_exit(5); }
        printf("clone holding\n");
        fflush(stdout);
        char b[8];
        /* Nothing comes on it: the parent's close ends the wait (EOF). */
        ssize_t n;
        while ((n = read(s, b, sizeof b)) > 0 || (n < 0 && errno == EINTR)) {}
        close(s);
        printf("clone released\n");
        fflush(stdout);
        int r, failed = 0;
        struct timespec pause = {0, 200 * 1000 * 1000};
        while ((r = ask(parent, parent_port)) != 1) {
            failed = r < 0 ? failed + 1 : 0;
            if (failed > WAIT_MS / 200) { printf("clone could not ask\n"); fflush(stdout); sf_exit(6); }
            nanosleep(&pause, NULL);
        }
        sf_exit(0);
    }
    pthread_t th;
    pthread_create(&th, NULL, accept_loop, (void *)(long)l);
    char line[16];
    if (fgets(line, sizeof line, stdin)) {
        pthread_mutex_lock(&held_lock);
        while (held < 0) pthread_cond_wait(&held_set, &held_lock);
        shutdown(held, SHUT_RDWR);
        close(held);
        pthread_mutex_unlock(&held_lock);
    }
    if (fgets(line, sizeof line, stdin)) go = 1;
    return join_and_report(t, 1);
}
