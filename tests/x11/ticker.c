/* An X client for tests/test_x11.py: maps a window named argv[1], draws a fixed pattern on it
 * (redrawn on every Expose), and every 100 ms bumps its STARLING_TICKS property (a request on its
 * X connection, which the test watches to see the connection work). Prints its window id once
 * it is mapped. Plain Xlib: one connection, no threads, no extra descriptors. */
#include <X11/Xatom.h>
#include <X11/Xlib.h>
#include <stdio.h>
#include <unistd.h>

static void draw(Display *d, Window w, GC gc) {
    for (int i = 0; i < 12; i++) {
        XSetForeground(d, gc, (unsigned long)(i * 0x151515) & 0xffffff);
        XFillRectangle(d, w, gc, i * 20, (i % 3) * 10, 20, 100);
    }
}

int main(int argc, char **argv) {
    Display *d = XOpenDisplay(NULL);
    if (!d) {
        fprintf(stderr, "ticker: cannot open the display\n");
        return 2;
    }
    int s = DefaultScreen(d);
    Window w = XCreateSimpleWindow(d, RootWindow(d, s), 10, 10, 240, 120, 1, BlackPixel(d, s), WhitePixel(d, s));
    XStoreName(d, w, argc > 1 ? argv[1] : "ticker");
    XSelectInput(d, w, ExposureMask | StructureNotifyMask);
    XMapWindow(d, w);
    GC gc = XCreateGC(d, w, 0, NULL);
    Atom ticks_atom = XInternAtom(d, "STARLING_TICKS", False);
    for (;;) {
        XEvent e;
        XNextEvent(d, &e);
        if (e.type == MapNotify)
            break;
    }
    draw(d, w, gc);
    XSync(d, False);
    printf("window 0x%lx\n", w);
    fflush(stdout);
    long ticks = 0;
    for (;;) {
        while (XPending(d)) {
            XEvent e;
            XNextEvent(d, &e);
            if (e.type == Expose)
                draw(d, w, gc);
        }
        ticks++;
        XChangeProperty(d, w, ticks_atom, XA_CARDINAL, 32, PropModeReplace, (unsigned char *)&ticks, 1);
        XFlush(d);
        usleep(100000);
    }
}
