/* Rewrites all of its memory again and again, far faster than a pre-copy
 * round can send it (one word per page, no pause), and checks every page
 * as it goes: in pass P each page must still hold what pass P-1 wrote there
 * (its index and P-1), so a page that came back as an older copy of itself
 * after a move, or as another page, is caught.
 *
 * usage: sweeper MIB
 * prints "sweeping" after the first pass; once it has moved (its parent is
 * another process: the restorer's), 20 more passes, then one line and exit 0.
 * A page that does not hold what it should: a line saying which, exit 1. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    size_t pages = (size_t)atol(argv[1]) * 256;
    uint64_t *mem = calloc(pages, 4096);
    if (!mem) return 3;
    pid_t parent = getppid();
    long after_move = -1;
    for (uint64_t pass = 1;; pass++) {
        for (size_t i = 0; i < pages; i++) {
            uint64_t want = ((pass - 1) << 32) | (pass == 1 ? 0 : i);
            if (mem[i * 512] != want) {
                printf("pass %llu: page %zu holds %llx, not %llx\n", (unsigned long long)pass, i,
                       (unsigned long long)mem[i * 512], (unsigned long long)want);
                return 1;
            }
            mem[i * 512] = (pass << 32) | i;
        }
        if (pass == 1) {
            printf("sweeping\n");
            fflush(stdout);
        }
        if (after_move < 0 && getppid() != parent) after_move = 0;
        if (after_move >= 0 && ++after_move == 20) {
            printf("every page as written, 20 passes after the move\n");
            return 0;
        }
    }
}
