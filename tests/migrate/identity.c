/* What a process's identity in /proc says, for migration tests: per line of
 * stdin it prints
 *   exe=<readlink /proc/self/exe> cmdline=<the NUL-separated args, NULs shown as |>
 *   environ=<bytes of /proc/self/environ>:<their FNV-1a hash>
 * then "round <n> done"; at the end of stdin, "end". `ps`, `top` and
 * `pgrep` read the same files, so a move must leave them as they were.  */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>

#include "say.h"

static size_t slurp(const char *path, char *buf, size_t cap) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    size_t n = 0;
    ssize_t r;
    while (n < cap && (r = read(fd, buf + n, cap - n)) > 0) n += (size_t)r;
    close(fd);
    return n;
}

int main(void) {
    static char exe[4096], args[8192], env[65536], line[16384];
    char in[256];
    for (int round = 1; fgets(in, sizeof in, stdin); round++) {
        ssize_t e = readlink("/proc/self/exe", exe, sizeof exe - 1);
        exe[e < 0 ? 0 : e] = 0;
        size_t n = slurp("/proc/self/cmdline", args, sizeof args - 1);
        for (size_t i = 0; i < n; i++)
            if (args[i] == 0) args[i] = '|';
        args[n] = 0;
        size_t m = slurp("/proc/self/environ", env, sizeof env);
        uint32_t h = 2166136261u;
        for (size_t i = 0; i < m; i++) h = (h ^ (unsigned char)env[i]) * 16777619u;
        snprintf(line, sizeof line, "exe=%s cmdline=%s\nenviron=%zu:%08x\nround %d done\n", exe, args, m, h, round);
        say(line);
    }
    say("end\n");
    return 0;
}
