/* The decoder's small float32 operations on CPUs, one call per layer instead of several torch
 * operations. Built with -ffp-contract=off: the same roundings as the torch definitions in
 * kvos/models/ops.py (rotary bit for bit; the norm's mean of squares summed in another order).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* With res != 0: x += res (written back to res_out). out = weight * (x * rsqrt(mean(x^2) + eps)).
 * x, res, res_out, out: [rows, dim] contiguous; res_out may alias res. */
void rms_norm(const float *x, const float *res, float *res_out, const float *weight, float eps,
              float *out, int64_t rows, int64_t dim, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        if (res) {
            float *ro = res_out + r * dim;
            const float *rr = res + r * dim;
            for (int64_t i = 0; i < dim; i++) ro[i] = xr[i] + rr[i];
            xr = ro;
        }
        double ss = 0.0;
        for (int64_t i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
        const float mean = (float)(ss / dim);
        const float inv = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* Rotate-half rotary embedding: x [T, heads, D] (row stride xs elements, head stride D) into
 * out [T, heads, D] contiguous: for i < D/2, (a, b) = (x[i], x[i + D/2]) becomes
 * (a * c[i] + (-b) * s[i], b * c[i + D/2] + a * s[i + D/2]); c, s: [max_pos, D] by position. */
void rotary(const float *x, int64_t T, int64_t heads, int64_t D, int64_t xs,
            const int64_t *positions, const float *cos, const float *sin, float *out) {
    const int64_t h = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int64_t k = 0; k < heads; k++) {
            const float *v = x + t * xs + k * D;
            float *o = out + (t * heads + k) * D;
            for (int64_t i = 0; i < h; i++) {
                const float a = v[i], b = v[i + h];
                o[i] = a * c[i] + (-b) * s[i];
                o[i + h] = b * c[i + h] + a * s[i + h];
            }
        }
    }
}
