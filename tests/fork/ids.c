/* Credentials follow a clone: each clone compares its real and effective
 * uid and gid with the parent's (in its memory since before the clone) and
 * exits 0 only if they match; it writes uid, gid and its number of
 * supplementary groups to DIR/ids-ID.txt, which comes home owned by that
 * uid/gid. (Supplementary groups do not follow yet: the restorer drops
 * them, so they are reported, not required.)
 * Usage: ids CLONES DIR   (prints "PARENT uid gid ngroups" and "STATUS id s") */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <grp.h>
#include "starling.h"

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: ids CLONES DIR\n"); return 2; }
    uid_t uid = getuid(), euid = geteuid();
    gid_t gid = getgid(), egid = getegid();
    int ng = getgroups(0, NULL);
    if (ng < 0) { perror("getgroups"); return 2; }
    printf("PARENT %u %u %d\n", (unsigned)uid, (unsigned)gid, ng);
    fflush(stdout);
    sf_ticket_t *t = sf_request_ticket(atoi(argv[1]), false);
    if (!t) { fprintf(stderr, "ticket: %s\n", sf_last_error()); return 2; }
    int m = sf_ticket_allocation(t);
    int id = sf_clone(t);
    if (id < 0) { fprintf(stderr, "sf_clone: %s\n", sf_last_error()); return 2; }
    if (id > 0) {
        int n = getgroups(0, NULL);
        int same = getuid() == uid && geteuid() == euid && getgid() == gid && getegid() == egid;
        char path[4096];
        snprintf(path, sizeof path, "%s/ids-%d.txt", argv[2], id);
        FILE *f = fopen(path, "w");
        if (!f) { perror(path); sf_exit(3); }
        fprintf(f, "%u %u %d\n", (unsigned)getuid(), (unsigned)getgid(), n);
        fclose(f);
        sf_exit(same ? 0 : 1);
    }
    int rc = sf_join(t);
    for (int i = 1; i <= m; i++) printf("STATUS %d %d\n", i, sf_clone_status(t, i));
    if (rc != 0) fprintf(stderr, "join: %s\n", sf_last_error());
    return rc ? 1 : 0;
}
