/* Four pthreads working on a shared heap in lock-step rounds (mutex +
 * condition variables), the main thread printing a running checksum after
 * each round. Its output depends only on its arguments, so a run that was
 * migrated mid-way must print exactly what an undisturbed run prints.
 * Each worker names itself (worker-N); at the end the main thread prints
 * every thread's name as the kernel has it (/proc/.../comm), which a move
 * must keep too (`ps`, `top` and debuggers show it).
 * usage: workers ROUNDS HEAP_MIB [PAUSE_US] */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define WORKERS 4

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER;
static pthread_cond_t cv_done = PTHREAD_COND_INITIALIZER;
static int round_no, done_count, stop;
static uint64_t results[WORKERS];
static uint64_t *heap;
static size_t heap_words;

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg, seen = 0;
    char name[16];
    snprintf(name, sizeof name, "worker-%d", id);
    pthread_setname_np(pthread_self(), name);
    for (;;) {
        pthread_mutex_lock(&mu);
        while (round_no == seen && !stop)
            pthread_cond_wait(&cv_work, &mu);
        if (stop) {
            pthread_mutex_unlock(&mu);
            return NULL;
        }
        seen = round_no;
        pthread_mutex_unlock(&mu);
        uint64_t h = 1469598103934665603ULL ^ (uint64_t)seen ^ ((uint64_t)id << 32);
        for (size_t i = (size_t)id; i < heap_words; i += WORKERS) {
            heap[i] = heap[i] * 6364136223846793005ULL + h;
            h = (h ^ heap[i]) * 1099511628211ULL;
        }
        double f = 0; /* keep the FPU/SSE state busy across the move */
        for (int k = 0; k < 1000; k++)
            f = f * 0.999 + (double)((h >> (k % 64)) & 0xff);
        pthread_mutex_lock(&mu);
        results[id] = h ^ (uint64_t)f;
        done_count++;
        pthread_cond_signal(&cv_done);
        pthread_mutex_unlock(&mu);
    }
}

int main(int argc, char **argv) {
    if (argc < 3)
        return 2;
    int rounds = atoi(argv[1]);
    heap_words = (size_t)atoi(argv[2]) * 1024 * 1024 / 8;
    useconds_t pause = argc > 3 ? (useconds_t)atoi(argv[3]) : 20000;
    heap = malloc(heap_words * 8);
    for (size_t i = 0; i < heap_words; i++)
        heap[i] = i;
    pthread_t t[WORKERS];
    for (intptr_t i = 0; i < WORKERS; i++)
        pthread_create(&t[i], NULL, worker, (void *)i);
    uint64_t total = 0;
    for (int r = 1; r <= rounds; r++) {
        pthread_mutex_lock(&mu);
        done_count = 0;
        round_no = r;
        pthread_cond_broadcast(&cv_work);
        while (done_count < WORKERS)
            pthread_cond_wait(&cv_done, &mu);
        for (int w = 0; w < WORKERS; w++)
            total = total * 31 + results[w];
        pthread_mutex_unlock(&mu);
        printf("round %d %016llx\n", r, (unsigned long long)total);
        fflush(stdout);
        usleep(pause);
    }
    char name[16];
    printf("names:");
    pthread_getname_np(pthread_self(), name, sizeof name);
    printf(" %s", name);
    for (int i = 0; i < WORKERS; i++) {
        pthread_getname_np(t[i], name, sizeof name);
        printf(" %s", name);
    }
    printf("\n");
    pthread_mutex_lock(&mu);
    stop = 1;
    pthread_cond_broadcast(&cv_work);
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < WORKERS; i++)
        pthread_join(t[i], NULL);
    printf("done %016llx\n", (unsigned long long)total);
    return 0;
}
