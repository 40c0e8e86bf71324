/* Every entry point of kvserve's C kernels and the argument structs they share: the one
 * declaration of each. Each kernel source includes this file, so the compiler checks its
 * definitions against it; model/backends/cpu/kernels/build.py and model/backends/cpu/stack.py mirror it with
 * ctypes, and tests/model/test_kernel_header.py checks those mirrors against it (the
 * prototypes' arguments, and the structs' sizes and offsets as the compiler lays them out).
 * The kernel build hashes this header with each source, so a change here rebuilds them. */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H

#include <stdint.h>

/* fused.c */
void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *out, int rows,
                      int d, float eps, int nthreads);
void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int rows, int d, float eps, int nthreads);
void rope_store_f32(float *qkv, const float *cos_t, const float *sin_t, int rows, int H, int KV,
                    int D, float *k_cache, float *v_cache, const int64_t *slot_blocks,
                    const int64_t *slot_offsets, int BS, int nthreads);
void rope_store_bf16(uint16_t *qkv, const uint16_t *cos_t, const uint16_t *sin_t, int rows,
                     int H, int KV, int D, uint16_t *k_cache, uint16_t *v_cache,
                     const int64_t *slot_blocks, const int64_t *slot_offsets, int BS,
                     int nthreads);
void qk_norm_f32(float *qkv, const float *wq, const float *wk, int rows, int H, int KV, int D,
                 float eps, int nthreads);
void qk_norm_bf16(uint16_t *qkv, const uint16_t *wq, const uint16_t *wk, int rows, int H,
                  int KV, int D, float eps, int nthreads);
void qk_norm_all_f32(float *qkv, const float *wq, const float *wk, int rows, int H, int KV,
                     int D, float eps, int nthreads);
void qk_norm_all_bf16(uint16_t *qkv, const uint16_t *wq, const uint16_t *wk, int rows, int H,
                      int KV, int D, float eps, int nthreads);
void geglu_f32(const float *gate_up, float *out, int rows, int ff, int nthreads);
void geglu_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int ff, int nthreads);
void softcap_f32(float *x, int rows, int n, float cap, int nthreads);
void softcap_bf16(uint16_t *x, int rows, int n, float cap, int nthreads);
void greedy_f32(const float *x, int rows, int n, int64_t *out, int nthreads);
void greedy_bf16(const uint16_t *x, int rows, int n, int64_t *out, int nthreads);

/* paged_attention.c (built per HEAD_DIM, BLOCK_SIZE and GROUP) */
void paged_attention_f32(const float *q, const float *k, const float *v, const int64_t *tables,
                         const int64_t *row_seq, const int64_t *lens, const int64_t *skip,
                         float *out, int R, int q_stride, int KV, int max_blocks, float scale,
                         float softcap, const float *alibi, int nthreads);
void paged_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                          const int64_t *tables, const int64_t *row_seq, const int64_t *lens,
                          const int64_t *skip, uint16_t *out, int R, int q_stride, int KV,
                          int max_blocks, float scale, float softcap, const float *alibi,
                          int nthreads);
int paged_attention_amx_init(void);
void paged_attention_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                         const int64_t *tables, const int64_t *row_seq, const int64_t *lens,
                         const int64_t *skip, uint16_t *out, int R, int q_stride, int KV,
                         int max_blocks, float scale, float softcap, const float *alibi,
                         int nthreads);

/* linear_bf16.c */
int linear_bf16_init(void);
void linear_bf16(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads);

/* linear_vec.c (built per instruction set): the same contract as linear_bf16; for
 * linear_int8, w is int8_pack's blob (int8 weights, then float32 scales and int32 sums).
 * linear_vec_init: 1 when the build can run (its amx build asks for the tile state). */
int linear_vec_init(void);
void linear_bf16_vec(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                     uint16_t *scratch, int m, int n, int k, int nthreads);
void linear_int8(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads);
/* linear_int4: w is int4_pack's blob (4-bit weights in groups of 32 k, each with a bf16
 * scale and minimum: model/backends/cpu/kernels/linear.py). */
void linear_int4(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads);
/* linear_int5: w is int5_pack's blob (5-bit weights in groups of 32 k, each with a float16
 * step and minimum); otherwise as linear_int4. */
void linear_int5(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                 uint16_t *scratch, int m, int n, int k, int nthreads);
/* int4_quantize: float32 weights, `groups` groups of 32 k one after another, rounded to
 * 4 bits as model/grouped.py's int4_quantize_reference describes (nsearch: the searched
 * step counts; the range in 1..nsteps steps for a group of 16 distinct values or fewer):
 * q a byte a weight (0..15), d and m a float16 each a group. */
void int4_quantize(const float *w, uint8_t *q, uint16_t *d, uint16_t *m, int nsearch,
                   int nsteps, int groups, int nthreads);
/* linear_int8g: w is int8g_pack's blob (int8 weights with a float16 scale each 32 k). */
void linear_int8g(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *out,
                  uint16_t *scratch, int m, int n, int k, int nthreads);
/* int5_quantize: float32 weights, `groups` groups of 32 k one after another, rounded to
 * 5 bits as model/grouped.py's int5_quantize_reference describes: q a byte a weight
 * (0..31), d and m a float16 each a group. */
void int5_quantize(const float *w, uint8_t *q, uint16_t *d, uint16_t *m, int groups,
                   int nthreads);
/* int8g_quantize: float32 weights, `groups` groups of 32 k one after another, rounded to
 * int8 as linear.py's int8g_quantize describes (steps: max|w| / 127 and the smallest
 * nonzero |w| over 1..divisors, then the least-squares one): q an int8 a weight, d a
 * float16 each a group. */
void int8g_quantize(const float *w, int8_t *q, uint16_t *d, int divisors, int groups,
                    int nthreads);

/* stack.c: the decoder layers as one call, over the kernels above as function pointers */
typedef void (*norm_fn)(uint16_t *x, const uint16_t *delta, const uint16_t *weight,
                        uint16_t *out, int rows, int d, float eps, int nthreads);
typedef void (*linear_fn)(const uint16_t *x, const uint16_t *w, const float *bias,
                          uint16_t *out, uint16_t *scratch, int m, int n, int k, int nthreads);
typedef void (*qk_norm_fn)(uint16_t *qkv, const uint16_t *wq, const uint16_t *wk, int rows,
                           int H, int KV, int D, float eps, int nthreads);
typedef void (*rope_fn)(uint16_t *qkv, const uint16_t *cos_t, const uint16_t *sin_t,
                        int rows, int H, int KV, int D, uint16_t *k_cache, uint16_t *v_cache,
                        const int64_t *slot_blocks, const int64_t *slot_offsets,
                        int block_size, int nthreads);
typedef void (*geglu_fn)(const uint16_t *gate_up, uint16_t *out, int rows, int ff,
                         int nthreads);
typedef void (*attention_fn)(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                             const int64_t *tables, const int64_t *row_seq,
                             const int64_t *lens, const int64_t *skip, uint16_t *out, int R,
                             int q_stride, int KV, int max_blocks, float scale, float softcap,
                             const float *alibi, int nthreads);

/* experts.c: a mixture of experts over one step's rows. experts_route: each row's top_k
 * experts by its router logits (rows of `stride` values, the first `experts` read; ties to
 * the lower id), their softmax weights over every expert (renormalized to sum 1 where
 * `normalize`), rounded to bf16. experts_forward: the routed experts; every expert's
 * (gate | up) is in swiglu_layout (the linear stores silu(g) * u), its down projection
 * plain; the buffers are (rows * top_k, width) but for starts (experts + 1) and cursor
 * (experts). */
typedef struct {
    linear_fn linear_in, linear_out; /* the kernels of the experts' (gate | up) and down */
    const uint16_t *const *w_in;  /* (experts): each expert's (gate | up) */
    const uint16_t *const *w_out; /* (experts): each expert's down projection */
    int experts, top_k, d, ff, rows, nthreads;
    const uint16_t *x;       /* (rows, d) */
    const int64_t *ids;      /* (rows, top_k): the chosen experts */
    const uint16_t *weights; /* (rows, top_k): their router weights */
    uint16_t *out;           /* (rows, d) */
    uint16_t *xs, *act, *gate, *ys;
    int32_t *order, *starts, *cursor;
} experts_args;

void experts_route(const uint16_t *logits, int rows, int stride, int experts, int top_k,
                   int normalize, int64_t *ids, uint16_t *weights);
void experts_forward(const experts_args *a);
typedef void (*route_fn)(const uint16_t *logits, int rows, int stride, int experts, int top_k,
                         int normalize, int64_t *ids, uint16_t *weights);
typedef void (*experts_fn)(const experts_args *a);

/* One layer's weights in the kernels' layouts; biases are float32 or NULL. Each linear
 * comes with the kernel of its own layout (bf16, int8, int8g, int4 or int5: a checkpoint's
 * 4-, 5- and 8-bit tensors may share a layer). */
typedef struct {
    const uint16_t *attn_norm;
    const uint16_t *wqkv;
    const float *bqkv;
    const uint16_t *wo;
    const float *bo;
    const uint16_t *ffn_norm;
    const uint16_t *w_in; /* (gate | up) in swiglu_layout: the linear stores silu(g) * u */
    const float *b_in;
    const uint16_t *w_out;
    const float *b_out;
    uint16_t *k_cache, *v_cache;
    const uint16_t *q_norm, *k_norm; /* Qwen3's norms over each q and k head, or NULL */
    const uint16_t *post_attn_norm, *post_ffn_norm; /* Gemma's norms on each output, or NULL */
    int rotate;   /* 0: a layer without RoPE (SmolLM3): K stored as projected */
    int windowed; /* 1: a sliding-window layer (it reads the step's win_ arguments) */
    /* a mixture of experts in place of the FFN (w_in, w_out unused), or router NULL: the
     * router's rows padded to whole 64-row blocks, each expert's weights as experts.c
     * reads them */
    const uint16_t *router;
    const uint16_t *const *expert_w_in;
    const uint16_t *const *expert_w_out;
    int64_t *expert_load; /* the tokens routed to each expert, added to (NULL: not counted) */
    linear_fn qkv_linear, o_linear, in_linear, out_linear, router_linear;
    linear_fn expert_in_linear, expert_out_linear;
    /* LoRA (model/adapters.py's LoraBank): the bank's stacks of each linear an adapter
     * may adapt, q|k|v, o, (gate|)up, down: A (slots, width, in) and B transposed in
     * blocks of 64 features (slots, out / 64, width, 64), bf16, B's features in the
     * linear's own order (gate | up, not swiglu_layout); NULL: none. Where they are not
     * zero: A's rows below ranks (slots), each block's ranks in spans (slots, blocks, 2) */
    const uint16_t *lora_a[4], *lora_b[4];
    int lora_width[4];
    const int32_t *lora_ranks[4], *lora_spans[4];
} layer_args;

typedef struct {
    norm_fn norm;
    qk_norm_fn qk_norm;
    rope_fn rope;
    attention_fn attend;
    geglu_fn geglu; /* Gemma's GeGLU after a plain (gate | up) linear; NULL: SwiGLU, fused */
    route_fn route; /* experts.c's, where a layer has a mixture of experts (else NULL) */
    experts_fn run_experts;
    int experts, router_rows, top_k, expert_ff, normalize;
    int layers, rows, d, heads, kv, head_dim, ff, block_size, max_blocks, nthreads;
    float eps, scale;
    float softcap; /* Gemma 2's soft-capped attention scores (0: none) */
    float residual; /* each sublayer's output times this before its add (Granite; else 1) */
    int output_norms; /* 1: OLMo 2's layers, the norms on what each sublayer adds */
    const layer_args *w;
    const uint16_t *final_norm;
    /* this step: (rows, head_dim) rotations, slots of the new tokens, the attention rows */
    const uint16_t *cos_t, *sin_t;
    const int64_t *slot_blocks, *slot_offsets, *tables, *row_seq, *lens;
    /* the windowed layers' view of the step: their own pool's slots (NULL: the step's),
     * their RoPE tables (Gemma 3's own base; NULL: the step's), their attention rows
     * (model/backends/cpu/kernels/attention.py's window_view, or their pool's tables;
     * NULL tables: the step's) */
    const int64_t *win_slot_blocks, *win_slot_offsets;
    const uint16_t *win_cos_t, *win_sin_t;
    const int64_t *win_tables, *win_row_seq, *win_lens, *win_skip;
    int win_max_blocks;
    /* (rows, width) buffers: x the residual stream (the embeddings on entry), h the normed
     * input of each sublayer and on return the final norm's output */
    uint16_t *x, *h, *qkv, *attn, *o, *act, *gate, *delta;
    uint16_t *gate_up; /* (rows, 2 * ff): GeGLU's linear output, or with LoRA rows SwiGLU's
                        * before its gate (NULL: neither) */
    /* LoRA: each row's bank slot (-1: the base model), NULL when no row takes an adapter
     * this call; the bank's slots; lora_low (rows, the widest width) float32; the rows
     * grouped by slot (stack.c's lora_group): lora_order (rows), lora_starts (slots + 1) */
    const int64_t *lora_rows;
    int lora_slots;
    float *lora_low;
    int32_t *lora_order, *lora_starts;
    /* a mixture's: router logits (rows, router_rows), the choices (rows, top_k), and
     * experts_args' buffers */
    uint16_t *logits, *choice_weights, *xs, *e_act, *e_gate, *ys;
    int64_t *choice_ids;
    int32_t *order, *starts, *cursor;
} stack_args;

void stack_forward(const stack_args *a);

#endif
