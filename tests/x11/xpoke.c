/* The user's hand for tests/test_x11.py: moves the pointer over the window whose id is argv[1]
 * and taps Shift there, in bursts of ten motions and one key press and release every 200 ms,
 * through XTEST (so the server reports them as real input, not SendEvent's), until killed. */
#include <X11/Xlib.h>
#include <X11/extensions/XTest.h>
#include <X11/keysym.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char **argv) {
    Display *d = XOpenDisplay(NULL);
    int ev, err, major, minor;
    if (!d || argc < 2 || !XTestQueryExtension(d, &ev, &err, &major, &minor)) {
        fprintf(stderr, "xpoke: no display, no window id, or no XTEST\n");
        return 2;
    }
    Window w = (Window)strtoul(argv[1], NULL, 0), child;
    XWindowAttributes a;
    int x, y;
    if (!XGetWindowAttributes(d, w, &a) || !XTranslateCoordinates(d, w, a.root, 0, 0, &x, &y, &child)) {
        fprintf(stderr, "xpoke: no window %s\n", argv[1]);
        return 2;
    }
    KeyCode shift = XKeysymToKeycode(d, XK_Shift_L);
    for (unsigned n = 0;; n++) {
        for (int i = 0; i < 10; i++)
            XTestFakeMotionEvent(d, -1, x + 5 + (int)((n * 10 + i) % 50), y + 5 + i, 0);
        XTestFakeKeyEvent(d, shift, True, 0);
        XTestFakeKeyEvent(d, shift, False, 0);
        XFlush(d);
        usleep(200000);
    }
}
