/* What confines a clone (issue 12): every process, the parent first, then
 * each clone, prints one line
 *   WHO ID Seccomp NoNewPrivs CapEff CapPrm CapInh CapBnd CapAmb ptrace-rc errno mount-rc errno
 * with the fields of its /proc/self/status and, in a clone, the results of
 * ptrace(PTRACE_TRACEME) and mount("none", "/mnt", "tmpfs"), each made
 * through syscall(2) so the answer is the kernel's (the parent prints "-":
 * it runs on the client, outside any sandbox, and must not try them). Its
 * line shows what a clone would have without the cluster's confinement.
 * Usage: confined CLONES [HIERARCHICAL 0|1]   (also prints "STATUS id s") */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "starling.h"

static void field(const char *status, const char *name, char *out, size_t n) {
    const char *p = strstr(status, name);
    snprintf(out, n, "?");
    if (!p) return;
    p += strlen(name);
    while (*p == ':' || *p == ' ' || *p == '\t') p++;
    size_t i = 0;
    while (p[i] && p[i] != '\n' && i + 1 < n) { out[i] = p[i]; i++; }
    out[i] = 0;
}

static void report(const char *who, int id, int probe) {
    char status[16384] = {0};
    FILE *f = fopen("/proc/self/status", "r");
    if (f) { size_t got = fread(status, 1, sizeof status - 1, f); status[got] = 0; fclose(f); }
    const char *names[] = {"\nSeccomp", "\nNoNewPrivs", "\nCapEff", "\nCapPrm", "\nCapInh", "\nCapBnd", "\nCapAmb"};
    char line[1024];
    int off = snprintf(line, sizeof line, "%s %d", who, id);
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char v[64];
        field(status, names[i], v, sizeof v);
        off += snprintf(line + off, sizeof line - off, " %s", v);
    }
    if (!probe) {
        printf("%s - - - -\n", line);
        fflush(stdout);
        return;
    }
    errno = 0;
    long pr = syscall(SYS_ptrace, 0 /* PTRACE_TRACEME */, 0, NULL, NULL);
    int pe = errno;
    errno = 0;
    long mr = syscall(SYS_mount, "none", "/mnt", "tmpfs", 0, NULL);
    int me = errno;
    if (mr == 0) syscall(SYS_umount2, "/mnt", 0);
    printf("%s %ld %d %ld %d\n", line, pr, pe, mr, me);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 3) { fprintf(stderr, "usage: confined CLONES [HIERARCHICAL 0|1]\n"); return 2; }
    sf_ticket_t *t = sf_request_ticket(atoi(argv[1]), argc == 3 && atoi(argv[2]) == 1);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        report("CLONE", id, 1);
        sf_exit(0);
    }
    int rc = sf_join(t);
    /* The parent only reads its status: it runs on the client, outside any sandbox. */
    report("PARENT", 0, 0);
    for (int i = 1; i <= m; i++) printf("STATUS %d %d\n", i, sf_clone_status(t, i));
    if (rc != 0) fprintf(stderr, "join: %s\n", sf_last_error());
    return rc ? 1 : 0;
}
