/* A process tree for migration tests: the parent forks CHILDREN children;
 * every process runs PHASES phases of STEPS steps, each step touching its
 * own 4 MiB heap buffer and printing a line with a running checksum of it
 * (one write(2) per line, so lines of different processes never mix), then
 * sleeping SLEEP_MS. After each phase but the last every process prints
 * "p<k> phase <n> done" and waits at a gate: the parent reads a line from
 * stdin, then sends each child SIGUSR1 (which the children wait for with
 * sigwaitinfo), so a test moves the tree at a known point without timing.
 * Child k exits with code 10 + k; the parent reaps each with waitpid,
 * prints its status ("reaped <k> exit <code>"), then "done", and exits 7.
 *
 *   tree CHILDREN PHASES STEPS SLEEP_MS                                  */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "say.h"

static int children, phases, steps, sleep_ms;
static pid_t pids[16];

static void gate(int k, int phase) {
    char line[128];
    snprintf(line, sizeof line, "p%d phase %d done\n", k, phase);
    say(line);
    if (k == 0) {
        char c;
        do {
            if (read(0, &c, 1) != 1) _exit(97);
        } while (c != '\n');
        for (int i = 0; i < children; i++) kill(pids[i], SIGUSR1);
    } else {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, SIGUSR1);
        while (sigwaitinfo(&set, NULL) != SIGUSR1) {}
    }
}

static void run(int k) {
    size_t words = (4u << 20) / sizeof(uint64_t);
    uint64_t *buf = malloc(words * sizeof(uint64_t));
    if (!buf) _exit(98);
    for (size_t j = 0; j < words; j++) buf[j] = j * 2654435761u + (uint64_t)k;
    uint64_t sum = 0;
    char line[128];
    for (int p = 0; p < phases; p++) {
        for (int i = 0; i < steps; i++) {
            for (size_t j = (size_t)i % 7; j < words; j += 7) {
                buf[j] = buf[j] * 6364136223846793005ull + 1442695040888963407ull;
                sum ^= buf[j] + j;
            }
            snprintf(line, sizeof line, "p%d phase %d step %d sum %016llx\n", k, p, i, (unsigned long long)sum);
            say(line);
            struct timespec ts = {sleep_ms / 1000, (long)(sleep_ms % 1000) * 1000000L};
            while (nanosleep(&ts, &ts) != 0) {}
        }
        if (p + 1 < phases) gate(k, p);
    }
    free(buf);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: tree CHILDREN PHASES STEPS SLEEP_MS\n");
        return 2;
    }
    children = atoi(argv[1]), phases = atoi(argv[2]), steps = atoi(argv[3]), sleep_ms = atoi(argv[4]);
    if (children > 16) children = 16;
    /* Blocked before the forks: a SIGUSR1 sent before a child waits stays pending. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigprocmask(SIG_BLOCK, &set, NULL);
    for (int k = 1; k <= children; k++) {
        pid_t p = fork();
        if (p < 0) return 3;
        if (p == 0) {
            run(k);
            _exit(10 + k);
        }
        pids[k - 1] = p;
    }
    run(0);
    char line[128];
    for (int k = 1; k <= children; k++) {
        int status = 0;
        if (waitpid(pids[k - 1], &status, 0) != pids[k - 1]) {
            snprintf(line, sizeof line, "reaped %d failed\n", k);
        } else if (WIFEXITED(status)) {
            snprintf(line, sizeof line, "reaped %d exit %d\n", k, WEXITSTATUS(status));
        } else {
            snprintf(line, sizeof line, "reaped %d signal %d\n", k, WTERMSIG(status));
        }
        say(line);
    }
    say("done\n");
    return 7;
}
