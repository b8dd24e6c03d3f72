/* Memory with a known pattern, for a sniffer on the cluster's network: 4 MiB
 * where every 64-byte unit is byte j = (j * 37 + 11) ^ 0x5a (computed, so the
 * binary does not contain it).
 *   pattern fork N   clone N times (spread); each clone checks every byte of
 *                    the pattern it faulted in, exits 0 if all match; the
 *                    parent prints "clones ok" when every clone did.
 *   pattern hold     prints "ready", waits for a line on stdin (a move in
 *                    between), checks the pattern, prints "held ok". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "starling.h"

#define SIZE (4 << 20)

static unsigned char unit(int j) { return (unsigned char)((j * 37 + 11) ^ 0x5a); }

static int intact(const unsigned char *buf) {
    for (long i = 0; i < SIZE; i++)
        if (buf[i] != unit((int)(i % 64))) return 0;
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    unsigned char *buf = malloc(SIZE);
    if (!buf) return 3;
    for (long i = 0; i < SIZE; i++) buf[i] = unit((int)(i % 64));
    if (strcmp(argv[1], "fork") == 0 && argc == 3) {
        int n = atoi(argv[2]);
        sf_ticket_t *t = sf_request_ticket(n, 0);
        if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
        int id = sf_clone(t);
        if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
        if (id > 0) sf_exit(intact(buf) ? 0 : 1);
        if (sf_join(t) != 0) { fprintf(stderr, "a clone saw another pattern: %s\n", sf_last_error()); return 4; }
        printf("clones ok\n");
        return 0;
    }
    if (strcmp(argv[1], "hold") == 0) {
        printf("ready\n");
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin)) return 5;
        printf(intact(buf) ? "held ok\n" : "held CHANGED\n");
        return 0;
    }
    return 2;
}
