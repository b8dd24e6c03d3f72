/* A task that opens a socket now and then: every 200 ms it opens a UDP
 * socket, sends one datagram to the discard port of 127.0.0.1, holds the
 * socket for 100 ms and closes it, so half of the time it holds a socket
 * (which cannot move) and half of the time none. Prints "ready", then
 * "period I" after each period, then "done".
 * usage: connects PERIODS */
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {}
}

int main(int argc, char **argv) {
    int periods = argc > 1 ? atoi(argv[1]) : 40;
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons(9), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; i < periods; i++) {
        int s = socket(AF_INET, SOCK_DGRAM, 0);
        if (s < 0) { perror("socket"); return 2; }
        (void)sendto(s, "x", 1, 0, (struct sockaddr *)&to, sizeof to);
        sleep_ms(100);
        close(s);
        sleep_ms(100);
        printf("period %d\n", i);
        fflush(stdout);
    }
    printf("done\n");
    return 0;
}
