/* Vector registers across a move: loads known patterns into every vector
 * register this CPU has (zmm0-31 with AVX-512, else ymm0-15 with AVX2, else
 * xmm0-15), prints "spinning", then spins on raw read(0) system calls (no
 * libc, so nothing else touches the registers) until a byte arrives on
 * stdin, stores the registers and prints "registers same" or the first
 * that differs. A test moves it while it spins. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static uint8_t in[32][64] __attribute__((aligned(64))), out[32][64] __attribute__((aligned(64)));

/* read(0, &c, 1) until it returns 1 (EAGAIN on a non-blocking stdin spins). */
#define SPIN \
    "1: xor %%eax, %%eax\n xor %%edi, %%edi\n lea %2, %%rsi\n mov $1, %%edx\n syscall\n cmp $1, %%rax\n jne 1b\n"

#define L5(op, n) op(n)
#define Z_LD(n) "vmovdqu64 " #n "*64(%0), %%zmm" #n "\n"
#define Z_ST(n) "vmovdqu64 %%zmm" #n ", " #n "*64(%1)\n"
#define Y_LD(n) "vmovdqu " #n "*64(%0), %%ymm" #n "\n"
#define Y_ST(n) "vmovdqu %%ymm" #n ", " #n "*64(%1)\n"
#define X_LD(n) "movdqu " #n "*64(%0), %%xmm" #n "\n"
#define X_ST(n) "movdqu %%xmm" #n ", " #n "*64(%1)\n"
#define R16(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define R32(M) R16(M) M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) M(24) M(25) M(26) M(27) M(28) M(29) M(30) M(31)

static char byte;

__attribute__((target("avx512f"))) static void zmm(void) {
    __asm__ volatile(R32(Z_LD) SPIN R32(Z_ST) : : "r"(in), "r"(out), "m"(byte) : "rax", "rcx", "rdx", "rsi", "rdi", "r11", "memory");
}
__attribute__((target("avx2"))) static void ymm(void) {
    __asm__ volatile(R16(Y_LD) SPIN R16(Y_ST) : : "r"(in), "r"(out), "m"(byte) : "rax", "rcx", "rdx", "rsi", "rdi", "r11", "memory");
}
static void xmm(void) {
    __asm__ volatile(R16(X_LD) SPIN R16(X_ST) : : "r"(in), "r"(out), "m"(byte) : "rax", "rcx", "rdx", "rsi", "rdi", "r11", "memory");
}

int main(void) {
    int regs, width;
    void (*run)(void);
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) { run = zmm; regs = 32; width = 64; }
    else if (__builtin_cpu_supports("avx2")) { run = ymm; regs = 16; width = 32; }
    else { run = xmm; regs = 16; width = 16; }
    for (int r = 0; r < 32; r++)
        for (int j = 0; j < 64; j++) in[r][j] = (uint8_t)(r * 37 + j * 11 + 1);
    fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
    printf("spinning with %d registers of %d bytes\n", regs, width);
    fflush(stdout);
    run();
    for (int r = 0; r < regs; r++)
        for (int j = 0; j < width; j++)
            if (in[r][j] != out[r][j]) {
                printf("register %d byte %d: %u, was %u\n", r, j, out[r][j], in[r][j]);
                return 1;
            }
    printf("registers same\n");
    return 0;
}
