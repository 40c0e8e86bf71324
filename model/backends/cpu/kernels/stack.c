/* A whole stack of pre-norm Llama decoder layers (RMSNorm, RoPE, paged attention, SwiGLU;
 * with Qwen3's q/k norms, SmolLM3's layers without RoPE, Granite's scaled sublayers and
 * scores, and Mistral's sliding windows), of OLMo 2's (norms on the sublayers' outputs,
 * q/k norms over the whole projections) or of Gemma 3's (a norm before and after each
 * sublayer, GeGLU, windowed layers with their own RoPE base and KV pool; Gemma 2's
 * soft-capped scores); pre-norm layers may have a mixture of experts in place of the
 * FFN (Qwen3-MoE, Mixtral, OLMoE: experts.c). In bf16 as one call, for CPUs where every
 * part runs as kvserve's own kernel: the AMX tile linears (linear_bf16.c), the fused
 * norm, RoPE-and-store and GeGLU (fused.c) and the AMX paged attention
 * (paged_attention.c). It computes exactly what
 * Block.forward does with those kernels, in the same order on the same buffers, so the
 * bits are the same; what it saves is the interpreter between them: about seven Python
 * calls, their argument conversions and output allocations per layer.
 *
 * The kernels live in their own libraries (the attention one is built per head size), so
 * they come in as function pointers. Each keeps its own OpenMP parallel regions. Built and
 * loaded by model/backends/cpu/kernels/stack.py; model/backends/cpu/stack.py fills in the arguments.
 *
 * A call whose rows take LoRA adapters (model/adapters.py) adds each adapted row's delta
 * to its linears' outputs as the modules do: to q|k|v before the norms and RoPE, to
 * (gate | up) before the gate (the SwiGLU linear then stores both, and the gate is
 * applied here), to o and down.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kvserve.h"

/* x[i] = bf16(x[i] * m), rounded to nearest even as torch rounds a bf16 tensor times a
 * float */
static void scale_bf16(uint16_t *x, long n, float m) {
    for (long i = 0; i < n; ++i) x[i] = float_bf16(bf16_float(x[i]) * m);
}

/* x[i] = bf16(x[i] + y[i]), rounded to nearest even as torch adds two bf16 tensors */
static void add_bf16(uint16_t *x, const uint16_t *y, long n) {
    for (long i = 0; i < n; ++i) x[i] = float_bf16(bf16_float(x[i]) + bf16_float(y[i]));
}

/* LoRA's rows grouped by adapter (counting sort on the slot): lora_order holds the
 * adapted rows, slot by slot, lora_starts[s] where slot s's begin (slots + 1 entries).
 * Made once a call: every layer's linears take the same groups. */
static void lora_group(const stack_args *a) {
    int32_t *starts = a->lora_starts, *order = a->lora_order;
    const int S = a->lora_slots;
    memset(starts, 0, sizeof(int32_t) * (S + 1));
    for (int t = 0; t < a->rows; ++t)
        if (a->lora_rows[t] >= 0) starts[a->lora_rows[t] + 1]++;
    for (int s = 0; s < S; ++s) starts[s + 1] += starts[s];
    int32_t fill[S];
    memcpy(fill, starts, sizeof fill);
    for (int t = 0; t < a->rows; ++t)
        if (a->lora_rows[t] >= 0) order[fill[a->lora_rows[t]]++] = t;
}

/* LoRA's work items: LORA_ROWS rows of one adapter, and in the second product LORA_COLS
 * of their output features (long stretches of memory: the hardware's prefetch keeps up);
 * the first product sums LORA_RANKS ranks at once; B's stacks are in blocks of
 * LORA_BLOCK features (model/adapters.py's BLOCK) */
#define LORA_ROWS 32
#define LORA_COLS 1024
#define LORA_ITEMS 4 /* work items a thread gets at least (for the dynamic schedule) */
#define LORA_RANKS 4
#define LORA_BLOCK 64
#define LORA_CONVERTED 128 /* ranks of a block a prompt's rows read as float32, at most */
#if defined(__AVX512F__)
#define LORA_WIDE 4 /* rows a pass takes: LORA_RANKS x LORA_WIDE sums in 16 registers */
#else
#define LORA_WIDE 2
#endif

/* 16 float32 lanes (GCC's vector extension: one AVX-512 register, two AVX2 ones), so the
 * sums stay in registers, and 16 bf16 values loaded into them (static functions, so
 * GCC's note that such a return changes the ABI below AVX-512 does not apply) */
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float lanes __attribute__((vector_size(64)));
typedef uint16_t lanes_u16 __attribute__((vector_size(32)));
typedef uint32_t lanes_u32 __attribute__((vector_size(64)));
#define LANE_VECS (LORA_BLOCK / 16) /* a block's features in lanes */

static inline lanes lanes_bf16(const uint16_t *p) {
    lanes_u16 h;
    memcpy(&h, p, sizeof h);
    return (lanes)(__builtin_convertvector(h, lanes_u32) << 16);
}

static inline lanes lanes_f32(const float *p) {
    lanes v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* v rounded to bf16 (to nearest even, as float_bf16), as the float32 of it */
static inline lanes lanes_round(const lanes *v) {
    const lanes_u32 bits = (lanes_u32)*v;
    return (lanes)((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u);
}

/* v's 16 values, already rounded to bf16 (lanes_round), stored as bf16 */
static inline void lanes_store_bf16(uint16_t *p, const lanes *v) {
    const lanes_u16 h = __builtin_convertvector((lanes_u32)*v >> 16, lanes_u16);
    memcpy(p, &h, sizeof h);
}

static inline float lanes_sum(const lanes *v) {
    float sum = 0.f;
    for (int j = 0; j < 16; ++j) sum += (*v)[j];
    return sum;
}

/* The rows i0..i1 of lora_order that work item `c` of slot s takes (none: i0 >= i1). */
static inline void lora_rows_of(const stack_args *a, int s, int c, int *i0, int *i1) {
    const int end = a->lora_starts[s + 1];
    *i0 = a->lora_starts[s] + c * LORA_ROWS;
    *i1 = *i0 + LORA_ROWS < end ? *i0 + LORA_ROWS : end;
}

/* low[i + h][r] for ranks r0..r0+LORA_RANKS (those below used) of `rows` rows from i
 * (at most `wide`, a constant of each call: LORA_WIDE or 2): the dot products of A's
 * rows with x's, their partial sums in 16 lanes, LORA_RANKS x wide independent chains
 * held in registers */
static inline __attribute__((always_inline)) void lora_dots(
    const stack_args *a, const uint16_t *A, int W, int used, const uint16_t *x, int k, int s,
    int r0, int i, int rows, const int wide) {
    const int ranks = used - r0 < LORA_RANKS ? used - r0 : LORA_RANKS;
    const uint16_t *xs[LORA_WIDE], *as[LORA_RANKS];
    for (int h = 0; h < wide; ++h) xs[h] = x + (long)a->lora_order[i + (h < rows ? h : 0)] * k;
    for (int q = 0; q < LORA_RANKS; ++q) as[q] = A + ((long)s * W + r0 + (q < ranks ? q : 0)) * k;
    lanes sums[LORA_RANKS][LORA_WIDE] = {};
    for (int j = 0; j + 16 <= k; j += 16) {
        lanes xv[LORA_WIDE];
        for (int h = 0; h < wide; ++h) xv[h] = lanes_bf16(xs[h] + j);
        for (int q = 0; q < LORA_RANKS; ++q) {
            if (j % 32 == 0) /* the next rank group's A: a stretch too short to be seen */
                __builtin_prefetch(as[q] + j + (long)LORA_RANKS * k, 0, 1);
            const lanes av = lanes_bf16(as[q] + j);
            for (int h = 0; h < wide; ++h) sums[q][h] += av * xv[h];
        }
    }
    for (int q = 0; q < ranks; ++q)
        for (int h = 0; h < rows; ++h) {
            float sum = lanes_sum(&sums[q][h]);
            for (int j = k - k % 16; j < k; ++j) sum += bf16_float(as[q][j]) * bf16_float(xs[h][j]);
            a->lora_low[(long)(i + h) * W + r0 + q] = sum;
        }
}

/* low (rows of lora_order, W) = x A[slot]^T for A's ranks up to `ranks`[slot] (the
 * rest of A is zero: their low is not written), by (slot, rows, ranks) work items, each
 * streaming its stretch of A (`split` of them an adapter's A): each adapter's A read
 * once a call. The work of a parallel region (lora_add's), which waits for it all at
 * the end. */
static void lora_low(const stack_args *a, const uint16_t *A, int W, const int32_t *ranks,
                     const uint16_t *x, int k, int chunks, int split) {
    /* ranks an item takes: W over `split` items, rounded up to whole LORA_RANKS groups
     * (split items of it cover W) */
    const int S = a->lora_slots, per = (W + split - 1) / split;
    const int step = (per + LORA_RANKS - 1) / LORA_RANKS * LORA_RANKS;
#pragma omp for collapse(3) schedule(dynamic)
    for (int s = 0; s < S; ++s)
        for (int c = 0; c < chunks; ++c)
            for (int q = 0; q < split; ++q) {
                int i0, i1;
                lora_rows_of(a, s, c, &i0, &i1);
                const int r1 = (q + 1) * step < ranks[s] ? (q + 1) * step : ranks[s];
                for (int r = q * step; r < r1 && i0 < i1; r += LORA_RANKS)
                    for (int i = i0; i < i1; i += LORA_WIDE) {
                        const int rows = i1 - i < LORA_WIDE ? i1 - i : LORA_WIDE;
                        if (rows > 2)
                            lora_dots(a, A, W, ranks[s], x, k, s, r, i, rows, LORA_WIDE);
                        else
                            lora_dots(a, A, W, ranks[s], x, k, s, r, i, rows, 2);
                    }
            }
}

/* y[j] = bf16(y[j] + bf16(sum[j])): a block's delta rounded to bf16 and added, as torch
 * adds two bf16 tensors (a block cut short by the linear's end: one value at a time) */
static inline void lora_store(uint16_t *y, const lanes *sum, int width) {
    if (width == LORA_BLOCK) {
        for (int c = 0; c < LANE_VECS; ++c) {
            const lanes sum_c = lanes_bf16(y + 16 * c) + lanes_round(&sum[c]);
            const lanes rounded = lanes_round(&sum_c);
            lanes_store_bf16(y + 16 * c, &rounded);
        }
        return;
    }
    for (int j = 0; j < width; ++j)
        y[j] = float_bf16(bf16_float(y[j]) + bf16_float(float_bf16(sum[j / 16][j % 16])));
}

/* y's `rows` rows from i of lora_order (at most `wide`, a constant of each call) +=
 * their deltas at one block of B's features (o.. o + width, at `at` in y's rows: gated, a
 * SwiGLU's gate or up block): low B^T over the block's ranks r0..r1, each rank's
 * LORA_BLOCK values of B (float32 from r0 where f32, else bf16), the rows' sums held in
 * registers */
static inline __attribute__((always_inline)) void lora_block(
    const stack_args *a, const void *block, const int f32, int W, int r0, int r1, uint16_t *y,
    int n, long at, int width, int i, int rows, const int wide) {
    const float *low[LORA_WIDE];
    for (int h = 0; h < wide; ++h) low[h] = a->lora_low + (long)(i + (h < rows ? h : 0)) * W;
    lanes v[LORA_WIDE][LANE_VECS] = {};
    for (int r = r0; r < r1; ++r) {
        lanes bv[LANE_VECS];
        if (!f32) /* the next block's rank r: spans of 2 KB apart, too short to be seen */
            for (int c = 0; c < LORA_BLOCK; c += 32)
                __builtin_prefetch((const uint16_t *)block + (long)(W + r) * LORA_BLOCK + c, 0, 1);
        for (int c = 0; c < LANE_VECS; ++c)
            bv[c] = f32 ? lanes_f32((const float *)block + (long)(r - r0) * LORA_BLOCK + 16 * c)
                        : lanes_bf16((const uint16_t *)block + (long)r * LORA_BLOCK + 16 * c);
        for (int h = 0; h < wide; ++h)
            for (int c = 0; c < LANE_VECS; ++c) v[h][c] += low[h][r] * bv[c];
    }
    for (int h = 0; h < rows; ++h) lora_store(y + (long)a->lora_order[i + h] * n + at, v[h], width);
}

/* The deltas of rows i0..i1 of lora_order at one block of B's features (from `block`,
 * its ranks r0..r1): a decode's row or two straight from B; an item of more rows (a
 * prompt's) LORA_WIDE at a time, from a float32 copy of the block made here once (where
 * the ranks are few enough for it), not converted for every pass */
static void lora_block_rows(const stack_args *a, const uint16_t *block, int W, int r0, int r1,
                            uint16_t *y, int n, long at, int width, int i0, int i1) {
    if (i1 - i0 <= 2) {
        lora_block(a, block, 0, W, r0, r1, y, n, at, width, i0, i1 - i0, 2);
        return;
    }
    float copy[LORA_CONVERTED * LORA_BLOCK];
    const int f32 = r1 - r0 <= LORA_CONVERTED;
    if (f32)
        for (int j = 0; j < (r1 - r0) * LORA_BLOCK; ++j)
            copy[j] = bf16_float(block[(long)r0 * LORA_BLOCK + j]);
    for (int i = i0; i < i1; i += LORA_WIDE) {
        const int rows = i1 - i < LORA_WIDE ? i1 - i : LORA_WIDE;
        if (f32)
            lora_block(a, copy, 1, W, r0, r1, y, n, at, width, i, rows, LORA_WIDE);
        else
            lora_block(a, block, 0, W, r0, r1, y, n, at, width, i, rows, LORA_WIDE);
    }
}

/* y += low B^T for the adapted rows, by (slot, rows, features) work items (`split` of
 * them the features, at most LORA_COLS an item), each streaming its stretch of B
 * (LoraBank's blocks: every rank's LORA_BLOCK features together) over the block's span
 * of nonzero ranks (spans, (slots, blocks, 2); within the ranks low has). The work of a
 * parallel region (lora_add's). */
static void lora_deltas(const stack_args *a, const uint16_t *Bt, int W, const int32_t *ranks,
                        const int32_t *spans, uint16_t *y, int n, int gated, int chunks, int split) {
    const int nb = (n + LORA_BLOCK - 1) / LORA_BLOCK;
    const int per = (nb + split - 1) / split < LORA_COLS / LORA_BLOCK ? (nb + split - 1) / split
                                                                     : LORA_COLS / LORA_BLOCK;
    const int S = a->lora_slots, items = (nb + per - 1) / per;
#pragma omp for collapse(3) schedule(dynamic)
    for (int s = 0; s < S; ++s)
        for (int c = 0; c < chunks; ++c)
            for (int q = 0; q < items; ++q) {
                int i0, i1;
                lora_rows_of(a, s, c, &i0, &i1);
                for (int b = q * per; b < (q + 1) * per && b < nb && i0 < i1; ++b) {
                    const uint16_t *block = Bt + ((long)s * nb + b) * W * LORA_BLOCK;
                    const int32_t *span = spans + ((long)s * nb + b) * 2;
                    const int r1 = span[1] < ranks[s] ? span[1] : ranks[s];
                    const int o = b * LORA_BLOCK, width = n - o < LORA_BLOCK ? n - o : LORA_BLOCK;
                    /* a SwiGLU's block of gate or up features is one of its blocks */
                    const long at = gated ? swiglu_column(o, n / 2) : o;
                    if (span[0] < r1)
                        lora_block_rows(a, block, W, span[0], r1, y, n, at, width, i0, i1);
                }
            }
}

/* LoRA: y (rows, n) += each adapted row's (A[slot] @ x) @ B[slot]^T for x (rows, k), of
 * the layer's linear `which` (layer_args' lora_ order): the delta in float32 rounded to
 * bf16, then added as torch adds two bf16 tensors (model/adapters.py's Adapters.add);
 * gated: y is a SwiGLU's (gate | up) in swiglu_layout's order. Rows of slot -1 are left
 * alone. Work goes by adapter, in long stretches of memory, so each adapter's A and B
 * are streamed once a call: low = x A^T (lora_low), then low B^T (lora_deltas), in one
 * parallel region. */
static void lora_add(const stack_args *a, const layer_args *w, int which, const uint16_t *x,
                     uint16_t *y, int n, int k, int gated, int nt) {
    const uint16_t *A = w->lora_a[which], *Bt = w->lora_b[which];
    const int32_t *ranks = w->lora_ranks[which], *spans = w->lora_spans[which];
    if (!a->lora_rows || !A) return;
    const int W = w->lora_width[which], chunks = (a->rows + LORA_ROWS - 1) / LORA_ROWS;
    /* items of rows with work, and into how many each product splits them: enough for
     * every thread (one adapter's row alone: all of them on its A and B) */
    int groups = 0;
    for (int s = 0; s < a->lora_slots; ++s)
        groups += (a->lora_starts[s + 1] - a->lora_starts[s] + LORA_ROWS - 1) / LORA_ROWS;
    const int split = groups ? (LORA_ITEMS * nt + groups - 1) / groups : 1;
    const int groups_of_ranks = (W + LORA_RANKS - 1) / LORA_RANKS;
#pragma omp parallel num_threads(nt)
    {
        lora_low(a, A, W, ranks, x, k, chunks, split < groups_of_ranks ? split : groups_of_ranks);
        lora_deltas(a, Bt, W, ranks, spans, y, n, gated, chunks, split);
    }
}

/* act (rows, ff) = silu(gate) * up from a (gate | up) output in swiglu_layout's order
 * (64-feature blocks alternating gate, up), rounded as torch's bf16 ops round: silu's
 * result, then the product; exp by common.h's polynomial, as the fused kernels' */
static void swiglu_gate(const uint16_t *gate_up, uint16_t *act, int T, int ff, int nt) {
    const int blocks = ff / LINEAR_NB;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int t = 0; t < T; ++t)
        for (int b = 0; b < blocks; ++b) {
            const uint16_t *g = gate_up + (long)t * 2 * ff + 2L * b * LINEAR_NB;
            const uint16_t *u = g + LINEAR_NB;
            uint16_t *out = act + (long)t * ff + (long)b * LINEAR_NB;
#pragma omp simd
            for (int j = 0; j < LINEAR_NB; ++j) {
                const float x = bf16_float(g[j]);
                const float silu = bf16_float(float_bf16(x / (1.f + exp_poly(-x))));
                out[j] = float_bf16(silu * bf16_float(u[j]));
            }
        }
}

/* A dense FFN over the normed rows `in` into delta: GeGLU after a plain (gate | up)
 * linear, or SwiGLU whose linear applies the gate itself; with LoRA rows the linears'
 * deltas are added, SwiGLU's to (gate | up) before its gate. */
static void dense_ffn(const stack_args *a, const layer_args *w, const uint16_t *in, int T,
                      int nt) {
    const int ff = a->ff, adapted = a->lora_rows && w->lora_a[2];
    if (a->geglu || adapted) {
        w->in_linear(in, w->w_in, w->b_in, a->gate_up, NULL, T, 2 * ff, a->d, nt);
        lora_add(a, w, 2, in, a->gate_up, 2 * ff, a->d, !a->geglu, nt);
        if (a->geglu)
            a->geglu(a->gate_up, a->act, T, ff, nt);
        else
            swiglu_gate(a->gate_up, a->act, T, ff, nt);
    } else {
        w->in_linear(in, w->w_in, w->b_in, a->act, a->gate, T, 2 * ff, a->d, nt);
    }
    w->out_linear(a->act, w->w_out, w->b_out, a->delta, NULL, T, a->d, ff, nt);
    lora_add(a, w, 3, a->act, a->delta, a->d, ff, 0, nt);
}

/* a layer's mixture of experts over the normed rows h: route each row, run the experts
 * into delta (model/moe.py's MoE.forward with the CPU's kernels) */
static void mixture(const stack_args *a, const layer_args *w, int T, int nt) {
    w->router_linear(a->h, w->router, NULL, a->logits, NULL, T, a->router_rows, a->d, nt);
    a->route(a->logits, T, a->router_rows, a->experts, a->top_k, a->normalize, a->choice_ids,
             a->choice_weights);
    if (w->expert_load)
        for (long p = 0; p < (long)T * a->top_k; ++p) w->expert_load[a->choice_ids[p]]++;
    const experts_args e = {
        .linear_in = w->expert_in_linear,
        .linear_out = w->expert_out_linear,
        .w_in = w->expert_w_in,
        .w_out = w->expert_w_out,
        .experts = a->experts,
        .top_k = a->top_k,
        .d = a->d,
        .ff = a->expert_ff,
        .rows = T,
        .nthreads = nt,
        .x = a->h,
        .ids = a->choice_ids,
        .weights = a->choice_weights,
        .out = a->delta,
        .xs = a->xs,
        .act = a->e_act,
        .gate = a->e_gate,
        .ys = a->ys,
        .order = a->order,
        .starts = a->starts,
        .cursor = a->cursor,
    };
    a->run_experts(&e);
}

void stack_forward(const stack_args *a) {
    const int T = a->rows, d = a->d, H = a->heads, KV = a->kv, D = a->head_dim;
    const int nqkv = (H + 2 * KV) * D, nt = a->nthreads;
    const long n = (long)T * d;
    if (a->lora_rows) lora_group(a);
    for (int l = 0; l < a->layers; ++l) {
        const layer_args *w = a->w + l;
        /* pre-norm: each sublayer reads the normed residual stream (the last layer's
         * delta added first); OLMo 2's output norms: it reads the stream itself, and its
         * normed output is added at once */
        const uint16_t *in = a->x;
        if (!a->output_norms) {
            a->norm(a->x, l ? a->delta : NULL, w->attn_norm, a->h, T, d, a->eps, nt);
            in = a->h;
        }
        w->qkv_linear(in, w->wqkv, w->bqkv, a->qkv, NULL, T, nqkv, d, nt);
        lora_add(a, w, 0, in, a->qkv, nqkv, d, 0, nt);
        if (w->q_norm) a->qk_norm(a->qkv, w->q_norm, w->k_norm, T, H, KV, D, a->eps, nt);
        /* a windowed layer: its own RoPE base, pool and attention rows, where it has them */
        const int own = w->windowed;
        const uint16_t *cos_t = own && a->win_cos_t ? a->win_cos_t : a->cos_t;
        const uint16_t *sin_t = own && a->win_cos_t ? a->win_sin_t : a->sin_t;
        const int pool = own && a->win_slot_blocks;
        a->rope(a->qkv, w->rotate ? cos_t : NULL, w->rotate ? sin_t : NULL, T, H, KV, D,
                w->k_cache, w->v_cache, pool ? a->win_slot_blocks : a->slot_blocks,
                pool ? a->win_slot_offsets : a->slot_offsets, a->block_size, nt);
        if (own && a->win_tables)
            a->attend(a->qkv, w->k_cache, w->v_cache, a->win_tables, a->win_row_seq,
                      a->win_lens, a->win_skip, a->attn, T, nqkv, KV, a->win_max_blocks,
                      a->scale, a->softcap, NULL, nt);
        else
            a->attend(a->qkv, w->k_cache, w->v_cache, a->tables, a->row_seq, a->lens, NULL,
                      a->attn, T, nqkv, KV, a->max_blocks, a->scale, a->softcap, NULL, nt);
        w->o_linear(a->attn, w->wo, w->bo, a->o, NULL, T, d, H * D, nt);
        lora_add(a, w, 1, a->attn, a->o, d, H * D, 0, nt);
        if (a->output_norms) {
            a->norm(a->o, NULL, w->attn_norm, a->h, T, d, a->eps, nt);
            add_bf16(a->x, a->h, n);
            dense_ffn(a, w, a->x, T, nt);
            a->norm(a->delta, NULL, w->ffn_norm, a->h, T, d, a->eps, nt);
            add_bf16(a->x, a->h, n);
            continue;
        }
        if (a->residual != 1.0f) scale_bf16(a->o, n, a->residual);
        if (w->post_attn_norm) a->norm(a->o, NULL, w->post_attn_norm, a->o, T, d, a->eps, nt);
        a->norm(a->x, a->o, w->ffn_norm, a->h, T, d, a->eps, nt);
        if (w->router)
            mixture(a, w, T, nt);
        else
            dense_ffn(a, w, a->h, T, nt);
        if (w->post_ffn_norm) a->norm(a->delta, NULL, w->post_ffn_norm, a->delta, T, d, a->eps, nt);
        if (a->residual != 1.0f) scale_bf16(a->delta, n, a->residual);
    }
    /* pre-norm: the last layer's delta is still to be added */
    const uint16_t *last = a->layers && !a->output_norms ? a->delta : NULL;
    a->norm(a->x, last, a->final_norm, a->h, T, d, a->eps, nt);
}
