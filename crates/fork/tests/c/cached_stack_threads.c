/* Threads in a clone on stacks glibc cached from threads that ran (and
 * ended) in the parent, while another thread of the clone keeps faulting in
 * template pages.
 *
 * Why this is a case of its own: a stack glibc caches lies in memory the
 * clone registered with its userfaultfd, so when a clone's thread ends on
 * it, glibc's MADV_DONTNEED of the unused stack part is a REMOVE event. While
 * such an event is pending the kernel refuses every UFFDIO_COPY/ZEROPAGE
 * with EAGAIN; a fault handler that counts that as "installed" later serves
 * the page as zero, and the clone reads zeros where the template had data
 * (Python: a NULL object type, then a segfault). Here a scanner thread
 * checks a heap array of known content page by page while the main thread
 * starts and joins short threads on the cached stacks (each touches its stack
 * and TLS); any page that arrives wrong fails the clone. */
#define _GNU_SOURCE
#include "sftest.h"
#include <pthread.h>
#include <stdint.h>
#include <stdatomic.h>

#ifndef PARENT_THREADS
#define PARENT_THREADS 2 /* the scanner and the workers each get one cached stack */
#endif
#define ARRAY_BYTES (48u << 20)
#define WORDS_PER_PAGE (4096 / sizeof(uint64_t))

static __thread uint64_t tls_value = 0x5eed;
static __thread char tls_buf[256];

static uint64_t *array;
static size_t array_words;
static atomic_int scanning = 1;

static uint64_t pattern(size_t i) { return (i * 0x9e3779b97f4a7c15ull) | 1; }

static void *parent_thread(void *arg) {
    /* Use a good part of the stack so that glibc's cached stack has content. */
    volatile char big[64 << 10];
    memset((char *)big, 0x5a, sizeof big);
    tls_value = 1;
    return arg;
}

/* Runs on a cached stack in the clone: its stack and TLS must work. */
static void *clone_worker(void *arg) {
    uintptr_t n = (uintptr_t)arg;
    volatile uint64_t frame[4096];
    for (size_t i = 0; i < 4096; i++) frame[i] = n * 4096 + i;
    uint64_t sum = 0;
    for (size_t i = 0; i < 4096; i++) sum += frame[i];
    if (tls_value != 0x5eed) return (void *)1; /* a new thread's TLS is the initial image */
    tls_value = n;
    snprintf(tls_buf, sizeof tls_buf, "worker %lu", (unsigned long)n);
    if (sum != n * 4096 * 4096 + 4096 * 4095 / 2) return (void *)2;
    return NULL;
}

/* Checks every word of the array; returns the number of wrong pages. */
static void *scanner(void *arg) {
    (void)arg;
    uintptr_t bad = 0;
    for (size_t p = 0; p < array_words / WORDS_PER_PAGE; p++) {
        for (size_t w = 0; w < WORDS_PER_PAGE; w++) {
            size_t i = p * WORDS_PER_PAGE + w;
            if (array[i] != pattern(i)) {
                if (bad < 5)
                    fprintf(stderr, "[clone %d] page %zu (%p) word %zu: %#llx, template had %#llx\n", sft_id, p,
                            (void *)&array[p * WORDS_PER_PAGE], w, (unsigned long long)array[i],
                            (unsigned long long)pattern(i));
                bad++;
                break;
            }
        }
    }
    atomic_store(&scanning, 0);
    return (void *)bad;
}

int main(void) {
    array_words = ARRAY_BYTES / sizeof(uint64_t);
    array = aligned_alloc(4096, ARRAY_BYTES);
    PCHECK(array != NULL);
    for (size_t i = 0; i < array_words; i++) array[i] = pattern(i);

    /* Threads that run and end in the parent: glibc keeps their stacks. */
    pthread_t th[PARENT_THREADS];
    for (int i = 0; i < PARENT_THREADS; i++) PCHECK(pthread_create(&th[i], NULL, parent_thread, NULL) == 0);
    for (int i = 0; i < PARENT_THREADS; i++) PCHECK(pthread_join(th[i], NULL) == 0);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        CHECK(tls_value == 0x5eed);
        pthread_t scan;
        CHECK(pthread_create(&scan, NULL, scanner, NULL) == 0);
        uintptr_t n = 0;
        do {
            pthread_t w;
            void *ret = (void *)-1;
            CHECK(pthread_create(&w, NULL, clone_worker, (void *)++n) == 0);
            CHECK(pthread_join(w, &ret) == 0);
            CHECK(ret == NULL);
        } while (atomic_load(&scanning));
        void *bad = (void *)-1;
        CHECK(pthread_join(scan, &bad) == 0);
        fprintf(stderr, "[clone %d] %lu threads ran during the scan\n", id, (unsigned long)n);
        CHECK(bad == NULL);
        CHECK(tls_value == 0x5eed);
        sf_exit(0);
    }
    sft_join(t, 2);
    printf("PASS cached_stack_threads\n");
    return 0;
}
