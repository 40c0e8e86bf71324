/* Linear layers in vector code, for CPUs without AMX tiles, and AMX CPUs' int8:
 * out (M, N) = x (M, K) @ W^T + bias, bf16 in and out, float32 accumulation, one
 * round-to-nearest-even rounding on store.
 *
 * Built once per instruction set (model/backends/cpu/kernels/linear.py passes -m flags for the level
 * model/backends/cpu/isa.py picks), from the same source:
 *   avx512-bf16  vdpbf16ps for bf16 (pairs of k per 32-bit lane), vpdpbusd for int8; with
 *                PREFER_FMA (Intel's cores), passes of FMA_ROWS rows or more as avx512f
 *   avx512f      bf16 -> float32 (a shift) and FMA; int8 by vpmaddubsw / vpmaddwd
 *   avx2         the same with 256-bit vectors (AVX2 + FMA: the portable floor)
 *   amx          avx512-bf16's code, and int8 on the tile unit (tdpbusd) from AMX_INT8_ROWS
 *
 * bf16 weights are in the AMX kernel's layout (linear_bf16.c), (N/64, K/2, 64, 2): every
 * batch size and every instruction set reads the one copy. The FMA path adds a lane's odd
 * k product, then its even one, each product exact in float32: the order vdpbf16ps
 * specifies, so every level gives the same bits, and a row's result is the same whatever
 * rows share its call.
 *
 * int8 weights (--quantization int8) are per-output-feature symmetric, in (N/64, K/4,
 * 64, 4) with the N float32 scales and N int32 compensations after them (int8_pack in
 * model/backends/cpu/kernels/linear.py). Each call quantizes its rows of x to int8, symmetric per
 * row; the dot products are exact int32 sums on every level, then
 * y = float(sum) * (row scale * feature scale) + bias.
 *
 * A SwiGLU's gate and up projections can run as one weight whose 64-feature blocks
 * alternate gate, up (scratch given): the gate block is rounded into scratch and the up
 * block's epilogue stores silu(gate) * up, rounded step by step as the unfused ops are.
 */
#include "kvserve.h"
#include "common.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NB LINEAR_NB  /* output features per block */
#define M_CHUNK 64  /* rows kept hot while a thread's weight blocks pass */
#define PREFETCH 2048  /* bytes of the weight stream fetched ahead */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define VL 16
typedef __m512 vf;
typedef __m512i vi;
#define vf_zero() _mm512_setzero_ps()
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_set1(f) _mm512_set1_ps(f)
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_set1(i) _mm512_set1_epi32(i)
#define vi_zero() _mm512_setzero_si512()
#define vi_add(a, b) _mm512_add_epi32(a, b)
#define vi_store(p, v) _mm512_storeu_si512((void *)(p), v)
#define lo_bf16(w) _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))
#define hi_bf16(w) _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)))
#define MR_MAX 6
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
typedef __m256 vf;
typedef __m256i vi;
#define vf_zero() _mm256_setzero_ps()
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_set1(f) _mm256_set1_ps(f)
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_set1(i) _mm256_set1_epi32(i)
#define vi_zero() _mm256_setzero_si256()
#define vi_add(a, b) _mm256_add_epi32(a, b)
#define vi_store(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define lo_bf16(w) _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
#define hi_bf16(w) _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)))
#define MR_MAX 4  /* rows per pass: the tiles go over a block in slices here */
#endif

#define NV (NB / VL) /* vectors per block row */
/* A pass of more than two rows computes long enough for its weight block to come from
 * L2: each such pass also pulls its share of the thread's next block into L2 (pf_len
 * bytes from pf, spread evenly over the pass's k steps), so the memory streams while the
 * passes compute and the next block's first pass does not wait for DRAM (measured:
 * docs/decisions.md). Called at each
 * step `it`, with the bytes issued so far in `done` and `rate` from PF_RATE for the
 * pass's `its` steps: a division per step cost more than the prefetches at AVX2. */
#define PF_RATE(pf_len, its) ((((long)(pf_len) << 16) + (its) - 1) / (its))
#define PREFETCH_NEXT(pf, rate, done, it)                                                \
    do {                                                                                 \
        const long want_ = ((long)(it) * (rate)) >> 16;                                  \
        for (; done < want_; done += 64) _mm_prefetch((pf) + done, _MM_HINT_T1);         \
    } while (0)

/* The weights PREFETCH bytes past a k step's into L1: one k step of either layout (two k
 * of bf16, four of int8) is 4 * NB bytes of a block. */
PREFETCH_HELPER prefetch_step(const void *wk) {
    for (int off = 0; off < 4 * NB; off += 64)
        _mm_prefetch((const char *)wk + PREFETCH + off, _MM_HINT_T0);
}

/* The weight vectors of a k step, loaded once for all MR rows. Left to itself GCC loads
 * them again for every row (the loads are cheaper to redo than registers to hold, by its
 * measure): 24 loads for 24 dot products at 6 rows, and the tile ran well below the speed
 * it reaches with the vectors held (docs/decisions.md). An empty asm that "changes"
 * them makes a reload impossible. Only where vdpbf16ps / vpdpbusd take the vectors as
 * they are: at the lower levels each is converted or split before use, and holding them
 * spilled others (AVX2 bf16, 256 rows: 168 -> 96 GFLOP/s). */
#define KEEP_IN_REGISTERS(v)                                                             \
    do {                                                                                 \
        for (int j_ = 0; j_ < NV; ++j_) __asm__("" : "+v"(v[j_]));                       \
    } while (0)
#if VL == 16 && defined(__AVX512BF16__)
#define KEEP_BF16(v) KEEP_IN_REGISTERS(v)
#else
#define KEEP_BF16(v) ((void)0)
#endif
#if VL == 16 && defined(__AVX512VNNI__)
#define KEEP_INT8(v) KEEP_IN_REGISTERS(v)
#else
#define KEEP_INT8(v) ((void)0)
#endif
#if MR_MAX >= 6
#define NBLK_MAX 4   /* blocks a pass holds in registers at once */
#define ROW_BLOCKS 4 /* blocks a one-row pass takes */
#else
#define NBLK_MAX 1
#define ROW_BLOCKS 2 /* in turns (bf16_row_turns) */
#endif
_Static_assert(ROW_BLOCKS <= NBLK_MAX * MR_MAX, "a pass's acc holds NBLK_MAX * MR_MAX blocks' rows");

/* Blocks a pass of `rows` rows takes at once: one row, ROW_BLOCKS; two rows, 2 where
 * they fit in registers; more rows (up to MR_MAX), one. */
static inline int blocks_for(int rows) {
    return rows == 1 ? ROW_BLOCKS : (rows == 2 && NBLK_MAX >= 2 ? 2 : 1);
}

/* Calls FN(NBLK, MR, ...) with the shape as constants, for the shapes blocks_for gives. */
#if MR_MAX >= 6
#define WIDE_TILES(FN, nblk, rows, ...)                                                  \
    if (nblk == 4) FN(4, 1, __VA_ARGS__);                                                \
    else if (nblk == 2) FN(2, 2, __VA_ARGS__);                                           \
    else if (rows == 6) FN(1, 6, __VA_ARGS__);                                           \
    else if (rows == 5) FN(1, 5, __VA_ARGS__);                                           \
    else
#else
#define WIDE_TILES(FN, nblk, rows, ...)                                                  \
    if (nblk == 2) FN(2, 1, __VA_ARGS__);                                                \
    else
#endif
#define TILE_SWITCH(FN, nblk, rows, ...)                                                 \
    do {                                                                                 \
        WIDE_TILES(FN, nblk, rows, __VA_ARGS__)                                          \
        switch (rows) {                                                                  \
            case 4: FN(1, 4, __VA_ARGS__); break;                                        \
            case 3: FN(1, 3, __VA_ARGS__); break;                                        \
            case 2: FN(1, 2, __VA_ARGS__); break;                                        \
            default: FN(1, 1, __VA_ARGS__); break;                                       \
        }                                                                                \
    } while (0)

/* ---- the epilogue: bias, SwiGLU, bf16 rounding (plain C, vectorized by the compiler;
 * built without FP contraction, so it is the same arithmetic at every vector width) ---- */

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? (u >> 16) | 0x40u : r);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* *buf, grown to at least `bytes` (its contents not kept). */
static void *kept_buffer(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *buf = malloc(bytes);
        *cap = bytes;
    }
    return *buf;
}

/* The calling thread's buffer of n floats, 64-byte aligned, kept for its next pass: x's
 * rows widened to float32 (6 k floats a pass: 344 KB at k = 14,336), which on the stack
 * overflowed OpenMP workers started with a small OMP_STACKSIZE (256K crashed there) */
static inline float *widened_rows(size_t n) {
    static __thread void *buf;
    static __thread size_t cap;
    const uintptr_t p = (uintptr_t)kept_buffer(&buf, &cap, n * sizeof(float) + 63);
    return (float *)((p + 63) & ~(uintptr_t)63);
}


static const float NO_BIAS[NB];  /* zeros: acc + 0.f, as the plain store adds */

/* One row's W results (a block of NB, or half a block from the AMX int8 2x2 pass): + bias,
 * rounded; with a gate row, silu(gate) * up. W is a constant wherever it is inlined. The
 * SwiGLU loop reads its bias from memory in every case: a `bias ? bias[j] : 0.f` in it
 * kept GCC from vectorizing it (docs/decisions.md). */
static inline __attribute__((always_inline)) void store_cols(const int W, const float *acc,
                                                               const float *bias,
                                                               uint16_t *out,
                                                               const uint16_t *gate) {
    if (gate) {
        const float *b = bias ? bias : NO_BIAS;
        for (int j = 0; j < W; ++j) {
            const float v = acc[j] + b[j];
            const float g = bf16_to_f32(gate[j]);
            const float silu = g / (1.f + exp_poly(-g));
            out[j] = f32_to_bf16(round_bf16(silu) * round_bf16(v));
        }
    } else {
        for (int j = 0; j < W; ++j) out[j] = f32_to_bf16(acc[j] + (bias ? bias[j] : 0.f));
    }
}

static inline void store_row(const float *acc, const float *bias, uint16_t *out,
                             const uint16_t *gate) {
    store_cols(NB, acc, bias, out, gate);
}

/* ---- bf16 ---------------------------------------------------------------------------- */

/* MR rows of x (bf16, row stride k) against NBLK consecutive weight blocks (each k * NB
 * apart): acc (NBLK, MR, NB) float32. Several blocks at once are several streams of
 * weights in flight, which a single-row pass needs to reach the memory bandwidth. */
static inline __attribute__((always_inline)) void bf16_tile(const int NBLK, const int MR,
                                                             const uint16_t *x, int k,
                                                             const uint16_t *w, float *acc,
                                                             const char *pf, long pf_len) {
    vf c[NBLK_MAX][MR_MAX][NV];
    for (int s = 0; s < NBLK; ++s)
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NV; ++j) c[s][r][j] = vf_zero();
    long pf_done = 0;
    const long pf_rate = PF_RATE(pf_len, k / 2);
    for (int kp = 0; kp < k / 2; ++kp) {
        PREFETCH_NEXT(pf, pf_rate, pf_done, kp + 1);
        for (int s = 0; s < NBLK; ++s) {
            const uint16_t *wk = w + (long)s * k * NB + (long)kp * 2 * NB;
            prefetch_step(wk);
            vi wv[NV];
            for (int j = 0; j < NV; ++j) wv[j] = vi_load(wk + j * 2 * VL);
            KEEP_BF16(wv);
            for (int r = 0; r < MR; ++r) {
                uint32_t pair;
                memcpy(&pair, x + (long)r * k + 2 * kp, sizeof pair);
#if VL == 16 && defined(__AVX512BF16__)
                const vi xb = vi_set1((int)pair);
                for (int j = 0; j < NV; ++j)
                    c[s][r][j] = _mm512_dpbf16_ps(c[s][r][j], (__m512bh)wv[j], (__m512bh)xb);
#else
                const vf xe = vf_set1(bf16_to_f32((uint16_t)pair));
                const vf xo = vf_set1(bf16_to_f32((uint16_t)(pair >> 16)));
                for (int j = 0; j < NV; ++j) {
                    c[s][r][j] = vf_fma(hi_bf16(wv[j]), xo, c[s][r][j]);
                    c[s][r][j] = vf_fma(lo_bf16(wv[j]), xe, c[s][r][j]);
                }
#endif
            }
        }
    }
    for (int s = 0; s < NBLK; ++s)
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NV; ++j) vf_store(acc + (s * MR + r) * NB + j * VL, c[s][r][j]);
}

#if VL == 16
/* AVX-512 passes of FMA_ROWS rows or more (compute-bound: a batch's decode step, a
 * prefill) by convert + FMA: always at avx512f, and at avx512-bf16 where model/backends/cpu/isa.py's
 * prefer_fma finds vdpbf16ps the slower way (-DPREFER_FMA; measured: docs/decisions.md). x's
 * rows are widened to float32 once a pass, so that each FMA takes its row's k value as a
 * broadcast from memory; each weight vector is converted once for all MR rows, its odd
 * k's FMAs over every row, then its even k's: per lane the one-row pass's order, the
 * same bits as vdpbf16ps. */
#define FMA_ROWS 4
#define XK 32  /* k per slice of widened x (the weight layout's k is a multiple of it) */
static inline __attribute__((always_inline)) void bf16_tile_fma(
    const int MR, const uint16_t *x, int k, const uint16_t *w, float *acc, const char *pf,
    long pf_len) {
    /* x in float32, slices of XK k with the MR rows' slices side by side: a k pair's
     * broadcasts at fixed offsets from one pointer */
    float *const xf = widened_rows((size_t)k * MR);  /* 24 KB at k = 1,024 */
    for (int s = 0; s < k / XK; ++s)
        for (int r = 0; r < MR; ++r)
            for (int i = 0; i < XK; ++i)
                xf[(s * MR + r) * XK + i] = bf16_to_f32(x[(long)r * k + s * XK + i]);
    vf c[MR_MAX][NV];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) c[r][j] = vf_zero();
    long pf_done = 0;
    const long pf_rate = PF_RATE(pf_len, k / 2);
    for (int kp = 0; kp < k / 2; ++kp) {
        PREFETCH_NEXT(pf, pf_rate, pf_done, kp + 1);
        const uint16_t *wk = w + (long)kp * 2 * NB;
        prefetch_step(wk);
        const float *xs = xf + (2 * kp / XK * MR) * XK + 2 * kp % XK;
        for (int j = 0; j < NV; ++j) {
            const vi wv = vi_load(wk + j * 2 * VL);
            const vf hi = hi_bf16(wv), lo = lo_bf16(wv);
            /* hidden from GCC, which would otherwise hold the 2 * MR broadcasts for all
             * of j and spill accumulators for them: a broadcast is a load, not an ALU op */
            const float *xk = xs;
            __asm__ volatile("" : "+r"(xk));
            for (int r = 0; r < MR; ++r)
                c[r][j] = vf_fma(hi, vf_set1(xk[r * XK + 1]), c[r][j]);
            for (int r = 0; r < MR; ++r) c[r][j] = vf_fma(lo, vf_set1(xk[r * XK]), c[r][j]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NV; ++j) vf_store(acc + r * NB + j * VL, c[r][j]);
}
#if !defined(__AVX512BF16__) || defined(PREFER_FMA)
#define WIDE_FMA 1
#endif
#endif

#if VL == 8
/* AVX2 (16 registers): the block in slices of SV vectors, each over all of k, so that a
 * weight vector is converted once for all MR rows (one row per pass converted it for
 * every row: conversions as many as FMAs); x's rows widened to float32 once, so each
 * row's k pair is two broadcasts from memory. The same FMAs in the same order per lane
 * as the one-row pass, so the same bits. */
#define SV 2
static inline __attribute__((always_inline)) void bf16_tile_sliced(
    const int MR, const uint16_t *x, int k, const uint16_t *w, float *acc, const char *pf,
    long pf_len) {
    float(*const xf)[k] = (float(*)[k])widened_rows((size_t)MR * k);  /* 16 KB at k = 1,024 */
    for (int r = 0; r < MR; ++r)
        for (int i = 0; i < k; ++i) xf[r][i] = bf16_to_f32(x[(long)r * k + i]);
    long pf_done = 0;
    const long pf_rate = PF_RATE(pf_len, NV / SV * (k / 2));
    for (int j0 = 0; j0 < NV; j0 += SV) {
        vf c[MR_MAX][SV];
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < SV; ++j) c[r][j] = vf_zero();
        for (int kp = 0; kp < k / 2; ++kp) {
            PREFETCH_NEXT(pf, pf_rate, pf_done, j0 / SV * (k / 2) + kp + 1);
            const uint16_t *wk = w + (long)kp * 2 * NB;
            if (j0 == 0) prefetch_step(wk);
            vf hi[SV], lo[SV];
            for (int j = 0; j < SV; ++j) {
                const vi wv = vi_load(wk + (j0 + j) * 2 * VL);
                hi[j] = hi_bf16(wv);
                lo[j] = lo_bf16(wv);
            }
            for (int r = 0; r < MR; ++r) {
                const vf xo = vf_set1(xf[r][2 * kp + 1]), xe = vf_set1(xf[r][2 * kp]);
                for (int j = 0; j < SV; ++j) {
                    c[r][j] = vf_fma(hi[j], xo, c[r][j]);
                    c[r][j] = vf_fma(lo[j], xe, c[r][j]);
                }
            }
        }
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < SV; ++j) vf_store(acc + r * NB + (j0 + j) * VL, c[r][j]);
    }
}
#endif

#if VL == 8
/* One row against NT consecutive blocks at AVX2, whose 16 registers hold one block's
 * accumulators: the blocks take turns of TURN_STEPS k steps (1 KB of each), their
 * accumulators parked in acc between turns. NT streams of weights in flight instead of
 * one, which a core's prefetchers read faster (benchmarks/kernels/linear_baseline.py; measured:
 * docs/decisions.md). No
 * software prefetch: with turns it cost more than it brought. Each lane still sums its k
 * in order, so the bits are bf16_tile's. */
#define TURN_STEPS 4
static inline __attribute__((always_inline)) void bf16_row_turns(const int NT,
                                                                  const uint16_t *x, int k,
                                                                  const uint16_t *w,
                                                                  float *acc) {
    for (int j = 0; j < NT * NB; ++j) acc[j] = 0.f;
    for (int k0 = 0; k0 < k / 2; k0 += TURN_STEPS) {
        const int k1 = k0 + TURN_STEPS < k / 2 ? k0 + TURN_STEPS : k / 2;
        for (int s = 0; s < NT; ++s) {
            vf c[NV];
            for (int j = 0; j < NV; ++j) c[j] = _mm256_load_ps(acc + s * NB + j * VL);
            for (int kp = k0; kp < k1; ++kp) {
                const uint16_t *wk = w + (long)s * k * NB + (long)kp * 2 * NB;
                uint32_t pair;
                memcpy(&pair, x + 2 * kp, sizeof pair);
                const vf xe = vf_set1(bf16_to_f32((uint16_t)pair));
                const vf xo = vf_set1(bf16_to_f32((uint16_t)(pair >> 16)));
                for (int j = 0; j < NV; ++j) {
                    const vi wv = vi_load(wk + j * 2 * VL);
                    c[j] = vf_fma(hi_bf16(wv), xo, c[j]);
                    c[j] = vf_fma(lo_bf16(wv), xe, c[j]);
                }
            }
            for (int j = 0; j < NV; ++j) vf_store(acc + s * NB + j * VL, c[j]);
        }
    }
}
#endif

/* ---- int8 ---------------------------------------------------------------------------- */

/* The 4 int8 of x at k .. k + 3 times those of the weights' lanes, summed into each lane. */
static inline vi dot4(vi acc, vi xb, vi w) {
#if VL == 16 && defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, xb, w);  /* x as uint8 (+128: X_OFFSET) */
#elif VL == 16
    /* |w| (uint8) times x with w's sign: 2 products per int16 stay below 2^15 */
    const vi sx = _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xb);
    const vi p16 = _mm512_maddubs_epi16(_mm512_abs_epi8(w), sx);
    return vi_add(acc, _mm512_madd_epi16(p16, _mm512_set1_epi16(1)));
#else
    const vi p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xb, w));
    return vi_add(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

#if VL == 16 && defined(__AVX512VNNI__)
#define X_OFFSET 128  /* vpdpbusd takes x unsigned: x + 128, less 128 * sum(w) after */
#else
#define X_OFFSET 0
#endif

static inline __attribute__((always_inline)) void int8_tile(const int NBLK, const int MR,
                                                             const uint8_t *xq, int k,
                                                             const int8_t *w, int32_t *acc,
                                                             const char *pf, long pf_len) {
    vi c[NBLK_MAX][MR_MAX][NV];
    for (int s = 0; s < NBLK; ++s)
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NV; ++j) c[s][r][j] = vi_zero();
    long pf_done = 0;
    const long pf_rate = PF_RATE(pf_len, k / 4);
    for (int kq = 0; kq < k / 4; ++kq) {
        PREFETCH_NEXT(pf, pf_rate, pf_done, kq + 1);
        for (int s = 0; s < NBLK; ++s) {
            const int8_t *wk = w + (long)s * k * NB + (long)kq * 4 * NB;
            prefetch_step(wk);
            vi wv[NV];
            for (int j = 0; j < NV; ++j) wv[j] = vi_load(wk + j * 4 * VL);
            KEEP_INT8(wv);
            for (int r = 0; r < MR; ++r) {
                int32_t quad;
                memcpy(&quad, xq + (long)r * k + 4 * kq, sizeof quad);
                const vi xb = vi_set1(quad);
                for (int j = 0; j < NV; ++j) c[s][r][j] = dot4(c[s][r][j], xb, wv[j]);
            }
        }
    }
    for (int s = 0; s < NBLK; ++s)
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NV; ++j) vi_store(acc + (s * MR + r) * NB + j * VL, c[s][r][j]);
}

#if VL == 8
/* AVX2: as bf16_tile_sliced, the block in slices of SV vectors over all of k; each weight
 * vector is loaded and its |w| taken once for the MR rows. Exact int32 sums. */
static inline __attribute__((always_inline)) void int8_tile_sliced(
    const int MR, const uint8_t *xq, int k, const int8_t *w, int32_t *acc, const char *pf,
    long pf_len) {
    long pf_done = 0;
    const long pf_rate = PF_RATE(pf_len, NV / SV * (k / 4));
    const vi ones = _mm256_set1_epi16(1);
    for (int j0 = 0; j0 < NV; j0 += SV) {
        vi c[MR_MAX][SV];
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < SV; ++j) c[r][j] = vi_zero();
        for (int kq = 0; kq < k / 4; ++kq) {
            PREFETCH_NEXT(pf, pf_rate, pf_done, j0 / SV * (k / 4) + kq + 1);
            const int8_t *wk = w + (long)kq * 4 * NB;
            if (j0 == 0) prefetch_step(wk);
            vi wv[SV], aw[SV];
            for (int j = 0; j < SV; ++j) {
                wv[j] = vi_load(wk + (j0 + j) * 4 * VL);
                aw[j] = _mm256_abs_epi8(wv[j]);
            }
            for (int r = 0; r < MR; ++r) {
                int32_t quad;
                memcpy(&quad, xq + (long)r * k + 4 * kq, sizeof quad);
                const vi xb = vi_set1(quad);
                for (int j = 0; j < SV; ++j) {
                    const vi p16 = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xb, wv[j]));
                    c[r][j] = vi_add(c[r][j], _mm256_madd_epi16(p16, ones));
                }
            }
        }
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < SV; ++j) vi_store(acc + r * NB + (j0 + j) * VL, c[r][j]);
    }
}
#endif

#if VL == 8
/* int8's bf16_row_turns: turns of TURN_STEPS k quads (1 KB of a block each). */
static inline __attribute__((always_inline)) void int8_row_turns(const int NT,
                                                                  const uint8_t *xq, int k,
                                                                  const int8_t *w,
                                                                  int32_t *acc) {
    for (int j = 0; j < NT * NB; ++j) acc[j] = 0;
    for (int k0 = 0; k0 < k / 4; k0 += TURN_STEPS) {
        const int k1 = k0 + TURN_STEPS < k / 4 ? k0 + TURN_STEPS : k / 4;
        for (int s = 0; s < NT; ++s) {
            vi c[NV];
            for (int j = 0; j < NV; ++j) c[j] = vi_load(acc + s * NB + j * VL);
            for (int kq = k0; kq < k1; ++kq) {
                const int8_t *wk = w + (long)s * k * NB + (long)kq * 4 * NB;
                int32_t quad;
                memcpy(&quad, xq + 4 * kq, sizeof quad);
                const vi xb = vi_set1(quad);
                for (int j = 0; j < NV; ++j) c[j] = dot4(c[j], xb, vi_load(wk + j * 4 * VL));
            }
            for (int j = 0; j < NV; ++j) vi_store(acc + s * NB + j * VL, c[j]);
        }
    }
}
#endif

/* n bf16 values -> int8 q (stored + offset), returning their scale: q = rint(x * 127 /
 * max|x|), the scale max|x| / 127. */
static inline float quantize_span(const uint16_t *x, int n, uint8_t *q, int offset) {
    /* max |x| on the bf16 bits: without the sign they order as the values do. GCC
     * vectorizes this integer max; the float one stayed a chain of scalar vmaxss
     * (docs/decisions.md). A NaN (above 0x7f80) is skipped, as the float comparison
     * below skips it. */
    unsigned top = 0;
    for (int i = 0; i < n; ++i) {
        const unsigned a = x[i] & 0x7fffu;
        top = a > top ? a : top;
    }
    float amax = bf16_to_f32((uint16_t)top);
    if (top > 0x7f80u) {
        amax = 0.f;
        for (int i = 0; i < n; ++i) {
            const float a = fabsf(bf16_to_f32(x[i]));
            amax = a > amax ? a : amax;
        }
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < n; ++i) {
        float v = rintf(bf16_to_f32(x[i]) * inv);
        v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
        q[i] = (uint8_t)((int)v + offset);
    }
    return amax / 127.f;
}

/* Row r of x -> int8 (stored + offset) with scale sx[r] (quantize_span). */
static void quantize_rows(const uint16_t *x, int m, int k, uint8_t *xq, float *sx,
                          int offset, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if ((long)m * k > 65536)
    for (int r = 0; r < m; ++r)
        sx[r] = quantize_span(x + (long)r * k, k, xq + (long)r * k, offset);
}

/* ---- the drivers --------------------------------------------------------------------- */

/* The work of a call is units x passes: a unit is a weight block (a gate/up pair for a
 * SwiGLU), and each unit is passed over by every pass of every chunk of rows (chunks of
 * M_CHUNK rows, passes of up to MR_MAX). Each thread takes an equal contiguous share in
 * unit-major order, so a unit at a share's edge is split between two threads by passes
 * (each pass is the same rows against the same block whoever runs it: the same bits).
 * Shares of whole units left one thread idle at the end: 9 blocks (d = 576) over two
 * threads is 5 against 4, and such a call at 16 rows took as long as one of 10 blocks.
 * A call of one or two rows takes the blocks blocks_for() says
 * at a time in a single pass: there the shares are whole units (in a longer call a chunk
 * of one or two rows takes one block a pass). Within a share, for each chunk of
 * rows, each of its units while the passes go over it; results go out in block order (a
 * gate before its up block). */
#ifdef _OPENMP
#define OMP_IDS(t, nt) (t = omp_get_thread_num(), nt = omp_get_num_threads())
#else
#define OMP_IDS(t, nt) ((void)0)
#endif
static inline int passes_of(int m) {  /* the passes over one unit, all chunks */
    const int last = m % M_CHUNK;
    return m / M_CHUNK * ((M_CHUNK + MR_MAX - 1) / MR_MAX) + (last + MR_MAX - 1) / MR_MAX;
}
#define FOR_PASSES(n, m, scratch, nthreads, BODY)                                        \
    do {                                                                                 \
        const int unit = (scratch) ? 2 : 1, units = (n) / NB / unit;                     \
        const int few = (m) <= 2, tp = few ? 1 : passes_of(m);                           \
        const long work = (long)units * tp;                                              \
        int nt_ = (nthreads) < work ? (nthreads) : (int)work;                            \
        if (nt_ < 1) nt_ = 1;                                                            \
        _Pragma("omp parallel num_threads(nt_)")                                         \
        {                                                                                \
            int t_ = 0, nts_ = 1;                                                        \
            OMP_IDS(t_, nts_);                                                           \
            const long w0 = work * t_ / nts_, w1 = work * (t_ + 1) / nts_;               \
            /* the share: unit u0 from pass g0 to unit u1 (inclusive) to pass g1 */     \
            const int u0 = (int)(w0 / tp), g0 = (int)(w0 % tp);                          \
            const int u1 = (int)((w1 - 1) / tp), g1 = (int)((w1 - 1) % tp);              \
            const int b0 = u0 * unit, b1 = w0 < w1 ? (u1 + 1) * unit : b0;               \
            for (int m0 = 0, g = 0; m0 < (m); m0 += M_CHUNK) {                           \
                const int m1 = m0 + M_CHUNK < (m) ? m0 + M_CHUNK : (m);                  \
                const int group = few ? blocks_for(m1 - m0) : 1;                         \
                const int passes = (m1 - m0 + MR_MAX - 1) / MR_MAX;                      \
                for (int b = b0; b < b1;) {                                              \
                    const int nblk = b + group <= b1 ? group : 1, u = b / unit;          \
                    /* the block after these (PREFETCH_NEXT); -1: none, or one or two */ \
                    /* rows, whose passes read several blocks at once instead */         \
                    const int next = group > 1 ? -1                                      \
                                     : b + nblk < b1 ? b + nblk                          \
                                     : m1 < (m) ? b0 : -1;                               \
                    for (int r = m0; r < m1; r += MR_MAX) {                              \
                        const int rows = m1 - r < MR_MAX ? m1 - r : MR_MAX;              \
                        const int pass = (r - m0) / MR_MAX;                              \
                        if ((u == u0 && g + pass < g0) || (u == u1 && g + pass > g1))    \
                            continue; /* the other thread's passes of a shared unit */   \
                        BODY                                                             \
                    }                                                                    \
                    b += nblk;                                                           \
                }                                                                        \
                g += passes;                                                             \
            }                                                                            \
        }                                                                                \
    } while (0)

#if VL == 8
#define BF16_TILE(NBLK, MR, x, k, w, acc, pf, pf_len)                                    \
    (NBLK > 1   ? bf16_row_turns(NBLK, x, k, w, acc)                                     \
     : MR == 1 ? bf16_tile(1, 1, x, k, w, acc, pf, pf_len)                               \
               : bf16_tile_sliced(MR, x, k, w, acc, pf, pf_len))
#define INT8_TILE(NBLK, MR, x, k, w, acc, pf, pf_len)                                    \
    (NBLK > 1   ? int8_row_turns(NBLK, x, k, w, acc)                                     \
     : MR == 1 ? int8_tile(1, 1, x, k, w, acc, pf, pf_len)                               \
               : int8_tile_sliced(MR, x, k, w, acc, pf, pf_len))
#elif defined(WIDE_FMA)
#define BF16_TILE(NBLK, MR, ...) \
    (MR < FMA_ROWS ? bf16_tile(NBLK, MR, __VA_ARGS__) : bf16_tile_fma(MR, __VA_ARGS__))
#define INT8_TILE(NBLK, MR, ...) int8_tile(NBLK, MR, __VA_ARGS__)
#else
#define BF16_TILE(NBLK, MR, ...) bf16_tile(NBLK, MR, __VA_ARGS__)
#define INT8_TILE(NBLK, MR, ...) int8_tile(NBLK, MR, __VA_ARGS__)
#endif
/* This pass's share of block `next` of w (blocks of block_bytes): start and length. */
#define NEXT_SHARE(w, block_bytes, next, pass, passes, pf, pf_len)                       \
    const char *pf = (const char *)(w) + ((next) < 0 ? 0 : (long)(next) * (block_bytes) + \
                                          (block_bytes) * (pass) / (passes));            \
    const long pf_len = (next) < 0 ? 0                                                   \
                        : (block_bytes) * ((pass) + 1) / (passes) -                      \
                              (block_bytes) * (pass) / (passes)

void linear_bf16_vec(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                     uint16_t *scratch, int m, int n, int k, int nthreads) {
    FOR_PASSES(n, m, scratch, nthreads, {
        float acc[NBLK_MAX * MR_MAX * NB] __attribute__((aligned(64)));
        NEXT_SHARE(w, 2L * k * NB, next, pass, passes, pf, pf_len);
        TILE_SWITCH(BF16_TILE, nblk, rows, x + (long)r * k, k, w + (long)b * k * NB, acc, pf,
                    pf_len);
        for (int s = 0; s < nblk; ++s) {
            const target t = block_target(out, scratch, n, b + s);
            for (int i = 0; i < rows; ++i)
                store_row(acc + (s * rows + i) * NB, bias ? bias + (b + s) * NB : 0,
                          t.dst + (long)(r + i) * t.stride,
                          t.gate ? t.gate + (long)(r + i) * t.stride : 0);
        }
    });
}

/* One row's W int32 sums -> y = float(sum) * (row scale * feature scale), stored as
 * store_row does. */
static inline __attribute__((always_inline)) void store_int8_row(
    const int W, const int32_t *a, float sr, const float *sw, const int32_t *comp,
    const float *bias, uint16_t *dst, const uint16_t *gate) {
    float y[NB] __attribute__((aligned(64)));
    for (int j = 0; j < W; ++j)
        y[j] = (float)(a[j] - (X_OFFSET ? comp[j] : 0)) * (sr * sw[j]);
    store_cols(W, y, bias, dst, gate);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && X_OFFSET == 128
/* int8 on the AMX tile unit (the amx build of this file): tdpbusd takes x as uint8 (+128)
 * and the weights as int8 in exactly the layout above, (K/4, 64, 4) a block being the
 * tile unit's B operand at a stride of 256 bytes, and sums them exactly in int32, as
 * vpdpbusd does: the same sums, so the same bits, at any number of rows and in either
 * pass below. Used from AMX_INT8_ROWS rows up where k is whole 64-byte tile rows; below
 * 8 rows the VNNI passes measured as fast or faster, from 16 up the tiles faster. The
 * passes are linear_bf16.c's: 32 rows against half a block
 * (2 x 2 tiles, the half-block's weights staying in L1 while a chunk's rows pass), and up
 * to 16 rows against a whole block (1 x 4) for the rows left over. */
#define AMX_INT8_ROWS 8
#define AMX_INT8_KSTEP 64   /* k per tile: 16 rows of 4 */
#define AMX_INT8_CHUNK 256  /* rows of x kept hot in L2 while a thread's blocks pass */

int linear_vec_init(void) { return amx_request(); }

/* A pass's int32 sums wait here while the next pass's dot products are issued, so their
 * epilogue (scales, bias, SwiGLU, rounding) runs beside the tile unit's work instead of
 * after it, as linear_bf16.c's epilogue does. */
typedef struct {
    int32_t acc[2][32 * NB] __attribute__((aligned(64)));
    int cur;          /* which acc the next pass stores into */
    int rows, width;  /* of the waiting pass; rows 0 when none waits */
    int stride;       /* of dst and gate */
    const float *sx;  /* the waiting rows' scales */
    const float *sw;  /* the waiting features' scales, compensations, bias (or null) */
    const int32_t *comp;
    const float *bias;
    uint16_t *dst;
    const uint16_t *gate;
} int8_epilogue;

/* The waiting pass's rows through store_int8_row, its width a constant in each call. */
static void int8_flush(int8_epilogue *e) {
    const int32_t *acc = e->acc[e->cur ^ 1];
    for (int i = 0; i < e->rows; ++i) {
        uint16_t *dst = e->dst + (long)i * e->stride;
        const uint16_t *gate = e->gate ? e->gate + (long)i * e->stride : 0;
        if (e->width == NB)
            store_int8_row(NB, acc + i * NB, e->sx[i], e->sw, e->comp, e->bias, dst, gate);
        else
            store_int8_row(32, acc + i * 32, e->sx[i], e->sw, e->comp, e->bias, dst, gate);
    }
    e->rows = 0;
}

/* Flush the waiting pass, then store tiles 0-3 (rows x width sums of the pass just
 * issued, for features from f0 of block target tg, rows from r) to wait in its place. */
#define INT8_HAND_OVER(e, rows_, width_, r, f0, sx_, sw_, comp_, bias_, tg, STORE_TILES)      \
    do {                                                                                 \
        int8_flush(e);                                                                   \
        int32_t *acc = (e)->acc[(e)->cur];                                               \
        STORE_TILES;                                                                     \
        (e)->rows = rows_, (e)->width = width_, (e)->stride = (tg).stride;               \
        (e)->sx = (sx_) + (r), (e)->sw = (sw_) + (f0), (e)->comp = (comp_) + (f0);       \
        (e)->bias = (bias_) ? (bias_) + (f0) : 0;                                        \
        (e)->dst = (tg).dst + (long)(r) * (tg).stride + (f0) % NB;                       \
        (e)->gate = (tg).gate ? (tg).gate + (long)(r) * (tg).stride + (f0) % NB : 0;      \
        (e)->cur ^= 1;                                                                   \
    } while (0)

/* Tiles as amx_configure_linear sets them: C 0-3 (rows x 16 int32), A 4 (rows x 64
 * uint8), B 5-7 (16 k-quads x 64 bytes). Up to 16 rows of xq (row stride k) against the
 * 64-feature block w; the block streams from memory, the next k step asked for ahead. */
static void amx_int8_1x4(const uint8_t *xq, int k, const int8_t *w) {
    amx_zero_c();
    for (int kk = 0; kk < k; kk += AMX_INT8_KSTEP) {
        const int8_t *b = w + (long)kk * NB;  /* k-quad kk / 4, 4 * NB bytes each */
        for (int off = 0; off < AMX_INT8_KSTEP * NB; off += 64)
            _mm_prefetch((const char *)b + AMX_INT8_KSTEP * NB + off, _MM_HINT_T0);
        AMX_1X4_STEP(_tile_dpbusd, xq + kk, k, b);
    }
}

/* 32 rows of xq against 32 features (w: half a block, its rows 256 bytes apart) by
 * AMX_2X2_STEP; a share of the next block (pf_step bytes a k step) goes to L2 meanwhile. */
static void amx_int8_2x2(const uint8_t *xq, int k, const int8_t *w, const char *pf,
                         int pf_step) {
    amx_zero_c();
    for (int kk = 0; kk < k; kk += AMX_INT8_KSTEP) {
        const int8_t *b = w + (long)kk * NB;
        for (int off = 0; off < pf_step; off += 64) _mm_prefetch(pf + off, _MM_HINT_T1);
        pf += pf_step;
        AMX_2X2_STEP(_tile_dpbusd, xq + kk, k, b);
    }
}

/* Rows m0..m1 of xq against block b: pairs of 16-row tiles one half-block at a time,
 * then the rows left over by the 1x4 pass; *configured tracks the tile shape. */
static void amx_int8_rows(const uint8_t *xq, const float *sx, const int8_t *q, const float *sw,
                          const int32_t *comp, const float *bias, target tg, int b, int m0,
                          int m1, int k, int *configured, int8_epilogue *e) {
    const int8_t *w = q + (long)b * k * NB;
    const int pairs_end = m0 + (m1 - m0) / 32 * 32;
    if (pairs_end > m0 && *configured != 16) amx_configure_linear(*configured = 16);
    /* the next block into L2 over this one's 2x2 passes, as linear_bf16.c's amx_rows */
    const int steps = (pairs_end - m0) / 32 * 2 * (k / AMX_INT8_KSTEP);
    const long block_bytes = (long)k * NB;
    const int pf_step = amx_prefetch_share(block_bytes, steps);
    const char *pf = (const char *)(w + block_bytes);
    for (int half = 0; half < 2; ++half)
        for (int r = m0; r < pairs_end; r += 32) {
            amx_int8_2x2(xq + (long)r * k, k, w + half * 128, pf, pf_step);
            pf += (long)pf_step * (k / AMX_INT8_KSTEP);
            INT8_HAND_OVER(e, 32, 32, r, b * NB + half * 32, sx, sw, comp, bias, tg,
                           AMX_STORE_2X2(acc));
        }
    for (int r = pairs_end; r < m1; r += 16) {
        const int rows = m1 - r < 16 ? m1 - r : 16;
        if (*configured != rows) amx_configure_linear(*configured = rows);
        amx_int8_1x4(xq + (long)r * k, k, w);
        INT8_HAND_OVER(e, rows, NB, r, b * NB, sx, sw, comp, bias, tg, AMX_STORE_1X4(acc));
    }
}

/* Each thread a contiguous share of whole units (a SwiGLU's gate block before its up
 * block), as the bf16 tile kernel shares them; for each chunk of rows, each of its
 * blocks. A gate block's last pass is flushed before its up block's first epilogue reads
 * it: an up block's passes cover the same rows in the same order, and each pass flushes
 * the one before it. */
static void linear_int8_amx(const uint8_t *xq, const float *sx, const int8_t *q,
                            const float *sw, const int32_t *comp, const float *bias,
                            uint16_t *out, uint16_t *scratch, int m, int n, int k,
                            int nthreads) {
    const int unit = scratch ? 2 : 1, units = n / NB / unit;
    if (nthreads > units) nthreads = units;
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
        OMP_IDS(t, nt);
        const int b0 = (int)((long)units * t / nt) * unit;
        const int b1 = (int)((long)units * (t + 1) / nt) * unit;
        int8_epilogue e;
        e.cur = 0;
        e.rows = 0;
        int configured = 0;
        for (int m0 = 0; m0 < m; m0 += AMX_INT8_CHUNK) {
            const int m1 = m0 + AMX_INT8_CHUNK < m ? m0 + AMX_INT8_CHUNK : m;
            for (int b = b0; b < b1; ++b)
                amx_int8_rows(xq, sx, q, sw, comp, bias, block_target(out, scratch, n, b), b,
                              m0, m1, k, &configured, &e);
        }
        int8_flush(&e);
        if (configured) _tile_release();
    }
}
#define AMX_INT8(m, k) ((m) >= AMX_INT8_ROWS && (k) % AMX_INT8_KSTEP == 0)
#else
int linear_vec_init(void) { return 1; }
#define AMX_INT8(m, k) 0
#define linear_int8_amx(...) ((void)0)
#endif

void linear_int8(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads) {
    const int8_t *q = (const int8_t *)w;
    const float *sw = (const float *)(q + (long)n * k);
    const int32_t *comp = (const int32_t *)(sw + n);
    /* x's rows in int8 and their scales, in buffers the calling thread keeps (a fresh
     * allocation of a prefill's rows came back from the OS as pages to fault in on
     * every call); the parallel regions get them as locals, since a __thread variable
     * named there would be each worker's own */
    static __thread void *xq_buf, *sx_buf;
    static __thread size_t xq_cap, sx_cap;
    uint8_t *const xq = kept_buffer(&xq_buf, &xq_cap, (size_t)m * k + 64);
    float *const sx = kept_buffer(&sx_buf, &sx_cap, sizeof(float) * ((size_t)m + 1));
    quantize_rows(x, m, k, xq, sx, X_OFFSET, nthreads);
    if (AMX_INT8(m, k)) {
        linear_int8_amx(xq, sx, q, sw, comp, bias, out, scratch, m, n, k, nthreads);
        return;
    }
    FOR_PASSES(n, m, scratch, nthreads, {
        int32_t acc[NBLK_MAX * MR_MAX * NB] __attribute__((aligned(64)));
        NEXT_SHARE(q, (long)k * NB, next, pass, passes, pf, pf_len);
        TILE_SWITCH(INT8_TILE, nblk, rows, xq + (long)r * k, k, q + (long)b * k * NB, acc, pf,
                    pf_len);
        for (int s = 0; s < nblk; ++s) {
            const int bs = b + s;
            const target t = block_target(out, scratch, n, bs);
            for (int i = 0; i < rows; ++i)
                store_int8_row(NB, acc + (s * rows + i) * NB, sx[r + i], sw + bs * NB,
                               comp + bs * NB, bias ? bias + bs * NB : 0,
                               t.dst + (long)(r + i) * t.stride,
                               t.gate ? t.gate + (long)(r + i) * t.stride : 0);
        }
    });
}

/* ---- grouped weights: int4, int5 and int8g --------------------------------------------- */

/* Weights with a scale each GROUP k of an output feature, for checkpoints stored that way
 * and --quantization int4 (model/backends/cpu/kernels/linear.py's int4_pack, int5_pack,
 * int8g_pack):
 *   int4   w = d * q + m, q in 0..15, the group's d and m in float16. A block of NB features
 *          is (K/8, NB, 4) bytes: a feature's 4 bytes at octet o hold k = 8o + i in byte
 *          i's low nibble and k = 8o + 4 + i in its high one, so one vector of bytes
 *          unpacks to two k quads; then (K/GROUP, 2, NB) float16, each group's d then m.
 *   int5   w = d * q + m, q in 0..31, d and m in float16 (GGUF's Q5_0, Q5_1, Q5_K). Each
 *          octet is int4's NB * 4 bytes of the codes' low four bits, then two planes of
 *          NB / 2 bytes: bit p of the first is the fifth bit of the code in byte p's
 *          low nibble, of the second of its high one; then (K/GROUP, 2, NB) float16.
 *   int8g  w = d * q, q int8, the group's d in float16 (GGUF's Q8_0 blocks held as they
 *          are). A block is (K/4, NB, 4) int8, then (K/GROUP, NB) float16.
 * A call quantizes each group of GROUP values of x's rows to int8 (symmetric, its own
 * scale sx, no offset) and sums each group's quantized x (xs); per group the exact int32
 * sum s of q * xq becomes sx * (d * s + m * xs) (int4, int5) or sx * (d * s) (int8g) in
 * float32 (multiplies and adds, no fused multiply-add), added group after group: the
 * same operations in the same order at every level and row count, the same bits. The
 * tile unit does not take these: the amx build runs the VNNI code (a group's sums through
 * the tiles, each stored for its scales, measured no faster: docs/kernels.md). */
#define GROUP 32
#if VL == 16
#define GROUPED_MR 4 /* rows a pass: each weight vector serves them all */
#define GROUPED_SV 2 /* vectors of a block a pass of several rows holds */
#define GROUPED_ROW_SV 4 /* ... and of one row */
#define vi_and(a, b) _mm512_and_si512(a, b)
#define vi_xor(a, b) _mm512_xor_si512(a, b)
#define vi_sub(a, b) _mm512_sub_epi32(a, b)
#define vi_srl16(a, n) _mm512_srli_epi16(a, n)
#define vi_set1_8(c) _mm512_set1_epi8(c)
#define vf_from_int(a) _mm512_cvtepi32_ps(a)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#else
#define GROUPED_MR 2
#define GROUPED_SV 2
#define GROUPED_ROW_SV 2
#define vi_and(a, b) _mm256_and_si256(a, b)
#define vi_xor(a, b) _mm256_xor_si256(a, b)
#define vi_sub(a, b) _mm256_sub_epi32(a, b)
#define vi_srl16(a, n) _mm256_srli_epi16(a, n)
#define vi_set1_8(c) _mm256_set1_epi8(c)
#define vf_from_int(a) _mm256_cvtepi32_ps(a)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#endif

/* int5's codes: a vector of int4's nibbles (a, 0..15) with each byte's fifth bit (16)
 * from `plane`, one bit a byte in the vector's byte order (VL * 4 bits) */
static inline vi with_high_bits(vi a, const uint8_t *plane) {
#if VL == 16
    uint64_t bits;
    memcpy(&bits, plane, 8);
    return _mm512_mask_add_epi8(a, (__mmask64)bits, a, _mm512_set1_epi8(16));
#else
    uint32_t bits;
    memcpy(&bits, plane, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(a, _mm256_and_si256(set, _mm256_set1_epi8(16)));
#endif
}

/* acc + the 4 products of each lane's 4 unsigned weights (0..15) and x's 4 int8 */
static inline vi dot_u4(vi acc, vi w, vi x) {
#if VL == 16 && defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, x);
#elif VL == 16
    return vi_add(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
#else
    return vi_add(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

/* int8g's weight vector as dot_s8 takes it, and acc + the 4 products of each lane's 4
 * int8 weights and x's 4 int8: with VNNI, w + 128 (unsigned) times x, which adds 128 *
 * the group's sum of x (S8_LIFT: taken off per group); elsewhere dot4's exact sum */
#if VL == 16 && defined(__AVX512VNNI__)
#define S8_LIFT 128
#define s8_operand(w) vi_xor(w, vi_set1_8((char)0x80))
static inline vi dot_s8(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
#define S8_LIFT 0
#define s8_operand(w) (w)
static inline vi dot_s8(vi acc, vi w, vi x) { return dot4(acc, x, w); }
#endif

/* MR rows of xq against one block's vectors j0 .. j0 + NSV, int4 (BITS 4), int5 (BITS 5)
 * or int8g (BITS 8): acc (MR, NB) float32. xs and sx: (MR, K/GROUP) each group's sum of xq and
 * scale. pf: the next block's pf_len bytes, pulled into L2 over the first slice's k
 * steps (as the int8 kernel's passes do: PREFETCH_NEXT), or NULL. */
static inline __attribute__((always_inline)) void grouped_slice(
    const int BITS, const int MR, const int NSV, const int8_t *xq, const int32_t *xs,
    const float *sx, int k, const uint8_t *wq, const uint16_t *scales, int j0, float *acc,
    const char *pf, long pf_len) {
    const vi low = vi_set1_8(0x0F);
    const int groups = k / GROUP;
    const long pf_rate = PF_RATE(pf_len, k / 8);
    long pf_done = 0;
    vf c[GROUPED_MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NSV; ++j) c[r][j] = vf_zero();
    for (int g = 0; g < groups; ++g) {
        vi s[GROUPED_MR][NV];
        for (int r = 0; r < MR; ++r)
            for (int j = 0; j < NSV; ++j) s[r][j] = vi_zero();
        for (int o = g * GROUP / 8; o < (g + 1) * GROUP / 8; ++o) {  /* 8 k a step */
            if (j0 == 0) {  /* the block's bytes PREFETCH ahead (an octet: BITS * NB) */
                prefetch_step(wq + (long)o * NB * BITS);
                if (BITS == 8) prefetch_step(wq + (long)o * NB * BITS + 4 * NB);
                if (BITS == 5)
                    _mm_prefetch((const char *)wq + (long)o * NB * BITS + 4 * NB + PREFETCH,
                                 _MM_HINT_T0);
                if (pf) PREFETCH_NEXT(pf, pf_rate, pf_done, o + 1);
            }
            vi lo[NV], hi[NV];
            for (int j = 0; j < NSV; ++j) {
                if (BITS == 4) {
                    const vi v = vi_load(wq + ((long)o * NB + (j0 + j) * VL) * 4);
                    lo[j] = vi_and(v, low);
                    hi[j] = vi_and(vi_srl16(v, 4), low);
                } else if (BITS == 5) {  /* int4's nibbles, then the two bit planes */
                    const uint8_t *octet = wq + (long)o * NB * 5;
                    const vi v = vi_load(octet + (j0 + j) * VL * 4);
                    const uint8_t *planes = octet + 4 * NB + (j0 + j) * VL / 2;
                    lo[j] = with_high_bits(vi_and(v, low), planes);
                    hi[j] = with_high_bits(vi_and(vi_srl16(v, 4), low), planes + NB / 2);
                } else {
                    lo[j] = s8_operand(vi_load(wq + ((long)2 * o * NB + (j0 + j) * VL) * 4));
                    hi[j] = s8_operand(vi_load(wq + ((long)(2 * o + 1) * NB + (j0 + j) * VL) * 4));
                }
            }
            for (int r = 0; r < MR; ++r) {
                int32_t q0, q1;
                memcpy(&q0, xq + (long)r * k + 8 * o, 4);
                memcpy(&q1, xq + (long)r * k + 8 * o + 4, 4);
                const vi x0 = vi_set1(q0), x1 = vi_set1(q1);
                for (int j = 0; j < NSV; ++j)
                    s[r][j] = BITS != 8 ? dot_u4(dot_u4(s[r][j], lo[j], x0), hi[j], x1)
                                        : dot_s8(dot_s8(s[r][j], lo[j], x0), hi[j], x1);
            }
        }
        for (int j = 0; j < NSV; ++j) {
            const long at = (j0 + j) * VL;
            const uint16_t *dm = scales + (long)g * (BITS == 8 ? 1 : 2) * NB + at;
            const vf d = vf_load_f16(dm);
            const vf mn = BITS == 8 ? d : vf_load_f16(dm + NB);
            for (int r = 0; r < MR; ++r) {
                const vf sg = vf_set1(sx[r * groups + g]);
                vf t;
                if (BITS != 8) {
                    const vf xsum = vf_set1((float)xs[r * groups + g]);
                    t = vf_add(vf_mul(d, vf_from_int(s[r][j])), vf_mul(mn, xsum));
                } else {
                    const vi exact = vi_sub(s[r][j], vi_set1(S8_LIFT * xs[r * groups + g]));
                    t = vf_mul(d, vf_from_int(exact));
                }
                c[r][j] = vf_add(c[r][j], vf_mul(sg, t));
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NSV; ++j) vf_store(acc + r * NB + (j0 + j) * VL, c[r][j]);
}

/* The bytes of a block's weights (its scales follow them). */
static inline long grouped_weight_bytes(const int BITS, int k) { return (long)k * NB * BITS / 8; }

static inline __attribute__((always_inline)) void grouped_tile(
    const int BITS, const int MR, const int8_t *xq, const int32_t *xs, const float *sx, int k,
    const uint8_t *block, float *acc, const char *pf, long pf_len) {
    const uint16_t *scales = (const uint16_t *)(block + grouped_weight_bytes(BITS, k));
    const int sv = MR == 1 ? GROUPED_ROW_SV : GROUPED_SV;
    for (int j0 = 0; j0 < NV; j0 += sv)
        grouped_slice(BITS, MR, sv, xq, xs, sx, k, block, scales, j0, acc, pf, pf_len);
}

/* Rows r .. r + rows of x against one block, into acc (rows, NB); pf, pf_len: the block
 * to pull into L2 meanwhile (grouped_slice). */
static inline __attribute__((always_inline)) void grouped_rows(
    const int BITS, int rows, const int8_t *xq, const int32_t *xs, const float *sx, int k,
    const uint8_t *block, float *acc, const char *pf, long pf_len) {
    switch (rows) {
#if GROUPED_MR == 4
        case 4: grouped_tile(BITS, 4, xq, xs, sx, k, block, acc, pf, pf_len); break;
        case 3: grouped_tile(BITS, 3, xq, xs, sx, k, block, acc, pf, pf_len); break;
#endif
        case 2: grouped_tile(BITS, 2, xq, xs, sx, k, block, acc, pf, pf_len); break;
        default: grouped_tile(BITS, 1, xq, xs, sx, k, block, acc, pf, pf_len); break;
    }
}

/* Each group of GROUP of x's m rows -> int8 with its scale sx and its sum xs. */
static void quantize_groups(const uint16_t *x, int m, int k, int8_t *xq, float *sx,
                            int32_t *xs, int nthreads) {
    const long groups = (long)m * k / GROUP;
#pragma omp parallel for schedule(static) num_threads(nthreads) if ((long)m * k > 65536)
    for (long i = 0; i < groups; ++i) {
        int8_t *q = xq + i * GROUP;
        sx[i] = quantize_span(x + i * GROUP, GROUP, (uint8_t *)q, 0);
        int32_t t = 0;
        for (int j = 0; j < GROUP; ++j) t += q[j];
        xs[i] = t;
    }
}

static inline __attribute__((always_inline)) void linear_grouped(
    const int BITS, const uint16_t *x, const uint8_t *w, const float *bias, uint16_t *out,
    uint16_t *scratch, int m, int n, int k, int nthreads) {
    const int groups = k / GROUP;
    const long block_bytes = grouped_weight_bytes(BITS, k) + (long)groups * NB * 2 * (BITS == 8 ? 1 : 2);
    static __thread void *xq_buf, *sx_buf, *xs_buf;
    static __thread size_t xq_cap, sx_cap, xs_cap;
    int8_t *const xq = kept_buffer(&xq_buf, &xq_cap, (size_t)m * k + 64);
    float *const sx = kept_buffer(&sx_buf, &sx_cap, sizeof(float) * ((size_t)m * groups + 1));
    int32_t *const xs = kept_buffer(&xs_buf, &xs_cap, sizeof(int32_t) * ((size_t)m * groups + 1));
    quantize_groups(x, m, k, xq, sx, xs, nthreads);
    /* a unit is a block, or a SwiGLU's gate and up blocks (the gate stored first) */
    const int unit = scratch ? 2 : 1, units = n / NB / unit;
    const int nt = nthreads < units ? nthreads : units;
#pragma omp parallel for schedule(static) num_threads(nt > 0 ? nt : 1)
    for (int u = 0; u < units; ++u)
        for (int b = u * unit; b < (u + 1) * unit; ++b) {
            const uint8_t *block = w + b * block_bytes;
            const target t = block_target(out, scratch, n, b);
            /* the next block into L2 during the first pass over this one (the thread's
             * next, but at the end of its share of the units) */
            const char *next = b + 1 < n / NB ? (const char *)(block + block_bytes) : NULL;
            for (int r = 0; r < m; r += GROUPED_MR) {
                const int rows = m - r < GROUPED_MR ? m - r : GROUPED_MR;
                float acc[GROUPED_MR * NB] __attribute__((aligned(64)));
                grouped_rows(BITS, rows, xq + (long)r * k, xs + (long)r * groups,
                             sx + (long)r * groups, k, block, acc, r == 0 ? next : NULL,
                             block_bytes);
                for (int i = 0; i < rows; ++i)
                    store_cols(NB, acc + i * NB, bias ? bias + b * NB : 0,
                               t.dst + (long)(r + i) * t.stride,
                               t.gate ? t.gate + (long)(r + i) * t.stride : 0);
            }
        }
}

void linear_int4(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads) {
    linear_grouped(4, x, (const uint8_t *)w, bias, out, scratch, m, n, k, nthreads);
}

void linear_int5(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads) {
    linear_grouped(5, x, (const uint8_t *)w, bias, out, scratch, m, n, k, nthreads);
}

void linear_int8g(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                  uint16_t *scratch, int m, int n, int k, int nthreads) {
    linear_grouped(8, x, (const uint8_t *)w, bias, out, scratch, m, n, k, nthreads);
}

/* float16 to and from float32, rounding to nearest even as torch's .to(torch.float16) does */
static inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
static inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

/* ---- a group on a float16 grid (m, d), codes 0..top: int4's levels and int5 (the
 * reference's _on_grid, _keep_better and _recentred) ---- */

/* g's codes 0..top on the float16 grid (m, d) into q, and their squared error summed in
 * k order. */
static float grid_try(const float *g, uint16_t dh, uint16_t mh, float top, uint8_t *q) {
    const float df = f16_to_f32(dh), mf = f16_to_f32(mh), step = df > 0.f ? df : 1.f;
    float err = 0.f;
    for (int i = 0; i < GROUP; ++i) {
        float v = nearbyintf((g[i] - mf) / step);
        v = v < 0.f ? 0.f : (v > top ? top : v);
        q[i] = (uint8_t)v;
        const float e = (df * v + mf) - g[i];
        err += e * e;
    }
    return err;
}

/* A group's fit so far: codes, float16 step and minimum, squared error. */
typedef struct {
    uint8_t q[GROUP];
    uint16_t d, m;
    float err;
} grid_fit;

/* (d, m) as `fit`, whatever its error. */
static void grid_set(const float *g, uint16_t d, uint16_t m, float top, grid_fit *fit) {
    fit->d = d;
    fit->m = m;
    fit->err = grid_try(g, d, m, top, fit->q);
}

/* (d, m) kept in `best` where its squared error is less (the first of ties stays). */
static void grid_keep(const float *g, uint16_t d, uint16_t m, float top, grid_fit *best) {
    grid_fit trial;
    grid_set(g, d, m, top, &trial);
    if (trial.err < best->err) *best = trial;
}

/* `best` re-centred: its step's float16 neighbours and the step itself, each with the
 * minimum that centres best's codes on g (rounded to float16), tried in that order; none
 * where the step is 0. */
static void grid_recentre(const float *g, float top, grid_fit *best) {
    if (!(f16_to_f32(best->d) > 0.f)) return;
    uint8_t kept[GROUP];
    memcpy(kept, best->q, GROUP);
    const uint16_t around[3] = {(uint16_t)(best->d - 1), (uint16_t)(best->d + 1), best->d};
    for (int c = 0; c < 3; ++c) {
        const float step = f16_to_f32(around[c]);
        float sum = 0.f;
        for (int i = 0; i < GROUP; ++i) sum += g[i] - step * (float)kept[i];
        grid_keep(g, around[c], f32_to_f16(sum / (float)GROUP), top, best);
    }
}

/* A group's least and greatest values, -0 as +0 (which zero a min or max keeps is the
 * implementation's). */
static void group_range(const float *g, float *lo, float *hi) {
    float a = g[0], b = g[0];
    for (int i = 1; i < GROUP; ++i) {
        a = g[i] < a ? g[i] : a;
        b = g[i] > b ? g[i] : b;
    }
    *lo = a + 0.f;
    *hi = b + 0.f;
}

/* ---- int4 weights' rounding at load (model/grouped.py's int4_quantize_reference: the same
 * arithmetic, every sum in k order, no contraction) ---- */

/* A group's weighted squared error: (s * L + mn - g) squared, each times its weight
 * wt[i], summed. */
static float int4_err(const float *g, const float *wt, const float *L, float s, float mn) {
    float err = 0.f;
    for (int i = 0; i < GROUP; ++i) {
        const float e = (s * L[i] + mn) - g[i];
        err += wt[i] * (e * e);
    }
    return err;
}

/* Codes L of g on `iscale` steps a unit above mn, clamped to 0..15. */
static void int4_codes(const float *g, float iscale, float mn, float *L) {
    for (int i = 0; i < GROUP; ++i) {
        const float v = nearbyintf(iscale * (g[i] - mn));
        L[i] = v < 0.f ? 0.f : (v > 15.f ? 15.f : v);
    }
}

/* The weighted least-squares line through (L, g) into (s, m), the minimum at most 0 (the
 * reference's _least_squares); 0 where the codes are all one value. sums: the weights'
 * and the weighted g's. */
static int int4_fit(const float *g, const float *wt, const float *L, const float *sums,
                    float *s, float *m) {
    float sl = 0.f, sl2 = 0.f, sxl = 0.f;
    for (int i = 0; i < GROUP; ++i) sl += wt[i] * L[i];
    for (int i = 0; i < GROUP; ++i) sl2 += (wt[i] * L[i]) * L[i];
    for (int i = 0; i < GROUP; ++i) sxl += (wt[i] * L[i]) * g[i];
    const float det = sums[0] * sl2 - sl * sl;
    if (!(det > 0.f)) return 0;
    *s = (sums[0] * sxl - sums[1] * sl) / det;
    *m = (sl2 * sums[1] - sl * sxl) / det;
    if (*m > 0.f) {
        *s = sxl / sl2;
        *m = 0.f;
    }
    return 1;
}

/* The weighted least-squares search: (step, minimum) in float32 (the reference's
 * _int4_search). */
static void int4_search(const float *g, const float *wt, float mn, float hi, int nsearch,
                        float *s_out, float *m_out) {
    const float range = hi - mn;
    if (range == 0.f) {
        *s_out = 0.f;
        *m_out = mn;
        return;
    }
    float sums[2] = {0.f, 0.f}, L[GROUP];
    for (int i = 0; i < GROUP; ++i) sums[0] += wt[i];
    for (int i = 0; i < GROUP; ++i) sums[1] += wt[i] * g[i];
    const float iscale = 15.f / range;
    int4_codes(g, iscale, mn, L);
    float best_s = 1.f / iscale, best_m = mn;
    float best = int4_err(g, wt, L, best_s, best_m);
    for (int c = 0; c < nsearch; ++c) {
        int4_codes(g, (float)((-1.0 + 0.1 * c) + 15.0) / range, mn, L);
        float s, m;
        if (!int4_fit(g, wt, L, sums, &s, &m)) continue;
        const float err = int4_err(g, wt, L, s, m);
        if (err < best) {
            best = err;
            best_s = s;
            best_m = m;
        }
    }
    *s_out = best_s;
    *m_out = best_m;
}


/* Whether a group of GROUP holds 16 distinct values or fewer (stops at the 17th). */
static int int4_few_levels(const float *g) {
    float seen[16];
    int n = 0;
    for (int i = 0; i < GROUP; ++i) {
        int j = 0;
        while (j < n && seen[j] != g[i]) ++j;
        if (j < n) continue;
        if (n == 16) return 0;
        seen[n++] = g[i];
    }
    return 1;
}

/* A group of few levels (a 4-bit checkpoint's): its range lo..hi in 1..nsteps steps on
 * float16 (m, d), the first of the least squared error; then the step's float16
 * neighbours and the step itself, each with the minimum that centres the kept codes on
 * g (rounded to float16), tried in that order (the reference's _on_levels). */
static void int4_levels(const float *g, float lo, float hi, int nsteps, uint8_t *q,
                        uint16_t *d, uint16_t *m) {
    const uint16_t mc = f32_to_f16(lo);
    grid_fit best;
    for (int steps = 1; steps <= nsteps; ++steps) {
        const uint16_t dc = f32_to_f16((hi - f16_to_f32(mc)) / (float)steps);
        if (steps == 1)
            grid_set(g, dc, mc, 15.f, &best);
        else
            grid_keep(g, dc, mc, 15.f, &best);
    }
    grid_recentre(g, 15.f, &best);
    memcpy(q, best.q, GROUP);
    *d = best.d;
    *m = best.m;
}

/* One group: a group of 16 distinct values or fewer on its own levels (int4_levels),
 * any other by the weighted least-squares search (each weight counted by the group's
 * root mean square plus its own magnitude), its step and minimum rounded to float16 and
 * the codes to nearest on them. */
static void int4_group(const float *g, int nsearch, int nsteps, uint8_t *q, uint16_t *d,
                       uint16_t *m) {
    float lo, hi;
    group_range(g, &lo, &hi);
    if (int4_few_levels(g)) {
        int4_levels(g, lo, hi, nsteps, q, d, m);
        return;
    }
    float sq = 0.f, wt[GROUP], s, mn;
    for (int i = 0; i < GROUP; ++i) sq += g[i] * g[i];
    const float rms = sqrtf(sq / (float)GROUP);
    for (int i = 0; i < GROUP; ++i) wt[i] = rms + fabsf(g[i]);
    int4_search(g, wt, lo < 0.f ? lo : 0.f, hi, nsearch, &s, &mn);
    *d = f32_to_f16(s);
    *m = f32_to_f16(mn);
    grid_try(g, *d, *m, 15.f, q);
}

void int4_quantize(const float *w, uint8_t *q, uint16_t *d, uint16_t *m, int nsearch,
                   int nsteps, int groups, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int g = 0; g < groups; ++g)
        int4_group(w + (long)g * GROUP, nsearch, nsteps, q + (long)g * GROUP, d + g, m + g);
}

/* ---- int5 weights' rounding at load (model/grouped.py's int5_quantize_reference: the same
 * arithmetic, every sum in k order, no contraction) ---- */

/* The range lo..hi in as many steps as the smallest gap between distinct values makes,
 * the minimum lo or the fewest steps under it that float16 holds exactly (the
 * reference's _int5_levels, before its tries of fewer steps). */
static void int5_gap_fit(const float *g, float lo, float span, float steps, grid_fit *best) {
    const uint16_t d = f32_to_f16(span / steps);
    float under = lo;
    for (int below = 0; below < 32; ++below) {
        const float u = lo - (float)below * f16_to_f32(d);
        if (f16_to_f32(f32_to_f16(u)) == u && steps + (float)below <= 31.f) {
            under = u;
            break;
        }
    }
    grid_set(g, d, f32_to_f16(under), 31.f, best);
}

/* The least positive difference of any two of g's values (INFINITY where all are one):
 * the smallest gap between its distinct values sorted, since rounding is monotonic (no
 * farther pair's difference rounds below a nearer one's), without the sort. */
static float least_gap(const float *g) {
    float out[VL];
#if VL == 16
    __m512 least = _mm512_set1_ps(INFINITY);
    for (int i = 0; i < GROUP; ++i)
        for (int j = 0; j < GROUP; j += VL) {
            const __m512 diff = _mm512_sub_ps(_mm512_loadu_ps(g + j), _mm512_set1_ps(g[i]));
            const __mmask16 above = _mm512_cmp_ps_mask(diff, _mm512_setzero_ps(), _CMP_GT_OQ);
            least = _mm512_mask_min_ps(least, above, least, diff);
        }
    _mm512_storeu_ps(out, least);
#else
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 least = inf;
    for (int i = 0; i < GROUP; ++i)
        for (int j = 0; j < GROUP; j += VL) {
            const __m256 diff = _mm256_sub_ps(_mm256_loadu_ps(g + j), _mm256_set1_ps(g[i]));
            const __m256 above = _mm256_cmp_ps(diff, _mm256_setzero_ps(), _CMP_GT_OQ);
            least = _mm256_min_ps(least, _mm256_blendv_ps(inf, diff, above));
        }
    _mm256_storeu_ps(out, least);
#endif
    float gap = out[0];
    for (int i = 1; i < VL; ++i) gap = out[i] < gap ? out[i] : gap;
    return gap;
}

/* One group (the reference's _int5_levels, _int5_rescued and _recentred). */
static void int5_group(const float *g, uint8_t *q, uint16_t *d, uint16_t *m) {
    float lo, hi;
    group_range(g, &lo, &hi);
    const float span = hi - lo, gap = least_gap(g);
    float steps = gap != INFINITY ? nearbyintf(span / gap) : 1.f;
    steps = steps < 1.f ? 1.f : (steps > 31.f ? 31.f : steps);
    const uint16_t mc = f32_to_f16(lo);
    grid_fit best;
    int5_gap_fit(g, lo, span, steps, &best);
    for (int fewer = 1; fewer <= 2; ++fewer) {
        const float n = steps - (float)fewer;
        grid_keep(g, f32_to_f16(span / (n < 1.f ? 1.f : n)), mc, 31.f, &best);
    }
    const float df = f16_to_f32(best.d);
    if (best.err * 16.f > df * df)  /* farther off than bf16 rounding: every step count */
        for (int n = 1; n <= 31; ++n) grid_keep(g, f32_to_f16(span / (float)n), mc, 31.f, &best);
    grid_recentre(g, 31.f, &best);
    memcpy(q, best.q, GROUP);
    *d = best.d;
    *m = best.m;
}

void int5_quantize(const float *w, uint8_t *q, uint16_t *d, uint16_t *m, int groups,
                   int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int g = 0; g < groups; ++g)
        int5_group(w + (long)g * GROUP, q + (long)g * GROUP, d + g, m + g);
}

/* ---- int8g weights' rounding at load (linear.py's int8g_quantize: the same arithmetic) ---- */

/* A group's weights g rounded on the symmetric grid of step dh (float16): q, and the
 * squared error summed in k order. */
static float int8g_try(const float *g, uint16_t dh, int8_t *q) {
    const float d = f16_to_f32(dh), step = d > 0.f ? d : 1.f;
    float sq[GROUP];
    for (int i = 0; i < GROUP; ++i) {
        float v = nearbyintf(g[i] / step);
        v = v < -127.f ? -127.f : (v > 127.f ? 127.f : v);
        q[i] = (int8_t)v;
        const float e = v * d - g[i];
        sq[i] = e * e;
    }
    float err = 0.f;
    for (int i = 0; i < GROUP; ++i) err += sq[i];
    return err;
}

/* One group: the steps max|g| / 127, then the smallest nonzero |g| over 1 .. divisors (a
 * checkpoint's own step where its codes reach one of those), the first with the least
 * error kept; then the least-squares step of the kept codes, where it does better. */
static void int8g_group(const float *g, int divisors, int8_t *q, uint16_t *d) {
    float amax = 0.f, least = INFINITY;
    for (int i = 0; i < GROUP; ++i) {
        const float a = fabsf(g[i]);
        amax = a > amax ? a : amax;
        least = a > 0.f && a < least ? a : least;
    }
    least = least == INFINITY ? 0.f : least;
    int8_t trial[GROUP];
    float best = 0.f;
    for (int c = 0; c <= divisors + 1; ++c) {
        float step;
        if (c == 0) {
            step = amax / 127.f;
        } else if (c <= divisors) {
            step = least / (float)c;
        } else {  /* the kept codes' least-squares step */
            float cs = 0.f, qq = 0.f;
            for (int i = 0; i < GROUP; ++i) cs += g[i] * (float)q[i];
            for (int i = 0; i < GROUP; ++i) qq += (float)q[i] * (float)q[i];
            if (!(qq > 0.f)) return;
            step = cs / qq;
        }
        const uint16_t dc = f32_to_f16(step);
        const float err = int8g_try(g, dc, trial);
        if (c == 0 || err < best) {
            best = err;
            memcpy(q, trial, GROUP);
            *d = dc;
        }
    }
}

void int8g_quantize(const float *w, int8_t *q, uint16_t *d, int divisors, int groups,
                    int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (int g = 0; g < groups; ++g)
        int8g_group(w + (long)g * GROUP, divisors, q + (long)g * GROUP, d + g);
}
