/* Fused elementwise kernels for the CPU: each replaces several PyTorch ops (and their
 * per-op dispatch) with one pass over memory. float32 and bfloat16 (uint16 bits)
 * variants; math is done in float32 and rounded once (round-to-nearest-even) on store.
 * Built and loaded by model/backends/cpu/kernels/fused.py. (SwiGLU's silu(gate) * up is fused into
 * the bf16 tile linear instead; a separate pass here measured slower than PyTorch's.)
 */
#include "kvserve.h"
#include "common.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float f32_load(float f) { return f; }
static inline float f32_store(float f) { return f; }

#define PARALLEL(work) _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (work > 65536)")

/* x <- x + delta (when delta is given); out <- weight * round(x * rsqrt(mean(x^2) + eps)).
 * The norm is computed in float32 from the stored (rounded) x, as HF's RMSNorm does. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE)                                        \
void NAME(T *x, const T *delta, const T *weight, T *out, int rows, int d, float eps,     \
          int nthreads) {                                                                \
    const long work = (long)rows * d;                                                    \
    PARALLEL(work)                                                                       \
    for (int r = 0; r < rows; ++r) {                                                     \
        T *xr = x + (long)r * d;                                                         \
        float ss = 0.f;                                                                  \
        if (delta) {                                                                     \
            const T *dr = delta + (long)r * d;                                           \
            for (int i = 0; i < d; ++i) {                                                \
                const T s = STORE(LOAD(xr[i]) + LOAD(dr[i]));                            \
                xr[i] = s;                                                               \
                const float v = LOAD(s);                                                 \
                ss += v * v;                                                             \
            }                                                                            \
        } else {                                                                         \
            for (int i = 0; i < d; ++i) { const float v = LOAD(xr[i]); ss += v * v; }    \
        }                                                                                \
        const float inv = 1.f / sqrtf(ss / (float)d + eps);                              \
        T *o = out + (long)r * d;                                                        \
        for (int i = 0; i < d; ++i)                                                      \
            o[i] = STORE(LOAD(weight[i]) * LOAD(STORE(LOAD(xr[i]) * inv)));              \
    }                                                                                    \
}

/* RoPE in place on the query and key heads of each row of the fused qkv projection
 * (rows of (H + 2 KV) heads), HF "rotate half" layout; then the row's key and value heads
 * are written into the paged cache: K blocks (KV, D/P, BS, P), V blocks (KV, BS/P, D, P),
 * P = 1 for float32 and 2 for bfloat16 (see model/backends/cpu/kernels/paged_attention.c).
 * cos/sin: (rows, D) in the model dtype, already at each token's position; NULL: no RoPE. */
/* Head h's K slot of token `off` in block `blk` (its first element), and the start of the
 * V rows that hold it (the token is at + off % P); KV, D, BS and P as in the function. */
#define K_SLOT(cache, blk, h, off) ((cache) + ((blk) * KV + (h)) * (int64_t)D * BS + (off) * P)
#define V_ROWS(cache, blk, h, off) \
    ((cache) + ((blk) * KV + (h)) * (int64_t)D * BS + ((off) / P) * D * P)
#define DEFINE_ROPE_STORE(NAME, T, LOAD, STORE)                                          \
void NAME(T *qkv, const T *cos_t, const T *sin_t, int rows, int H, int KV, int D,        \
          T *k_cache, T *v_cache, const int64_t *slot_blocks, const int64_t *slot_offsets, \
          int BS, int nthreads) {                                                        \
    const int half = D / 2, width = (H + 2 * KV) * D;                                    \
    /* a row's cache write touches D / P + 1 lines per head, mostly not in cache */     \
    const long work = (long)rows * width * (k_cache ? 16 : 1);                           \
    PARALLEL(work)                                                                       \
    for (int r = 0; r < rows; ++r) {                                                     \
        T *row = qkv + (long)r * width;                                                  \
        if (cos_t) {                                                                     \
            const T *c = cos_t + (long)r * D, *s = sin_t + (long)r * D;                  \
            for (int h = 0; h < H + KV; ++h) {                                           \
                T *x = row + h * D;                                                      \
                for (int i = 0; i < half; ++i) {                                         \
                    const float x1 = LOAD(x[i]), x2 = LOAD(x[i + half]);                 \
                    x[i] = STORE(x1 * LOAD(c[i]) - x2 * LOAD(s[i]));                     \
                    x[i + half] = STORE(x2 * LOAD(c[i + half]) + x1 * LOAD(s[i + half])); \
                }                                                                        \
            }                                                                            \
        }                                                                                \
        if (!k_cache) continue;                                                          \
        const int64_t blk = slot_blocks[r], off = slot_offsets[r];                       \
        const int P = 4 / (int)sizeof(T);  /* elements per 32-bit lane */               \
        if (r + 1 < rows) { /* the next row's cache lines: fetch while this one is stored */ \
            const int64_t nb = slot_blocks[r + 1], no = slot_offsets[r + 1];             \
            for (int h = 0; h < KV; ++h) {                                               \
                const T *kn = K_SLOT(k_cache, nb, h, no), *vn = V_ROWS(v_cache, nb, h, no); \
                for (int i = 0; i < D / P; ++i) __builtin_prefetch(kn + i * BS * P, 1);  \
                for (int i = 0; i < D * P * (int)sizeof(T); i += 64)                     \
                    __builtin_prefetch((const char *)vn + i, 1);                         \
            }                                                                            \
        }                                                                                \
        for (int h = 0; h < KV; ++h) {                                                   \
            const T *k = row + (H + h) * D, *v = row + (H + KV + h) * D;                 \
            T *kb = K_SLOT(k_cache, blk, h, off), *vb = V_ROWS(v_cache, blk, h, off) + off % P; \
            for (int i = 0; i < D; ++i) kb[(i / P) * BS * P + i % P] = k[i];             \
            for (int i = 0; i < D; ++i) vb[i * P] = v[i];                                \
        }                                                                                \
    }                                                                                    \
}

/* Qwen3's q/k norms, in place on each row of the fused qkv projection (rows of H query,
 * KV key and KV value heads of D): each query head normed with wq and each key head with
 * wk, as add_rms_norm norms a row without a delta; the value heads are left as they are. */
#define DEFINE_QK_NORM(NAME, T, LOAD, STORE)                                             \
void NAME(T *qkv, const T *wq, const T *wk, int rows, int H, int KV, int D, float eps,   \
          int nthreads) {                                                                \
    const long heads = (long)rows * (H + KV), work = heads * D;                          \
    PARALLEL(work)                                                                       \
    for (long j = 0; j < heads; ++j) {                                                   \
        const long r = j / (H + KV);                                                     \
        const int h = (int)(j % (H + KV));                                               \
        T *xr = qkv + (r * (H + 2 * KV) + h) * (long)D;                                  \
        const T *w = h < H ? wq : wk;                                                    \
        float ss = 0.f;                                                                  \
        for (int i = 0; i < D; ++i) { const float v = LOAD(xr[i]); ss += v * v; }        \
        const float inv = 1.f / sqrtf(ss / (float)D + eps);                              \
        for (int i = 0; i < D; ++i)                                                      \
            xr[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(xr[i]) * inv)));                  \
    }                                                                                    \
}

/* OLMo 2's q/k norms, in place on each row of the fused qkv projection: all H query heads
 * normed as one vector with wq (H * D weights), all KV key heads with wk (KV * D); the
 * value heads are left as they are. The same arithmetic as add_rms_norm without a delta. */
#define DEFINE_QK_NORM_ALL(NAME, T, LOAD, STORE)                                         \
void NAME(T *qkv, const T *wq, const T *wk, int rows, int H, int KV, int D, float eps,   \
          int nthreads) {                                                                \
    const long work = (long)rows * (H + KV) * D;                                         \
    PARALLEL(work)                                                                       \
    for (long j = 0; j < 2L * rows; ++j) {                                               \
        const long r = j / 2;                                                            \
        const int key = (int)(j % 2), n = (key ? KV : H) * D;                            \
        T *xr = qkv + r * (long)(H + 2 * KV) * D + (key ? (long)H * D : 0);              \
        const T *w = key ? wk : wq;                                                      \
        float ss = 0.f;                                                                  \
        for (int i = 0; i < n; ++i) { const float v = LOAD(xr[i]); ss += v * v; }        \
        const float inv = 1.f / sqrtf(ss / (float)n + eps);                              \
        for (int i = 0; i < n; ++i)                                                      \
            xr[i] = STORE(LOAD(w[i]) * LOAD(STORE(LOAD(xr[i]) * inv)));                  \
    }                                                                                    \
}

DEFINE_QK_NORM(qk_norm_f32, float, f32_load, f32_store)
DEFINE_QK_NORM(qk_norm_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_QK_NORM_ALL(qk_norm_all_f32, float, f32_load, f32_store)
DEFINE_QK_NORM_ALL(qk_norm_all_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, f32_load, f32_store)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_load, bf16_store)
DEFINE_ROPE_STORE(rope_store_f32, float, f32_load, f32_store)
DEFINE_ROPE_STORE(rope_store_bf16, uint16_t, bf16_load, bf16_store)

/* Gemma's GeGLU on the (gate | up) projection's rows (rows of 2 * ff: gate, then up):
 * out = round(gelu_tanh(gate)) * round(up), rounded, with gelu_tanh(g) =
 * g / (1 + exp(-2 sqrt(2 / pi) (g + 0.044715 g^3))), which is 0.5 g (1 + tanh(...)). */
#define DEFINE_GEGLU(NAME, T, LOAD, STORE)                                               \
void NAME(const T *gate_up, T *out, int rows, int ff, int nthreads) {                    \
    const long work = (long)rows * ff;                                                   \
    PARALLEL(work)                                                                       \
    for (int r = 0; r < rows; ++r) {                                                     \
        const T *g = gate_up + (long)r * 2 * ff, *u = g + ff;                            \
        T *o = out + (long)r * ff;                                                       \
        for (int i = 0; i < ff; ++i) {                                                   \
            const float x = LOAD(g[i]);                                                  \
            const float y = 1.5957691216f * (x + 0.044715f * x * x * x);                 \
            const float gelu = x / (1.f + exp_poly(-y));                                 \
            o[i] = STORE(LOAD(STORE(gelu)) * LOAD(u[i]));                                \
        }                                                                                \
    }                                                                                    \
}

DEFINE_GEGLU(geglu_f32, float, f32_load, f32_store)
DEFINE_GEGLU(geglu_bf16, uint16_t, bf16_load, bf16_store)

/* Gemma 2's final logit soft-capping over rows of n logits, in place: x <- cap * tanh(x / cap), rounded once,
 * with tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2 |y|) (exp_poly's domain, <= 0),
 * as the attention kernels cap their scores. A NaN stays a NaN. */
#define DEFINE_SOFTCAP(NAME, T, LOAD, STORE)                                             \
void NAME(T *x, int rows, int n, float cap, int nthreads) {                              \
    const long work = (long)rows * n;                                                    \
    PARALLEL(work)                                                                       \
    for (int r = 0; r < rows; ++r) {                                                     \
        T *row = x + (long)r * n;                                                        \
        for (int i = 0; i < n; ++i) {                                                    \
            const float y = LOAD(row[i]) / cap;                                          \
            const float e = exp_poly(-2.f * fabsf(y));                                   \
            row[i] = STORE(copysignf(cap * ((1.f - e) / (1.f + e)), y));                 \
        }                                                                                \
    }                                                                                    \
}

DEFINE_SOFTCAP(softcap_f32, float, f32_load, f32_store)
DEFINE_SOFTCAP(softcap_bf16, uint16_t, bf16_load, bf16_store)

/* Greedy decoding over rows of logits: out[r] = the first index of row r's maximum, or -1
 * where that maximum is not finite (a NaN or +inf anywhere, or every value -inf): what
 * torch.max(dim=-1) followed by isfinite() says, in one read of the logits (torch's bf16
 * max reduction is several times slower). */
#define DEFINE_GREEDY(NAME, T, LOAD)                                                     \
void NAME(const T *x, int rows, int n, int64_t *out, int nthreads) {                     \
    const long work = (long)rows * n;                                                    \
    PARALLEL(work)                                                                       \
    for (int r = 0; r < rows; ++r) {                                                     \
        const T *xr = x + (long)r * n;                                                   \
        float best = -INFINITY;                                                          \
        long at = 0;                                                                     \
        int bad = 0;                                                                     \
        int i = 0;                                                                       \
        GREEDY_LANES(T)                                                                  \
        for (; i < n; ++i) {                                                             \
            const float v = LOAD(xr[i]);                                                 \
            if (v != v) bad = 1;                                                         \
            else if (v > best) best = v, at = i;                                         \
        }                                                                                \
        out[r] = bad || !isfinite(best) ? -1 : at;                                       \
    }                                                                                    \
}

#ifdef __AVX512F__
#include <immintrin.h>
static inline __m512 lanes_load_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 lanes_load_f32(const float *p) { return _mm512_loadu_ps(p); }
#define LANES_LOAD(T) _Generic((T *)0, uint16_t *: lanes_load_bf16, float *: lanes_load_f32)
/* 16 running maxima (strictly greater: each lane keeps its first), then the lowest index
 * among the lanes that hold the overall maximum. */
#define GREEDY_LANES(T)                                                                  \
    if (n >= 16) {                                                                       \
        __m512 vbest = _mm512_set1_ps(-INFINITY);                                        \
        __m512i vat = _mm512_setzero_si512();                                            \
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); \
        __mmask16 nan = 0;                                                               \
        for (; i + 16 <= n; i += 16) {                                                   \
            const __m512 v = LANES_LOAD(T)(xr + i);                                      \
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                               \
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);               \
            vbest = _mm512_mask_mov_ps(vbest, gt, v);                                    \
            vat = _mm512_mask_mov_epi32(vat, gt, idx);                                   \
            idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));                          \
        }                                                                                \
        float lb[16];                                                                    \
        int la[16];                                                                      \
        _mm512_storeu_ps(lb, vbest);                                                     \
        _mm512_storeu_si512(la, vat);                                                    \
        at = n;                                                                          \
        for (int l = 0; l < 16; ++l)                                                     \
            if (lb[l] > best || (lb[l] == best && la[l] < at)) best = lb[l], at = la[l]; \
        bad = nan != 0;                                                                  \
    }
#elif defined(__AVX2__)
#include <immintrin.h>
static inline __m256 lanes_load_bf16(const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 lanes_load_f32(const float *p) { return _mm256_loadu_ps(p); }
#define LANES_LOAD(T) _Generic((T *)0, uint16_t *: lanes_load_bf16, float *: lanes_load_f32)
/* As AVX-512's, in two sets of 8 lanes (one set's compare and blend wait on each other;
 * the scalar loop was far slower at AVX2: docs/decisions.md). */
#define GREEDY_LANES(T)                                                                  \
    if (n >= 16) {                                                                       \
        __m256 vbest[2] = {_mm256_set1_ps(-INFINITY), _mm256_set1_ps(-INFINITY)};        \
        __m256i vat[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};               \
        __m256i idx[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),                     \
                          _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};              \
        __m256 nan = _mm256_setzero_ps();                                                \
        for (; i + 16 <= n; i += 16)                                                     \
            for (int s = 0; s < 2; ++s) {                                                \
                const __m256 v = LANES_LOAD(T)(xr + i + 8 * s);                          \
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));              \
                const __m256 gt = _mm256_cmp_ps(v, vbest[s], _CMP_GT_OQ);                \
                vbest[s] = _mm256_blendv_ps(vbest[s], v, gt);                            \
                vat[s] = _mm256_blendv_epi8(vat[s], idx[s], _mm256_castps_si256(gt));    \
                idx[s] = _mm256_add_epi32(idx[s], _mm256_set1_epi32(16));                \
            }                                                                            \
        float lb[16];                                                                    \
        int la[16];                                                                      \
        for (int s = 0; s < 2; ++s) {                                                    \
            _mm256_storeu_ps(lb + 8 * s, vbest[s]);                                      \
            _mm256_storeu_si256((__m256i *)(la + 8 * s), vat[s]);                        \
        }                                                                                \
        at = n;                                                                          \
        for (int l = 0; l < 16; ++l)                                                     \
            if (lb[l] > best || (lb[l] == best && la[l] < at)) best = lb[l], at = la[l]; \
        bad = _mm256_movemask_ps(nan) != 0;                                              \
    }
#else
#define GREEDY_LANES(T)
#endif

DEFINE_GREEDY(greedy_f32, float, f32_load)
DEFINE_GREEDY(greedy_bf16, uint16_t, bf16_load)
