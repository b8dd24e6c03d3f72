/* sf_kill ends every clone at once; statuses report the signal. Misuse is
 * reported through sf_last_error. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "starling.h"

int main(void) {
    if (sf_request_ticket(0, false) != NULL || strlen(sf_last_error()) == 0) return 20;
    if (sf_clone(NULL) != -1) return 21;
    sf_ticket_t *t = sf_request_ticket(2, false);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 22; }
    if (id > 0) { for (;;) pause(); }
    if (sf_clone(t) != -1) return 23;              /* a ticket clones once */
    usleep(200 * 1000);
    if (sf_kill(t) != 0) { fprintf(stderr, "sf_kill: %s\n", sf_last_error()); return 24; }
    for (int c = 1; c <= 2; c++)
        if (sf_clone_status(t, c) != 128 + 9) { fprintf(stderr, "clone %d status %d\n", c, sf_clone_status(t, c)); return 25; }
    sf_release_ticket(t);
    printf("killed\n");
    return 0;
}
