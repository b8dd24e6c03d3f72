/* Pipe placeholders and closed sockets. A non-stdio pipe keeps its fd
 * numbers in a clone but is a placeholder: the read end reads EOF (not the
 * data waiting in the parent's pipe), the write end fails with EPIPE
 * (SIGPIPE ignored, as in the parent). Sockets are closed (EBADF). */
#include "sftest.h"
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>

int main(void) {
    int p[2], s[2];
    PCHECK(pipe(p) == 0);
    PCHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, s) == 0);
    /* fixed, high fd numbers: the clone must see them at the same numbers */
    PCHECK(dup2(p[0], 40) == 40 && dup2(p[1], 41) == 41 && dup2(s[0], 42) == 42);
    close(p[0]); close(p[1]); close(s[0]);
    PCHECK(write(41, "parent-data", 11) == 11);   /* waiting in the parent's pipe */
    signal(SIGPIPE, SIG_IGN);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        struct stat st;
        CHECK(fstat(40, &st) == 0 && S_ISFIFO(st.st_mode));
        CHECK(fstat(41, &st) == 0 && S_ISFIFO(st.st_mode));
        CHECK((fcntl(40, F_GETFL) & O_ACCMODE) == O_RDONLY);
        CHECK((fcntl(41, F_GETFL) & O_ACCMODE) == O_WRONLY);
        char buf[32];
        CHECK(read(40, buf, sizeof buf) == 0);
        errno = 0;
        CHECK(write(41, "x", 1) == -1 && errno == EPIPE);
        errno = 0;
        CHECK(fcntl(42, F_GETFD) == -1 && errno == EBADF);
        sf_exit(0);
    }
    sft_join(t, 2);
    /* the parent's pipe still holds its data: no clone read it */
    char buf[32] = {0};
    PCHECK(read(40, buf, sizeof buf) == 11 && memcmp(buf, "parent-data", 11) == 0);
    PCHECK(fcntl(42, F_GETFD) >= 0);
    printf("PASS pipes_sockets\n");
    return 0;
}
