/* The migration benchmark's task: holds RESIDENT_MIB of its own data and
 * rewrites it at WRITE_MIB_PER_S, in a loop that notes the time on every
 * pass (CLOCK_MONOTONIC: the same clock on every host of one machine).
 * A move freezes it: the longest gap between two passes is the pause as
 * the task itself saw it.
 *
 * usage: migrate_work RESIDENT_MIB WRITE_MIB_PER_S SECONDS
 * It ends after SECONDS or at SIGTERM/SIGINT, whichever comes first.
 * prints "ready" once its memory is resident, then at the end one line:
 *   pause_ms=<longest gap> gaps_over_5ms=<n> passes=<n> checksum=<hex> */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static volatile sig_atomic_t asked_to_stop;
static void on_stop(int s) { (void)s; asked_to_stop = 1; }

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    size_t mib = (size_t)atol(argv[1]);
    double rate = atof(argv[2]);
    double seconds = atof(argv[3]);
    size_t pages = mib * 256;
    uint64_t *mem = malloc(pages * 4096);
    if (!mem) return 3;
    uint64_t x = 88172645463325252ULL;
    for (size_t i = 0; i < pages * 512; i++) { /* every page, distinct data */
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        mem[i] = x;
    }
    signal(SIGTERM, on_stop);
    signal(SIGINT, on_stop);
    printf("ready\n");
    fflush(stdout);
    double start = now_ms(), last = start, longest = 0, written_pages = 0;
    long passes = 0, gaps = 0;
    size_t cursor = 0;
    for (;;) {
        double t = now_ms();
        double gap = t - last;
        if (gap > longest) longest = gap;
        if (gap > 5) gaps++;
        last = t;
        passes++;
        if (asked_to_stop || t - start > seconds * 1e3) break;
        /* Write pages at the requested rate: one word in each, spread out. */
        double due = (t - start) / 1e3 * rate * 256;
        while (written_pages < due) {
            cursor = (cursor + 7919) % pages; /* a stride that visits every page */
            mem[cursor * 512] += 1;
            written_pages += 1;
        }
        for (volatile int spin = 0; spin < 2000; spin++) {}
    }
    uint64_t sum = 0;
    for (size_t i = 0; i < pages * 512; i += 64) sum = sum * 31 + mem[i];
    printf("pause_ms=%.3f gaps_over_5ms=%ld passes=%ld checksum=%016llx\n", longest, gaps, passes, (unsigned long long)sum);
    return 0;
}
