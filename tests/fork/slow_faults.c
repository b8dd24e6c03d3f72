/* A clone that keeps page-faulting until told to stop (tests/test_dashboard.py: the live fault
 * count of a ticket whose clone still runs). The parent writes 256 MiB and takes a one-clone
 * ticket; the clone connects to PORT at sf_parent_host() (the test listens there), says "1\n",
 * then reads one page of that memory it has not read yet every millisecond — page faults its
 * host's handler serves from the parent (a fault may bring a few pages at once) — until a byte
 * arrives on the connection, and exits 0 (1 if it read a wrong byte). The parent joins and
 * prints the clone's status and fault count.
 * Usage: slow_faults PORT */
#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#include "starling.h"

#define HEAP (256UL << 20)

static int dial(const char *host, const char *port) {
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai;
    if (getaddrinfo(host, port, &hints, &ai) != 0) return -1;
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) { close(fd); fd = -1; }
    freeaddrinfo(ai);
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 2) { fprintf(stderr, "usage: slow_faults PORT\n"); return 2; }
    unsigned char *heap = mmap(NULL, HEAP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (heap == MAP_FAILED) { perror("mmap"); return 2; }
    for (size_t i = 0; i < HEAP; i += 4096) heap[i] = (unsigned char)(i >> 12) | 1;
    sf_ticket_t *t = sf_request_ticket(1, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        const char *parent = sf_parent_host();
        int fd = dial(parent ? parent : "127.0.0.1", argv[1]);
        if (fd < 0 || write(fd, "1\n", 2) != 2) { perror("connect to the test"); fflush(stderr); sf_exit(3); }
        unsigned long bad = 0;
        size_t off = 0;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        /* The poll's timeout paces the reads: one fresh page per millisecond. Past the end the
         * pages are all here already, and the clone just waits. */
        while (poll(&p, 1, 1) == 0) {
            if (off < HEAP) {
                if (heap[off] != ((unsigned char)(off >> 12) | 1)) bad++;
                off += 4096;
            }
        }
        sf_exit(bad ? 1 : 0);
    }
    if (sf_join(t) != 0) { fprintf(stderr, "join: %s\n", sf_last_error()); return 3; }
    printf("clone status=%d faults=%lld\n", sf_clone_status(t, 1), sf_clone_stat(t, 1, 0));
    return sf_clone_status(t, 1) == 0 ? 0 : 1;
}
