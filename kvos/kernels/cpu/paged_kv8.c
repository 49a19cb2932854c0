/* 8-bit paged KV caches (int8, fp8 e4m3) on x86-64 CPUs: the quantizing write and the decode
 * attention, for the same layouts and numbers as the torch reference (kvos/kernels/kv_quant.py).
 *
 * A cache view (Kv8View) gives K and V bytes with their own element strides (block, token, head,
 * d: V may be token-minor), and float32 scales, one per (block, token, head) row, with strides
 * shared by K's and V's. The write quantizes a row as kv_quant.quantize does: int8 scale
 * amax / 127, values x / scale rounded half to even; fp8 the least-squared-error scale of
 * (amax / 448) * (1 + j / 16), j < 16 (error summed in double, eight lanes at a time: it may
 * differ from torch's sum in the last bits, which matters only where two candidates tie to within
 * double rounding), values rounded to nearest even e4m3. The attention dequantizes each block's rows
 * (x * scale in float32, as kv_quant.dequantize) into a float buffer and folds it into the
 * float32 online softmax of paged_attention.c's generic path (attend_rows). Built with -ffp-contract=off.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct Kv8View {
    const void *k, *v;          /* int8 or e4m3 bytes */
    const float *k_scale, *v_scale;
    int64_t ksb, kst, ksh, ksd; /* element (byte) strides of K */
    int64_t vsb, vst, vsh, vsd; /* of V */
    int64_t ssb, sst, ssh;      /* of both scale tensors */
    int64_t fp8;                /* 1: e4m3, 0: int8 */
} Kv8View;

/* e4m3fn code -> float, exactly (0x7F / 0xFF are NaN; the write never makes them). */
static float e4m3_value(uint8_t c) {
    const int e = (c >> 3) & 15, m = c & 7;
    float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
    if ((c & 0x7F) == 0x7F) v = NAN;
    return (c & 0x80) ? -v : v;
}

static float E4M3[256];
static int e4m3_ready;

static void e4m3_init(void) {
    if (__atomic_load_n(&e4m3_ready, __ATOMIC_ACQUIRE)) return;
    for (int c = 0; c < 256; c++) E4M3[c] = e4m3_value((uint8_t)c);
    __atomic_store_n(&e4m3_ready, 1, __ATOMIC_RELEASE);
}

static inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* |y| <= 448 rounded to the nearest e4m3fn value, ties to even, subnormals kept: its value
 * (signed) and code (sign in bit 7). The same exact steps as cache_write._round_e4m3. */
static inline uint8_t round_e4m3(float y, float *value) {
    const float a = fabsf(y);
    int32_t e = (int32_t)(float_to_bits(a) >> 23);
    if (e < 121) e = 121;
    const float step = bits_to_float((uint32_t)(e - 3) << 23);
    const float r = rintf(a * bits_to_float((uint32_t)(257 - e) << 23)); /* exact: < 16, ties to even */
    const int neg = float_to_bits(y) >> 31;
    *value = neg ? -(r * step) : r * step;
    return (uint8_t)((e - 121) * 8 + (int32_t)r + (neg ? 128 : 0));
}

/* The squared error of x [D] quantized with scale s (divisor div = max(s, 1e-30)), in double. */
static double fp8_error(const float *x, int64_t D, float s, float div) {
    double err = 0.0;
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / div, val;
        y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y);
        round_e4m3(y, &val);
        const double diff = (double)val * (double)s - (double)x[d];
        err += diff * diff;
    }
    return err;
}

/* fp8_error eight values at a time (D a multiple of 8): the same values per element (IEEE
 * division, round_e4m3's exact steps with round-to-nearest-even), the sum in another order. */
static double fp8_error8(const float *x, int64_t D, float s, float div) {
    const __m256 DIV = _mm256_set1_ps(div), LO = _mm256_set1_ps(-448.0f), HI = _mm256_set1_ps(448.0f);
    const __m256 SIGN = _mm256_set1_ps(-0.0f);
    const __m256i MINE = _mm256_set1_epi32(121), C3 = _mm256_set1_epi32(3), C257 = _mm256_set1_epi32(257);
    const __m256d S = _mm256_set1_pd((double)s);
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 xv = _mm256_loadu_ps(x + d);
        const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(xv, DIV), LO), HI);
        const __m256 a = _mm256_andnot_ps(SIGN, y);
        const __m256i e = _mm256_max_epi32(_mm256_srli_epi32(_mm256_castps_si256(a), 23), MINE);
        const __m256 step = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, C3), 23));
        const __m256 inv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(C257, e), 23));
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(a, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 val = _mm256_or_ps(_mm256_mul_ps(r, step), _mm256_and_ps(SIGN, y));
        const __m256d d0 = _mm256_sub_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(val)), S),
                                         _mm256_cvtps_pd(_mm256_castps256_ps128(xv)));
        const __m256d d1 = _mm256_sub_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(val, 1)), S),
                                         _mm256_cvtps_pd(_mm256_extractf128_ps(xv, 1)));
        acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(d0, d0));
        acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(d1, d1));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(acc0, acc1));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* One row x [D] into codes (strided by sd) and its scale. */
static void quantize_row(const float *x, int64_t D, int fp8, uint8_t *codes, int64_t sd, float *scale) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
    if (!fp8) {
        const float s = amax / 127.0f, div = s > 1e-30f ? s : 1e-30f;
        for (int64_t d = 0; d < D; d++) {
            float y = x[d] / div;
            y = y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y);
            codes[d * sd] = (uint8_t)(int8_t)rintf(y);
        }
        *scale = s;
        return;
    }
    const float base = amax / 448.0f;
    double best = INFINITY;
    float s = base;
    for (int j = 0; j < 16; j++) {
        const float sj = base * (1.0f + (float)j / 16.0f), div = sj > 1e-30f ? sj : 1e-30f;
        const double err = D % 8 == 0 ? fp8_error8(x, D, sj, div) : fp8_error(x, D, sj, div);
        if (err < best) { best = err; s = sj; }
    }
    const float div = s > 1e-30f ? s : 1e-30f;
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / div, val;
        y = y < -448.0f ? -448.0f : (y > 448.0f ? 448.0f : y);
        codes[d * sd] = round_e4m3(y, &val);
    }
    *scale = s;
}

/* Token t's K and V rows (src_k[t], src_v[t]: [heads, D] with row strides k_stride, v_stride
 * elements, head stride D) into slot slots[t] of the view; slot -1 (padding) is skipped. Slots
 * must be distinct (rows are written in parallel). */
void paged_write_kv8(const float *src_k, const float *src_v, int64_t T, int64_t heads, int64_t D,
                     int64_t k_stride, int64_t v_stride, const Kv8View *c, const int64_t *slots,
                     int64_t block_size, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * heads >= 64)
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        const int64_t b = slots[t] / block_size, o = slots[t] % block_size;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t srow = b * c->ssb + o * c->sst + h * c->ssh;
            quantize_row(src_k + t * k_stride + h * D, D, (int)c->fp8,
                         (uint8_t *)c->k + b * c->ksb + o * c->kst + h * c->ksh, c->ksd,
                         (float *)c->k_scale + srow);
            quantize_row(src_v + t * v_stride + h * D, D, (int)c->fp8,
                         (uint8_t *)c->v + b * c->vsb + o * c->vst + h * c->vsh, c->vsd,
                         (float *)c->v_scale + srow);
        }
    }
}

typedef struct { float *scores, *acc, *mx, *sum; } RowsState; /* paged_attention.c */
RowsState rows_state(int64_t group, int64_t D, int64_t rows);
void attend_rows(const float *qs, int64_t group, int64_t D, const float *k, const float *v, int64_t st,
                 int64_t rows, float scale, RowsState *state);
void finish_rows(const RowsState *state, int64_t group, int64_t D, float *out);

/* Rows t0 .. t1-1 (offsets in one block) of one head of K or V, dequantized into out [rows, D]. */
static void dequantize_rows(const uint8_t *base, int64_t st, int64_t sd, const float *scale, int64_t sst,
                            int64_t o0, int64_t o1, int64_t D, int fp8, float *out) {
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = base + o * st;
        const float s = scale[o * sst];
        float *dst = out + (o - o0) * D;
        if (fp8)
            for (int64_t d = 0; d < D; d++) dst[d] = E4M3[row[d * sd]] * s;
        else
            for (int64_t d = 0; d < D; d++) dst[d] = (float)(int8_t)row[d * sd] * s;
    }
}

/* Decode attention (one query per sequence, q and out [nseq, nh, D] contiguous, D a multiple of
 * 8) over an 8-bit cache: keys at positions max(0, len - window) .. len - 1 (window 0: all).
 * Only rows below each sequence's length are read (and only blocks its table names there). */
void paged_decode_attention_kv8(const float *q, int64_t nseq, int64_t nh, int64_t nkv, int64_t D,
                                const Kv8View *c, const int32_t *tables, int64_t table_stride,
                                const int32_t *seq_lens, int64_t block_size, int64_t window, float scale,
                                float *out, int nthreads) {
    e4m3_init();
    const int64_t group = nh / nkv;
    const int fp8 = (int)c->fp8;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t job = 0; job < nseq * nkv; job++) {
        const int64_t s = job / nkv, g = job % nkv;
        const int64_t len = seq_lens[s];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        float *kf = malloc(sizeof(float) * block_size * D * 2), *vf = kf + block_size * D;
        RowsState state = rows_state(group, D, block_size);
        const float *qs = q + (s * nh + g * group) * D;
        for (int64_t t0 = start; t0 < len;) {
            const int64_t b = t0 / block_size;
            const int64_t t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;
            const int64_t blk = tables[s * table_stride + b], o0 = t0 % block_size, o1 = o0 + (t1 - t0);
            const float *srow = c->k_scale + blk * c->ssb + g * c->ssh;
            dequantize_rows((const uint8_t *)c->k + blk * c->ksb + g * c->ksh, c->kst, c->ksd, srow, c->sst,
                            o0, o1, D, fp8, kf);
            dequantize_rows((const uint8_t *)c->v + blk * c->vsb + g * c->vsh, c->vst, c->vsd,
                            c->v_scale + blk * c->ssb + g * c->ssh, c->sst, o0, o1, D, fp8, vf);
            attend_rows(qs, group, D, kf, vf, D, t1 - t0, scale, &state);
            t0 = t1;
        }
        finish_rows(&state, group, D, out + (s * nh + g * group) * D);
        free(kf);
        free(state.scores);
    }
}
