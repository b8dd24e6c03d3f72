/* A mapping of a deleted file cannot be cloned: sf_clone must fail with a
 * message naming it, and no clone may be launched. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/mman.h>
#include "starling.h"

int main(void) {
    char path[] = "/var/tmp/sf-unclonable-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0 || ftruncate(fd, 4096) != 0) { perror("mkstemp"); return 2; }
    void *p = mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); return 2; }
    unlink(path);
    sf_ticket_t *t = sf_request_ticket(2, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id > 0) { printf("CLONE RAN %d\n", id); sf_exit(0); }
    if (id == 0) { sf_join(t); printf("UNEXPECTED: sf_clone succeeded\n"); return 1; }
    printf("REFUSED: %s\n", sf_last_error());
    printf("path=%s\n", path);
    return strstr(sf_last_error(), path) ? 0 : 1;
}
