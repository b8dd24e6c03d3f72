/* POSIX timers that must move with the process (tests/test_migrate.py).
 *
 * It first makes three timers and deletes the first two, so the timers it
 * keeps have IDs a fresh process would not get: a disarmed spare, then
 *   tick:    CLOCK_MONOTONIC, SIGEV_SIGNAL SIGUSR1, every 10 ms; a handler counts
 *   oneshot: CLOCK_REALTIME, SIGEV_SIGNAL SIGUSR2, once in 1000 s
 *   thread:  CLOCK_MONOTONIC, SIGEV_THREAD_ID (this thread) SIGRTMIN, once in 2000 s
 * It prints "ready", then for every line on stdin one report:
 *   report TICKS SPARE_ID TICK_ID ONESHOT_ID THREAD_ID ONESHOT_LEFT_NS THREAD_LEFT_NS TICK_INTERVAL_NS
 * (times from timer_gettime). A signal of a one-shot timer, or a failed call,
 * exits with a message. On EOF it exits 0.
 * With an argument it holds a timer that cannot move as well: "thread-clock" one
 * on its thread's CPU clock, "many" 40 more (the image carries at most 32). */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t ticks;

static void on_tick(int sig) { (void)sig; ticks++; }
static void on_early(int sig) {
    (void)sig;
    static const char msg[] = "a one-shot timer fired early\n";
    write(2, msg, sizeof msg - 1);
    _exit(9);
}

static void fail(const char *what) { perror(what); exit(3); }

static timer_t make(clockid_t clock, int notify, int signo) {
    struct sigevent ev;
    memset(&ev, 0, sizeof ev);
    ev.sigev_notify = notify;
    ev.sigev_signo = signo;
    ev.sigev_value.sival_ptr = &ev; /* any value */
    if (notify == SIGEV_THREAD_ID) ev._sigev_un._tid = gettid();
    timer_t t;
    if (timer_create(clock, &ev, &t)) fail("timer_create");
    return t;
}

static void arm(timer_t t, long interval_ns, long value_s, long value_ns) {
    struct itimerspec its = {{interval_ns / 1000000000L, interval_ns % 1000000000L}, {value_s, value_ns}};
    if (timer_settime(t, 0, &its, NULL)) fail("timer_settime");
}

static long long left_ns(timer_t t, long long *interval) {
    struct itimerspec its;
    if (timer_gettime(t, &its)) fail("timer_gettime");
    if (interval) *interval = its.it_interval.tv_sec * 1000000000LL + its.it_interval.tv_nsec;
    return its.it_value.tv_sec * 1000000000LL + its.it_value.tv_nsec;
}

int main(int argc, char **argv) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_flags = SA_RESTART;
    sa.sa_handler = on_tick;
    sigaction(SIGUSR1, &sa, NULL);
    sa.sa_handler = on_early;
    sigaction(SIGUSR2, &sa, NULL);
    sigaction(SIGRTMIN, &sa, NULL);

    timer_t gone1 = make(CLOCK_MONOTONIC, SIGEV_SIGNAL, SIGUSR1);
    timer_t gone2 = make(CLOCK_MONOTONIC, SIGEV_SIGNAL, SIGUSR1);
    timer_t spare = make(CLOCK_MONOTONIC, SIGEV_NONE, 0);
    if (timer_delete(gone1) || timer_delete(gone2)) fail("timer_delete");
    timer_t tick = make(CLOCK_MONOTONIC, SIGEV_SIGNAL, SIGUSR1);
    timer_t oneshot = make(CLOCK_REALTIME, SIGEV_SIGNAL, SIGUSR2);
    timer_t thread = make(CLOCK_MONOTONIC, SIGEV_THREAD_ID, SIGRTMIN);
    arm(tick, 10000000L, 0, 10000000L);
    arm(oneshot, 0, 1000, 0);
    arm(thread, 0, 2000, 0);

    if (argc > 1 && !strcmp(argv[1], "thread-clock")) make(CLOCK_THREAD_CPUTIME_ID, SIGEV_NONE, 0);
    if (argc > 1 && !strcmp(argv[1], "many"))
        for (int i = 0; i < 40; i++) make(CLOCK_MONOTONIC, SIGEV_NONE, 0);
    printf("ready\n");
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        long long interval;
        long long oneshot_left = left_ns(oneshot, NULL), thread_left = left_ns(thread, NULL);
        left_ns(tick, &interval);
        printf("report %ld %ld %ld %ld %ld %lld %lld %lld\n", (long)ticks, (long)spare, (long)tick, (long)oneshot,
               (long)thread, oneshot_left, thread_left, interval);
        fflush(stdout);
    }
    return 0;
}
