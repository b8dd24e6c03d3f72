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
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in any = {.sin_family = AF_INET};
    if (l < 0 || bind(l, (struct sockaddr *)&any, sizeof any) < 0 || listen(l, 64) < 0) { perror("parent listener"); return 2; }
    socklen_t len = sizeof any;
    getsockname(l, (struct sockaddr *)&any, &len);
    int parent_port = ntohs(any.sin_port);
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
        struct sockaddr_in a;
        socklen_t alen = sizeof a;
        if (getsockname(p, (struct sockaddr *)&a, &alen) == 0) inet_ntop(AF_INET, &a.sin_addr, me, sizeof me);
        close(p);
        printf("SELF %d %s\n", id, me);
        for (int i = 2; i < argc; i++) {
            char target[64];
            snprintf(target, sizeof target, "%s", argv[i]);
            char *colon = strchr(target, ':');
            if (!colon) continue;
            *colon = 0;
            int s = dial(target, atoi(colon + 1));
            if (s >= 0) printf("REACH %d %s ok\n", id, argv[i]);
            else printf("REACH %d %s %d\n", id, argv[i], -s);
            if (s >= 0) close(s);
        }
        fflush(stdout);
        sf_exit(0);
    }
    pthread_t th;
    pthread_create(&th, NULL, accept_loop, (void *)(long)l);
    int rc = sf_join(t);
    for (int i = 1; i <= m; i++) printf("STATUS %d %d\n", i, sf_clone_status(t, i));
    if (rc != 0) fprintf(stderr, "join: %s\n", sf_last_error());
    return rc ? 1 : 0;
}
