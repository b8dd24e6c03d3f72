/* Stack values in the caller's frame, __thread variables, errno. */
#include "sftest.h"
#include <errno.h>

__thread int tls_counter = 5;
__thread char tls_buf[64];

int main(void) {
    volatile long stack_vals[64];
    for (int i = 0; i < 64; i++) stack_vals[i] = i * 1000003L;
    tls_counter = 77;
    strcpy(tls_buf, "thread-local");
    int *errno_addr = &errno;
    int *tls_addr = &tls_counter;

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        for (int i = 0; i < 64; i++) CHECK(stack_vals[i] == i * 1000003L);
        CHECK(tls_counter == 77);
        CHECK(strcmp(tls_buf, "thread-local") == 0);
        CHECK(&tls_counter == tls_addr);
        CHECK(&errno == errno_addr);
        errno = 0;
        CHECK(close(-1) == -1 && errno == EBADF);
        errno = ERANGE;
        CHECK(errno == ERANGE);
        sf_exit(0);
    }
    sft_join(t, 2);
    printf("PASS stack_tls_errno\n");
    return 0;
}
