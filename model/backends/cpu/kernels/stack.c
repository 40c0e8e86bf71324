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

/* LoRA: y (rows, n) += each adapted row's B[slot] @ (A[slot] @ x) for x (rows, k), of the
 * layer's linear `which` (layer_args' lora_ order): the delta in float32 rounded to bf16,
 * then added as torch adds two bf16 tensors (model/adapters.py's Adapters.add); gated: y
 * is a SwiGLU's (gate | up) in swiglu_layout's order. Rows of slot -1 are left alone. */
static void lora_add(const stack_args *a, const layer_args *w, int which, const uint16_t *x,
                     uint16_t *y, int n, int k, int gated, int nt) {
    const uint16_t *A = w->lora_a[which], *B = w->lora_b[which];
    if (!a->lora_rows || !A) return;
    const int T = a->rows, W = w->lora_width[which];
    const int64_t *slots = a->lora_rows;
    float *low = a->lora_low;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int t = 0; t < T; ++t)
        for (int r = 0; r < W; ++r) {
            if (slots[t] < 0) continue;
            const uint16_t *ar = A + (slots[t] * W + r) * (long)k, *xr = x + (long)t * k;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < k; ++i) sum += bf16_float(ar[i]) * bf16_float(xr[i]);
            low[(long)t * W + r] = sum;
        }
#pragma omp parallel for collapse(2) schedule(static) num_threads(nt)
    for (int t = 0; t < T; ++t)
        for (int o = 0; o < n; ++o) {
            if (slots[t] < 0) continue;
            const uint16_t *br = B + (slots[t] * n + o) * (long)W;
            const float *lr = low + (long)t * W;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int r = 0; r < W; ++r) sum += bf16_float(br[r]) * lr[r];
            const long at = (long)t * n + (gated ? swiglu_column(o, n / 2) : o);
            y[at] = float_bf16(bf16_float(y[at]) + bf16_float(float_bf16(sum)));
        }
}

/* act (rows, ff) = silu(gate) * up from a (gate | up) output in swiglu_layout's order,
 * rounded as torch's bf16 ops round: silu's result, then the product */
static void swiglu_gate(const uint16_t *gate_up, uint16_t *act, int T, int ff, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int t = 0; t < T; ++t) {
        const uint16_t *row = gate_up + (long)t * 2 * ff;
        for (int f = 0; f < ff; ++f) {
            const float g = bf16_float(row[swiglu_column(f, ff)]);
            const float up = bf16_float(row[swiglu_column(f + ff, ff)]);
            act[(long)t * ff + f] = float_bf16(bf16_float(float_bf16(g / (1.f + expf(-g)))) * up);
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
