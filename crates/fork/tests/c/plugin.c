/* A library the dlopen test loads at run time (not linked in). */
int plugin_secret = 1234;
int plugin_mul(int a, int b) { return a * b + plugin_secret; }
