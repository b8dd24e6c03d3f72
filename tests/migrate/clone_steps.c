/* A remote-fork clone that a test moves while it works. The parent fills
 * 16 MiB before sf_clone; the clone prints "clone ready", then per step
 * prints "clone step I <sum>" where sum = (I + 1) * sum of data[I*1000 ..
 * I*1000 + 999] mod 2^64 and data[j] = j * 2654435761 + 12345 (mod 2^64),
 * each step paced by ~20 ms of CPU (pacing only: the output depends on the
 * arguments alone). The parent prints "join RC" after sf_join and exits 0
 * only if every clone exited 0.
 * usage: clone_steps STEPS */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "starling.h"

#define WORDS (2u << 20)
static uint64_t data[WORDS];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    for (uint64_t j = 0; j < WORDS; j++) data[j] = j * 2654435761ULL + 12345;
    sf_ticket_t *t = sf_request_ticket(1, false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        printf("clone ready\n");
        fflush(stdout);
        for (int i = 0; i < steps; i++) {
            uint64_t sum = 0;
            for (uint64_t j = (uint64_t)i * 1000; j < (uint64_t)i * 1000 + 1000; j++) sum += data[j % WORDS];
            sum *= (uint64_t)(i + 1);
            for (double until = now() + 0.02; now() < until;) {}
            printf("clone step %d %llu\n", i, (unsigned long long)sum);
            fflush(stdout);
        }
        sf_exit(0);
    }
    int rc = sf_join(t);
    printf("join %d\n", rc);
    return rc == 0 ? 0 : 1;
}
