/* A CPU-bound program in phases, for moves on the cluster. It holds HEAP_MIB
 * of its own data, and per step: mixes a slice of it (CPU work), prints
 * "step N <checksum>" and appends block N to OUTFILE. After each phase but
 * the last it prints "phase P done" and waits for a line on stdin, so a test
 * moves it at a known point without any timing. Its output, its file and its
 * exit status (7) depend only on its arguments.
 *
 * Block N of OUTFILE: 65536 bytes, byte j = (N * 131 + j * 7) & 0xff.
 * usage: phases STEPS_PER_PHASE PHASES OUTFILE HEAP_MIB */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 65536

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    int steps = atoi(argv[1]), phases = atoi(argv[2]);
    size_t words = (size_t)atol(argv[4]) * (1 << 20) / 8;
    uint64_t *heap = malloc(words * 8);
    FILE *out = fopen(argv[3], "w");
    if (!heap || !out) return 3;
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < words; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        heap[i] = x;
    }
    static unsigned char block[BLOCK];
    uint64_t sum = 0;
    int n = 0;
    for (int p = 0; p < phases; p++) {
        for (int s = 0; s < steps; s++, n++) {
            size_t slice = words / 16, base = (size_t)(n % 16) * slice;
            for (int rep = 0; rep < 4; rep++)
                for (size_t i = base; i < base + slice; i++) {
                    heap[i] = heap[i] * 6364136223846793005ULL + 1442695040888963407ULL + (uint64_t)rep;
                    sum += heap[i] >> 11;
                }
            for (int j = 0; j < BLOCK; j++) block[j] = (unsigned char)((n * 131 + j * 7) & 0xff);
            if (fwrite(block, 1, BLOCK, out) != BLOCK) return 4;
            fflush(out);
            printf("step %d %016llx\n", n, (unsigned long long)sum);
            fflush(stdout);
        }
        if (p + 1 < phases) {
            printf("phase %d done\n", p);
            fflush(stdout);
            char line[64];
            if (!fgets(line, sizeof line, stdin)) return 5;
        }
    }
    fclose(out);
    printf("done %016llx\n", (unsigned long long)sum);
    return 7;
}
