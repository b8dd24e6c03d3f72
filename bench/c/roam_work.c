/* roam_work: the bimodal program of bench/roam_bench.py (issue 11 part 5).
 *
 * Usage: roam_work N
 *
 * Puts its terminal in raw mode and prints "READY". Then, per byte read from the terminal:
 *   'C'  crunch: N rounds of a 64-bit LCG + xorshift (fixed work, no memory traffic), printing
 *        "CRUNCH <realtime ms>" before and "DONE <realtime ms> <longest gap ms> <checksum>" after;
 *        the longest gap between two looks at CLOCK_MONOTONIC (every 65536 rounds) is the pause
 *        the program saw (a move's freeze, or being descheduled);
 *   'Q'  prints "BYE" and exits 0;
 *   else echoes the byte (an editor drawing the key the user typed).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

static double ms(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: roam_work N\n");
        return 2;
    }
    uint64_t n = strtoull(argv[1], NULL, 10);
    struct termios t;
    if (tcgetattr(0, &t) == 0) {
        cfmakeraw(&t);
        tcsetattr(0, TCSANOW, &t);
    }
    printf("READY\r\n");
    fflush(stdout);
    for (;;) {
        char c;
        if (read(0, &c, 1) != 1)
            return 1;
        if (c == 'Q') {
            printf("BYE\r\n");
            fflush(stdout);
            return 0;
        }
        if (c != 'C') {
            if (write(1, &c, 1) != 1)
                return 1;
            continue;
        }
        printf("CRUNCH %.0f\r\n", ms(CLOCK_REALTIME));
        fflush(stdout);
        uint64_t x = 1;
        double last = ms(CLOCK_MONOTONIC), gap = 0;
        for (uint64_t i = 0; i < n; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            x ^= x >> 29;
            if ((i & 0xffff) == 0) {
                double m = ms(CLOCK_MONOTONIC);
                if (m - last > gap)
                    gap = m - last;
                last = m;
            }
        }
        printf("DONE %.0f %.1f %llu\r\n", ms(CLOCK_REALTIME), gap, (unsigned long long)(x & 0xffff));
        fflush(stdout);
    }
}
