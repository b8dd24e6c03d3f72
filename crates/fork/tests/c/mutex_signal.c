/* pthread mutexes (normal, error-checking, robust), threads created in the
 * clone, an installed signal handler, the signal mask. */
#define _GNU_SOURCE
#include "sftest.h"
#include <pthread.h>
#include <signal.h>
#include <errno.h>

static pthread_mutex_t plain = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t errchk, robust;
static volatile sig_atomic_t got_usr1;
static long shared_counter;

static void on_usr1(int sig) { (void)sig; got_usr1++; }

static void *worker(void *arg) {
    for (int i = 0; i < 10000; i++) {
        pthread_mutex_lock(&plain);
        shared_counter++;
        pthread_mutex_unlock(&plain);
    }
    return arg;
}

int main(void) {
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_ERRORCHECK);
    pthread_mutex_init(&errchk, &a);
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&robust, &a);
    struct sigaction sa = {0};
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    PCHECK(sigaction(SIGUSR1, &sa, NULL) == 0);
    signal(SIGPIPE, SIG_IGN);
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGUSR2);
    PCHECK(sigprocmask(SIG_BLOCK, &block, NULL) == 0);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        /* error-checking and robust mutexes compare the owner with the tid */
        CHECK(pthread_mutex_lock(&errchk) == 0);
        CHECK(pthread_mutex_lock(&errchk) == EDEADLK);
        CHECK(pthread_mutex_unlock(&errchk) == 0);
        CHECK(pthread_mutex_lock(&robust) == 0);
        CHECK(pthread_mutex_unlock(&robust) == 0);
        pthread_t th[4];
        for (int i = 0; i < 4; i++) CHECK(pthread_create(&th[i], NULL, worker, NULL) == 0);
        for (int i = 0; i < 4; i++) CHECK(pthread_join(th[i], NULL) == 0);
        CHECK(shared_counter == 40000);
        struct sigaction cur;
        CHECK(sigaction(SIGUSR1, NULL, &cur) == 0 && cur.sa_handler == on_usr1);
        CHECK(sigaction(SIGPIPE, NULL, &cur) == 0 && cur.sa_handler == SIG_IGN);
        sigset_t now;
        CHECK(sigprocmask(SIG_BLOCK, NULL, &now) == 0 && sigismember(&now, SIGUSR2));
        CHECK(raise(SIGUSR1) == 0);
        CHECK(got_usr1 == 1);
        CHECK(kill(getpid(), SIGUSR1) == 0);
        CHECK(got_usr1 == 2);
        sf_exit(0);
    }
    sft_join(t, 2);
    PCHECK(got_usr1 == 0 && shared_counter == 0);
    printf("PASS mutex_signal\n");
    return 0;
}
