/* A mixture of experts over one step's tokens, in bf16, for the CPU. experts_route: each
 * token's choice from its router logits, the one routing every CPU path of a bf16 model
 * takes (the module path through model/backends/cpu/kernels/experts.py, and stack.c), so
 * both choose the same experts with the same weights. experts_forward, the routed experts:
 * the (token, choice) pairs are grouped by expert (a counting sort, stable: token order
 * within an expert), each chosen expert's two linears run once over its rows as one
 * kvserve linear call each (its weights read once a step), and each expert's output,
 * times the token's router weight, is added into the token's row in expert order. That is
 * model/moe.py's GroupedExperts with the same kernels, the same roundings (bf16 product,
 * then a bf16 add per expert, as torch's index_add_) in the same order: the same bits.
 * The linears come in as function pointers (linear_bf16.c's or linear_vec.c's, bf16, int8
 * or int4; the (gate | up) and down kernels may differ), each keeping its own OpenMP regions. Built and loaded by
 * model/backends/cpu/kernels/experts.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kvserve.h"

void experts_route(const uint16_t *logits, int rows, int stride, int experts, int top_k,
                   int normalize, int64_t *ids, uint16_t *weights) {
    for (int t = 0; t < rows; ++t) {
        const uint16_t *l = logits + (long)t * stride;
        int64_t *id = ids + (long)t * top_k;
        float peak = bf16_float(l[0]), total = 0.0f, chosen = 0.0f, w[top_k];
        for (int e = 1; e < experts; ++e)
            if (bf16_float(l[e]) > peak) peak = bf16_float(l[e]);
        for (int e = 0; e < experts; ++e) total += expf(bf16_float(l[e]) - peak);
        /* the top_k by logit, each the highest not yet taken (ties: the lower id) */
        for (int j = 0; j < top_k; ++j) {
            int best = -1;
            for (int e = 0; e < experts; ++e) {
                int taken = 0;
                for (int i = 0; i < j; ++i) taken |= id[i] == e;
                if (!taken && (best < 0 || bf16_float(l[e]) > bf16_float(l[best]))) best = e;
            }
            id[j] = best;
            w[j] = expf(bf16_float(l[best]) - peak) / total;
            chosen += w[j];
        }
        for (int j = 0; j < top_k; ++j)
            weights[(long)t * top_k + j] = float_bf16(normalize ? w[j] / chosen : w[j]);
    }
}

void experts_forward(const experts_args *a) {
    const int T = a->rows, k = a->top_k, E = a->experts, d = a->d, ff = a->ff;
    const int pairs = T * k;
    int32_t *start = a->starts; /* (E + 1): where each expert's pairs begin */
    memset(start, 0, sizeof(int32_t) * (E + 1));
    for (int p = 0; p < pairs; ++p) start[a->ids[p] + 1]++;
    for (int e = 0; e < E; ++e) start[e + 1] += start[e];
    int32_t *next = a->cursor; /* (E) */
    memcpy(next, start, sizeof(int32_t) * E);
    for (int p = 0; p < pairs; ++p) a->order[next[a->ids[p]]++] = p;
    /* each pair's token row, gathered in expert order */
#pragma omp parallel for num_threads(a->nthreads) schedule(static)
    for (int i = 0; i < pairs; ++i)
        memcpy(a->xs + (long)i * d, a->x + (long)(a->order[i] / k) * d, sizeof(uint16_t) * d);
    for (int e = 0; e < E; ++e) {
        const int n = start[e + 1] - start[e];
        if (!n) continue;
        const long r = start[e];
        a->linear_in(a->xs + r * d, a->w_in[e], NULL, a->act + r * ff, a->gate + r * ff, n,
                  2 * ff, d, a->nthreads);
        a->linear_out(a->act + r * ff, a->w_out[e], NULL, a->ys + r * d, NULL, n, d, ff,
                  a->nthreads);
    }
    /* out[t] = sum over its pairs in expert order of bf16(y * w), each add rounded */
    memset(a->out, 0, sizeof(uint16_t) * (long)T * d);
#pragma omp parallel for num_threads(a->nthreads) schedule(static)
    for (int c = 0; c < d; c += 64) {
        const int width = d - c < 64 ? d - c : 64;
        for (int i = 0; i < pairs; ++i) {
            const int p = a->order[i];
            const float w = bf16_float(a->weights[p]);
            uint16_t *o = a->out + (long)(p / k) * d + c;
            const uint16_t *y = a->ys + (long)i * d + c;
            for (int j = 0; j < width; ++j) {
                const float scaled = bf16_float(float_bf16(bf16_float(y[j]) * w));
                o[j] = float_bf16(bf16_float(o[j]) + scaled);
            }
        }
    }
}
