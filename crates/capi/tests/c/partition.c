/* SnowFlock-style use: clones split a computation on warm state, return
 * results through files, the parent collates after sf_join. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "starling.h"

int main(int argc, char **argv) {
    if (argc != 2) return 10;
    const char *dir = argv[1];
    int n = 1 << 20;
    long *data = malloc(n * sizeof *data);          /* warm, parsed input */
    for (int i = 0; i < n; i++) data[i] = i % 1000;
    sf_ticket_t *t = sf_request_ticket(3, false);
    if (!t) return 11;
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 12; }
    if (id > 0) {
        long sum = 0;
        for (int i = id - 1; i < n; i += m) sum += data[i];
        char path[4096];
        snprintf(path, sizeof path, "%s/part-%d", dir, id);
        FILE *f = fopen(path, "w");
        if (!f) sf_exit(20);
        fprintf(f, "%ld\n", sum);
        fclose(f);
        sf_exit(0);
    }
    if (sf_join(t) != 0) { fprintf(stderr, "sf_join: %s\n", sf_last_error()); return 13; }
    long total = 0, expect = 0;
    for (int i = 0; i < n; i++) expect += data[i];
    for (int c = 1; c <= m; c++) {
        if (sf_clone_status(t, c) != 0) { fprintf(stderr, "clone %d status %d\n", c, sf_clone_status(t, c)); return 14; }
        char path[4096];
        snprintf(path, sizeof path, "%s/part-%d", dir, c);
        FILE *f = fopen(path, "r");
        long s;
        if (!f || fscanf(f, "%ld", &s) != 1) return 15;
        fclose(f);
        total += s;
    }
    sf_release_ticket(t);
    printf("total=%ld expect=%ld clones=%d\n", total, expect, m);
    return total == expect ? 0 : 16;
}
