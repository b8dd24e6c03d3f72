/* What a ticket's clones can reach (issue 12, SnowFlock's network per
 * ticket). Two spread clones; the parent listens on an ephemeral port and
 * answers each connection's first line:
 *   "1 IP PORT"  clone 1 says where it listens (IP: its host's address as
 *                seen on its connection to the parent); answered "P"
 *   "2"          clone 2 asks where clone 1 listens; answered "IP PORT"
 * Clone 1 accepts one connection on PORT and answers it "C1". Clone 2 then
 * connects to clone 1 and to each TARGET (IP:PORT: TCP; udp:IP:PORT: one
 * datagram, "ok" when one comes back) of the command line, and prints one
 * line per attempt:
 *   REACH parent|clone1|IP:PORT|udp:IP:PORT ok|ERRNO
 * Each clone prints "SELF id IP" (its host's address). Usage:
 *   ticketnet CLONE1_PORT [TARGET...]   (also prints "STATUS id s") */
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
static char clone1[64];

static void *serve(void *arg) {
    int c = (int)(long)arg;
    char line[128];
    if (read_line(c, line, sizeof line, WAIT_MS) >= 0) {
        if (line[0] == '1') {
            pthread_mutex_lock(&lock);
            snprintf(clone1, sizeof clone1, "%s", line + 2);
            pthread_cond_broadcast(&known);
            pthread_mutex_unlock(&lock);
            (void)!write(c, "P\n", 2);
        } else {
            pthread_mutex_lock(&lock);
            while (!clone1[0]) pthread_cond_wait(&known, &lock);
            char out[80];
            int n = snprintf(out, sizeof out, "%s\n", clone1);
            pthread_mutex_unlock(&lock);
            (void)!write(c, out, (size_t)n);
        }
    }
    close(c);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: ticketnet CLONE1_PORT [IP:PORT...]\n"); return 2; }
    int port1 = atoi(argv[1]);
    int parent_port = 0;
    int l = listen_at(&parent_port, 16, "parent listener");
    if (l < 0) return 2;
    sf_ticket_t *t = sf_request_ticket(2, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        const char *parent = sf_parent_host();
        char me[64] = "?", line[128];
        int p = dial(parent, parent_port);
        say("parent", p);
        if (p < 0) sf_exit(3);
        self_ip(p, me, sizeof me);
        printf("SELF %d %s\n", id, me);
        fflush(stdout);
        if (id == 1) {
            int s = listen_at(&port1, 4, "clone 1 listener");
            if (s < 0) sf_exit(4);
            int n = snprintf(line, sizeof line, "1 %s %d\n", me, port1);
            (void)!write(p, line, (size_t)n);
            read_line(p, line, sizeof line, WAIT_MS);
            struct pollfd pf = {s, POLLIN, 0};
            if (poll(&pf, 1, WAIT_MS) > 0) {
                int c = accept(s, NULL, NULL);
                if (c >= 0) { (void)!write(c, "C1\n", 3); close(c); }
            }
            sf_exit(0);
        }
        (void)!write(p, "2\n", 2);
        char ip[64];
        int port = 0;
        if (read_line(p, line, sizeof line, WAIT_MS) < 0 || sscanf(line, "%63s %d", ip, &port) != 2) sf_exit(5);
        int c = dial(ip, port);
        if (c >= 0 && (read_line(c, line, sizeof line, WAIT_MS) < 0 || strcmp(line, "C1") != 0)) c = -EPROTO;
        say("clone1", c);
        reach_targets(NULL, argv + 2, argc - 2);
        sf_exit(0);
    }
    pthread_t th;
    pthread_create(&th, NULL, accept_loop, (void *)(long)l);
    return join_and_report(t, m);
}
