/* A ticket on a mixed cluster (issue 12): some hosts enforce a ticket's own
 * network, some cannot (tests/test_ticket_net.py). Asks for N spread clones
 * and prints what sf_ticket_unisolated says of the grant:
 *   UNISOLATED COUNT k
 *   UNISOLATED i NAME<TAB>WHY       one per host, as the API writes it
 *   API null=R range=S cut=S        R: the count for a NULL ticket; range:
 *                                   the buffer after asking for host k (out
 *                                   of range: left as "untouched"); cut: host
 *                                   0 written into 3 bytes
 * Each clone dials the parent (its address as the parent sees it is its
 * host's) and then each TARGET (IP:PORT), and prints
 *   SELF id IP
 *   REACH id IP:PORT ok|ERRNO
 * The parent prints "STATUS id s" per clone after sf_join.
 * Usage: mixednet N [TARGET...] */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include "starling.h"
#include "netprobe.h"

/* The parent answers each clone's connection with one line and closes it. */
static void *serve(void *conn) {
    int c = (int)(long)conn;
    (void)!write(c, "P\n", 2);
    close(c);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: mixednet N [IP:PORT...]\n"); return 2; }
    int parent_port = 0;
    int l = listen_at(&parent_port, 64, "parent listener");
    if (l < 0) return 2;
    sf_ticket_t *t = sf_request_ticket(atoi(argv[1]), false);
    if (!t) { printf("TICKET %s\n", sf_last_error()); return 2; }
    int k = sf_ticket_unisolated(t, 0, NULL, 0);
    printf("UNISOLATED COUNT %d\n", k);
    for (int i = 0; i < k; i++) {
        char entry[8192];
        sf_ticket_unisolated(t, i, entry, sizeof entry);
        printf("UNISOLATED %d %s\n", i, entry);
    }
    char range[16] = "untouched", cut[3] = "";
    sf_ticket_unisolated(t, k, range, sizeof range);
    sf_ticket_unisolated(t, 0, cut, sizeof cut);
    printf("API null=%d range=%s cut=%s\n", sf_ticket_unisolated(NULL, 0, NULL, 0), range, cut);
    fflush(stdout);
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        char me[64] = "?", line[16];
        int p = dial(sf_parent_host(), parent_port);
        if (p < 0 || read_line(p, line, sizeof line, WAIT_MS) < 0) sf_exit(3);
        self_ip(p, me, sizeof me);
        close(p);
        printf("SELF %d %s\n", id, me);
        char label[16];
        snprintf(label, sizeof label, "%d", id);
        reach_targets(label, argv + 2, argc - 2);
        sf_exit(0);
    }
    pthread_t th;
    pthread_create(&th, NULL, accept_loop, (void *)(long)l);
    return join_and_report(t, m);
}
