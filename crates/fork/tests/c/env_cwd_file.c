/* Environment, cwd, umask, and an open regular file at its offset. */
#include "sftest.h"
#include <fcntl.h>
#include <sys/stat.h>
#include <limits.h>

int main(void) {
    char dir[] = "/tmp/sftest-cwd-XXXXXX";
    PCHECK(mkdtemp(dir) != NULL);
    PCHECK(chdir(dir) == 0);
    setenv("STARLING_TEST_VAR", "hello-clone", 1);
    umask(027);
    FILE *f = fopen("data.txt", "w");
    PCHECK(f != NULL);
    fputs("0123456789abcdefghijklmnopqrstuvwxyz", f);
    fclose(f);
    int fd = open("data.txt", O_RDONLY);
    PCHECK(fd >= 0);
    int fd_hi = fcntl(fd, F_DUPFD, 37);      /* a high fd number */
    char buf[11] = {0};
    PCHECK(read(fd, buf, 10) == 10);        /* offset now 10 */

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        CHECK(getenv("STARLING_TEST_VAR") && strcmp(getenv("STARLING_TEST_VAR"), "hello-clone") == 0);
        char cwd[PATH_MAX];
        CHECK(getcwd(cwd, sizeof cwd) && strcmp(cwd, dir) == 0);
        mode_t old = umask(0);
        CHECK(old == 027);
        char next[5] = {0};
        CHECK(lseek(fd, 0, SEEK_CUR) == 10);
        CHECK(read(fd, next, 4) == 4 && memcmp(next, "abcd", 4) == 0);
        CHECK(fcntl(fd_hi, F_GETFD) >= 0);
        /* relative paths resolve in the restored cwd */
        CHECK(access("data.txt", R_OK) == 0);
        sf_exit(0);
    }
    sft_join(t, 2);
    /* the parent's offset is its own */
    char more[5] = {0};
    PCHECK(read(fd, more, 4) == 4 && memcmp(more, "abcd", 4) == 0);
    unlink("data.txt");
    chdir("/");
    rmdir(dir);
    printf("PASS env_cwd_file\n");
    return 0;
}
