/* ClustalW-style pairwise alignment split across clones: clone ID scores
 * the pairs (i, j), i < j, with (i*len+j) % m == ID-1, and sends
 * "i j score" lines back over TCP to the parent (which listens on the
 * address sf_parent_host() names), which collates them and checks the full
 * matrix against a local computation.
 * Usage: pairscores CLONES NSEQ SEQLEN [hier]   (hier: hierarchical ticket) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <errno.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <poll.h>
#include "starling.h"

static int nseq, seqlen;
static char **seqs;

/* Needleman-Wunsch global alignment score (match 2, mismatch -1, gap -2). */
static int nw(const char *a, const char *b, int n) {
    int *prev = malloc((n + 1) * sizeof(int)), *cur = malloc((n + 1) * sizeof(int));
    for (int j = 0; j <= n; j++) prev[j] = -2 * j;
    for (int i = 1; i <= n; i++) {
        cur[0] = -2 * i;
        for (int j = 1; j <= n; j++) {
            int d = prev[j - 1] + (a[i - 1] == b[j - 1] ? 2 : -1);
            int u = prev[j] - 2, l = cur[j - 1] - 2;
            cur[j] = d > u ? (d > l ? d : l) : (u > l ? u : l);
        }
        int *t = prev; prev = cur; cur = t;
    }
    int s = prev[n];
    free(prev); free(cur);
    return s;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 4;
    nseq = argc > 2 ? atoi(argv[2]) : 24;
    seqlen = argc > 3 ? atoi(argv[3]) : 300;
    srand(42);
    seqs = malloc(nseq * sizeof(char *));
    for (int i = 0; i < nseq; i++) {
        seqs[i] = malloc(seqlen + 1);
        for (int k = 0; k < seqlen; k++) seqs[i][k] = "ACGT"[rand() % 4];
        seqs[i][seqlen] = 0;
    }
    sf_ticket_t *t = sf_request_ticket(n, argc > 4 && strcmp(argv[4], "hier") == 0);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    const char *host = sf_parent_host();
    if (!host) { fprintf(stderr, "no parent host\n"); return 2; }
    /* The parent listens before cloning: the port is in the clones' memory. */
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = { .sin_family = AF_INET };
    inet_pton(AF_INET, host, &sa.sin_addr);
    if (bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(ls, 64) != 0) { perror("listen"); return 2; }
    socklen_t sl = sizeof sa;
    getsockname(ls, (struct sockaddr *)&sa, &sl);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        /* The listening socket did not follow (sockets are closed in clones). */
        const char *env = getenv("STARLING_PARENT_HOST");
        if (!env || strcmp(env, host) != 0) { fprintf(stderr, "clone %d: STARLING_PARENT_HOST=%s\n", id, env ? env : "(unset)"); sf_exit(5); }
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(s, (struct sockaddr *)&sa, sizeof sa) != 0) { perror("clone connect"); sf_exit(6); }
        FILE *out = fdopen(s, "w");
        int count = 0;
        for (int i = 0; i < nseq; i++)
            for (int j = i + 1; j < nseq; j++)
                if ((i * seqlen + j) % m == id - 1) { fprintf(out, "%d %d %d\n", i, j, nw(seqs[i], seqs[j], seqlen)); count++; }
        fclose(out);
        printf("clone %d scored %d pairs\n", id, count);
        sf_exit(0);
    }
    int *score = malloc(nseq * nseq * sizeof(int));
    for (int k = 0; k < nseq * nseq; k++) score[k] = -999999;
    int pairs = nseq * (nseq - 1) / 2, got = 0, done = 0;
    while (done < m) {
        struct pollfd p = { .fd = ls, .events = POLLIN };
        if (poll(&p, 1, 60000) <= 0) { fprintf(stderr, "timeout waiting for clones (%d/%d connected)\n", done, m); break; }
        int c = accept(ls, NULL, NULL);
        if (c < 0) continue;
        FILE *in = fdopen(c, "r");
        int i, j, s;
        while (fscanf(in, "%d %d %d", &i, &j, &s) == 3)
            if (i >= 0 && i < nseq && j >= 0 && j < nseq) { score[i * nseq + j] = s; got++; }
        fclose(in);
        done++;
    }
    if (sf_join(t) != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    int wrong = 0;
    for (int i = 0; i < nseq; i++)
        for (int j = i + 1; j < nseq; j++)
            if (score[i * nseq + j] != nw(seqs[i], seqs[j], seqlen)) wrong++;
    for (int i = 1; i <= m; i++)
        if (sf_clone_status(t, i) != 0) { fprintf(stderr, "clone %d status %d\n", i, sf_clone_status(t, i)); wrong++; }
    printf("clones=%d pairs=%d received=%d wrong=%d parent_host=%s\n", m, pairs, got, wrong, host);
    return wrong || got != pairs ? 1 : 0;
}
