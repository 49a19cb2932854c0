/* Block-quantized weight products on x86-64 CPUs (AVX2 + FMA), float32 activations.
 *
 * Weights keep GGUF's blocks of 32 along K, one float32 scale D (and, for the 4-bit form, one
 * float32 minimum M) per block:
 *   u4 form: w = q * D + M, q in 0..15, two per byte (a block's elements 0-15 in the low nibbles
 *            of its 16 bytes, 16-31 in the high ones: GGUF's Q4_1 / Q4_K order);
 *   i8 form: w = q * D, q a signed byte (Q8_0, Q5_0, Q4_0, Q6_K once expanded).
 * Each weight is rebuilt in float32 with one rounding per operation, the same operations in the
 * same order as the float32 dequantization of the GGUF formats (multiply, then add: this file
 * is built with -ffp-contract=off, so no multiply-add is fused except the explicit ones that
 * accumulate products), so the product uses exactly the weights of the float32 model; only the
 * order of the sum over K differs from a BLAS call.
 *
 * out[M, N] = x[M, K] @ W[N, K]^T. K is a multiple of 32. Rows of W are split over threads.
 * Up to 4 rows of x: each block of W is rebuilt in registers and used at once; more rows: each
 * row of W is rebuilt once into a stack buffer (K floats) that all rows of x then read from L1.
 */
#include <immintrin.h>
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

/* Row n of W rebuilt into w [K] (the same float32 values as the fused paths above). */
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
