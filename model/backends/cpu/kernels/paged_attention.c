/* Paged attention on the CPU for any mix of prefill chunks and decodes: every query row
 * attends to the first lens[row] tokens of its sequence, K/V read straight from the block
 * pool (no gather), online softmax, GQA by sharing each K/V head across its group of query
 * heads. A row's result is computed the same way whatever rows share the call (a decode
 * alone, beside other decodes, or one token of a prefill chunk), so outputs do not depend
 * on how requests are batched or chunked. Built and loaded by model/backends/cpu/kernels/attention.py,
 * once per (HEAD_DIM, BLOCK_SIZE, GROUP): constant sizes keep every accumulator in a
 * register.
 *
 * Cache layouts (one layer), P = 1 for float32 and 2 for bfloat16 (a 32-bit lane):
 *   k: (num_blocks, KV, HEAD_DIM / P, BLOCK_SIZE, P)  channel-major: one vector FMA adds
 *      one channel's contribution to the scores of a whole block of tokens
 *   v: (num_blocks, KV, BLOCK_SIZE / P, HEAD_DIM, P)
 * In bfloat16 these are the tile unit's B operands for q.k and p.v (the AMX kernel at the
 * end of this file).
 * q: (R, KV * GROUP, HEAD_DIM) in the cache's dtype, one row per query token, rows
 *    q_stride elements apart (a view of a fused qkv projection); out: (R, KV * GROUP,
 *    HEAD_DIM) in the cache's dtype, computed in float32 and rounded once
 * k/v: float32 or bfloat16 (uint16 bits); tables: (B, max_blocks) int64, one per sequence;
 * row_seq: (R,) int64 sequence of each row, or NULL for row r -> sequence r;
 * softcap: > 0, each score (scaled) becomes softcap * tanh(score / softcap) (Gemma 2);
 * lens: (R,) int64 keys each row sees (its position + 1); skip: (R,) int64 or NULL, keys at
 * the front of a row's range it does not see (a sliding window's start: the caller shifts
 * each row's table to the window's first block, so skip < BLOCK_SIZE + the rows sharing
 * a table); alibi: (H,) slopes or NULL.
 */
#include "kvserve.h"
#include "common.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(HEAD_DIM) || !defined(BLOCK_SIZE) || !defined(GROUP)
#error "build with -DHEAD_DIM=... -DBLOCK_SIZE=... -DGROUP=..."
#endif

#define D HEAD_DIM
#define BS BLOCK_SIZE
#define G GROUP
/* Vectors are at most the CPU's width, VW floats: GCC keeps a wider generic vector in
 * memory and moves it through general registers (docs/decisions.md). A block's
 * scores are NP pieces of BW tokens. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define DV (D < VW ? D : VW)
#define BW (BS < VW ? BS : VW)
#define NP (BS / BW)
#if D % DV || D % 2 || BS % 2 || BS % BW
#error "HEAD_DIM must be a multiple of 16 or a power of two below it; BLOCK_SIZE even"
#endif

typedef float vblk __attribute__((vector_size(BW * 4)));   /* scores of BW tokens */
typedef int32_t iblk __attribute__((vector_size(BW * 4)));
typedef float vch __attribute__((vector_size(DV * 4)));    /* DV channels */
typedef uint32_t uch __attribute__((vector_size(DV * 4)));
typedef uint32_t ublk __attribute__((vector_size(BW * 4)));

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) = 2^n * 2^f in AVX-512's own instructions (x <= 0, clamped at -87): returns f in
 * [-0.5, 0.5], n = floor(x log2 e + 0.5) by vrndscaleps in *n; the caller takes 2^f from
 * one of common.h's polynomials and scales by 2^n with vscalefps. */
static inline __m512 exp_split(__m512 x, __m512 *n) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.f), x);
    const __m512 u = _mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(0.5f));
    *n = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_fmsub_ps(x, _mm512_set1_ps(EXP_LOG2E), *n);
}
#endif

/* exp(x) for x <= 0 on a vector (common.h's polynomial), i = round(x log2 e) by
 * truncation. Underflows to ~1e-38 below -87. */
#define VMADD(a, b, c) ((a) * (b) + (c))
#define VCONST(c) (c)
static inline vblk vexp(vblk x) {
#if defined(__AVX512F__) && BW == 16
    /* the same steps in AVX-512's own instructions, the same bits: the floor by
     * vrndscaleps, 2^n by vscalefps (exact: n >= -125 and the polynomial is near 1); 11
     * instructions where the generic code compiled to 19 (docs/decisions.md) */
    __m512 v, n;
    memcpy(&v, &x, sizeof v);
    const __m512 f = exp_split(v, &n);
    const __m512 r = _mm512_scalef_ps(EXP2_POLY(f, _mm512_fmadd_ps, _mm512_set1_ps), n);
    memcpy(&x, &r, sizeof x);
    return x;
#else
    const vblk lo = (vblk){0} - 87.f;
    const iblk under = x < lo;
    x = (vblk)(((iblk)lo & under) | ((iblk)x & ~under));
    const vblk t = x * EXP_LOG2E;
    const vblk u = t + 0.5f;
    iblk i = __builtin_convertvector(u, iblk);           /* truncation toward zero */
    i += (iblk)(__builtin_convertvector(i, vblk) > u);   /* -> floor(t + 0.5) */
    const vblk f = t - __builtin_convertvector(i, vblk);
    const vblk p = EXP2_POLY(f, VMADD, VCONST);
    const iblk bits = (i + 127) << 23;
    return p * (vblk)bits;
#endif
}

/* Two channels (d, d + 1; d even) of a K block, keys x .. x + BW - 1 (x a multiple of
 * BW). float32 blocks are (D, BS); bfloat16 blocks (D/2, BS, 2), channel pairs
 * interleaved the way the tile unit's B operand wants them, so one 32-bit lane holds
 * both channels of a key. */
static inline void keys2_f32(const float *kb, int d, int x, vblk *a, vblk *b) {
    memcpy(a, kb + d * BS + x, sizeof *a);
    memcpy(b, kb + (d + 1) * BS + x, sizeof *b);
}
static inline void keys2_bf16(const uint16_t *kb, int d, int x, vblk *a, vblk *b) {
    ublk u;
    memcpy(&u, kb + d * BS + 2 * x, sizeof u);
    *a = (vblk)(u << 16);  /* casts between vector types keep the bits (memcpy between */
    *b = (vblk)(u & 0xFFFF0000u);  /* them went through integer registers at AVX2) */
}
/* Channels c * DV .. c * DV + DV - 1 of two tokens (t, t + 1; t even) of a V block.
 * float32 blocks are (BS, D); bfloat16 blocks (BS/2, D, 2), token pairs interleaved. */
static inline void vals2_f32(const float *vb, int t, int c, vch *a, vch *b) {
    memcpy(a, vb + t * D + c * DV, sizeof *a);
    memcpy(b, vb + (t + 1) * D + c * DV, sizeof *b);
}
static inline void vals2_bf16(const uint16_t *vb, int t, int c, vch *a, vch *b) {
    uch u;
    memcpy(&u, vb + t * D + 2 * c * DV, sizeof u);
    *a = (vch)(u << 16);
    *b = (vch)(u & 0xFFFF0000u);
}

/* Gemma 2's soft-capped scores: cap * tanh(x / cap), tanh(y) = sign(y) (1 - e) / (1 + e)
 * with e = exp(-2 |y|) (vexp's domain, x <= 0). */
static inline vblk vsoftcap(vblk x, float cap) {
    const vblk y = x * (1.f / cap);
    const iblk sign = (iblk)y & (int32_t)0x80000000;
    const vblk a = (vblk)((iblk)y ^ sign);
    const vblk e = vexp(a * -2.f);
    const vblk t = (1.f - e) / (1.f + e);
    return (vblk)((iblk)t | sign) * cap;
}

static inline float hmax(const vblk *v, int pieces) {  /* over `pieces` vectors */
    vblk x = v[0];
    for (int i = 1; i < pieces; ++i) {
        const iblk gt = x > v[i];
        x = (vblk)(((iblk)x & gt) | ((iblk)v[i] & ~gt));
    }
    float a[BW], m;
    memcpy(a, &x, sizeof a);
    m = a[0];
    for (int t = 1; t < BW; ++t) m = a[t] > m ? a[t] : m;
    return m;
}

static inline float hsum(const vblk *v, int pieces) {
    vblk x = v[0];
    for (int i = 1; i < pieces; ++i) x += v[i];
    float a[BW], s = 0.f;
    memcpy(a, &x, sizeof a);
    for (int t = 0; t < BW; ++t) s += a[t];
    return s;
}

/* Where block b of `table` keeps head kvh: its byte offset in the K cache and in the V
 * cache (`bytes` a block of one head). */
static inline int64_t block_at(const int64_t *table, int b, int KV, int kvh, int64_t bytes) {
    return (table[b] * KV + kvh) * bytes;
}

/* Block b of `table`: every line of its K and V for head kvh (`bytes` each), into L2. */
PREFETCH_HELPER prefetch_block_now(const void *k, const void *v, const int64_t *table, int b,
                                    int KV, int kvh, int64_t bytes) {
    const int64_t at = block_at(table, b, KV, kvh, bytes);
    for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch((const char *)k + at + off, 0, 2);
        __builtin_prefetch((const char *)v + at + off, 0, 2);
    }
}

/* The AVX-512 BF16 kernel's prefetch. Blocks are scattered: while block j of a sequence's
 * `table` is read, the one after next is fetched into L2 (on a pass's first block, the
 * next too); fetching the next into L1 in one burst measured slower. `bytes`: one block
 * of one K/V head; the pass reads blocks first .. nblk -
 * 1. The other vector kernels spread theirs through the score pass (prefetch_share). */
PREFETCH_HELPER prefetch_ahead(const void *k, const void *v, const int64_t *table, int j,
                                int first, int nblk, int KV, int kvh, int64_t bytes) {
    for (int a = j == first ? 1 : 2; a <= 2 && j + a < nblk; ++a)
        prefetch_block_now(k, v, table, j + a, KV, kvh, bytes);
}

/* The vector kernels' prefetch (DEFINE_KERNEL): spread through the reads, not in bursts.
 * A task's first block is read on demand and the one after it fetched at once; from then
 * on, while the score pass over block jb runs, each channel pair's iteration fetches the
 * same lines (those channels' keys, and as many bytes of values) of block jb + 2, into
 * L2. A decode row's blocks come from memory (a step's weights evicted them) in 2 KB
 * pieces scattered over the pool, one K/V head of a block each, which the hardware
 * prefetchers do not follow; prefetch_ahead's burst of a whole block's lines at a step's
 * start (64 lines a block, four blocks a step) filled the core's miss buffers and
 * stalled the scores behind it (docs/decisions.md). */
#define AHEAD_BLOCKS 2
/* The lines of a K and a V block (`bytes` each) that channel pair d's share of the score
 * pass stands for: bytes / (D / 2) of each, from d / 2 of those shares in. */
PREFETCH_HELPER prefetch_share(const char *kb, const char *vb, int d, int64_t bytes) {
    const int64_t share = bytes / (D / 2), at = (int64_t)(d / 2) * share;
    for (int64_t off = 0; off < share; off += 64) {
        __builtin_prefetch(kb + at + off, 0, 2);
        __builtin_prefetch(vb + at + off, 0, 2);
    }
}

/* Runs of up to `most` consecutive rows of one sequence (row_seq NULL: every row its
 * own): starts[i] the first row of run i, starts[n] = R; returns n. */
static inline int row_runs(const int64_t *row_seq, int R, int most, int *starts) {
    int n = 0;
    for (int r = 0; r < R; ++r)
        if (!row_seq || r == 0 || row_seq[r] != row_seq[r - 1] || r - starts[n - 1] == most)
            starts[n++] = r;
    starts[n] = R;
    return n;
}

#if defined(__AVX512F__) && BS == 16
#include <immintrin.h>

/* vexp on a 512-bit vector (a block of scores), lanes outside `keep` zeroed. */
static inline __m512 exp_masked(__m512 x, __mmask16 keep) {
    vblk e;
    memcpy(&e, &x, sizeof e);
    e = vexp(e);
    memcpy(&x, &e, sizeof x);
    return _mm512_maskz_mov_ps(keep, x);
}
#endif

/* Rows of one sequence (a prefill chunk's) share a task, up to ROWS_PER_TASK of them:
 * each K/V block is read once for all of them (from L1 after the first row), and the
 * rows' work overlaps where one row's blocks wait on each other's running max. A block
 * that leaves a row's running max as it was takes its correction, exp(0) = 1, without
 * calling expf. Neither changes a row's arithmetic, so neither changes its bits. */
#define ROWS_PER_TASK 8
/* Blocks per online-softmax step: one running max, one sum and at most one correction for
 * their keys, not one of each per block (docs/decisions.md). Every row steps from its
 * first block, so a row's arithmetic
 * is the same in any batch. */
#define STEP_BLOCKS 4

static inline float f32_id(float f) { return f; }
static inline float bf16_load(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t bf16_store(float f) {  /* round to nearest even (no NaN here) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* ---- Long rows in parts ---------------------------------------------------------------
 * A row's keys are taken PART_KEYS at a time from its first key: each part runs its own
 * online softmax to a partial (its running max, sum and unnormalized output), and a row
 * of more than one part combines its partials in part order (merge_parts). A row of one
 * part writes its output straight from its softmax as it always has. Where the parts fall
 * is a function of the row's own length, and so is the arithmetic, so a row's bits do not
 * depend on the batch (and merge_parts is one out-of-line function, the same code for
 * every caller).
 *
 * Who runs the parts is the call's choice, which the bits do not see. Where the call's
 * tasks (a run of rows over a K/V head) are too few to share evenly among the threads
 * (one long decode is as many as its K/V heads: 3 tasks on 2 threads split 2:1), each
 * part of a run is a task of its own ("spread"), its partials in one buffer for the call
 * and combined once every task has run. Else a task runs all the parts of its run in
 * turn, its partials in a buffer of its own, and combines them at its end (a long
 * prompt's chunk: nothing written beyond the cache). Spreading tasks that already shared
 * evenly measured slower. */
#define PART_KEYS 512
#define PART_BLOCKS (PART_KEYS / BS)
#if PART_BLOCKS < 1 || PART_BLOCKS % STEP_BLOCKS || PART_BLOCKS % 2
#error "PART_KEYS must be a multiple of STEP_BLOCKS blocks and of two blocks"
#endif
#define PARTIAL (D + 2)                        /* floats in a partial: m, l, D outputs */
#define SPREAD_BYTES ((int64_t)16 << 20)       /* the most a call's partials may take */

static inline int parts_of(int64_t len) { return (int)((len + PART_KEYS - 1) / PART_KEYS); }
/* The partials a row of len keys leaves: one a part where it has more than one, else none
 * (it writes its output straight). */
static inline int partials_of(int64_t len) { return parts_of(len) > 1 ? parts_of(len) : 0; }

typedef struct {
    int *starts, runs;   /* row runs (row_runs) */
    int spread, units;   /* units: tasks per K/V head (runs, or every run's parts) */
    int *first_unit;     /* spread: run i's parts are units first_unit[i] .. [i + 1] - 1 */
    int *unit_run;       /* spread: each unit's run */
    int64_t *slot;       /* spread: each row's first partial; -1 for a row of one part */
    float *partial;      /* spread: slot x H x PARTIAL */
} split_plan;

/* The runs of R rows and who runs their parts, for KV heads on nthreads threads. */
static inline void split_plan_init(split_plan *sp, const int64_t *row_seq, const int64_t *lens,
                                   int R, int rows_per_task, int KV, int nthreads) {
    memset(sp, 0, sizeof *sp);
    sp->starts = malloc(((size_t)R + 1) * sizeof *sp->starts);
    sp->runs = sp->units = row_runs(row_seq, R, rows_per_task, sp->starts);
    int64_t units = 0, slots = 0;
    for (int r = 0; r < R; ++r) slots += partials_of(lens[r]);
    for (int i = 0; i < sp->runs; ++i) units += parts_of(lens[sp->starts[i + 1] - 1]);
    const int tasks = sp->runs * KV;
    if (units == sp->runs || tasks >= 4 * nthreads || tasks % nthreads == 0 ||
        slots * KV * G * PARTIAL * (int64_t)sizeof(float) > SPREAD_BYTES)
        return;  /* every task runs its run's parts */
    sp->spread = 1, sp->units = (int)units;
    sp->first_unit = malloc(((size_t)sp->runs + 1) * sizeof *sp->first_unit);
    sp->unit_run = malloc((size_t)units * sizeof *sp->unit_run);
    sp->slot = malloc((size_t)R * sizeof *sp->slot);
    sp->partial = malloc((size_t)slots * KV * G * PARTIAL * sizeof(float));
    for (int i = 0, u = 0; i < sp->runs; ++i) {
        sp->first_unit[i] = u;
        for (int p = parts_of(lens[sp->starts[i + 1] - 1]); p; --p) sp->unit_run[u++] = i;
    }
    sp->first_unit[sp->runs] = (int)units;
    for (int r = 0, s = 0; r < R; ++r) {
        sp->slot[r] = partials_of(lens[r]) ? s : -1;
        s += partials_of(lens[r]);
    }
}

static inline void split_plan_free(split_plan *sp) {
    free(sp->starts), free(sp->first_unit), free(sp->unit_run), free(sp->slot), free(sp->partial);
}

/* Unit u's run and parts p0 .. p1 - 1 (the last row of a run has the most). */
typedef struct {
    int run, r0, nr, p0, p1;
} unit_parts;

static inline unit_parts unit_of(const split_plan *sp, const int64_t *lens, int u) {
    unit_parts w;
    w.run = sp->spread ? sp->unit_run[u] : u;
    w.r0 = sp->starts[w.run], w.nr = sp->starts[w.run + 1] - w.r0;
    w.p0 = sp->spread ? u - sp->first_unit[w.run] : 0;
    w.p1 = sp->spread ? w.p0 + 1 : parts_of(lens[w.r0 + w.nr - 1]);
    return w;
}

/* A task's partials: part p of row i (of the run) over head h of its K/V head's group at
 * partial_of(...) + h * PARTIAL; the call's buffer when spread, else the task's own. */
typedef struct {
    float *own;        /* the task's: (row, part, head) */
    int parts;         /* the task's parts (own) */
    int H;
} partials;

static inline float *partial_of(const split_plan *sp, const partials *pt, int r0, int i,
                                int part, int kvh) {
    if (sp->spread)
        return sp->partial + ((sp->slot[r0 + i] + part) * pt->H + kvh * G) * (int64_t)PARTIAL;
    return pt->own + ((int64_t)i * pt->parts + part) * G * PARTIAL;
}

/* The task's own buffer for unit w (NULL where spread or no row has two parts). */
static inline float *own_partials(const split_plan *sp, const unit_parts *w) {
    if (sp->spread || w->p1 == 1) return NULL;
    return malloc((size_t)w->nr * w->p1 * G * PARTIAL * sizeof(float));
}

/* A part's weight in its row's output. Out of line, so that no loop over parts becomes
 * vector code: glibc's vector expf need not give the scalar one's bits, and which one a
 * loop got could depend on the number of parts. */
static __attribute__((noinline)) float part_weight(float m, float top) { return expf(m - top); }

/* One row and head's output from its `parts` partials (part p at first + p * stride) into
 * out[0 .. D - 1] (bfloat16 when out_bf16, else float32). Out of line: the same code, so
 * the same bits, wherever the parts ran. */
static __attribute__((noinline)) void merge_parts(const float *first, int parts,
                                                  int64_t stride, void *out, int out_bf16) {
    float top = -1e30f, l = 0.f, w[parts];
    for (int p = 0; p < parts; ++p) top = fmaxf(top, first[p * stride]);
    for (int p = 0; p < parts; ++p) {  /* the weights first: no call in the loop below */
        const float m = first[p * stride];
        w[p] = m == top ? 1.f : part_weight(m, top);  /* exp(0) = 1 */
        l += first[p * stride + 1] * w[p];
    }
    vch o[D / DV];
    for (int c = 0; c < D / DV; ++c) o[c] = (vch){0};
    for (int p = 0; p < parts; ++p)
        for (int c = 0; c < D / DV; ++c) {
            vch x;
            memcpy(&x, first + p * stride + 2 + c * DV, sizeof x);
            o[c] += x * w[p];
        }
    const float inv = 1.f / l;
    float r[D];
    for (int c = 0; c < D / DV; ++c) {
        const vch x = o[c] * inv;
        memcpy(r + c * DV, &x, sizeof x);
    }
    for (int d = 0; d < D; ++d) {
        if (out_bf16)
            ((uint16_t *)out)[d] = bf16_store(r[d]);
        else
            ((float *)out)[d] = r[d];
    }
}

/* A task's end: its rows of more than one part, over its K/V head's group, from its own
 * buffer into `out` ((R, H, D), element size esize). */
static inline void merge_own(const split_plan *sp, const partials *pt, const unit_parts *w,
                             const int64_t *lens, int kvh, char *out, int esize) {
    if (!pt->own) return;
    for (int i = 0; i < w->nr; ++i) {
        const int parts = parts_of(lens[w->r0 + i]);
        if (parts == 1) continue;
        for (int g = 0; g < G; ++g)
            merge_parts(partial_of(sp, pt, w->r0, i, 0, kvh) + g * PARTIAL, parts,
                        G * PARTIAL,
                        out + ((int64_t)(w->r0 + i) * pt->H + kvh * G + g) * D * esize,
                        esize == 2);
    }
}

/* After every task of a spread call: each row of more than one part, head by head. */
static void merge_spread(const split_plan *sp, const int64_t *lens, int R, int H, char *out,
                         int esize, int nthreads) {
    if (!sp->spread) return;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int t = 0; t < R * H; ++t) {
        const int r = t / H, h = t % H, parts = parts_of(lens[r]);
        if (parts > 1)
            merge_parts(sp->partial + (sp->slot[r] * H + h) * (int64_t)PARTIAL, parts,
                        (int64_t)H * PARTIAL, out + ((int64_t)r * H + h) * D * esize,
                        esize == 2);
    }
}

/* The blocks of a step a row sees, `rest` keys of it from the step's first block on:
 * returns how many (1 .. STEP_BLOCKS); n[b] the keys of block b it sees. */
static inline int step_blocks(int64_t rest, int *n) {
    int nb = 0;
    for (; nb < STEP_BLOCKS && rest > (int64_t)nb * BS; ++nb) {
        const int64_t left = rest - (int64_t)nb * BS;
        n[nb] = left < BS ? (int)left : BS;
    }
    return nb;
}

/* A block's p.v into row r (its probabilities p, n tokens). One value vector feeds G
 * FMAs, and each accumulator adds the tokens in order. With 32 vector registers every
 * channel chunk's accumulators stay in them through the block; with AVX2's 16 they
 * spilled to memory at every token, so there the chunks go two at a time where G <= 4
 * (PV_CHUNKS), else one. */
#if defined(__AVX512F__)
#define PV_BLOCK(VALS)                                                                    \
    do {                                                                                  \
        vch acc[G][D / DV];                                                               \
        memcpy(acc, r->acc, sizeof acc);                                                  \
        for (int t = 0; t < n; t += 2) {                                                  \
            for (int c = 0; c < D / DV; ++c) {                                            \
                vch v0, v1;                                                               \
                VALS(vb, t, c, &v0, &v1);                                                 \
                for (int g = 0; g < G; ++g) acc[g][c] += p[g][t] * v0;                    \
                if (t + 1 < n)                                                            \
                    for (int g = 0; g < G; ++g) acc[g][c] += p[g][t + 1] * v1;            \
            }                                                                             \
        }                                                                                 \
        memcpy(r->acc, acc, sizeof acc);                                                  \
    } while (0)
#else
/* AVX2: 2G accumulators where G <= 4, independent chains enough for the FMA's latency
 * (as SCORE_PASS takes for the scores). */
#define PV_CHUNKS (G <= 4 && (D / DV) % 2 == 0 ? 2 : 1)
#define PV_BLOCK(VALS)                                                                    \
    do {                                                                                  \
        for (int c = 0; c < D / DV; c += PV_CHUNKS) {                                     \
            vch acc[PV_CHUNKS][G];                                                        \
            for (int h = 0; h < PV_CHUNKS; ++h)                                           \
                for (int g = 0; g < G; ++g) acc[h][g] = r->acc[g][c + h];                 \
            for (int t = 0; t < n; t += 2)                                                \
                for (int h = 0; h < PV_CHUNKS; ++h) {                                     \
                    vch v0, v1;                                                           \
                    VALS(vb, t, c + h, &v0, &v1);                                         \
                    for (int g = 0; g < G; ++g) acc[h][g] += p[g][t] * v0;                \
                    if (t + 1 < n)                                                        \
                        for (int g = 0; g < G; ++g) acc[h][g] += p[g][t + 1] * v1;        \
                }                                                                         \
            for (int h = 0; h < PV_CHUNKS; ++h)                                           \
                for (int g = 0; g < G; ++g) r->acc[g][c + h] = acc[h][g];                 \
        }                                                                                 \
    } while (0)
#endif

typedef struct {  /* one query row's online softmax over one K/V head's group */
    float qs[G][D], m[G], l[G];  /* qs: q times the scale */
    vch acc[G][D / DV];
    int64_t len;   /* keys the row sees */
    int64_t skip;  /* of them, those at the front it does not */
    int dirty;     /* keys taken since the last partial */
} vec_row;

/* A part's end: the row's partial for each head of the group at dest + g * PARTIAL, and a
 * fresh softmax for the next part. */
static inline void vec_row_flush(vec_row *r, float *dest) {
    for (int g = 0; g < G; ++g) {
        float *pa = dest + g * PARTIAL;
        pa[0] = r->m[g], pa[1] = r->l[g];
        memcpy(pa + 2, r->acc[g], D * sizeof(float));
        for (int c = 0; c < D / DV; ++c) r->acc[g][c] = (vch){0};
        r->m[g] = -1e30f, r->l[g] = 0.f;
    }
    r->dirty = 0;
}

/* The scores of NPC pieces of BW keys (pieces u .. u + NPC - 1 of the step's blocks) for
 * the G heads of row r, into sc. Each key vector feeds G FMAs; the G * NPC accumulators
 * are independent chains, which the FMA's latency wants several of (G alone is 1 to 4
 * for most models). Two pieces where 2G accumulators and their key vectors fit in the
 * registers (16 at AVX2). Every row takes the same passes over its blocks, so its bits
 * still do not depend on the batch (the library is built with -ffast-math: the bits are
 * this code's, not those of the one-piece loop it replaced; docs/decisions.md).
 * The lead row's pass also fetches the blocks AHEAD_BLOCKS after those it starts, a share
 * each channel pair (prefetch_share); it reads DEFINE_KERNEL's tab, bytes and nblk. */
#define SCORE_PIECES (G <= 4 ? 2 : 1)
#define SCORE_PASS(NPC, KEYS)                                                             \
    do {                                                                                  \
        vblk acc_[NPC][G];                                                                \
        for (int p_ = 0; p_ < NPC; ++p_)                                                  \
            for (int g = 0; g < G; ++g) acc_[p_][g] = (vblk){0};                          \
        int64_t ahead_[NPC];  /* where a piece starts a block: the one to fetch, or -1 */ \
        for (int p_ = 0; p_ < NPC; ++p_) {                                                \
            const int fb_ = j + (u + p_) / NP + AHEAD_BLOCKS;                             \
            const int at_ = lead && (u + p_) % NP == 0 && fb_ < nblk;                     \
            ahead_[p_] = at_ ? block_at(tab, fb_, KV, kvh, bytes) : -1;                   \
        }                                                                                 \
        for (int d = 0; d < D; d += 2) {                                                  \
            for (int p_ = 0; p_ < NPC; ++p_)                                              \
                if (ahead_[p_] >= 0)                                                      \
                    prefetch_share((const char *)k + ahead_[p_],                          \
                                   (const char *)v + ahead_[p_], d, bytes);               \
            for (int p_ = 0; p_ < NPC; ++p_) {                                            \
                vblk k0, k1;                                                              \
                KEYS(kbs[(u + p_) / NP], d, (u + p_) % NP * BW, &k0, &k1);                \
                for (int g = 0; g < G; ++g) acc_[p_][g] += r->qs[g][d] * k0;              \
                for (int g = 0; g < G; ++g) acc_[p_][g] += r->qs[g][d + 1] * k1;          \
            }                                                                             \
        }                                                                                 \
        for (int p_ = 0; p_ < NPC; ++p_)                                                  \
            for (int g = 0; g < G; ++g) sc[g][u + p_] = acc_[p_][g];                      \
    } while (0)

#define DEFINE_KERNEL(NAME, QT, QLOAD, QSTORE, T, KEYS, VALS)                             \
void NAME(const QT *q, const T *k, const T *v, const int64_t *tables,                     \
          const int64_t *row_seq, const int64_t *lens, const int64_t *skip, QT *out,      \
          int R, int q_stride, int KV, int max_blocks, float scale, float softcap,        \
          const float *alibi, int nthreads) {                                             \
    const int H = KV * G;                                                                 \
    split_plan sp;                                                                        \
    split_plan_init(&sp, row_seq, lens, R, ROWS_PER_TASK, KV, nthreads);                  \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                \
    for (int task = 0; task < sp.units * KV; ++task) {                                    \
        const int kvh = task % KV;                                                        \
        const unit_parts w = unit_of(&sp, lens, task / KV);                               \
        const int r0 = w.r0, nr = w.nr, first = w.p0 * PART_BLOCKS;                       \
        const partials pt = {own_partials(&sp, &w), w.p1, H};                             \
        const int64_t seq = row_seq ? row_seq[r0] : r0;                                   \
        const int64_t *tab = tables + seq * max_blocks, bytes = D * BS * sizeof(T);       \
        vec_row rows[ROWS_PER_TASK];                                                      \
        int nblk = 0;                                                                     \
        for (int i = 0; i < nr; ++i) {                                                    \
            vec_row *r = &rows[i];                                                        \
            r->len = lens[r0 + i];                                                        \
            r->skip = skip ? skip[r0 + i] : 0;                                            \
            const int64_t end = (int64_t)w.p1 * PART_KEYS;                                \
            const int nb = (int)(((r->len < end ? r->len : end) + BS - 1) / BS);          \
            nblk = nb > nblk ? nb : nblk;                                                 \
            r->dirty = 0;                                                                 \
            for (int g = 0; g < G; ++g) {                                                 \
                const QT *qh = q + (int64_t)(r0 + i) * q_stride + (kvh * G + g) * D;      \
                for (int d = 0; d < D; ++d) r->qs[g][d] = QLOAD(qh[d]) * scale;           \
                for (int c = 0; c < D / DV; ++c) r->acc[g][c] = (vch){0};                 \
                r->m[g] = -1e30f;                                                         \
                r->l[g] = 0.f;                                                            \
            }                                                                             \
        }                                                                                 \
        for (int j = first; j < nblk; j += STEP_BLOCKS) {  /* a softmax step */          \
            const int part = j / PART_BLOCKS;                                             \
            const int64_t part_end = (int64_t)(part + 1) * PART_KEYS;                     \
            if (j > first && j % PART_BLOCKS == 0)  /* part - 1 ends */                   \
                for (int i = 0; i < nr; ++i)                                              \
                    if (rows[i].dirty)                                                    \
                        vec_row_flush(&rows[i],                                           \
                                      partial_of(&sp, &pt, r0, i, part - 1, kvh));        \
            const T *kbs[STEP_BLOCKS], *vbs[STEP_BLOCKS];                                 \
            for (int b = 0; b < STEP_BLOCKS && j + b < nblk; ++b) {                       \
                const int64_t blk = tab[j + b];                                           \
                kbs[b] = k + (blk * KV + kvh) * (int64_t)(D * BS);                        \
                vbs[b] = v + (blk * KV + kvh) * (int64_t)(D * BS);                        \
            }                                                                             \
            if (j == first && first + 1 < nblk)  /* the block after the first, at once */ \
                prefetch_block_now(k, v, tab, first + 1, KV, kvh, bytes);                 \
            for (int i = 0; i < nr; ++i) {                                                \
                vec_row *r = &rows[i];                                                    \
                const int lead = i == nr - 1;  /* the run's longest row fetches ahead */ \
                const int64_t end = r->len < part_end ? r->len : part_end;                \
                const int64_t rest = end - (int64_t)j * BS;                               \
                if (rest <= 0) continue;                                                  \
                int ns[STEP_BLOCKS];                                                      \
                const int nb = step_blocks(rest, ns);                                     \
                if ((int64_t)(j + nb) * BS <= r->skip) continue; /* no key it sees */    \
                r->dirty = parts_of(r->len) > 1;                                          \
                vblk sc[G][STEP_BLOCKS * NP];                                             \
                for (int u = 0; u < nb * NP;) {  /* pieces of BW keys: block u / NP */    \
                    if (SCORE_PIECES == 2 && u + 1 < nb * NP) {                           \
                        SCORE_PASS(2, KEYS);                                              \
                        u += 2;                                                           \
                    } else {                                                              \
                        SCORE_PASS(1, KEYS);                                              \
                        u += 1;                                                           \
                    }                                                                     \
                }                                                                         \
                if (softcap > 0.f)                                                        \
                    for (int g = 0; g < G; ++g)                                           \
                        for (int x = 0; x < nb * NP; ++x)                                 \
                            sc[g][x] = vsoftcap(sc[g][x], softcap);                       \
                float pb[STEP_BLOCKS][G][BS];                                             \
                for (int g = 0; g < G; ++g) {                                             \
                    for (int b = 0; b < nb; ++b) {                                        \
                        const int n = ns[b];                                              \
                        float s[BS];                                                      \
                        memcpy(s, &sc[g][b * NP], sizeof s);                              \
                        if (alibi) {                                                      \
                            const float slope = alibi[kvh * G + g];                       \
                            const int64_t at = (int64_t)(j + b) * BS;                     \
                            for (int t = 0; t < BS; ++t)                                  \
                                s[t] -= slope * (float)(r->len - 1 - (at + t));           \
                        }                                                                 \
                        for (int t = n; t < BS; ++t) s[t] = -1e30f;  /* past the context */ \
                        for (int64_t t = 0, at = (int64_t)(j + b) * BS; /* before the window */ \
                             t < BS && at + t < r->skip; ++t)                             \
                            s[t] = -1e30f;                                                \
                        memcpy(&sc[g][b * NP], s, sizeof s);                              \
                    }                                                                     \
                    const float bmax = fmaxf(r->m[g], hmax(sc[g], nb * NP));              \
                    vblk e[STEP_BLOCKS * NP];                                             \
                    for (int x = 0; x < nb * NP; ++x) e[x] = vexp(sc[g][x] - bmax);       \
                    /* the max unchanged: exp(0) = 1 without the call; a part's first     \
                     * step: exp(-1e30 - max) = 0 without it (the same bits as expf's) */ \
                    const float corr = bmax == r->m[g]  ? 1.f                             \
                                       : r->m[g] == -1e30f ? 0.f                          \
                                                          : expf(r->m[g] - bmax);         \
                    r->l[g] = r->l[g] * corr + hsum(e, nb * NP);                          \
                    r->m[g] = bmax;                                                       \
                    for (int b = 0; b < nb; ++b) memcpy(pb[b][g], &e[b * NP], BS * 4);    \
                    for (int c = 0; c < D / DV; ++c) r->acc[g][c] *= corr;                \
                }                                                                         \
                for (int b = 0; b < nb; ++b) {                                            \
                    const T *vb = vbs[b];                                                 \
                    const int n = ns[b];                                                  \
                    float(*p)[BS] = pb[b];                                                \
                    PV_BLOCK(VALS);                                                       \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int i = 0; i < nr; ++i) {                                                    \
            const int parts = parts_of(rows[i].len);                                      \
            if (rows[i].dirty) {  /* the row's last part here */                         \
                const int last = (parts < w.p1 ? parts : w.p1) - 1;                       \
                vec_row_flush(&rows[i], partial_of(&sp, &pt, r0, i, last, kvh));          \
                continue;                                                                 \
            }                                                                             \
            if (parts > 1 || w.p0) continue;  /* parts: merged below */                   \
            for (int g = 0; g < G; ++g) {  /* a row of one part */                        \
                QT *o = out + ((int64_t)(r0 + i) * H + kvh * G + g) * D;                  \
                const float inv = 1.f / rows[i].l[g];                                     \
                for (int c = 0; c < D / DV; ++c) {                                        \
                    float r[DV];                                                          \
                    const vch rv = rows[i].acc[g][c] * inv;                               \
                    memcpy(r, &rv, sizeof r);                                             \
                    for (int x = 0; x < DV; ++x) o[c * DV + x] = QSTORE(r[x]);            \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        merge_own(&sp, &pt, &w, lens, kvh, (char *)out, sizeof(QT));                      \
        free(pt.own);                                                                     \
    }                                                                                     \
    merge_spread(&sp, lens, R, H, (char *)out, sizeof(QT), nthreads);                     \
    split_plan_free(&sp);                                                                 \
}

DEFINE_KERNEL(paged_attention_f32, float, f32_id, f32_id, float, keys2_f32, vals2_f32)
#if defined(__AVX512BF16__) && !defined(PREFER_FMA) && BS == 16 && D % 16 == 0
/* bf16 with AVX-512 BF16 (and no tiles, or tiles not wanted; where model/backends/cpu/isa.py's
 * prefer_fma finds vdpbf16ps slower than the FMA, -DPREFER_FMA, the float32 kernel below
 * instead: docs/decisions.md): the same tasks and online softmax, with the dot products
 * done by vdpbf16ps on the cache's own pairs. q.k: each 32-bit lane of a K vector holds
 * a key's channels d, d + 1 (the layout above), so one vdpbf16ps against q's (d, d + 1)
 * pair adds both channels to 16 keys' scores, q taken as the bf16 it is and the scale
 * applied to the scores. p.v: a V vector holds 16 channels of a token pair, so the
 * probabilities go in as bf16 pairs, rounded as the AMX kernel rounds them, and the
 * running sum adds those rounded weights. Half the multiply-adds of the float32 version
 * and none of its conversions (docs/decisions.md). A row's arithmetic is its own, so its
 * bits do not
 * depend on what else is in the call. */
#define QK_CHAINS (D % 8 == 0 ? 4 : 1)
/* Rows share a task as in DEFINE_KERNEL; a softmax step that leaves a row's running max
 * as it was skips its correction (exp(0) = 1: no expf, no rescaling), and a row's q.k
 * scores are computed two blocks at a time (each q broadcast serves both). Each row's
 * arithmetic is its own whatever else is in the call, so are its bits
 * (docs/decisions.md). */

typedef struct {  /* one query row's online softmax over one K/V head's group */
    uint32_t qp[G][D / 2];  /* q's channel pairs, as bf16 pairs */
    __m512 acc[G][D / 16];
    float m[G], l[G];
    int64_t len;   /* keys the row sees */
    int64_t skip;  /* of them, those at the front it does not */
    int dirty;     /* keys taken since the last partial */
} bf16_row;

/* A part's end: as vec_row_flush. */
static inline void bf16_row_flush(bf16_row *r, float *dest) {
    for (int g = 0; g < G; ++g) {
        float *pa = dest + g * PARTIAL;
        pa[0] = r->m[g], pa[1] = r->l[g];
        for (int c = 0; c < D / 16; ++c) {
            _mm512_storeu_ps(pa + 2 + c * 16, r->acc[g][c]);
            r->acc[g][c] = _mm512_setzero_ps();
        }
        r->m[g] = -1e30f, r->l[g] = 0.f;
    }
    r->dirty = 0;
}

/* The row's q.k scores of nb blocks (1 or 2, a constant at each call: q's broadcasts
 * serve both), scaled. Two where both blocks' partial sums stay in registers (at most 32
 * vectors). */
#define QK_PAIRS (2 * G * QK_CHAINS + 3 <= 32)
static inline __attribute__((always_inline)) void bf16_scores(
    const bf16_row *r, const uint16_t *const *kb, int nb, float scale, __m512 sc[][G]) {
    /* QK_CHAINS partial sums per head: one would be a chain of D / 2 dependent
     * vdpbf16ps, its latency the block's time */
    __m512 part[2][G][QK_CHAINS];
    for (int b = 0; b < nb; ++b)
        for (int g = 0; g < G; ++g)
            for (int i = 0; i < QK_CHAINS; ++i) part[b][g][i] = _mm512_setzero_ps();
    for (int d = 0; d < D / 2; d += QK_CHAINS) {
        for (int i = 0; i < QK_CHAINS; ++i) {
            __m512bh kv[2];
            for (int b = 0; b < nb; ++b)
                kv[b] = (__m512bh)_mm512_loadu_si512(kb[b] + (d + i) * BS * 2);
            for (int g = 0; g < G; ++g) {
                const __m512bh qq = (__m512bh)_mm512_set1_epi32((int)r->qp[g][d + i]);
                for (int b = 0; b < nb; ++b)
                    part[b][g][i] = _mm512_dpbf16_ps(part[b][g][i], kv[b], qq);
            }
        }
    }
    for (int b = 0; b < nb; ++b)
        for (int g = 0; g < G; ++g) {
            __m512 t = part[b][g][0];
            for (int i = 1; i < QK_CHAINS; ++i) t = _mm512_add_ps(t, part[b][g][i]);
            sc[b][g] = _mm512_mul_ps(t, _mm512_set1_ps(scale));
        }
}

/* Blocks j .. j + nb - 1's scores sc (nb 1 .. STEP_BLOCKS, n[b] of block b's keys visible
 * to the row, block b's first key at (j + b) * BS) into the row: one online-softmax step
 * over them all, then p.v. */
static inline __attribute__((always_inline)) void bf16_row_blocks(
    bf16_row *r, __m512 sc[][G], const uint16_t *const *vb, int j, int nb, const int *n,
    float softcap, const float *alibi, int kvh, __m512 lane) {
    __mmask16 keep[STEP_BLOCKS];
    for (int b = 0; b < nb; ++b) {
        keep[b] = n[b] < BS ? (__mmask16)((1u << n[b]) - 1) : (__mmask16)0xFFFF;
        const int64_t before = r->skip - (int64_t)(j + b) * BS;  /* the window's start */
        if (before > 0) keep[b] &= before >= BS ? 0 : (__mmask16)~((1u << before) - 1);
    }
    uint32_t pp[STEP_BLOCKS][G][BS / 2];  /* the probabilities as bf16 token pairs */
    for (int g = 0; g < G; ++g) {
        __m512 s[STEP_BLOCKS];
        for (int b = 0; b < nb; ++b) {
            s[b] = sc[b][g];
            if (softcap > 0.f) {
                vblk v;
                memcpy(&v, &s[b], sizeof v);
                v = vsoftcap(v, softcap);
                memcpy(&s[b], &v, sizeof v);
            }
            if (alibi) {  /* -slope * distance, distance = S - 1 - key position */
                const __m512 dist = _mm512_sub_ps(
                    _mm512_set1_ps((float)(r->len - 1 - (int64_t)(j + b) * BS)), lane);
                s[b] = _mm512_fnmadd_ps(_mm512_set1_ps(alibi[kvh * G + g]), dist, s[b]);
            }
            s[b] = _mm512_mask_blend_ps(keep[b], _mm512_set1_ps(-1e30f), s[b]);
        }
        __m512 top = s[0];
        for (int b = 1; b < nb; ++b) top = _mm512_max_ps(top, s[b]);
        const float bmax = fmaxf(r->m[g], _mm512_reduce_max_ps(top));
        __m512 total = _mm512_setzero_ps();
        for (int b = 0; b < nb; ++b) {
            const __m512 e = exp_masked(_mm512_sub_ps(s[b], _mm512_set1_ps(bmax)), keep[b]);
            const __m256bh pb = _mm512_cvtneps_pbh(e);
            memcpy(pp[b][g], &pb, sizeof pp[b][g]);
            total = _mm512_add_ps(total, _mm512_cvtpbh_ps(pb));
        }
        const float sum = _mm512_reduce_add_ps(total);
        if (bmax == r->m[g]) {  /* the correction would be exp(0) = 1: nothing to scale */
            r->l[g] += sum;
            continue;
        }
        /* a part's first step: exp(-1e30 - max) = 0 without the call (expf's bits too) */
        const float corr = r->m[g] == -1e30f ? 0.f : expf(r->m[g] - bmax);
        r->l[g] = r->l[g] * corr + sum;
        r->m[g] = bmax;
        for (int c = 0; c < D / 16; ++c)
            r->acc[g][c] = _mm512_mul_ps(r->acc[g][c], _mm512_set1_ps(corr));
    }
    __m512 acc[G][D / 16];  /* in registers for the blocks' tokens */
    memcpy(acc, r->acc, sizeof acc);
    for (int b = 0; b < nb; ++b)
        for (int t = 0; t < n[b]; t += 2) {  /* token pairs; past the context: none */
            /* a last odd token's partner slot may hold anything: its channels read 0 */
            const __mmask32 both = t + 1 < n[b] ? 0xFFFFFFFFu : 0x55555555u;
            for (int c = 0; c < D / 16; ++c) {
                const __m512bh vv = (__m512bh)_mm512_maskz_loadu_epi16(
                    both, vb[b] + (int64_t)t * D + c * 32);
                for (int g = 0; g < G; ++g)
                    acc[g][c] = _mm512_dpbf16_ps(
                        acc[g][c], vv, (__m512bh)_mm512_set1_epi32((int)pp[b][g][t / 2]));
            }
        }
    memcpy(r->acc, acc, sizeof acc);
}

void paged_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                          const int64_t *tables, const int64_t *row_seq, const int64_t *lens,
                          const int64_t *skip, uint16_t *out, int R, int q_stride, int KV,
                          int max_blocks, float scale, float softcap, const float *alibi,
                          int nthreads) {
    const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int H = KV * G;
    /* tasks: a K/V head of up to ROWS_PER_TASK consecutive rows of one sequence, all their
     * parts or one (split_plan) */
    split_plan sp;
    split_plan_init(&sp, row_seq, lens, R, ROWS_PER_TASK, KV, nthreads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int task = 0; task < sp.units * KV; ++task) {
        const int kvh = task % KV;
        const unit_parts w = unit_of(&sp, lens, task / KV);
        const int r0 = w.r0, nr = w.nr, first = w.p0 * PART_BLOCKS;
        const partials pt = {own_partials(&sp, &w), w.p1, H};
        const int64_t seq = row_seq ? row_seq[r0] : r0;
        bf16_row rows[ROWS_PER_TASK];
        int nblk = 0;
        for (int i = 0; i < nr; ++i) {
            bf16_row *r = &rows[i];
            r->len = lens[r0 + i];
            r->skip = skip ? skip[r0 + i] : 0;
            const int64_t end = (int64_t)w.p1 * PART_KEYS;
            const int nb = (int)(((r->len < end ? r->len : end) + BS - 1) / BS);
            nblk = nb > nblk ? nb : nblk;
            r->dirty = 0;
            for (int g = 0; g < G; ++g) {
                memcpy(r->qp[g], q + (int64_t)(r0 + i) * q_stride + (kvh * G + g) * D, D * 2);
                for (int c = 0; c < D / 16; ++c) r->acc[g][c] = _mm512_setzero_ps();
                r->m[g] = -1e30f;
                r->l[g] = 0.f;
            }
        }
        for (int j = first; j < nblk; j += STEP_BLOCKS) {  /* a softmax step */
            const int part = j / PART_BLOCKS;
            const int64_t part_end = (int64_t)(part + 1) * PART_KEYS;
            if (j > first && j % PART_BLOCKS == 0)  /* part - 1 ends */
                for (int i = 0; i < nr; ++i)
                    if (rows[i].dirty)
                        bf16_row_flush(&rows[i], partial_of(&sp, &pt, r0, i, part - 1, kvh));
            const uint16_t *kb[STEP_BLOCKS], *vb[STEP_BLOCKS];
            for (int b = 0; b < STEP_BLOCKS && j + b < nblk; ++b) {
                const int64_t blk = tables[seq * max_blocks + j + b];
                kb[b] = k + (blk * KV + kvh) * (int64_t)(D * BS);
                vb[b] = v + (blk * KV + kvh) * (int64_t)(D * BS);
                prefetch_ahead(k, v, tables + seq * max_blocks, j + b, first, nblk, KV, kvh,
                               D * BS * 2);
            }
            for (int i = 0; i < nr; ++i) {
                const int64_t end = rows[i].len < part_end ? rows[i].len : part_end;
                const int64_t rest = end - (int64_t)j * BS;
                if (rest <= 0) continue;
                rows[i].dirty = parts_of(rows[i].len) > 1;
                int n[STEP_BLOCKS];
                const int nb = step_blocks(rest, n);
                __m512 sc[STEP_BLOCKS][G];
                for (int b = 0; b < nb; b += 2) {  /* the scores two blocks at a time */
                    if (b + 1 < nb && QK_PAIRS) {
                        bf16_scores(&rows[i], kb + b, 2, scale, sc + b);
                    } else {
                        bf16_scores(&rows[i], kb + b, 1, scale, sc + b);
                        if (b + 1 < nb) bf16_scores(&rows[i], kb + b + 1, 1, scale, sc + b + 1);
                    }
                }
                bf16_row_blocks(&rows[i], sc, vb, j, nb, n, softcap, alibi, kvh, lane);
            }
        }
        for (int i = 0; i < nr; ++i) {
            const int parts = parts_of(rows[i].len);
            if (rows[i].dirty) {  /* the row's last part here */
                const int last = (parts < w.p1 ? parts : w.p1) - 1;
                bf16_row_flush(&rows[i], partial_of(&sp, &pt, r0, i, last, kvh));
                continue;
            }
            if (parts > 1 || w.p0) continue;  /* parts: merged below */
            for (int g = 0; g < G; ++g) {  /* a row of one part */
                uint16_t *o = out + ((int64_t)(r0 + i) * H + kvh * G + g) * D;
                const __m512 inv = _mm512_set1_ps(1.f / rows[i].l[g]);
                for (int c = 0; c < D / 16; ++c) {
                    const __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(rows[i].acc[g][c], inv));
                    _mm256_storeu_si256((__m256i *)(o + c * 16), (__m256i)r);
                }
            }
        }
        merge_own(&sp, &pt, &w, lens, kvh, (char *)out, 2);
        free(pt.own);
    }
    merge_spread(&sp, lens, R, H, (char *)out, 2, nthreads);
    split_plan_free(&sp);
}
#else
/* bf16 queries and output (as the decoder stack's buffers hold them): float32 inside,
 * the K/V widened and multiplied by FMA */
DEFINE_KERNEL(paged_attention_bf16, uint16_t, bf16_load, bf16_store, uint16_t, keys2_bf16,
              vals2_bf16)
#endif

/* ---- bfloat16 on the AMX tile unit ------------------------------------------------------
 * The same attention for bfloat16 caches on CPUs with AMX, BLOCK_SIZE 16 and HEAD_DIM a
 * multiple of 32. A task is one K/V head and up to TOK consecutive tokens of a sequence:
 * their TOK * G query rows (token-major, then head) form one 16-row tile. For each block
 * of 16 keys the tile unit computes the rows' scores (q.k accumulated in float32); the
 * online softmax runs per row in float32 vectors; the probabilities are rounded to
 * bfloat16 and the tile unit computes p.v into a fresh float32 tile, which is added to the
 * row's accumulator (o = o * correction + p.v). Each row only takes the blocks up to its
 * own position, and every step is a function of that row alone (tile dot products are per
 * element), so the result is the same bits whether the row is a decode, one token of a
 * prefill chunk, or a recomputed token after preemption, and whatever else is batched. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && BS == 16 && \
    D % 32 == 0
#include <immintrin.h>
#include <stdlib.h>

#define TOK (16 / G)  /* tokens per task */

/* The AMX register state for this process (common.h). 1 when usable. */
int paged_attention_amx_init(void) { return amx_request(); }

/* Blocks per softmax step (the tile code below takes two: tmm0 and tmm6). 4 made prompts
 * faster still and decodes whose K/V come from memory slower, whatever the prefetching
 * tried (docs/decisions.md); a step's size is part of a row's arithmetic, so it is the
 * same for every row. */
#define STEP 2
#define SPAN (STEP * BS)  /* keys per softmax step: blocks 2i and 2i + 1 */
_Static_assert(SPAN == 32, "a step's probabilities are one vector of 32 bf16");

/* tmm0, tmm6: scores of the two blocks (rows x 16 keys fp32); tmm1: 32 channels of q
 * (rows x 32 bf16); tmm2: 32 channels of K (16 channel pairs x 16 keys x 2); tmm3: p.v
 * (rows x 16 channels fp32); tmm4: 16 channels of V (8 key pairs x 16 x 2); tmm5, tmm7: p
 * of the two blocks (rows x 16 keys bf16). `rows`: the query rows of a task (up to 16).
 * Tile loads, stores and dot products cost by the row, so a decode task (GROUP rows)
 * runs its tiles at that height rather than 16 (measured faster);
 * each row's arithmetic is the same at any height. */
static void configure_attention(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    c.rows[2] = 16;
    c.rows[4] = BS / 2;
    c.colsb[5] = c.colsb[7] = BS * 2;
    _tile_loadconfig(&c);
}

typedef struct {
    uint16_t q[16 * D] __attribute__((aligned(64)));
    float s[16 * SPAN] __attribute__((aligned(64)));
    uint16_t p[16 * SPAN] __attribute__((aligned(64)));
    float pv[16 * 16] __attribute__((aligned(64)));
    float o[16 * D] __attribute__((aligned(64)));
    float ps[16 * 16] __attribute__((aligned(64)));  /* the step's weights, lane sums */
    float l[16 * 16] __attribute__((aligned(64)));   /* running sums, per row and lane */
    float m[16] __attribute__((aligned(64)));
    float corr[16] __attribute__((aligned(64)));
    int64_t pos[16];
    int64_t skip[16];  /* keys at the front a row does not see (its window's start) */
    __mmask16 active;  /* rows that see any key of the current step */
} group_state;

/* Lanes first .. first + 15 of a step that a row may see, `last` its last key there. */
static inline __mmask16 visible(int64_t last, int first) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t lim = last - first;
    if (lim < 0) return 0;
    return _mm512_cmple_epi32_mask(lane, _mm512_set1_epi32(lim < 15 ? (int)lim : 15));
}

/* exp(x) for x <= 0, a probability rounded to bfloat16 next: vexp's steps (exp_split) with
 * common.h's cubic for 2^f in place of the degree-6 polynomial, three multiply-adds fewer
 * (docs/decisions.md). Lanes
 * outside `keep` are 0. */
static inline __m512 exp_p(__m512 x, __mmask16 keep) {
    __m512 n;
    const __m512 f = exp_split(x, &n);
    return _mm512_maskz_scalef_ps(keep, EXP2_CUBIC(f, _mm512_fmadd_ps, _mm512_set1_ps), n);
}

/* Row i's scores of the step (keys k0 .. k0 + SPAN - 1, `last` the last it sees from k0)
 * -> its probabilities in st->p, its step max in bmax[i] and its weights' lane sums in
 * st->ps. Keys past the row's position (or past the sequence's blocks) get probability 0.
 * FULL (a constant where inlined): the row sees every key of the step, the arithmetic of
 * masks of all ones without computing them. */
static inline __attribute__((always_inline)) void softmax_row(group_state *st, int i,
                                                              int64_t k0, int64_t last, int kvh,
                                                              float scale, float softcap,
                                                              const float *alibi,
                                                              float *bmax, const int FULL) {
    const __m512 lane = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __mmask16 keep[STEP];
    __m512 x[STEP];
    __m512 top = _mm512_set1_ps(st->m[i]);
    for (int b = 0; b < STEP; ++b) {
        keep[b] = FULL ? 0xFFFF : visible(last, b * BS);
        const int64_t before = st->skip[i] - k0 - b * BS;  /* the window's start */
        if (!FULL && before > 0) keep[b] &= before >= BS ? 0 : (__mmask16)~((1u << before) - 1);
        x[b] = _mm512_mul_ps(_mm512_load_ps(st->s + i * SPAN + b * BS), _mm512_set1_ps(scale));
        if (softcap > 0.f) {
            vblk v;
            memcpy(&v, &x[b], sizeof v);
            v = vsoftcap(v, softcap);
            memcpy(&x[b], &v, sizeof v);
        }
        if (alibi) {  /* -slope * distance, distance = pos - key position */
            const __m512 d = _mm512_sub_ps(_mm512_set1_ps((float)(last - b * BS)), lane);
            x[b] = _mm512_fnmadd_ps(_mm512_set1_ps(alibi[kvh * G + i % G]), d, x[b]);
        }
        if (!FULL) x[b] = _mm512_mask_blend_ps(keep[b], _mm512_set1_ps(-1e30f), x[b]);
        top = _mm512_max_ps(top, x[b]);
    }
    bmax[i] = _mm512_reduce_max_ps(top);
    top = _mm512_set1_ps(bmax[i]);
    /* the step's two blocks as one vector of 32 bf16 (the upper half from the first
     * argument), and the weights p.v uses summed, a pair of keys a lane, by one dot
     * product with ones, where each block had been converted back to float32 and added
     * (docs/decisions.md) */
    const __m512bh p = _mm512_cvtne2ps_pbh(exp_p(_mm512_sub_ps(x[1], top), keep[1]),
                                           exp_p(_mm512_sub_ps(x[0], top), keep[0]));
    _mm512_store_si512((__m512i *)(st->p + i * SPAN), (__m512i)p);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  /* bf16 1.0 */
    _mm512_store_ps(st->ps + i * 16, _mm512_dpbf16_ps(_mm512_setzero_ps(), p, ones));
}

/* The step's scores (keys k0 .. k0 + SPAN - 1, in st->s) -> probabilities in st->p,
 * running max and sum and the correction per row. The corrections of all 16 rows are one
 * vector (lane i: row i); a row's running sum is 16 lane sums, added up at its end. */
static void softmax_step(group_state *st, int nr, int64_t k0, int kvh, float scale,
                         float softcap, const float *alibi) {
    float bmax[16] __attribute__((aligned(64)));
    __mmask16 active = 0;
    for (int i = 0; i < 16; ++i) bmax[i] = st->m[i];
    for (int i = 0; i < nr; ++i) {
        if (st->pos[i] < k0) {  /* the row ends before this step */
            memset(st->p + i * SPAN, 0, SPAN * 2);
            continue;
        }
        active |= (__mmask16)(1u << i);
        const int64_t last = st->pos[i] - k0;  /* the last key this row sees, from k0 */
        if (last >= SPAN - 1 && st->skip[i] <= k0)
            softmax_row(st, i, k0, last, kvh, scale, softcap, alibi, bmax, 1);
        else
            softmax_row(st, i, k0, last, kvh, scale, softcap, alibi, bmax, 0);
    }
    const __m512 bm = _mm512_load_ps(bmax);
    __m512 corr = exp_masked(_mm512_sub_ps(_mm512_load_ps(st->m), bm), active);
    corr = _mm512_mask_blend_ps(active, _mm512_set1_ps(1.f), corr);
    _mm512_store_ps(st->corr, corr);
    for (int i = 0; i < nr; ++i)
        if (active >> i & 1)
            _mm512_store_ps(st->l + i * 16,
                            _mm512_fmadd_ps(_mm512_load_ps(st->l + i * 16),
                                            _mm512_set1_ps(st->corr[i]),
                                            _mm512_load_ps(st->ps + i * 16)));
    _mm512_store_ps(st->m, bm);
    st->active = active;
}

/* Block blk's keys or values (kv: the K or V pool) of head kvh, into L1. */
PREFETCH_HELPER prefetch_block(const uint16_t *kv, int64_t blk, int KV, int kvh) {
    const char *p = (const char *)(kv + (blk * KV + kvh) * (int64_t)(D * BS));
    for (int off = 0; off < D * BS * 2; off += 64) __builtin_prefetch(p + off);
}

/* The blocks of one pass over a K/V head: its sequence's block table, the pass's blocks
 * first .. end - 1 (none where no pass follows) and the blocks of the group's passes in
 * all (its last row's). */
typedef struct {
    const int64_t *table;
    int first, end, blocks, kvh;
} pass_blocks;

/* The keys or values (kv) of the STEP blocks from n of the pass `cur`, those past its end
 * from the thread's next pass: fetched a step ahead, each as the step's own are done
 * with (both at the step's start kept decodes from memory slower). */
PREFETCH_HELPER prefetch_step(const uint16_t *kv, const pass_blocks *cur,
                              const pass_blocks *next, int n, int KV, int kvh) {
    for (int b = n; b < n + STEP; ++b)
        if (b < cur->end)
            prefetch_block(kv, cur->table[b], KV, kvh);
        else if (next->first + b - cur->end < next->end)
            prefetch_block(kv, next->table[next->first + b - cur->end], KV, next->kvh);
}

static void attend_group(const uint16_t *q, int q_stride, const uint16_t *k, const uint16_t *v,
                         const pass_blocks *cur, const int64_t *lens, const int64_t *skip,
                         uint16_t *out, int r0,
                         int ntok, int kvh, int KV, float scale, float softcap,
                         const float *alibi,
                         const pass_blocks *next, const split_plan *sp, const partials *pt,
                         int part) {
    group_state st;
    const int H = KV * G, nr = ntok * G, nblk = cur->end;
    const int64_t *table = cur->table;
    memset(st.o, 0, sizeof(float) * D * nr);
    memset(st.l, 0, sizeof(float) * 16 * nr);
    for (int i = 0; i < 16; ++i) {
        st.m[i] = -1e30f, st.pos[i] = -1, st.skip[i] = 0;
        if (i >= nr) continue;
        const int64_t row = r0 + i / G;
        if (skip) st.skip[i] = skip[row];
        memcpy(st.q + i * D, q + row * q_stride + (kvh * G + i % G) * D, D * 2);
        st.pos[i] = lens[row] - 1;
    }
    for (int j = cur->first; j < nblk; j += STEP) {  /* a step: blocks j and j + 1 (if any) */
        const int two = j + 1 < nblk;
        const int64_t off0 = (table[j] * KV + kvh) * (int64_t)(D * BS);
        const int64_t off1 = two ? (table[j + 1] * KV + kvh) * (int64_t)(D * BS) : 0;
        _tile_zero(0);
        _tile_zero(6);
        for (int c = 0; c < D; c += 32) {
            _tile_loadd(1, st.q + c, D * 2);
            _tile_loadd(2, k + off0 + c * BS, 64);
            _tile_dpbf16ps(0, 1, 2);
            if (two) {
                _tile_loadd(2, k + off1 + c * BS, 64);
                _tile_dpbf16ps(6, 1, 2);
            }
        }
        _tile_stored(0, st.s, SPAN * 4);
        _tile_stored(6, st.s + BS, SPAN * 4);
        prefetch_step(k, cur, next, j + STEP, KV, kvh);  /* scattered blocks: fetch ahead */
        softmax_step(&st, nr, (int64_t)j * BS, kvh, scale, softcap, alibi);
        _tile_loadd(5, st.p, SPAN * 2);
        _tile_loadd(7, st.p + BS, SPAN * 2);
        for (int c = 0; c < D; c += 16) {
            _tile_zero(3);
            _tile_loadd(4, v + off0 + 2 * c, D * 4);
            _tile_dpbf16ps(3, 5, 4);
            if (two) {
                _tile_loadd(4, v + off1 + 2 * c, D * 4);
                _tile_dpbf16ps(3, 7, 4);
            }
            _tile_stored(3, st.pv, 64);
            for (int i = 0; i < nr; ++i) {
                if (!(st.active >> i & 1)) continue;
                float *o = st.o + i * D + c;
                _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), _mm512_set1_ps(st.corr[i]),
                                                   _mm512_load_ps(st.pv + i * 16)));
            }
        }
        prefetch_step(v, cur, next, j + STEP, KV, kvh);
    }
    for (int i = 0; i < nr; ++i) {
        const int parts = parts_of(st.pos[i] + 1);
        if (part >= parts) continue;  /* the row ends before this part */
        const float l = _mm512_reduce_add_ps(_mm512_load_ps(st.l + i * 16));
        if (parts > 1) {  /* a partial, combined by merge_parts */
            float *pa = partial_of(sp, pt, r0, i / G, part, kvh) + i % G * PARTIAL;
            pa[0] = st.m[i], pa[1] = l;
            memcpy(pa + 2, st.o + i * D, D * sizeof(float));
            continue;
        }
        const __m512 inv = _mm512_set1_ps(1.f / l);
        uint16_t *dst = out + ((r0 + i / G) * (int64_t)H + kvh * G + i % G) * D;
        for (int c = 0; c < D; c += 16)
            _mm256_storeu_si256((__m256i *)(dst + c),
                                (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_load_ps(st.o + i * D + c), inv)));
    }
}

/* Part `part` of a pass over K/V head kvh of a sequence of nblk blocks. */
static inline pass_blocks pass_of(const int64_t *table, int nblk, int part, int kvh) {
    const int first = part * PART_BLOCKS;
    pass_blocks p = {table, first, nblk < first + PART_BLOCKS ? nblk : first + PART_BLOCKS,
                     nblk, kvh};
    return p;
}

/* The first pass of task `task` (a unit, a group of rows and its parts, x `per_group`
 * runs of heads): its first part over its first head. */
static pass_blocks task_pass(const split_plan *sp, const int64_t *lens, int task, int per_group,
                             int per_task, const int64_t *tables, const int64_t *row_seq,
                             int max_blocks) {
    const unit_parts w = unit_of(sp, lens, task / per_group);
    const int r = w.r0 + w.nr - 1;  /* the group's last row sees the most */
    return pass_of(tables + (row_seq ? row_seq[r] : r) * max_blocks,
                   (int)((lens[r] - 1) / BS) + 1, w.p0, task % per_group * per_task);
}

/* q, out: (R, KV * G, D) bfloat16 (q's rows q_stride apart); the rest as for
 * paged_attention_bf16. */
void paged_attention_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                         const int64_t *tables, const int64_t *row_seq, const int64_t *lens,
                         const int64_t *skip, uint16_t *out, int R, int q_stride, int KV,
                         int max_blocks, float scale, float softcap, const float *alibi,
                         int nthreads) {
    split_plan sp;
    split_plan_init(&sp, row_seq, lens, R, TOK, KV, nthreads);
    /* A task is a unit (a group of rows, all its parts or one: split_plan) over all K/V
     * heads in turn where there are units enough to keep the threads busy (the heads of a
     * block are adjacent in the pool: measured faster than spreading a group's heads over
     * the threads), else over one head. */
    const int per_task = sp.units >= 4 * nthreads ? KV : 1, per_group = KV / per_task;
    const int ntasks = sp.units * per_group;
    int claimed = 0;  /* tasks handed out so far */
#pragma omp parallel num_threads(nthreads)
    {
        int rows = 0;  /* the tile height configured */
        /* Each thread claims its next task before it runs the current one, so that each
         * pass's last softmax step can fetch the first blocks of the pass that follows. */
        int task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (task < ntasks) {
            const int next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const unit_parts w = unit_of(&sp, lens, task / per_group);
            if (w.nr * G != rows) configure_attention(rows = w.nr * G);
            const partials pt = {own_partials(&sp, &w), w.p1, KV * G};
            const pass_blocks cur = task_pass(&sp, lens, task, per_group, per_task, tables,
                                              row_seq, max_blocks);
            const pass_blocks after =
                next < ntasks ? task_pass(&sp, lens, next, per_group, per_task, tables,
                                          row_seq, max_blocks)
                              : (pass_blocks){NULL, 0, 0, 0, 0};
            for (int kvh = cur.kvh; kvh < cur.kvh + per_task; ++kvh) {
                for (int p = w.p0; p < w.p1; ++p) {
                    const pass_blocks here = pass_of(cur.table, cur.blocks, p, kvh);
                    /* the pass after: the head's next part, the next head's first, or the
                     * next task's */
                    const pass_blocks then =
                        p + 1 < w.p1 ? pass_of(cur.table, cur.blocks, p + 1, kvh)
                        : kvh + 1 < cur.kvh + per_task
                            ? pass_of(cur.table, cur.blocks, w.p0, kvh + 1)
                            : after;
                    attend_group(q, q_stride, k, v, &here, lens, skip, out, w.r0, w.nr, kvh, KV,
                                 scale, softcap, alibi, &then, &sp, &pt, p);
                }
                merge_own(&sp, &pt, &w, lens, kvh, (char *)out, 2);
            }
            free(pt.own);
            task = next;
        }
        if (rows) _tile_release();
    }
    merge_spread(&sp, lens, R, KV * G, (char *)out, 2, nthreads);
    split_plan_free(&sp);
}

#else

int paged_attention_amx_init(void) { return 0; }

void paged_attention_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                         const int64_t *tables, const int64_t *row_seq, const int64_t *lens,
                         const int64_t *skip, uint16_t *out, int R, int q_stride, int KV,
                         int max_blocks, float scale, float softcap, const float *alibi,
                         int nthreads) {
    (void)softcap;
    (void)q, (void)k, (void)v, (void)tables, (void)row_seq, (void)lens, (void)skip, (void)out;
    (void)R;
    (void)q_stride;
    (void)KV, (void)max_blocks, (void)scale, (void)alibi, (void)nthreads;
}

#endif
