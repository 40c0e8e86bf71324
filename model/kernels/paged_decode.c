/* Paged decode attention on the CPU: one query token per sequence, K/V read straight
 * from the block pool (no gather), online softmax, GQA by sharing each K/V head across
 * its group of query heads. Built and loaded by model/kernels/__init__.py.
 *
 * The cache layouts make every inner loop contiguous, so the compiler vectorizes them:
 *   k: (num_blocks, KV, D, BS)  d-major: one FMA scores BS tokens for one channel
 *   v: (num_blocks, KV, BS, D)
 * q: (B, H, D) float32, out: (B, H, D) float32; k/v float32 or bfloat16 (uint16 bits)
 * tables: (B, max_blocks) int64; lens: (B,) int64 context incl. the new token
 * alibi: (H,) float32 slopes or NULL
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define MAX_G 32
#define MAX_D 256
#define MAX_BS 64

/* Built once per (head dim, block size): constant trip counts let the compiler unroll
 * and vectorize the inner loops completely. */
#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=... -DBLOCK_SIZE=..."
#endif

#define DEFINE_KERNEL(NAME, T, LOAD)                                                       \
void NAME(const float *q, const T *k, const T *v, const int64_t *tables,                   \
          const int64_t *lens, float *out, int B, int H, int KV, int max_blocks,           \
          float scale, const float *alibi, int nthreads) {                                 \
    const int G = H / KV, D = HEAD_DIM, BS = BLOCK_SIZE;                                   \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")                 \
    for (int task = 0; task < B * KV; ++task) {                                            \
        const int b = task / KV, kvh = task % KV;                                          \
        const int64_t S = lens[b];                                                         \
        float m[MAX_G], l[MAX_G], acc[MAX_G][MAX_D], s[MAX_G][MAX_BS], qs[MAX_G][MAX_D];   \
        for (int g = 0; g < G; ++g) {                                                      \
            m[g] = -1e30f;                                                                  \
            l[g] = 0.f;                                                                    \
            const float *qh = q + ((int64_t)b * H + kvh * G + g) * D;                      \
            for (int d = 0; d < D; ++d) { acc[g][d] = 0.f; qs[g][d] = qh[d] * scale; }     \
        }                                                                                  \
        const int nblk = (int)((S + BS - 1) / BS);                                         \
        for (int j = 0; j < nblk; ++j) {                                                   \
            const int64_t blk = tables[(int64_t)b * max_blocks + j];                       \
            const int64_t rest = S - (int64_t)j * BS;                                      \
            const int n = rest < BS ? (int)rest : BS;                                      \
            const T *kb = k + (blk * KV + kvh) * (int64_t)D * BS;                          \
            const T *vb = v + (blk * KV + kvh) * (int64_t)BS * D;                          \
            float kv[MAX_BS > MAX_D ? MAX_BS : MAX_D];                                     \
            for (int g = 0; g < G; ++g)                                                    \
                for (int t = 0; t < BS; ++t) s[g][t] = 0.f;                                \
            for (int d = 0; d < D; ++d) {       /* each key element converted once */      \
                const T *kd = kb + (int64_t)d * BS;                                        \
                for (int t = 0; t < BS; ++t) kv[t] = LOAD(kd[t]);                          \
                for (int g = 0; g < G; ++g) {                                              \
                    const float qd = qs[g][d];                                             \
                    for (int t = 0; t < BS; ++t) s[g][t] += qd * kv[t];                    \
                }                                                                          \
            }                                                                              \
            for (int g = 0; g < G; ++g) {                                                  \
                float *sg = s[g];                                                          \
                if (alibi) {                                                               \
                    const float slope = alibi[kvh * G + g];                                \
                    for (int t = 0; t < n; ++t)                                            \
                        sg[t] -= slope * (float)(S - 1 - ((int64_t)j * BS + t));           \
                }                                                                          \
                float bmax = m[g];                                                         \
                for (int t = 0; t < n; ++t) bmax = sg[t] > bmax ? sg[t] : bmax;            \
                const float corr = expf(m[g] - bmax);                                      \
                l[g] *= corr;                                                              \
                for (int d = 0; d < D; ++d) acc[g][d] *= corr;                             \
                for (int t = 0; t < n; ++t) { sg[t] = expf(sg[t] - bmax); l[g] += sg[t]; } \
                m[g] = bmax;                                                               \
            }                                                                              \
            for (int t = 0; t < n; ++t) {       /* each value element converted once */    \
                const T *vt = vb + (int64_t)t * D;                                         \
                for (int d = 0; d < D; ++d) kv[d] = LOAD(vt[d]);                           \
                for (int g = 0; g < G; ++g) {                                              \
                    const float p = s[g][t];                                               \
                    float *ag = acc[g];                                                    \
                    for (int d = 0; d < D; ++d) ag[d] += p * kv[d];                        \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (int g = 0; g < G; ++g) {                                                      \
            float *o = out + ((int64_t)b * H + kvh * G + g) * D;                           \
            const float inv = 1.f / l[g];                                                  \
            for (int d = 0; d < D; ++d) o[d] = acc[g][d] * inv;                            \
        }                                                                                  \
    }                                                                                      \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)

DEFINE_KERNEL(paged_decode_f32, float, LOAD_F32)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, LOAD_BF16)
