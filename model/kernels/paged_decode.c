/* Paged decode attention on the CPU: one query token per sequence, K/V read straight
 * from the block pool (no gather), online softmax, GQA by sharing each K/V head across
 * its group of query heads. Built and loaded by model/kernels/__init__.py, once per
 * (HEAD_DIM, BLOCK_SIZE, GROUP): constant sizes keep every accumulator in a register.
 *
 * Cache layouts (one layer):
 *   k: (num_blocks, KV, HEAD_DIM, BLOCK_SIZE)  channel-major: one vector FMA adds one
 *      channel's contribution to the scores of a whole block of tokens
 *   v: (num_blocks, KV, BLOCK_SIZE, HEAD_DIM)
 * q: (B, KV * GROUP, HEAD_DIM) float32; out: same shape, float32
 * k/v: float32 or bfloat16 (uint16 bits); tables: (B, max_blocks) int64;
 * lens: (B,) int64 context length including the new token; alibi: (H,) slopes or NULL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(HEAD_DIM) || !defined(BLOCK_SIZE) || !defined(GROUP)
#error "build with -DHEAD_DIM=... -DBLOCK_SIZE=... -DGROUP=..."
#endif

#define D HEAD_DIM
#define BS BLOCK_SIZE
#define G GROUP
#define DV (D < 16 ? D : 16)
#if D % DV
#error "HEAD_DIM must be a multiple of 16, or a power of two below it"
#endif

typedef float vblk __attribute__((vector_size(BS * 4)));   /* scores of BS tokens */
typedef int32_t iblk __attribute__((vector_size(BS * 4)));
typedef uint16_t hblk __attribute__((vector_size(BS * 2)));
typedef float vch __attribute__((vector_size(DV * 4)));    /* DV channels */
typedef uint16_t hch __attribute__((vector_size(DV * 2)));
typedef uint32_t uch __attribute__((vector_size(DV * 4)));
typedef uint32_t ublk __attribute__((vector_size(BS * 4)));

/* exp(x) for x <= 0 on a vector: 2^(x log2 e) = 2^i * 2^f with i the nearest integer
 * and f in [-0.5, 0.5]; 2^f by a degree-6 minimax polynomial (relative error ~1e-7,
 * float32 rounding included). Underflows to ~1e-38 below -87. */
static inline vblk vexp(vblk x) {
    const vblk lo = (vblk){0} - 87.f;
    const iblk under = x < lo;
    x = (vblk)(((iblk)lo & under) | ((iblk)x & ~under));
    const vblk t = x * 1.44269504f;
    const vblk u = t + 0.5f;
    iblk i = __builtin_convertvector(u, iblk);           /* truncation toward zero */
    i += (iblk)(__builtin_convertvector(i, vblk) > u);   /* -> floor(t + 0.5) */
    const vblk f = t - __builtin_convertvector(i, vblk);
    vblk p = f * 1.53337387e-4f + 1.33951858e-3f;
    p = p * f + 9.61849187e-3f;
    p = p * f + 5.55034131e-2f;
    p = p * f + 2.40226477e-1f;
    p = p * f + 6.93147182e-1f;
    p = p * f + 1.f;
    const iblk bits = (i + 127) << 23;
    return p * (vblk)bits;
}

static inline vblk keys_f32(const float *src) { vblk r; memcpy(&r, src, sizeof r); return r; }
static inline vblk keys_bf16(const uint16_t *src) {
    hblk h;
    memcpy(&h, src, sizeof h);
    ublk u = __builtin_convertvector(h, ublk) << 16;
    vblk r;
    memcpy(&r, &u, sizeof r);
    return r;
}
static inline vch vals_f32(const float *src) { vch r; memcpy(&r, src, sizeof r); return r; }
static inline vch vals_bf16(const uint16_t *src) {
    hch h;
    memcpy(&h, src, sizeof h);
    uch u = __builtin_convertvector(h, uch) << 16;
    vch r;
    memcpy(&r, &u, sizeof r);
    return r;
}

static inline float hmax(vblk v) {
    float a[BS], m;
    memcpy(a, &v, sizeof a);
    m = a[0];
    for (int t = 1; t < BS; ++t) m = a[t] > m ? a[t] : m;
    return m;
}

static inline float hsum(vblk v) {
    float a[BS], s = 0.f;
    memcpy(a, &v, sizeof a);
    for (int t = 0; t < BS; ++t) s += a[t];
    return s;
}

#define DEFINE_KERNEL(NAME, T, KEYS, VALS)                                                \
void NAME(const float *q, const T *k, const T *v, const int64_t *tables,                  \
          const int64_t *lens, float *out, int B, int KV, int max_blocks, float scale,    \
          const float *alibi, int nthreads) {                                             \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                \
    for (int task = 0; task < B * KV; ++task) {                                           \
        const int b = task / KV, kvh = task % KV, H = KV * G;                             \
        const int64_t S = lens[b];                                                        \
        float qs[G][D], m[G], l[G];                                                       \
        vch acc[G][D / DV];                                                               \
        for (int g = 0; g < G; ++g) {                                                     \
            const float *qh = q + ((int64_t)b * H + kvh * G + g) * D;                     \
            for (int d = 0; d < D; ++d) qs[g][d] = qh[d] * scale;                         \
            for (int c = 0; c < D / DV; ++c) acc[g][c] = (vch){0};                        \
            m[g] = -1e30f;                                                                \
            l[g] = 0.f;                                                                   \
        }                                                                                 \
        const int nblk = (int)((S + BS - 1) / BS);                                        \
        for (int j = 0; j < nblk; ++j) {                                                  \
            const int64_t blk = tables[(int64_t)b * max_blocks + j];                      \
            const int64_t rest = S - (int64_t)j * BS;                                     \
            const int n = rest < BS ? (int)rest : BS;                                     \
            const T *kb = k + (blk * KV + kvh) * (int64_t)(D * BS);                       \
            const T *vb = v + (blk * KV + kvh) * (int64_t)(D * BS);                       \
            if (j + 1 < nblk) {  /* blocks are scattered: fetch the next one meanwhile */ \
                const int64_t nxt = tables[(int64_t)b * max_blocks + j + 1];              \
                const char *pk = (const char *)(k + (nxt * KV + kvh) * (int64_t)(D * BS)); \
                const char *pv = (const char *)(v + (nxt * KV + kvh) * (int64_t)(D * BS)); \
                for (int off = 0; off < (int)(D * BS * sizeof(T)); off += 64) {           \
                    __builtin_prefetch(pk + off);                                         \
                    __builtin_prefetch(pv + off);                                         \
                }                                                                         \
            }                                                                             \
            vblk sc[G];                                                                   \
            for (int g = 0; g < G; ++g) sc[g] = (vblk){0};                                \
            for (int d = 0; d < D; ++d) {  /* one converted key vector feeds G FMAs */    \
                const vblk kv = KEYS(kb + d * BS);                                        \
                for (int g = 0; g < G; ++g) sc[g] += qs[g][d] * kv;                       \
            }                                                                             \
            float p[G][BS];                                                               \
            for (int g = 0; g < G; ++g) {                                                 \
                float s[BS];                                                              \
                memcpy(s, &sc[g], sizeof s);                                              \
                if (alibi) {                                                              \
                    const float slope = alibi[kvh * G + g];                               \
                    for (int t = 0; t < BS; ++t)                                          \
                        s[t] -= slope * (float)(S - 1 - ((int64_t)j * BS + t));           \
                }                                                                         \
                for (int t = n; t < BS; ++t) s[t] = -1e30f;  /* past the context */       \
                memcpy(&sc[g], s, sizeof s);                                              \
                const float bmax = fmaxf(m[g], hmax(sc[g]));                              \
                const vblk e = vexp(sc[g] - bmax);                                        \
                const float corr = expf(m[g] - bmax);                                     \
                l[g] = l[g] * corr + hsum(e);                                             \
                m[g] = bmax;                                                              \
                memcpy(p[g], &e, sizeof e);                                               \
                for (int c = 0; c < D / DV; ++c) acc[g][c] *= corr;                       \
            }                                                                             \
            for (int t = 0; t < n; ++t) {  /* one converted value vector feeds G FMAs */  \
                for (int c = 0; c < D / DV; ++c) {                                        \
                    const vch vv = VALS(vb + t * D + c * DV);                             \
                    for (int g = 0; g < G; ++g) acc[g][c] += p[g][t] * vv;                \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int g = 0; g < G; ++g) {                                                     \
            float *o = out + ((int64_t)b * H + kvh * G + g) * D;                          \
            const float inv = 1.f / l[g];                                                 \
            for (int c = 0; c < D / DV; ++c) {                                            \
                const vch r = acc[g][c] * inv;                                            \
                memcpy(o + c * DV, &r, sizeof r);                                         \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
}

DEFINE_KERNEL(paged_decode_f32, float, keys_f32, vals_f32)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, keys_bf16, vals_bf16)
