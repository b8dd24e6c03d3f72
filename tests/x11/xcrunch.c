/* An X client for tests/test_x11.py's roaming test: a bimodal program. It maps a window named
 * argv[1] listening for keys, buttons and pointer motion, prints its window id, waits for the
 * first input, then crunches (busy arithmetic) for ever, answering every input between slices
 * of work by drawing three frames (a flush each) as an interactive program would. Plain Xlib. */
#include <X11/Xlib.h>
#include <stdio.h>
#include <unistd.h>

static int is_input(const XEvent *e) {
    return e->type == KeyPress || e->type == KeyRelease || e->type == ButtonPress || e->type == ButtonRelease ||
           e->type == MotionNotify;
}

static void answer(Display *d, Window w, GC gc) {
    static unsigned long n;
    for (int f = 0; f < 3; f++) {
        n++;
        XSetForeground(d, gc, (n * 0x2f3f4f) & 0xffffff);
        XFillRectangle(d, w, gc, (int)(n % 10) * 20, 0, 20, 100);
        XFlush(d);
        usleep(2000);
    }
}

int main(int argc, char **argv) {
    Display *d = XOpenDisplay(NULL);
    if (!d) {
        fprintf(stderr, "xcrunch: cannot open the display\n");
        return 2;
    }
    int s = DefaultScreen(d);
    Window w = XCreateSimpleWindow(d, RootWindow(d, s), 10, 10, 200, 100, 1, BlackPixel(d, s), WhitePixel(d, s));
    XStoreName(d, w, argc > 1 ? argv[1] : "xcrunch");
    XSelectInput(d, w, KeyPressMask | KeyReleaseMask | ButtonPressMask | ButtonReleaseMask | PointerMotionMask | StructureNotifyMask);
    XMapWindow(d, w);
    GC gc = XCreateGC(d, w, 0, NULL);
    XEvent e;
    do
        XNextEvent(d, &e);
    while (e.type != MapNotify);
    XSync(d, False);
    printf("window 0x%lx\n", w);
    fflush(stdout);
    do
        XNextEvent(d, &e);
    while (!is_input(&e));
    answer(d, w, gc);
    printf("crunching\n");
    fflush(stdout);
    volatile double x = 1;
    for (;;) {
        for (int i = 0; i < 200000; i++)
            x = x * 1.0000001 + 1e-9;
        int answered = 0;
        while (XPending(d)) {
            XNextEvent(d, &e);
            answered |= is_input(&e);
        }
        if (answered)
            answer(d, w, gc);
    }
}
