/* Block-quantized weight products on x86-64 CPUs (AVX2 + FMA), float32 activations.
 *
 * Weights keep GGUF's blocks of 32 along K, one float32 scale D (and, for the 4-bit form, one
 * float32 minimum M) per block:
 *   u4 form: w = q * D + M, q in 0..15, two per byte (a block's elements 0-15 in the low nibbles
 *            of its 16 bytes, 16-31 in the high ones: GGUF's Q4_1 / Q4_K order);
 *   i8 form: w = q * D, q a signed byte (Q8_0, Q5_0, Q4_0, Q6_K once expanded).
 *
 * out[M, N] = x[M, K] @ W[N, K]^T. K is a multiple of 32. Rows of W are split over threads.
 * Three paths, by the number of rows of x:
 *   - one row (a decode step of one sequence): x is split into two 16-bit integers per value
 *     (quantize_rows: each within about 2^-31 of its block's largest magnitude) and each block's
 *     quants are multiplied with them in integers (vpmaddwd), exactly; one float32 multiply-add
 *     per block then applies D and x's scale, and for u4 the M term is M times x's float32 block
 *     sum. The same sum as with the float32 weights, rounded otherwise: within float32-level
 *     error where a block's values are within a few hundred times of each other (seen: 1e-7 to
 *     6e-7 of sum |x w|, as the float32 path); a block whose largest value is 1e4 times its
 *     others' gives those others fewer bits (u4 also loses them to M * sum(x_b)): errors of
 *     5e-6 of sum |x w| at 3e4 times for Q4_1 weights, against the float32 path's 7e-7.
 *     Rows holding an inf, a NaN or a block of values below 2^-100 take the float32 path.
 *     Two rows of W at a time.
 *   - 2-4 rows: each block of W is rebuilt in float32 in registers and used at once by every row.
 *   - more rows: each row of W is rebuilt into a stack buffer (K floats) that all rows of x
 *     then read from L1.
 * Rebuilt weights take one rounding per operation, the same operations in the same order as the
 * float32 dequantization of the GGUF formats (multiply, then add: this file is built with
 * -ffp-contract=off, so no multiply-add is fused except the explicit ones that accumulate
 * products), so those products use exactly the weights of the float32 model; only the order of
 * the sum over K differs from a BLAS call.
 */
#include <immintrin.h>
#include <float.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 u8x8_to_ps(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

static inline __m256 i8x8_to_ps(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

/* Block b (32 weights) of a row of W rebuilt into w[0..3], elements 0-7, 8-15, 16-23, 24-31. */
static inline void u4_block(const uint8_t *q, const float *d, const float *m, int64_t b, __m256 w[4]) {
    const __m128i low = _mm_set1_epi8(0x0F);
    const __m256 D = _mm256_set1_ps(d[b]), Mn = _mm256_set1_ps(m[b]);
    const __m128i v = _mm_loadu_si128((const __m128i *)(q + b * 16));
    const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    w[0] = _mm256_add_ps(_mm256_mul_ps(u8x8_to_ps(lo), D), Mn);
    w[1] = _mm256_add_ps(_mm256_mul_ps(u8x8_to_ps(_mm_srli_si128(lo, 8)), D), Mn);
    w[2] = _mm256_add_ps(_mm256_mul_ps(u8x8_to_ps(hi), D), Mn);
    w[3] = _mm256_add_ps(_mm256_mul_ps(u8x8_to_ps(_mm_srli_si128(hi, 8)), D), Mn);
}

static inline void i8_block(const int8_t *q, const float *d, int64_t b, __m256 w[4]) {
    const __m256 D = _mm256_set1_ps(d[b]);
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_mul_ps(i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(q + b * 32 + 8 * j))), D);
}

/* One row n of W against R rows of x (R = 1..4): each block rebuilt once (BLOCK fills w), used
 * at once by every row; NA independent sums per row keep the multiply-adds from waiting on
 * each other. */
#define ROW_BODY(R, BLOCK)                                                                 \
    {                                                                                      \
        enum { NA = R == 1 ? 4 : R == 2 ? 2 : 1 };                                         \
        __m256 acc[R][NA];                                                                 \
        for (int r = 0; r < R; r++)                                                        \
            for (int a = 0; a < NA; a++) acc[r][a] = _mm256_setzero_ps();                  \
        for (int64_t b = 0; b < K / 32; b++) {                                             \
            __m256 w[4];                                                                   \
            BLOCK;                                                                         \
            for (int r = 0; r < R; r++) {                                                  \
                const float *xb = x + r * K + b * 32;                                      \
                for (int j = 0; j < 4; j++)                                                \
                    acc[r][j % NA] =                                                       \
                        _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j % NA]);\
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < R; r++) {                                                      \
            for (int a = 1; a < NA; a++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);  \
            out[r * N] = hsum(acc[r][0]);                                                  \
        }                                                                                  \
    }
#define U4_ROW(R)                                                                         \
    static void u4_row_##R(const float *x, int64_t K, const uint8_t *q, const float *d,    \
                           const float *m, float *out, int64_t N)                          \
        ROW_BODY(R, u4_block(q, d, m, b, w))
#define I8_ROW(R)                                                                         \
    static void i8_row_##R(const float *x, int64_t K, const int8_t *q, const float *d,     \
                           float *out, int64_t N) ROW_BODY(R, i8_block(q, d, b, w))
U4_ROW(1)
U4_ROW(2)
U4_ROW(3)
U4_ROW(4)
I8_ROW(1)
I8_ROW(2)
I8_ROW(3)
I8_ROW(4)

/* Activation rows for the one-row path as two 16-bit integers per value, per block of 32:
 *   x[i] ~ s[b] * (hi[i] + lo[i] / 32768),  s[b] = max |x| over the block / 32767,
 * hi = x / s rounded to the nearest integer, lo = the remainder (within +-1/2) times 32768,
 * rounded: each value within about 2^-31 of its block's largest magnitude (below float32's
 * rounding for values within 2^7 of it; smaller ones lose relative precision). Each block of a
 * row takes 64 int16: hi then lo, each in the order the quants are widened in (elements 0-7,
 * 16-23, 8-15, 24-31); a row takes 2K. Returns 0, with a and s unspecified, when a block holds
 * an inf or a NaN or its largest magnitude is below 2^-100 but not 0 (32767 / max overflows or
 * the scales go subnormal): the caller then takes the float32 path, which carries them as a
 * float32 product does. */
static int quantize_rows(const float *x, int64_t R, int64_t K, int16_t *a, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f), lo_scale = _mm256_set1_ps(32768.0f);
    for (int64_t blk = 0; blk < R * K / 32; blk++) {
        const float *xb = x + blk * 32;
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(xb + 8 * j);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 big = _mm256_set1_ps(FLT_MAX); /* |x| > FLT_MAX or unordered: inf or NaN */
        __m256 bad = _mm256_cmp_ps(_mm256_andnot_ps(sign, v[0]), big, _CMP_NLE_UQ);
        for (int j = 1; j < 4; j++) bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, v[j]), big, _CMP_NLE_UQ));
        if (_mm256_movemask_ps(bad) || (top > 0 && top < 0x1p-100f)) return 0;
        s[blk] = top / 32767.0f;
        const __m256 inv = _mm256_set1_ps(top > 0 ? 32767.0f / top : 0.0f);
        __m256i hi[4], lo[4];
        for (int j = 0; j < 4; j++) {
            const __m256 t = _mm256_mul_ps(v[j], inv);
            hi[j] = _mm256_cvtps_epi32(t); /* to nearest; |t| <= 32767 up to rounding */
            lo[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, _mm256_cvtepi32_ps(hi[j])), lo_scale));
        }
        /* [e0-3 | e16-19] and [e4-7 | e20-23] packed: e0-7 | e16-23; likewise e8-15 | e24-31 */
        __m256i *out = (__m256i *)(a + blk * 64);
        __m256i *parts[2] = {hi, lo};
        for (int p = 0; p < 2; p++) {
            const __m256i *i = parts[p];
            _mm256_storeu_si256(out + 2 * p, _mm256_packs_epi32(_mm256_permute2x128_si256(i[0], i[2], 0x20),
                                                                _mm256_permute2x128_si256(i[0], i[2], 0x31)));
            _mm256_storeu_si256(out + 2 * p + 1, _mm256_packs_epi32(_mm256_permute2x128_si256(i[1], i[3], 0x20),
                                                                    _mm256_permute2x128_si256(i[1], i[3], 0x31)));
        }
    }
    return 1;
}

/* q_b . x_b's integer parts from a block's widened quants w and x's 64 int16 (quantize_rows),
 * as float32 lanes: hi's sums plus lo's / 32768. Each lane sums 4 products, exactly in int32 and
 * in its float32 conversion (u4: below 2^21; i8: at most 2^24). */
static inline __m256 block_dot(const __m256i w[2], const int16_t *xb) {
    const __m256i *v = (const __m256i *)xb;
    const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(v)),
                                        _mm256_madd_epi16(w[1], _mm256_loadu_si256(v + 1)));
    const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(v + 2)),
                                        _mm256_madd_epi16(w[1], _mm256_loadu_si256(v + 3)));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(1.0f / 32768), _mm256_cvtepi32_ps(hi));
}

/* Block b's 32 quants widened to 16 bits in quantize_rows' order: w[0] elements 0-7 | 16-23,
 * w[1] 8-15 | 24-31. u4: the block's 16 bytes in both 128-bit lanes, the low lane keeping the
 * low nibbles (elements 0-15) and the high lane the high ones (16-31). */
static inline void u4_quants(const uint8_t *q, int64_t b, __m256i w[2]) {
    const __m256i low = _mm256_set1_epi8(0x0F), shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + b * 16)));
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(v, shifts), low);
    w[0] = _mm256_unpacklo_epi8(nib, _mm256_setzero_si256());
    w[1] = _mm256_unpackhi_epi8(nib, _mm256_setzero_si256());
}

static inline void i8_quants(const int8_t *q, int64_t b, __m256i w[2]) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + b * 32));
    const __m256i sign = _mm256_cmpgt_epi8(_mm256_setzero_si256(), v);
    w[0] = _mm256_unpacklo_epi8(v, sign);
    w[1] = _mm256_unpackhi_epi8(v, sign);
}

/* sx[b] = the sum of x's block b (float32: four 8-lane vectors added pairwise, then the lanes). */
static void block_sums(const float *x, int64_t K, float *sx) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + b * 32;
        const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                       _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        sx[b] = hsum(s);
    }
}

/* sum over b of p[b] * c[b], b < n. */
static inline float dot(const float *p, const float *c, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= n; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(p + b), _mm256_loadu_ps(c + b), acc);
    float t = hsum(acc);
    for (; b < n; b++) t += p[b] * c[b];
    return t;
}

/* Rows n and n + 1 of W against one row of x from its 16-bit parts (a, s; quantize_rows):
 *   w . x = sum over blocks b of D[b] * s[b] * (q_b . (hi_b + lo_b / 32768))  +  M[b] * sum(x_b)
 * (MTERM: the M term, u4 only, from x's float32 block sums). Two rows of W at once share x's
 * loads and overlap their sums' latencies. AHEAD: an address in the next pair's
 * quants, prefetched (a pair reads two streams of W; without it the LM head's, from memory,
 * ran at half the speed). Prefetching past the end of W is harmless. */
#define PAIR_BODY(QUANTS0, QUANTS1, AHEAD, MTERM0, MTERM1)                                 \
    {                                                                                      \
        const int64_t nb = K / 32;                                                         \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                     \
        for (int64_t b = 0; b < nb; b++) {                                                 \
            __m256i w[2], v[2];                                                            \
            QUANTS0;                                                                       \
            QUANTS1;                                                                       \
            _mm_prefetch((const char *)(AHEAD), _MM_HINT_T0);                              \
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * s[b]), block_dot(w, a + b * 64), acc0);\
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d[nb + b] * s[b]), block_dot(v, a + b * 64), acc1);\
        }                                                                                  \
        out[0] = hsum(acc0) MTERM0;                                                        \
        out[1] = hsum(acc1) MTERM1;                                                        \
    }
static void u4_pair(const int16_t *a, const float *s, const float *sx, int64_t K, const uint8_t *q,
                    const float *d, const float *m, float *out)
    PAIR_BODY(u4_quants(q, b, w), u4_quants(q + K / 2, b, v), q + K + 32 * b, + dot(m, sx, nb), + dot(m + nb, sx, nb))
static void i8_pair(const int16_t *a, const float *s, int64_t K, const int8_t *q, const float *d, float *out)
    PAIR_BODY(i8_quants(q, b, w), i8_quants(q + K, b, v), q + 2 * K + 64 * b, , )

/* Row n of W rebuilt into w [K] (the same float32 values as u4_block / i8_block). */
static void u4_dequant_row(const uint8_t *q, const float *d, const float *m, int64_t K, float *w) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4];
        u4_block(q, d, m, b, v);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(w + b * 32 + 8 * j, v[j]);
    }
}

static void i8_dequant_row(const int8_t *q, const float *d, int64_t K, float *w) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 v[4];
        i8_block(q, d, b, v);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(w + b * 32 + 8 * j, v[j]);
    }
}

/* out[r * N + j] = w[j] . x[r] for two rebuilt rows w[0], w[1] of W (j = 0, 1; w1 may be
 * null when only one is left) and the M rows of x, four at a time: 6 loads per 8 multiply-adds. */
static void float_rows_times_rows(const float *w0, const float *w1, const float *x, int64_t M, int64_t K,
                                  float *out, int64_t N) {
    int64_t r = 0;
    if (w1) {
        for (; r + 4 <= M; r += 4) {
            __m256 a[4][2];
            for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
            const float *xr = x + r * K;
            for (int64_t k = 0; k < K; k += 8) {
                const __m256 u = _mm256_loadu_ps(w0 + k), v = _mm256_loadu_ps(w1 + k);
                for (int i = 0; i < 4; i++) {
                    const __m256 xv = _mm256_loadu_ps(xr + i * K + k);
                    a[i][0] = _mm256_fmadd_ps(u, xv, a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(v, xv, a[i][1]);
                }
            }
            for (int i = 0; i < 4; i++) {
                out[(r + i) * N] = hsum(a[i][0]);
                out[(r + i) * N + 1] = hsum(a[i][1]);
            }
        }
    }
    for (; r < M; r++) {
        const float *xr = x + r * K;
        for (int j = 0; j < (w1 ? 2 : 1); j++) {
            const float *w = j ? w1 : w0;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xr + k), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(xr + k + 8), a1);
            }
            for (; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(xr + k), a0);
            out[r * N + j] = hsum(_mm256_add_ps(a0, a1));
        }
    }
}

#define FUSED_MAX_ROWS 4 /* above: rebuild each row of W once into a buffer, then all rows of x */

/* x [M, K], q [N, K/2] bytes, d and m [N, K/32], out [M, N]. */
void u4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d,
               const float *m, int64_t N, float *out, int nthreads) {
    const int64_t nb = K / 32;
    if (M > FUSED_MAX_ROWS) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t n = 0; n < N; n += 2) {
            float w0[K], w1[K];
            const int pair = n + 1 < N;
            u4_dequant_row(q + n * (K / 2), d + n * nb, m + n * nb, K, w0);
            if (pair) u4_dequant_row(q + (n + 1) * (K / 2), d + (n + 1) * nb, m + (n + 1) * nb, K, w1);
            float_rows_times_rows(w0, pair ? w1 : 0, x, M, K, out + n, N);
        }
        return;
    }
    int16_t a[M == 1 ? 2 * K : 1];
    float s[M == 1 ? nb : 1], sx[M == 1 ? nb : 1];
    if (M == 1 && quantize_rows(x, 1, K, a, s)) {
        block_sums(x, K, sx);
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t n = 0; n < N - 1; n += 2)
            u4_pair(a, s, sx, K, q + n * (K / 2), d + n * nb, m + n * nb, out + n);
        if (N % 2) u4_row_1(x, K, q + (N - 1) * (K / 2), d + (N - 1) * nb, m + (N - 1) * nb, out + N - 1, N);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qn = q + n * (K / 2);
        const float *dn = d + n * nb, *mn = m + n * nb;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) u4_row_4(x + r * K, K, qn, dn, mn, out + r * N + n, N);
        switch (M - r) {
        case 3: u4_row_3(x + r * K, K, qn, dn, mn, out + r * N + n, N); break;
        case 2: u4_row_2(x + r * K, K, qn, dn, mn, out + r * N + n, N); break;
        case 1: u4_row_1(x + r * K, K, qn, dn, mn, out + r * N + n, N); break;
        }
    }
}

/* x [M, K], q [N, K] signed bytes, d [N, K/32], out [M, N]. */
void i8_matmul(const float *x, int64_t M, int64_t K, const int8_t *q, const float *d,
               int64_t N, float *out, int nthreads) {
    const int64_t nb = K / 32;
    if (M > FUSED_MAX_ROWS) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t n = 0; n < N; n += 2) {
            float w0[K], w1[K];
            const int pair = n + 1 < N;
            i8_dequant_row(q + n * K, d + n * nb, K, w0);
            if (pair) i8_dequant_row(q + (n + 1) * K, d + (n + 1) * nb, K, w1);
            float_rows_times_rows(w0, pair ? w1 : 0, x, M, K, out + n, N);
        }
        return;
    }
    int16_t a[M == 1 ? 2 * K : 1];
    float s[M == 1 ? nb : 1];
    if (M == 1 && quantize_rows(x, 1, K, a, s)) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t n = 0; n < N - 1; n += 2) i8_pair(a, s, K, q + n * K, d + n * nb, out + n);
        if (N % 2) i8_row_1(x, K, q + (N - 1) * K, d + (N - 1) * nb, out + N - 1, N);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *qn = q + n * K;
        const float *dn = d + n * nb;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) i8_row_4(x + r * K, K, qn, dn, out + r * N + n, N);
        switch (M - r) {
        case 3: i8_row_3(x + r * K, K, qn, dn, out + r * N + n, N); break;
        case 2: i8_row_2(x + r * K, K, qn, dn, out + r * N + n, N); break;
        case 1: i8_row_1(x + r * K, K, qn, dn, out + r * N + n, N); break;
        }
    }
}
