/* Hierarchical clones on one host share one file view, as processes forked
 * on one machine share its files: each clone writes DIR/from-ID, then
 * waits (bounded: 5 minutes) until it sees the files of all K clones,
 * checks their contents and writes DIR/seen-ID. Clones that did not share
 * a view would never see each other's files and exit 1. After sf_join the
 * parent finds every file at home.
 * Usage: shared_view K DIR   (prints "CLONE id host" and "GRANTED m") */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/utsname.h>
#include "starling.h"

static int read_int(const char *path, int *v) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int ok = fscanf(f, "%d", v) == 1;
    fclose(f);
    return ok;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: shared_view K DIR\n"); return 2; }
    int k = atoi(argv[1]);
    const char *dir = argv[2];
    setvbuf(stdout, NULL, _IOLBF, 0);
    sf_ticket_t *t = sf_request_ticket(k, true);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    printf("GRANTED %d\n", m);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        struct utsname u;
        uname(&u);
        printf("CLONE %d %s\n", id, u.nodename);
        char path[4096];
        snprintf(path, sizeof path, "%s/from-%d", dir, id);
        FILE *f = fopen(path, "w");
        if (!f) { perror(path); sf_exit(3); }
        fprintf(f, "%d\n", id * 1000 + 7);
        fclose(f);
        for (int other = 1; other <= m; other++) {
            snprintf(path, sizeof path, "%s/from-%d", dir, other);
            int v = 0;
            for (int tries = 0; !read_int(path, &v); tries++) {
                if (tries > 30000) { fprintf(stderr, "clone %d never saw %s\n", id, path); sf_exit(1); }
                nanosleep(&(struct timespec){ .tv_nsec = 10 * 1000 * 1000 }, NULL);
            }
            if (v != other * 1000 + 7) { fprintf(stderr, "clone %d: %s holds %d\n", id, path, v); sf_exit(4); }
        }
        snprintf(path, sizeof path, "%s/seen-%d", dir, id);
        f = fopen(path, "w");
        if (!f) sf_exit(3);
        fprintf(f, "%d\n", m);
        fclose(f);
        sf_exit(0);
    }
    int rc = sf_join(t);
    for (int i = 1; i <= m; i++) printf("STATUS %d %d\n", i, sf_clone_status(t, i));
    if (rc != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    return 0;
}
