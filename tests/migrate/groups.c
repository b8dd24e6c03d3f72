/* Sessions and process groups for migration tests. The parent (p0, which
 * leads its session as a task's first process does) forks:
 *   pA: leads a process group of its own (setpgid(0, 0), and the parent's
 *       setpgid(pA, pA), as a shell does, so the group exists at once);
 *   pB: forks pC, then starts a session of its own (setsid);
 *   pC: forked before pB's setsid, so in p0's session, joins pA's group.
 * Each child sends its role and pid on a pipe to the parent once set up;
 * the parent then prints "ready p0=<pid> pA=<pid> pB=<pid> pC=<pid>".
 * Per line of stdin (a round), the parent sends SIGUSR1 to pA's group
 * (kill(-pA)), then asks each process in turn (SIGUSR2; a byte on the pipe
 * when done) to print "<name> pid=.. ppid=.. sid=.. pgid=.. usr1=<SIGUSR1s
 * taken so far>", the parent last, then "round <n> done". At the end of
 * stdin it ends the children, reaps pA and pB and prints "end".
 * SIGUSR1 and SIGUSR2 are blocked everywhere and taken with sigwaitinfo, the
 * lower-numbered first, so a SIGUSR1 sent before a SIGUSR2 is counted before
 * the report it asks for.                                                  */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "say.h"

static int ack[2];


static void report(const char *name, int usr1) {
    char line[160];
    snprintf(line, sizeof line, "%s pid=%d ppid=%d sid=%d pgid=%d usr1=%d\n", name, (int)getpid(), (int)getppid(),
             (int)getsid(0), (int)getpgid(0), usr1);
    say(line);
}

struct hello {
    char role;
    int pid;
};

static void hello(char role) {
    struct hello h = {role, (int)getpid()};
    if (write(ack[1], &h, sizeof h) != (ssize_t)sizeof h) _exit(98);
}

/* A child: count SIGUSR1s, report on each SIGUSR2, for ever. */
static void serve(const char *name) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    int usr1 = 0;
    for (;;) {
        int sig = sigwaitinfo(&set, NULL);
        if (sig == SIGUSR1) {
            usr1++;
        } else if (sig == SIGUSR2) {
            report(name, usr1);
            char done = 'r';
            if (write(ack[1], &done, 1) != 1) _exit(97);
        }
    }
}

int main(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    sigprocmask(SIG_BLOCK, &set, NULL);
    if (pipe(ack) != 0) return 2;
    pid_t a = fork();
    if (a < 0) return 3;
    if (a == 0) {
        if (setpgid(0, 0) != 0) _exit(90);
        hello('A');
        serve("pA");
    }
    if (setpgid(a, a) != 0) return 4;
    pid_t b = fork();
    if (b < 0) return 3;
    if (b == 0) {
        pid_t c = fork();
        if (c < 0) _exit(91);
        if (c == 0) {
            if (setpgid(0, a) != 0) _exit(92);
            hello('C');
            serve("pC");
        }
        if (setsid() < 0) _exit(93);
        hello('B');
        serve("pB");
    }
    int pids[3] = {0, 0, 0}; /* A, B, C */
    for (int i = 0; i < 3; i++) {
        struct hello h;
        if (read(ack[0], &h, sizeof h) != (ssize_t)sizeof h) return 5;
        pids[h.role - 'A'] = h.pid;
    }
    char line[160];
    snprintf(line, sizeof line, "ready p0=%d pA=%d pB=%d pC=%d\n", (int)getpid(), pids[0], pids[1], pids[2]);
    say(line);
    int usr1 = 0;
    for (int round = 0;; round++) {
        char c;
        do {
            if (read(0, &c, 1) != 1) goto end;
        } while (c != '\n');
        if (kill(-pids[0], SIGUSR1) != 0) return 6;
        for (int i = 0; i < 3; i++) {
            kill(pids[i], SIGUSR2);
            if (read(ack[0], &c, 1) != 1) return 7;
        }
        struct timespec none = {0, 0};
        sigset_t one;
        sigemptyset(&one);
        sigaddset(&one, SIGUSR1);
        while (sigtimedwait(&one, NULL, &none) == SIGUSR1) usr1++;
        report("p0", usr1);
        snprintf(line, sizeof line, "round %d done\n", round);
        say(line);
    }
end:
    for (int i = 0; i < 3; i++) kill(pids[i], SIGTERM);
    waitpid(a, NULL, 0);
    waitpid(b, NULL, 0);
    say("end\n");
    return 0;
}
