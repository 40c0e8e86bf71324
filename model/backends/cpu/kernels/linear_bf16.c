/* bf16 linear layers for CPUs with AMX: out (M, N) = x (M, K) @ W^T + bias, accumulated in
 * float32 and rounded once (round-to-nearest-even) on store.
 *
 * W is kept in one blocked layout, (N/64, K/2, 64, 2): for each block of 64 output
 * features, K/2 rows of 64 (feature, k-pair) bf16 pairs. That is the tile unit's "VNNI"
 * B operand, so a B tile is 16 k-pair rows at a stride of 256 bytes, and one weight
 * block streams through contiguously.
 *
 * From three rows on every call runs on the tile unit, and each output element is the same
 * sequence of tile dot products whatever M is and whichever rows share its tile; one or
 * two rows take a vector pass that computes the tile unit's own sums (vec_blocks), so a
 * row's output does not depend on what else is in the batch (the attention kernel,
 * model/backends/cpu/kernels/paged_attention.c, gives the same promise for its part).
 * A SwiGLU's gate and up projections can run as one weight whose blocks alternate gate,
 * up (linear_bf16 with a scratch buffer): the up block's epilogue stores silu(gate) * up.
 * Built and loaded by model/backends/cpu/kernels/linear.py.
 */
#include "kvserve.h"
#include "common.h"
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NB LINEAR_NB    /* output features per block */
#define KSTEP 32       /* k per AMX tile */
/* The 1x4 kernel streams its weight block from memory (few rows: nothing to reuse); it
 * asks for the next k step's B tiles (4 KB) while this one's dot products run. 2 KB or
 * 8-16 KB ahead measured slower (benchmarks/kernels/linear_kernels.py, 1-16 rows). */
#define PREFETCH_AHEAD 4096
/* ... and the step after that into L2 (8 KB ahead; measured: docs/decisions.md). */
#define L2_AHEAD 8192
#define M_CHUNK 256    /* rows of x kept hot in L2 while the weight blocks pass */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

/* The AMX register state for this process (common.h). 1 when usable. */
int linear_bf16_init(void) { return amx_request(); }

/* Tiles are 64 bytes a row: rows x 16 floats for C, rows x 32 bf16 for A, 16 k-pairs x
 * 16 features x 2 for B. The 1x4 kernel uses tmm0-3 (C), tmm4 (A), tmm5-7 (B), with
 * `rows` rows in C and A (amx_configure_linear); the 2x2 kernel runs with rows = 16
 * throughout. */

/* The float32 results of one C block wait in acc until the next block's dot products
 * are issued: rounding and storing them then overlaps with the tile unit's work instead
 * of stalling on it (a third of the time at large M when done in place). */
typedef struct {
    float acc[2][32 * NB] __attribute__((aligned(64)));
    int cur;       /* which acc the next block stores into */
    int rows, width; /* of the waiting block; rows 0 when none waits */
    const float *bias;
    uint16_t *out;
    const uint16_t *gate; /* SwiGLU: the rounded gate block this (up) block multiplies */
} epilogue;

/* exp(x) in float32 (common.h's polynomial); scalef saturates to 0 and inf. */
static inline __m512 exp512(__m512 x) {
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    return _mm512_scalef_ps(EXP2_POLY(f, _mm512_fmadd_ps, _mm512_set1_ps), n);
}

static inline __m512 round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

/* Round the waiting block (+ bias) to bf16 and store it; for an up block of a SwiGLU,
 * store silu(gate) * up instead, rounded step by step as the unfused bf16 ops do. */
static void flush(epilogue *e, int n) {
    const float *acc = e->acc[e->cur ^ 1];
    for (int r = 0; r < e->rows; ++r)
        for (int j = 0; j < e->width; j += 16) {
            __m512 v = _mm512_load_ps(acc + r * e->width + j);
            if (e->bias) v = _mm512_add_ps(v, _mm512_loadu_ps(e->bias + j));
            if (e->gate) {
                const __m512 g = _mm512_cvtpbh_ps(
                    (__m256bh)_mm256_loadu_si256((const __m256i *)(e->gate + (long)r * n + j)));
                const __m512 one = _mm512_set1_ps(1.f);
                const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp512(
                                                          _mm512_sub_ps(_mm512_setzero_ps(), g))));
                v = _mm512_mul_ps(round_bf16(silu), round_bf16(v));
            }
            _mm256_storeu_si256((__m256i *)(e->out + (long)r * n + j),
                                (__m256i)_mm512_cvtneps_pbh(v));
        }
    e->rows = 0;
}

/* Flush the previous block, then store tiles 0-3 (a rows x width block) for later. */
#define HAND_OVER(e, n, rows_, width_, bias_, out_, gate_, STORE_TILES)                     \
    do {                                                                                 \
        flush(e, n);                                                                     \
        float *acc = (e)->acc[(e)->cur];                                                 \
        STORE_TILES;                                                                     \
        (e)->rows = rows_, (e)->width = width_, (e)->bias = bias_, (e)->out = out_;      \
        (e)->gate = gate_;                                                               \
        (e)->cur ^= 1;                                                                   \
    } while (0)

/* Up to 16 rows of x (row-major, k columns) against one 64-feature block. */
static void amx_1x4(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                    const uint16_t *gate, int rows, int n, int k, epilogue *e) {
    amx_zero_c();
    for (int kk = 0; kk < k; kk += KSTEP) {
        const uint16_t *b = w + (long)(kk / 2) * (2 * NB);
        for (int off = 0; off < KSTEP / 2 * NB * 4; off += 64) {
            _mm_prefetch((const char *)b + PREFETCH_AHEAD + off, _MM_HINT_T0);
            _mm_prefetch((const char *)b + L2_AHEAD + off, _MM_HINT_T1);
        }
        AMX_1X4_STEP(_tile_dpbf16ps, x + kk, k * 2, b);
    }
    HAND_OVER(e, n, rows, NB, bias, out, gate, AMX_STORE_1X4(acc));
}

/* Up to 16 rows of x against half a block (w, bias, out and gate at its first feature):
 * the 1x4 kernel's first two tiles, for a half block at the edge of a thread's share.
 * Each feature's dot products are the ones the 1x4 and 2x2 kernels issue for it. */
static void amx_1x2(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                    const uint16_t *gate, int rows, int n, int k, epilogue *e) {
    amx_zero_c();
    for (int kk = 0; kk < k; kk += KSTEP) {
        const uint16_t *b = w + (long)(kk / 2) * (2 * NB);
        for (int off = 0; off < KSTEP / 2 * NB * 4; off += 256) {  /* its half of each row */
            _mm_prefetch((const char *)b + PREFETCH_AHEAD + off, _MM_HINT_T0);
            _mm_prefetch((const char *)b + PREFETCH_AHEAD + off + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)b + L2_AHEAD + off, _MM_HINT_T1);
            _mm_prefetch((const char *)b + L2_AHEAD + off + 64, _MM_HINT_T1);
        }
        _tile_loadd(4, x + kk, k * 2);
        _tile_loadd(5, b, 256);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, (const char *)b + 64, 256);
        _tile_dpbf16ps(1, 4, 6);
    }
    HAND_OVER(e, n, rows, 32, bias, out, gate, {
        _tile_stored(0, acc, 128);
        _tile_stored(1, acc + 16, 128);
    });
}

/* 32 rows of x against 32 features (half of a block): tmm0-3 C (2 x 2), tmm4-5 A,
 * tmm6-7 B. Each B tile serves two A tiles and each A tile two B tiles. */
static void amx_2x2(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                    const uint16_t *gate, int n, int k, const char *pf, int pf_step,
                    epilogue *e) {
    amx_zero_c();
    for (int kk = 0; kk < k; kk += KSTEP) {
        const uint16_t *b = w + (long)(kk / 2) * (2 * NB);
        for (int off = 0; off < pf_step; off += 64) _mm_prefetch(pf + off, _MM_HINT_T1);
        pf += pf_step;
        AMX_2X2_STEP(_tile_dpbf16ps, x + kk, k * 2, b);
    }
    HAND_OVER(e, n, 32, 32, bias, out, gate, AMX_STORE_2X2(acc));
}

/* ---- few rows in vector code, with the tile unit's sums ------------------------------
 * One tdpbf16ps step (16 k pairs) adds to each output c + RNE(E + O), where E sums the
 * pairs' even products and O their odd ones, each from zero in k order with one rounding
 * per product (exact in float32), denormals flushed in and out. A scratch probe matched
 * that model bit for bit, where no order of single sums did. So a vector pass computes it
 * too, FMAs under MXCSR's DAZ and FTZ, and gives a row the bits the tiles give it in any
 * batch. At one or two rows it reads the weights in several streams, as the vector
 * linears do, where the tile pass reads one (measured: docs/decisions.md). */
#define VEC_ROWS 2      /* calls of up to this many rows take the vector pass */
#define VEC_TURNS 4     /* segments whose turns alternate */
#define VEC_PAIRS 4     /* k pairs a segment's turn takes (1 KB of a block) */
#define VEC_AHEAD 2048  /* bytes of a segment's weights asked for ahead, into L1 */

/* The even and the odd k's weights of a vector of 16 (feature, k-pair) bf16 pairs, as
 * float32 (exact). */
static inline __m512 even_k(__m512i wv) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
}
static inline __m512 odd_k(__m512i wv) {
    return _mm512_castsi512_ps(_mm512_and_si512(wv, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* A tile step's end for 16 outputs: *a = c + (E + O), the tile unit's order. */
static inline void step_end(float *a, __m512 even, __m512 odd) {
    _mm512_store_ps(a, _mm512_add_ps(_mm512_load_ps(a), _mm512_add_ps(even, odd)));
}

/* One segment of a block (V vectors of 16 features, at w) for MR rows of x: k pairs kp0
 * .. kp0 + VEC_PAIRS - 1 of a tile step, into its sums of even and odd products, parked
 * in eo (MR x 2 x 64 floats) between turns. */
static inline __attribute__((always_inline)) void vec_turn(const int MR, const int V,
                                                            const uint16_t *x, int k,
                                                            const uint16_t *w, int kp0,
                                                            float *eo) {
    __m512 e[2][4], o[2][4];
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < V; ++j) {
            e[r][j] = _mm512_load_ps(eo + (2 * r) * NB + j * 16);
            o[r][j] = _mm512_load_ps(eo + (2 * r + 1) * NB + j * 16);
        }
    for (int kp = kp0; kp < kp0 + VEC_PAIRS; ++kp) {
        const uint16_t *wk = w + (long)kp * 2 * NB;
        for (int j = 0; j < V; ++j)
            _mm_prefetch((const char *)wk + VEC_AHEAD + j * 64, _MM_HINT_T0);
        __m512 lo[4], hi[4];
        for (int j = 0; j < V; ++j) {
            const __m512i wv = _mm512_loadu_si512((const void *)(wk + j * 32));
            lo[j] = even_k(wv), hi[j] = odd_k(wv);
        }
        for (int r = 0; r < MR; ++r) {
            uint32_t pair;
            memcpy(&pair, x + (long)r * k + 2 * kp, sizeof pair);
            const __m512i xb = _mm512_set1_epi32((int)pair);
            const __m512 xe = even_k(xb), xo = odd_k(xb);
            for (int j = 0; j < V; ++j) {
                e[r][j] = _mm512_fmadd_ps(lo[j], xe, e[r][j]);
                o[r][j] = _mm512_fmadd_ps(hi[j], xo, o[r][j]);
            }
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < V; ++j) {
            _mm512_store_ps(eo + (2 * r) * NB + j * 16, e[r][j]);
            _mm512_store_ps(eo + (2 * r + 1) * NB + j * 16, o[r][j]);
        }
}

/* One row against REG_BLOCKS whole blocks in a row (w0 the first), all of K, the sums
 * held in registers (E and O of three blocks are 24 of the 32): acc[s] += E + O at each
 * tile step's end. vec_turn's operations in its order, so its bits, without the turns'
 * trips through memory (measured: docs/decisions.md). */
#define REG_BLOCKS 3
static void vec_row(const uint16_t *x, int k, const uint16_t *w0, long block_elems,
                    float (*acc)[VEC_ROWS * NB]) {
    for (int kk = 0; kk < k; kk += KSTEP) {
        __m512 e[REG_BLOCKS][4], o[REG_BLOCKS][4];
        for (int s = 0; s < REG_BLOCKS; ++s)
            for (int j = 0; j < 4; ++j) e[s][j] = o[s][j] = _mm512_setzero_ps();
        for (int kp = kk / 2; kp < kk / 2 + KSTEP / 2; ++kp) {
            uint32_t pair;
            memcpy(&pair, x + 2 * kp, sizeof pair);
            const __m512i xb = _mm512_set1_epi32((int)pair);
            const __m512 xe = even_k(xb), xo = odd_k(xb);
            for (int s = 0; s < REG_BLOCKS; ++s) {
                const uint16_t *wk = w0 + s * block_elems + (long)kp * 2 * NB;
                for (int j = 0; j < 4; ++j) {
                    _mm_prefetch((const char *)wk + VEC_AHEAD + j * 64, _MM_HINT_T0);
                    const __m512i wv = _mm512_loadu_si512((const void *)(wk + j * 32));
                    e[s][j] = _mm512_fmadd_ps(even_k(wv), xe, e[s][j]);
                    o[s][j] = _mm512_fmadd_ps(odd_k(wv), xo, o[s][j]);
                }
            }
        }
        for (int s = 0; s < REG_BLOCKS; ++s)
            for (int j = 0; j < 4; ++j) step_end(acc[s] + j * 16, e[s][j], o[s][j]);
    }
}

/* Rows 0..m - 1 against ns segments (a segment: seg_w[s] halves from half block
 * seg_h[s]) in turns of VEC_PAIRS k pairs, so that their weight streams are all in
 * flight; at each tile step's end, acc[s] += E + O. */
static void vec_turns(const uint16_t *x, const uint16_t *w, long block_elems, int m, int k,
                      const int *seg_h, const int *seg_w, int ns,
                      float (*acc)[VEC_ROWS * NB]) {
    float eo[VEC_TURNS][VEC_ROWS * 2 * NB] __attribute__((aligned(64)));
    for (int kk = 0; kk < k; kk += KSTEP) {
        memset(eo, 0, sizeof eo);
        for (int kp = kk / 2; kp < kk / 2 + KSTEP / 2; kp += VEC_PAIRS)
            for (int s = 0; s < ns; ++s) {
                const uint16_t *ws = w + seg_h[s] / 2 * block_elems + seg_h[s] % 2 * 64;
                if (seg_w[s] == 2 && m == 1) vec_turn(1, 4, x, k, ws, kp, eo[s]);
                else if (seg_w[s] == 2) vec_turn(2, 4, x, k, ws, kp, eo[s]);
                else if (m == 1) vec_turn(1, 2, x, k, ws, kp, eo[s]);
                else vec_turn(2, 2, x, k, ws, kp, eo[s]);
            }
        for (int s = 0; s < ns; ++s)
            for (int r = 0; r < m; ++r)
                for (int j = 0; j < seg_w[s] * 2; ++j) {
                    const float *even = eo[s] + 2 * r * NB + j * 16, *odd = even + NB;
                    step_end(acc[s] + r * NB + j * 16, _mm512_load_ps(even), _mm512_load_ps(odd));
                }
    }
}

/* Half blocks from h (of a share ending at h1) that one pass takes: block h / 2 whole
 * where h starts it and the share holds it, else the one half. */
static inline int halves_at(int h, int h1) { return h % 2 == 0 && h + 2 <= h1 ? 2 : 1; }

/* Rows 0..m - 1 (m <= VEC_ROWS) against half blocks h0..h1 - 1 (run_blocks' share):
 * segments, each a whole block or a half at the share's edge, VEC_TURNS at a time in
 * turns (vec_turns), or for one row REG_BLOCKS whole blocks at a time in registers
 * (vec_row). Every segment's result goes to the epilogue in order, as the tile passes
 * hand theirs over. */
static void vec_blocks(const uint16_t *x, const uint16_t *w, const float *bias,
                       uint16_t *out, uint16_t *scratch, int m, int n, int k, int h0,
                       int h1, epilogue *e) {
    const long block_elems = (long)k * NB;
    const unsigned csr = _mm_getcsr();
    float acc[VEC_TURNS][VEC_ROWS * NB] __attribute__((aligned(64)));
    for (int h = h0; h < h1;) {
        const int in_registers = m == 1 && h % 2 == 0 && h + 2 * REG_BLOCKS <= h1;
        int seg_h[VEC_TURNS], seg_w[VEC_TURNS], ns = 0;  /* first half, halves */
        for (; ns < (in_registers ? REG_BLOCKS : VEC_TURNS) && h < h1; ++ns) {
            seg_h[ns] = h, seg_w[ns] = halves_at(h, h1);
            h += seg_w[ns];
        }
        for (int s = 0; s < ns; ++s) memset(acc[s], 0, sizeof acc[s]);
        _mm_setcsr(csr | 0x8040);  /* FTZ and DAZ for the sums, as the tile unit's */
        if (in_registers)
            vec_row(x, k, w + seg_h[0] / 2 * block_elems, block_elems, acc);
        else
            vec_turns(x, w, block_elems, m, k, seg_h, seg_w, ns, acc);
        _mm_setcsr(csr);  /* the epilogue as the tile passes run it */
        for (int s = 0; s < ns; ++s) {
            const int b = seg_h[s] / 2, c0 = seg_h[s] % 2 * 32, width = seg_w[s] * 32;
            const target t = block_target(out, scratch, n, b);
            const float *mine = acc[s];
            HAND_OVER(e, t.stride, m, width, bias ? bias + b * NB + c0 : 0, t.dst + c0,
                      t.gate ? t.gate + c0 : 0, {
                for (int r = 0; r < m; ++r) memcpy(acc + r * width, mine + r * NB, width * 4);
            });
        }
    }
}

/* Rows m0..m1 of x against halves h0..h1 - 1 of one 64-feature block (both, or one at
 * the edge of a thread's share); *configured tracks the tile shape. Pairs of 16-row
 * tiles go one half-block at a time, so the half-block's weights (32 features x K) stay
 * in L1 while the rows pass; the last < 32 rows take the 1x4 path (1x2 for one half). */
static void amx_rows(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                     const uint16_t *gate, int m0, int m1, int n, int k, int h0, int h1,
                     int *configured, epilogue *e) {
    const int pairs_end = m0 + (m1 - m0) / 32 * 32;
    if (pairs_end > m0 && *configured != 16) amx_configure_linear(*configured = 16);
    /* The 2x2 kernel reads its half-blocks from cache: the next weight block is fetched
     * into L2 while this one computes, a share of it at each k step (one block ahead
     * measured 10-15% faster at 32-128 rows than none, two blocks slower). */
    const int steps = (pairs_end - m0) / 32 * (h1 - h0) * (k / KSTEP);
    const long block_bytes = (long)k * NB * 2;
    const int pf_step = amx_prefetch_share(block_bytes, steps);
    const char *pf = (const char *)(w + (long)k * NB);
    for (int half = h0; half < h1; ++half)
        for (int r = m0; r < pairs_end; r += 32) {
            amx_2x2(x + (long)r * k, w + half * 64, bias ? bias + half * 32 : 0,
                    out + (long)r * n + half * 32, gate ? gate + (long)r * n + half * 32 : 0, n,
                    k, pf, pf_step, e);
            pf += (long)pf_step * (k / KSTEP);
        }
    for (int r = pairs_end; r < m1; r += 16) {
        const int rows = m1 - r < 16 ? m1 - r : 16;
        if (*configured != rows) amx_configure_linear(*configured = rows);
        if (h1 - h0 == 2) {
            amx_1x4(x + (long)r * k, w, bias, out + (long)r * n, gate ? gate + (long)r * n : 0,
                    rows, n, k, e);
        } else {
            const int c0 = h0 * 32;  /* the half's first feature */
            amx_1x2(x + (long)r * k, w + 2 * c0, bias ? bias + c0 : 0, out + (long)r * n + c0,
                    gate ? gate + (long)r * n + c0 : 0, rows, n, k, e);
        }
    }
}

/* Half blocks [h0, h1) of one thread (2b and 2b + 1: block b's). Plain: block b ->
 * columns b * NB of out (row stride n). SwiGLU (w's blocks alternate gate, up): gate
 * block 2i is rounded into scratch, then up block 2i + 1 writes silu(gate) * up to
 * columns i * NB of out (both row stride n / 2). A SwiGLU thread's blocks come in whole
 * pairs, so the gate is always stored first. */
static void run_blocks(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                       uint16_t *scratch, int m, int n, int k, int h0, int h1) {
    const long block_elems = (long)k * NB;
    const int stride = scratch ? n / 2 : n;
    int configured = 0;
    epilogue e;
    e.cur = 0;
    e.rows = 0;
    if (m <= VEC_ROWS) {
        vec_blocks(x, w, bias, out, scratch, m, n, k, h0, h1, &e);
        flush(&e, stride);
        return;
    }
    for (int m0 = 0; m0 < m; m0 += M_CHUNK) {
        const int m1 = m0 + M_CHUNK < m ? m0 + M_CHUNK : m;
        for (int h = h0; h < h1;) {
            const int b = h / 2, first = h % 2, last = first + halves_at(h, h1);
            h += last - first;
            const target t = block_target(out, scratch, n, b);
            amx_rows(x, w + b * block_elems, bias ? bias + b * NB : 0, t.dst, t.gate, m0, m1,
                     t.stride, k, first, last, &configured, &e);
        }
    }
    flush(&e, stride);
    if (configured) _tile_release();
}

/* out = x @ W^T + bias, (m, n). With scratch (m, n/2) bf16, W is a SwiGLU's gate and up
 * projections as one weight whose 64-feature blocks alternate gate, up (swiglu_layout in
 * model/backends/cpu/kernels/linear.py): out (m, n/2) = silu(x @ Wg^T + bg) * (x @ Wu^T + bu), the
 * rounded gate waiting in scratch. */
void linear_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads) {
    /* Threads share half blocks: 9 blocks on two threads are 4.5 each, not 5 against 4
     * (docs/decisions.md). A SwiGLU's gate/up pairs stay whole on one thread. */
    const int unit = scratch ? 4 : 1;  /* half blocks that stay together */
    const int units = n / NB * 2 / unit;
    if (nthreads > units) nthreads = units;
#pragma omp parallel num_threads(nthreads)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int u0 = (int)((long)units * t / nt), u1 = (int)((long)units * (t + 1) / nt);
        run_blocks(x, w, bias, out, scratch, m, n, k, u0 * unit, u1 * unit);
    }
}

#else

int linear_bf16_init(void) { return 0; }

void linear_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads) {
    (void)x, (void)w, (void)bias, (void)out, (void)scratch, (void)m, (void)n, (void)k;
    (void)nthreads;
}

#endif
