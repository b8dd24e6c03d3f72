/* A parent whose stdout/stderr may be a regular file (`prog > out.txt`):
 * it writes a line, clones N workers that each write one line to stdout and
 * one to stderr, writes a line while they run, joins, and writes a final
 * line. Every line must end up in the file, in the parent's order for its
 * own lines, nothing replaced.
 * With DUP=1 the parent first keeps a copy of fd 1 on fd 9 (as pytest's
 * output capture does) and the clones write through that copy too.
 * With DUP=2 the parent does what pytest's output capture does: it keeps the
 * file on fd 9, puts an unlinked temporary file on fd 1 and 2, and writes its
 * own lines to fd 9; the clones write to fd 1 and 2 (so into the temporary
 * file), which the parent copies into the log after joining. The log is held
 * only by fd 9, which no clone writes: it must never be replaced.
 * With BULK > 0 each clone ends by writing BULK more lines to stdout ("CLONE i
 * bulk k"), so its output is still in flight when it exits: sf_join must not
 * return before every one of them has reached the file.
 * Usage: output_file N HIERARCHICAL(0|1) DUP(0|1|2) [BULK] */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include "starling.h"

static void say(int fd, const char *fmt, int a) {
    char buf[128];
    int n = snprintf(buf, sizeof buf, fmt, a);
    if (write(fd, buf, (size_t)n) != n) _exit(5);
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) { fprintf(stderr, "usage: output_file N HIERARCHICAL DUP [BULK]\n"); return 2; }
    int bulk = argc == 5 ? atoi(argv[4]) : 0;
    int n = atoi(argv[1]);
    int mode = atoi(argv[3]);
    int dup_fd = mode == 1 ? 9 : -1;
    if (dup_fd >= 0 && dup2(1, dup_fd) < 0) { perror("dup2"); return 2; }
    int log = 1; /* where the parent's own lines go */
    int capture = -1;
    if (mode == 2) {
        log = 9;
        capture = open("/var/tmp", O_TMPFILE | O_RDWR, 0600);
        if (capture < 0 || dup2(1, log) < 0 || dup2(capture, 1) < 0 || dup2(capture, 2) < 0) { perror("capture"); return 2; }
    }
    say(log, "PARENT first\n", 0);
    sf_ticket_t *t = sf_request_ticket(n, atoi(argv[2]) != 0);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        say(1, "CLONE %d out\n", id);
        say(2, "CLONE %d err\n", id);
        if (dup_fd >= 0) say(dup_fd, "CLONE %d dup\n", id);
        for (int k = 0; k < bulk; k++) {
            char buf[64];
            int len = snprintf(buf, sizeof buf, "CLONE %d bulk %d\n", id, k);
            if (write(1, buf, (size_t)len) != len) _exit(5);
        }
        sf_exit(0);
    }
    say(log, "PARENT during\n", 0);
    if (sf_join(t) != 0) { dprintf(log, "sf_join: %s\n", sf_last_error()); return 3; }
    for (int i = 1; i <= sf_ticket_allocation(t); i++)
        if (sf_clone_status(t, i) != 0) { dprintf(log, "clone %d status %d\n", i, sf_clone_status(t, i)); return 4; }
    if (capture >= 0) {
        /* What the clones wrote to their fd 1 and 2 is in the captured file. */
        char buf[4096];
        ssize_t n;
        for (off_t at = 0; (n = pread(capture, buf, sizeof buf, at)) > 0; at += n)
            if (write(log, buf, (size_t)n) != n) return 5;
    }
    say(log, "PARENT last %d\n", sf_ticket_allocation(t));
    return 0;
}
