/* What the kernel sources share besides their entry points (kvserve.h): the exp
 * polynomial and the AMX set-up. The kernel build hashes every header in this directory
 * with each source, so a change here rebuilds them all. */
#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H

#include <stdint.h>

/* exp(x) = 2^n * 2^f with n = round(x log2 e) and f in [-0.5, 0.5]; 2^f by a degree-6
 * minimax polynomial (relative error ~1e-7 with float32 rounding). EXP2_POLY(f, MADD, C)
 * is Horner's rule with MADD(a, b, c) = a * b + c and C(constant) in the caller's vector
 * or scalar types, so each kernel keeps its own arithmetic and all share the numbers. */
#define EXP_LOG2E 1.44269504f
#define EXP2_POLY(f, MADD, C)                                                            \
    MADD(MADD(MADD(MADD(MADD(MADD(C(1.53337387e-4f), f, C(1.33951858e-3f)), f,           \
                             C(9.61849187e-3f)), f, C(5.55034131e-2f)), f,                 \
                   C(2.40226477e-1f)), f, C(6.93147182e-1f)), f, C(1.f))

#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>

/* Ask Linux for the AMX tile register state (ARCH_REQ_XCOMP_PERM for XTILEDATA), once
 * per process; 1 when the tiles may be used. */
static inline int amx_request(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* LDTILECFG's 64-byte operand: palette 1, then bytes per row and rows of tmm0-7. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
#endif

#endif
