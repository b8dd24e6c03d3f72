/* sf_kill ends every clone at once; statuses report the signal. Misuse is
 * reported through sf_last_error. The clones (local backend: this machine)
 * each create a file once running; the parent kills once both exist. */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "starling.h"

static void marker(char *buf, size_t len, int parent, int id) {
    snprintf(buf, len, "/tmp/sf-capi-kill-%d-%d", parent, id);
}

int main(void) {
    if (sf_request_ticket(0, false) != NULL || strlen(sf_last_error()) == 0) return 20;
    if (sf_clone(NULL) != -1) return 21;
    int parent = getpid();
    sf_ticket_t *t = sf_request_ticket(2, false);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 22; }
    if (id > 0) {
        char path[128];
        marker(path, sizeof path, parent, id);
        FILE *f = fopen(path, "w");
        if (f) fclose(f);
        for (;;) pause();
    }
    if (sf_clone(t) != -1) return 23;              /* a ticket clones once */
    /* Both clones are running once their files exist (bounded: 5 minutes). */
    for (int c = 1; c <= 2; c++) {
        char path[128];
        marker(path, sizeof path, parent, c);
        for (int i = 0; access(path, F_OK) != 0; i++) {
            if (i > 30000) { fprintf(stderr, "clone %d never started\n", c); return 26; }
            nanosleep(&(struct timespec){ .tv_nsec = 10 * 1000 * 1000 }, NULL);
        }
        unlink(path);
    }
    if (sf_kill(t) != 0) { fprintf(stderr, "sf_kill: %s\n", sf_last_error()); return 24; }
    for (int c = 1; c <= 2; c++)
        if (sf_clone_status(t, c) != 128 + 9) { fprintf(stderr, "clone %d status %d\n", c, sf_clone_status(t, c)); return 25; }
    sf_release_ticket(t);
    printf("killed\n");
    return 0;
}
