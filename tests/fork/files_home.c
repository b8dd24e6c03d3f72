/* Each clone writes a file into DIR (the client's directory): the files come
 * home when the clones exit, visible once sf_join returns.
 * Usage: files_home CLONES DIR */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "starling.h"

int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    const char *dir = argv[2];
    sf_ticket_t *t = sf_request_ticket(n, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        char path[4096];
        snprintf(path, sizeof path, "%s/result-%d.txt", dir, id);
        FILE *f = fopen(path, "w");
        if (!f) { perror(path); sf_exit(1); }
        fprintf(f, "clone %d of %d\n", id, m);
        fclose(f);
        sf_exit(0);
    }
    if (sf_join(t) != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    int bad = 0;
    for (int i = 1; i <= m; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/result-%d.txt", dir, i);
        if (access(path, R_OK) != 0) { fprintf(stderr, "missing %s\n", path); bad++; }
        if (sf_clone_status(t, i) != 0) bad++;
    }
    printf("clones=%d missing_or_failed=%d\n", m, bad);
    return bad ? 1 : 0;
}
