/* getpid() == gettid() == the template's pid (glibc's cached tid stays
 * right), sched_getcpu via rseq, vDSO clock_gettime. */
#define _GNU_SOURCE
#include "sftest.h"
#include <sched.h>
#include <time.h>
#include <sys/time.h>
#include <sys/syscall.h>
#include <sys/rseq.h>
#include <sys/auxv.h>

int main(void) {
    pid_t parent = getpid();
    struct timespec before;
    clock_gettime(CLOCK_MONOTONIC, &before);
    unsigned long vdso = getauxval(AT_SYSINFO_EHDR);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        pid_t pid = getpid();
        CHECK(SFT_MOVED ? pid == parent : pid != parent); /* a clone is a new process; a moved one keeps its pid */
        CHECK(pid == (pid_t)syscall(SYS_gettid));
        CHECK(pid == gettid());
        CHECK(SFT_MOVED || getppid() != parent); /* documented difference (a clone's) */
        int cpu = sched_getcpu();
        CHECK(cpu >= 0);
        /* glibc's rseq area is registered again: the kernel keeps cpu_id fresh */
        struct rseq *rs = (struct rseq *)((char *)__builtin_thread_pointer() + __rseq_offset);
        CHECK(__rseq_size == 0 || (int)rs->cpu_id >= 0);
        CHECK(syscall(SYS_rseq, rs, 32, 0, RSEQ_SIG) == -1); /* already registered → EBUSY/EINVAL */
        struct timespec now;
        CHECK(clock_gettime(CLOCK_MONOTONIC, &now) == 0);
        CHECK(now.tv_sec > before.tv_sec || (now.tv_sec == before.tv_sec && now.tv_nsec >= before.tv_nsec));
        struct timeval tv;
        CHECK(gettimeofday(&tv, NULL) == 0 && tv.tv_sec > 1600000000);
        CHECK(time(NULL) > 1600000000);
        /* the vDSO sits where the template had it */
        CHECK(vdso != 0 && getauxval(AT_SYSINFO_EHDR) == vdso);
        CHECK(memcmp((void *)vdso, "\177ELF", 4) == 0);
        sf_exit(0);
    }
    sft_join(t, 2);
    printf("PASS pid_sched_vdso\n");
    return 0;
}
