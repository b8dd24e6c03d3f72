/* sigaltstack and rlimits in clones. The parent installs an alternate
 * signal stack and a SA_ONSTACK handler, and sets soft (and lowers hard)
 * limits to values no default has; each clone must see the same stack
 * and limits, and its handler must run on that stack (the kernel writes
 * the signal frame into memory the clone has not fetched yet). */
#include "sftest.h"
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>

#define ALT_SIZE (64 * 1024)
static char alt_stack[ALT_SIZE] __attribute__((aligned(16)));
static volatile int on_alt_stack = -1;

static void on_usr1(int sig) {
    (void)sig;
    char local;
    uintptr_t a = (uintptr_t)&local, lo = (uintptr_t)alt_stack;
    on_alt_stack = a >= lo && a < lo + ALT_SIZE;
}

static int limit_is(int res, rlim_t soft, rlim_t hard) {
    struct rlimit r;
    return getrlimit(res, &r) == 0 && r.rlim_cur == soft && r.rlim_max == hard;
}

int main(void) {
    stack_t ss = { .ss_sp = alt_stack, .ss_size = ALT_SIZE, .ss_flags = 0 };
    PCHECK(sigaltstack(&ss, NULL) == 0);
    struct sigaction sa = { .sa_handler = on_usr1, .sa_flags = SA_ONSTACK };
    sigemptyset(&sa.sa_mask);
    PCHECK(sigaction(SIGUSR1, &sa, NULL) == 0);
    /* the check itself works here: the handler runs on the alternate stack */
    PCHECK(raise(SIGUSR1) == 0 && on_alt_stack == 1);
    on_alt_stack = -1;

    struct rlimit nofile;
    PCHECK(getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_max >= 4000);
    PCHECK(setrlimit(RLIMIT_NOFILE, &(struct rlimit){ 777, 3999 }) == 0);
    struct rlimit fsize;
    PCHECK(getrlimit(RLIMIT_FSIZE, &fsize) == 0);
    PCHECK(setrlimit(RLIMIT_FSIZE, &(struct rlimit){ 1UL << 30, fsize.rlim_max }) == 0);
    PCHECK(setrlimit(RLIMIT_CORE, &(struct rlimit){ 0, 0 }) == 0);
    PCHECK(limit_is(RLIMIT_NOFILE, 777, 3999));

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        stack_t cur;
        CHECK(sigaltstack(NULL, &cur) == 0);
        CHECK(cur.ss_sp == alt_stack && cur.ss_size == ALT_SIZE && !(cur.ss_flags & SS_DISABLE));
        CHECK(on_alt_stack == -1);
        CHECK(raise(SIGUSR1) == 0);
        CHECK(on_alt_stack == 1);
        CHECK(limit_is(RLIMIT_NOFILE, 777, 3999));
        CHECK(limit_is(RLIMIT_FSIZE, 1UL << 30, fsize.rlim_max));
        CHECK(limit_is(RLIMIT_CORE, 0, 0));
        sf_exit(0);
    }
    sft_join(t, 2);
    printf("PASS altstack_rlimits\n");
    return 0;
}
