/* What the kernel sources share besides their entry points (kvserve.h): the exp
 * polynomials and the AMX set-up. The kernel build hashes every header in this directory
 * with each source, so a change here rebuilds them all. */
#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp(x) = 2^n * 2^f with n = round(x log2 e) and f in [-0.5, 0.5]; 2^f by a degree-6
 * minimax polynomial (relative error ~1e-7 with float32 rounding). EXP2_POLY(f, MADD, C)
 * is Horner's rule with MADD(a, b, c) = a * b + c and C(constant) in the caller's vector
 * or scalar types, so each kernel keeps its own arithmetic and all share the numbers. */
#define EXP_LOG2E 1.44269504f
#define EXP2_POLY(f, MADD, C)                                                            \
    MADD(MADD(MADD(MADD(MADD(MADD(C(1.53337387e-4f), f, C(1.33951858e-3f)), f,           \
                             C(9.61849187e-3f)), f, C(5.55034131e-2f)), f,                 \
                   C(2.40226477e-1f)), f, C(6.93147182e-1f)), f, C(1.f))
/* exp(x) by that polynomial on a scalar, n = rint(x log2 e); x clamped to [-87, 88] so
 * that 2^n is a normal float built from its bits. Plain arithmetic, which the compiler
 * vectorizes in a loop (linear_vec.c's SwiGLU, fused.c's GeGLU). */
#define EXP_SCALAR(c) (c)
static inline float exp_poly(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float t = x * EXP_LOG2E;
    const float n = rintf(t);
    const float f = t - n;
    const float p = EXP2_POLY(f, fmaf, EXP_SCALAR);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

/* 2^f on [-0.5, 0.5] by a cubic (a least-squares fit of the relative error, reweighted
 * toward minimax: 1.0e-4 at most with float32 rounding), for a value rounded to bfloat16
 * next, whose own rounding is up to 2.0e-3: the AMX attention's probabilities. */
#define EXP2_CUBIC(f, MADD, C)                                                           \
    MADD(MADD(MADD(C(0.0550089255f), f, C(0.242210954f)), f, C(0.693282902f)), f, C(1.f))

/* The linear kernels' (linear_bf16.c, linear_vec.c) weight block: 64 output features. */
#define LINEAR_NB 64

static inline float bf16_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* round to nearest even, as torch rounds a float to bf16 (no NaN reaches here) */
static inline uint16_t float_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* Where column j of a SwiGLU's (gate | up) output, 2 * ff wide, sits in swiglu_layout's
 * order: 64-feature blocks alternating gate, up. */
static inline long swiglu_column(int j, int ff) {
    const int up = j >= ff, f = up ? j - ff : j;
    return (long)(2 * (f / LINEAR_NB) + up) * LINEAR_NB + f % LINEAR_NB;
}

/* Where a linear's block b's results go: plain, columns b * 64 of out (row stride n);
 * SwiGLU (w's blocks alternate gate, up), gate block 2i into scratch and up block 2i + 1,
 * reading it, into columns i * 64 of out (both row stride n / 2). */
typedef struct {
    uint16_t *dst;
    const uint16_t *gate;
    int stride;
} target;

static inline target block_target(uint16_t *out, uint16_t *scratch, int n, int b) {
    target t = {out + b * LINEAR_NB, 0, n};
    if (scratch) {
        t.stride = n / 2;
        t.dst = (b % 2 ? out : scratch) + b / 2 * LINEAR_NB;
        t.gate = b % 2 ? scratch + b / 2 * LINEAR_NB : 0;
    }
    return t;
}

/* For a helper whose only effect is prefetching. GCC counts __builtin_prefetch as no
 * side effect, so it can find such a function (its loops provably finite) `const` and
 * delete the calls to it wherever it did not inline it first: linear_vec.c's k-step
 * prefetch was compiled out that way at every level, with nothing to say so. Forced
 * inline, the prefetches land in the
 * caller; tests/model/test_kernel_build.py checks that each level's build has them. */
#define PREFETCH_HELPER static inline __attribute__((always_inline)) void

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

#include <immintrin.h>
#include <string.h>

/* The linear kernels' tiles (bf16 and int8 alike), 64 bytes a row: tmm0-3 (C) and tmm4
 * (A) of `rows` rows, tmm5-7 (B) of 16. */
static inline void amx_configure_linear(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 5 ? (uint8_t)rows : 16;
    }
    _tile_loadconfig(&cfg);
}

/* C tiles 0-3 to zero, before a pass. */
static inline void amx_zero_c(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* One k step of the linear kernels' 1x4 pass: A (tmm4, rows of x at a_stride bytes)
 * against the four 16-feature B tiles of a 64-feature block (b, rows of 256 bytes) into
 * C 0-3; DP is the tile unit's dot product for the type (_tile_dpbf16ps, _tile_dpbusd). */
#define AMX_1X4_STEP(DP, a, a_stride, b)                                                 \
    do {                                                                                 \
        const char *b_ = (const char *)(b);                                              \
        _tile_loadd(4, a, a_stride);                                                     \
        _tile_loadd(5, b_, 256);                                                         \
        DP(0, 4, 5);                                                                     \
        _tile_loadd(6, b_ + 64, 256);                                                    \
        DP(1, 4, 6);                                                                     \
        _tile_loadd(7, b_ + 128, 256);                                                   \
        DP(2, 4, 7);                                                                     \
        _tile_loadd(5, b_ + 192, 256);                                                   \
        DP(3, 4, 5);                                                                     \
    } while (0)

/* One k step of the 2x2 pass (all tiles 16 rows): A 4-5 (rows 0-15 and 16-31 of x at
 * a_stride bytes) against B 6-7 (features 0-15 and 16-31 of a half-block: b and b + 64
 * bytes, rows of 256) into C 0-3; each B tile serves two A tiles and each A tile two B. */
#define AMX_2X2_STEP(DP, a, a_stride, b)                                                 \
    do {                                                                                 \
        const char *a_ = (const char *)(a), *b_ = (const char *)(b);                     \
        _tile_loadd(4, a_, a_stride);                                                    \
        _tile_loadd(6, b_, 256);                                                         \
        DP(0, 4, 6);                                                                     \
        _tile_loadd(7, b_ + 64, 256);                                                    \
        DP(1, 4, 7);                                                                     \
        _tile_loadd(5, a_ + 16L * (a_stride), a_stride);                                 \
        DP(2, 5, 6);                                                                     \
        DP(3, 5, 7);                                                                     \
    } while (0)

/* C 0-3 of a pass to acc (4-byte sums: float32 or int32): the 1x4 pass's rows x 64, or
 * the 2x2 pass's 32 x 32. */
#define AMX_STORE_1X4(acc)                                                               \
    do {                                                                                 \
        _tile_stored(0, (acc), 256);                                                     \
        _tile_stored(1, (acc) + 16, 256);                                                \
        _tile_stored(2, (acc) + 32, 256);                                                \
        _tile_stored(3, (acc) + 48, 256);                                                \
    } while (0)
#define AMX_STORE_2X2(acc)                                                               \
    do {                                                                                 \
        _tile_stored(0, (acc), 128);                                                     \
        _tile_stored(1, (acc) + 16, 128);                                                \
        _tile_stored(2, (acc) + 16 * 32, 128);                                           \
        _tile_stored(3, (acc) + 16 * 32 + 16, 128);                                      \
    } while (0)

/* Bytes of the next weight block (block_bytes) to fetch at each of a block's `steps` 2x2
 * k steps, whole cache lines; 0 when it has none. */
static inline int amx_prefetch_share(long block_bytes, int steps) {
    return steps ? (int)((block_bytes / steps + 63) / 64 * 64) : 0;
}
#endif

#endif
