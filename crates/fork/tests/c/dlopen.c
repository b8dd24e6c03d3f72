/* A dlopen'ed library stays callable in the clone; the clone can dlopen too. */
#include "sftest.h"
#include <dlfcn.h>

int main(int argc, char **argv) {
    PCHECK(argc == 2);                          /* path of libsfplugin.so */
    void *h = dlopen(argv[1], RTLD_NOW);
    PCHECK(h != NULL);
    int (*mul)(int, int) = (int (*)(int, int))dlsym(h, "plugin_mul");
    int *secret = dlsym(h, "plugin_secret");
    PCHECK(mul && secret);
    *secret = 100;                              /* a copy-on-written page of the library */

    sf_ticket_t *t;
    int id = sft_clone(&t, 2);
    if (id > 0) {
        CHECK(mul(6, 7) == 42 + 100);
        CHECK(dlsym(h, "plugin_mul") == (void *)mul);
        void *libm = dlopen("libm.so.6", RTLD_NOW);
        CHECK(libm != NULL);
        double (*cosp)(double) = (double (*)(double))dlsym(libm, "cos");
        CHECK(cosp && cosp(0.0) == 1.0);
        sf_exit(0);
    }
    sft_join(t, 2);
    printf("PASS dlopen\n");
    return 0;
}
