/* What the tree fixtures (tree.c, groups.c) share: one line to stdout, whole, with one write per
 * piece the kernel takes (a process's lines must not interleave with its relatives'). */
#ifndef STARLING_TESTS_MIGRATE_SAY_H
#define STARLING_TESTS_MIGRATE_SAY_H
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static void say(const char *line) {
    size_t n = strlen(line);
    while (n > 0) {
        ssize_t w = write(1, line, n);
        if (w <= 0) _exit(99);
        line += w;
        n -= (size_t)w;
    }
}
#endif
