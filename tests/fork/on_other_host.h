/* Force-included (cc -include) into the restore-correctness suite when it
 * runs on the cluster: every sf_clone call also checks, inside each clone,
 * that the clone runs on another emulated host (uname -n differs from the
 * parent's; each host has its own UTS namespace). Exit 99 if not. */
#ifndef SF_ON_OTHER_HOST_H
#define SF_ON_OTHER_HOST_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/utsname.h>
#include "starling.h"

static inline int sft_cluster_clone(sf_ticket_t *t) {
    struct utsname parent;
    uname(&parent);
    int id = sf_clone(t);
    if (id > 0) {
        struct utsname here;
        uname(&here);
        if (strcmp(here.nodename, parent.nodename) == 0) {
            fprintf(stderr, "clone %d runs on the parent's host %s\n", id, here.nodename);
            fflush(stderr);
            sf_exit(99);
        }
        fprintf(stderr, "clone %d on host %s\n", id, here.nodename);
    }
    return id;
}
#define sf_clone sft_cluster_clone
#endif
