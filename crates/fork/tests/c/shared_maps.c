/* MAP_SHARED mappings. A shared file mapping is the file itself in the
 * clone (mapped MAP_SHARED again): it reads what the parent wrote through
 * its mapping, and the mapping is shared ('s' in /proc/self/maps). Shared
 * anonymous memory becomes a private copy holding the parent's data: a
 * clone's write to it stays in the clone. */
#include "sftest.h"
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>

#define PAGE 4096
#define ANON_PAGES 16

static const char *parent_text = "written through the parent's shared mapping";

static uint32_t anon_word(size_t i) { return (uint32_t)(i * 2654435761u) | 1; }

/* Is the mapping holding addr shared, as the kernel lists it? */
static int mapped_shared(void *addr) {
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return -1;
    char line[512];
    int shared = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char perms[5];
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) == 3 && (unsigned long)addr >= lo && (unsigned long)addr < hi) {
            shared = perms[3] == 's';
            break;
        }
    }
    fclose(f);
    return shared;
}

int main(void) {
    char dir[] = "/var/tmp/sftest-shared-XXXXXX";
    PCHECK(mkdtemp(dir) != NULL);
    char path[128];
    snprintf(path, sizeof path, "%s/shared.bin", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    PCHECK(fd >= 0 && ftruncate(fd, 2 * PAGE) == 0);
    char *file = mmap(NULL, 2 * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    PCHECK(file != MAP_FAILED);
    close(fd);
    strcpy(file, parent_text);
    PCHECK(msync(file, 2 * PAGE, MS_SYNC) == 0);
    PCHECK(mapped_shared(file) == 1);
    uint32_t *anon = mmap(NULL, ANON_PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    PCHECK(anon != MAP_FAILED);
    for (size_t i = 0; i < ANON_PAGES * PAGE / 4; i++) anon[i] = anon_word(i);

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        CHECK(strcmp(file, parent_text) == 0);
        CHECK(mapped_shared(file) == 1);
        for (size_t i = 0; i < ANON_PAGES * PAGE / 4; i++) CHECK(anon[i] == anon_word(i));
        anon[0] = 0xdead0000u + (uint32_t)id;   /* a private copy: the parent never sees it */
        CHECK(anon[0] == 0xdead0000u + (uint32_t)id);
        sf_exit(0);
    }
    sft_join(t, 2);
    PCHECK(anon[0] == anon_word(0));
    PCHECK(strcmp(file, parent_text) == 0);
    munmap(file, 2 * PAGE);
    unlink(path);
    rmdir(dir);
    printf("PASS shared_maps\n");
    return 0;
}
