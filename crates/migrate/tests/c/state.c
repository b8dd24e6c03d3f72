/* Process state that must survive a move, checked by the program itself on
 * every step: an open file keeps its offset, a SIGALRM interval timer keeps
 * ticking into its handler, a SIGUSR1 handler runs on its alternate stack,
 * the signal mask, umask and cwd stay. Prints "step N ok" per step, or
 * "FAIL ..." and exits 1. usage: state FILE STEPS */
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

static volatile sig_atomic_t ticks;
static volatile sig_atomic_t on_alt;
static char altstack[64 * 1024];

static void on_alarm(int s) { (void)s; ticks++; }
static void on_usr1(int s) {
    (void)s;
    char here;
    on_alt = (&here >= altstack && &here < altstack + sizeof altstack);
}

#define FAIL(...) do { printf("FAIL " __VA_ARGS__); printf("\n"); fflush(stdout); exit(1); } while (0)

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    int steps = atoi(argv[2]);
    int fd = open(argv[1], O_RDONLY);
    if (fd < 0) FAIL("open");
    stack_t ss = { .ss_sp = altstack, .ss_size = sizeof altstack };
    sigaltstack(&ss, NULL);
    struct sigaction sa = { .sa_handler = on_usr1, .sa_flags = SA_ONSTACK };
    sigaction(SIGUSR1, &sa, NULL);
    struct sigaction al = { .sa_handler = on_alarm, .sa_flags = SA_RESTART };
    sigaction(SIGALRM, &al, NULL);
    struct itimerval it = { { 0, 5000 }, { 0, 5000 } };
    setitimer(ITIMER_REAL, &it, NULL);
    sigset_t blocked;
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGUSR2);
    sigprocmask(SIG_BLOCK, &blocked, NULL);
    umask(0027);
    char cwd0[4096];
    if (!getcwd(cwd0, sizeof cwd0)) FAIL("getcwd");
    int last_ticks = -1;
    for (int i = 0; i < steps; i++) {
        unsigned char b;
        if (read(fd, &b, 1) != 1) FAIL("read at step %d", i);
        if (b != (unsigned char)(i * 7 + 3)) FAIL("byte %d is %d: the file offset moved", i, b);
        on_alt = 0;
        raise(SIGUSR1);
        if (!on_alt) FAIL("SIGUSR1 handler not on its altstack at step %d", i);
        sigset_t now;
        sigprocmask(SIG_BLOCK, NULL, &now);
        if (!sigismember(&now, SIGUSR2)) FAIL("signal mask lost at step %d", i);
        mode_t m = umask(0027);
        if (m != 0027) FAIL("umask %o at step %d", m, i);
        char cwd[4096];
        if (!getcwd(cwd, sizeof cwd) || strcmp(cwd, cwd0)) FAIL("cwd changed at step %d", i);
        if (i % 10 == 9) {
            /* 10 steps of >= 10 ms each: the 5 ms timer must have fired. */
            if (ticks <= last_ticks) FAIL("interval timer stopped at step %d (%d ticks)", i, ticks);
            last_ticks = ticks;
        }
        printf("step %d ok\n", i);
        fflush(stdout);
        struct timespec ts = { 0, 10 * 1000 * 1000 };
        while (nanosleep(&ts, &ts) != 0) {}
    }
    printf("done\n");
    return 0;
}
