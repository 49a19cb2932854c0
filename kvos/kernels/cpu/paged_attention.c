/* Decode attention over a paged float32 KV cache on x86-64 CPUs (AVX2 + FMA).
 *
 * One query token per sequence attends keys at positions max(0, len - window) .. len - 1 of its
 * blocks (window 0: all). Cache element (block, token, head, d) lies at
 * base + block * sb + token * st + head * sh + d. Grouped-query heads sharing a KV head read
 * each key and value once. The softmax is computed a block at a time (running maximum,
 * rescaled sums) in float32 with expf; the result matches the masked float32 softmax up to the
 * rounding of the sums' order. Head sizes 64 and 128 take a path with the accumulator in
 * registers (the same operations in the same order); every next block's rows are prefetched,
 * since a block's address comes from the table.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Every row of one block's K and V (head offset included in ``at``) into the cache hierarchy. */
static inline void prefetch_rows(const float *kc, const float *vc, int64_t at, int64_t st, int64_t rows,
                                 int64_t D) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t d = 0; d < D; d += 16) {
            _mm_prefetch((const char *)(kc + at + t * st + d), _MM_HINT_T0);
            _mm_prefetch((const char *)(vc + at + t * st + d), _MM_HINT_T0);
        }
}

/* acc = acc * c + p * v */
static inline void scale_axpy(float *acc, float c, float p, const float *v, int64_t D) {
    const __m256 C = _mm256_set1_ps(c), P = _mm256_set1_ps(p);
    for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(P, _mm256_loadu_ps(v + d),
                                                  _mm256_mul_ps(_mm256_loadu_ps(acc + d), C)));
}

/* One query head i of a (sequence, KV head) job with D fixed at compile time: the same
 * operations in the same order as the generic loop below (so the same result, bit for bit), with
 * the head's accumulator held in registers across the whole context instead of read and written
 * back for every key. */
#define ATTEND_HEAD(DD)                                                                            \
    static void attend_head_##DD(const float *qh, const float *kc, const float *vc, int64_t sb,   \
                                 int64_t st, int64_t hoff, const int32_t *table, int64_t start,   \
                                 int64_t len, int64_t block_size, float scale, float *scores,      \
                                 float *o) {                                                       \
        enum { V = DD / 8 };                                                                       \
        __m256 acc[V];                                                                             \
        for (int v = 0; v < V; v++) acc[v] = _mm256_setzero_ps();                                  \
        float m = -INFINITY, l = 0.0f;                                                             \
        for (int64_t t0 = start; t0 < len;) {                                                      \
            const int64_t b = t0 / block_size;                                                     \
            const int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;           \
            const int64_t at = table[b] * sb + hoff;                                               \
            if (t1 < len) prefetch_rows(kc, vc, table[b + 1] * sb + hoff, st, block_size, DD);     \
            float bm = m;                                                                          \
            for (int64_t t = t0; t < t1; t++) {                                                    \
                const float sc = dot(qh, kc + at + (t % block_size) * st, DD) * scale;             \
                scores[t - t0] = sc;                                                               \
                if (sc > bm) bm = sc;                                                              \
            }                                                                                      \
            const float c = expf(m - bm); /* 0 on the first block */                               \
            const __m256 C = _mm256_set1_ps(c);                                                    \
            l *= c;                                                                                \
            for (int64_t t = t0; t < t1; t++) { /* no calls below: acc stays in registers */       \
                scores[t - t0] = expf(scores[t - t0] - bm);                                        \
                l += scores[t - t0];                                                               \
            }                                                                                      \
            for (int64_t t = t0; t < t1; t++) {                                                    \
                const __m256 P = _mm256_set1_ps(scores[t - t0]);                                   \
                const float *vr = vc + at + (t % block_size) * st;                                 \
                for (int v = 0; v < V; v++)                                                        \
                    acc[v] = _mm256_fmadd_ps(P, _mm256_loadu_ps(vr + 8 * v),                       \
                                             t == t0 ? _mm256_mul_ps(acc[v], C) : acc[v]);         \
            }                                                                                      \
            m = bm;                                                                                \
            t0 = t1;                                                                               \
        }                                                                                          \
        const float inv = l > 0 ? 1.0f / l : 0.0f;                                                 \
        for (int v = 0; v < V; v++) _mm256_storeu_ps(o + 8 * v, _mm256_mul_ps(acc[v], _mm256_set1_ps(inv))); \
    }
ATTEND_HEAD(64)
ATTEND_HEAD(128)

/* The online softmax of one (sequence, kv head) job: for the group's query heads, unnormalised
 * sums acc [group, D], running maxima mx (-inf before any key) and denominators sum [group], and
 * scores, scratch for up to ``rows`` keys at a time. One allocation: free(state.scores). */
typedef struct {
    float *scores, *acc, *mx, *sum;
} RowsState;

RowsState rows_state(int64_t group, int64_t D, int64_t rows) {
    RowsState st;
    st.scores = calloc(rows + group * D + 2 * group, sizeof(float));
    st.acc = st.scores + rows;
    st.mx = st.acc + group * D;
    st.sum = st.mx + group;
    for (int64_t i = 0; i < group; i++) st.mx[i] = -INFINITY;
    return st;
}

/* Fold keys k[r] and values v[r] (r < rows, row stride st) into the state of the group's query
 * heads qs [group, D]. */
void attend_rows(const float *qs, int64_t group, int64_t D, const float *k, const float *v, int64_t st,
                 int64_t rows, float scale, RowsState *state) {
    float *scores = state->scores;
    for (int64_t i = 0; i < group; i++) {
        float m = state->mx[i];
        for (int64_t t = 0; t < rows; t++) {
            scores[t] = dot(qs + i * D, k + t * st, D) * scale;
            if (scores[t] > m) m = scores[t];
        }
        const float c = expf(state->mx[i] - m); /* 0 on the first block (exp(-inf)) */
        float *a = state->acc + i * D;
        float l = state->sum[i] * c;
        for (int64_t t = 0; t < rows; t++) {
            const float p = expf(scores[t] - m);
            l += p;
            scale_axpy(a, t == 0 ? c : 1.0f, p, v + t * st, D);
        }
        state->sum[i] = l;
        state->mx[i] = m;
    }
}

/* out [group, D] = acc / sum per head (0 where no key was seen). */
void finish_rows(const RowsState *state, int64_t group, int64_t D, float *out) {
    for (int64_t i = 0; i < group; i++) {
        const float inv = state->sum[i] > 0 ? 1.0f / state->sum[i] : 0.0f;
        for (int64_t d = 0; d < D; d++) out[i * D + d] = state->acc[i * D + d] * inv;
    }
}

/* q, out: [nseq, nh, D] contiguous; tables [nseq, table_stride] int32; D a multiple of 8. */
void paged_decode_attention(const float *q, int64_t nseq, int64_t nh, int64_t nkv, int64_t D,
                            const float *kc, const float *vc, int64_t sb, int64_t st, int64_t sh,
                            const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                            int64_t block_size, int64_t window, float scale, float *out,
                            int nthreads) {
    const int64_t group = nh / nkv;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t job = 0; job < nseq * nkv; job++) {
        const int64_t s = job / nkv, g = job % nkv;
        const int64_t len = seq_lens[s];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        if (D == 64 || D == 128) {
            float scores[block_size];
            for (int64_t i = 0; i < group; i++) {
                const int64_t h = g * group + i;
                (D == 64 ? attend_head_64 : attend_head_128)(q + (s * nh + h) * D, kc, vc, sb, st, g * sh,
                                                             tables + s * table_stride, start, len, block_size,
                                                             scale, scores, out + (s * nh + h) * D);
            }
            continue;
        }
        RowsState state = rows_state(group, D, block_size);
        const float *qs = q + (s * nh + g * group) * D;
        for (int64_t t0 = start; t0 < len;) {
            const int64_t b = t0 / block_size;
            const int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;
            const int64_t blk = tables[s * table_stride + b];
            const int64_t at = blk * sb + g * sh + (t0 % block_size) * st;
            if (t1 < len) /* the next block's rows: its address is in the table, not predictable */
                prefetch_rows(kc, vc, tables[s * table_stride + b + 1] * sb + g * sh, st, block_size, D);
            attend_rows(qs, group, D, kc + at, vc + at, st, t1 - t0, scale, &state);
            t0 = t1;
        }
        finish_rows(&state, group, D, out + (s * nh + g * group) * D);
        free(state.scores);
    }
}

/* Token t's rows src[t] ([heads, D], row stride src_stride elements, head stride D) into cache
 * slot slots[t] (block slots[t] / block_size, offset slots[t] % block_size); slot -1 (padding)
 * is skipped. */
void paged_write(const float *src, int64_t T, int64_t heads, int64_t D, int64_t src_stride,
                 float *cache, int64_t sb, int64_t st, int64_t sh, const int64_t *slots,
                 int64_t block_size) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        float *dst = cache + (slots[t] / block_size) * sb + (slots[t] % block_size) * st;
        for (int64_t h = 0; h < heads; h++) {
            const float *s = src + t * src_stride + h * D;
            float *o = dst + h * sh;
            for (int64_t d = 0; d < D; d++) o[d] = s[d];
        }
    }
}
