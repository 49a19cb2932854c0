/* A Llama decoder's layers for a step of decodes in one call: per layer the same kernels, in the
 * same order and on the same float32 values, as the Python path calls one by one (norms and
 * rotary of elementwise.c, block-weight products of quant_matmul.c, the cache write and the
 * decode attention of paged_attention.c), and SiLU-and-multiply as torch defines it
 * (gate / (1 + exp(-gate)) * up). A layer whose cache is 8-bit (``kv8`` set) writes and attends
 * through paged_kv8.c instead. Built with -ffp-contract=off like the others.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

void rms_norm(const float *x, const float *res, float *res_out, const float *weight, float eps,
              float *out, int64_t rows, int64_t dim, int nthreads);
void rotary(const float *x, int64_t T, int64_t heads, int64_t D, int64_t xs,
            const int64_t *positions, const float *cos, const float *sin, float *out);
void paged_decode_attention(const float *q, int64_t nseq, int64_t nh, int64_t nkv, int64_t D,
                            const float *kc, const float *vc, int64_t sb, int64_t st, int64_t sh,
                            const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                            int64_t block_size, int64_t window, float scale, float *out, int nthreads);
void paged_write(const float *src, int64_t T, int64_t heads, int64_t D, int64_t src_stride,
                 float *cache, int64_t sb, int64_t st, int64_t sh, const int64_t *slots,
                 int64_t block_size);
typedef struct Kv8View Kv8View; /* paged_kv8.c */
void paged_write_kv8(const float *src_k, const float *src_v, int64_t T, int64_t heads, int64_t D,
                     int64_t k_stride, int64_t v_stride, const Kv8View *c, const int64_t *slots,
                     int64_t block_size, int nthreads);
void paged_decode_attention_kv8(const float *q, int64_t nseq, int64_t nh, int64_t nkv, int64_t D,
                                const Kv8View *c, const int32_t *tables, int64_t table_stride,
                                const int32_t *seq_lens, int64_t block_size, int64_t window, float scale,
                                float *out, int nthreads);
void u4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d,
               const float *m, int64_t N, float *out, int nthreads);
void i8_matmul(const float *x, int64_t M, int64_t K, const int8_t *q, const float *d,
               int64_t N, float *out, int nthreads);

/* A block-quantized weight [n, k]: u4 form when m is not null, else i8. */
typedef struct {
    const void *q;
    const float *d;
    const float *m;
    int64_t n;
} BlockWeight;

typedef struct {
    BlockWeight qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    float *k_cache, *v_cache;
    int64_t window;     /* 0: none */
    const Kv8View *kv8; /* an 8-bit cache (k_cache, v_cache unused), or null */
} DecodeLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    int64_t block_size, cache_sb, cache_st, cache_sh, table_stride;
    float eps, scale;
} DecodeShape;

static void product(const BlockWeight *w, const float *x, int64_t M, int64_t K, float *out, int threads) {
    if (w->m)
        u4_matmul(x, M, K, (const uint8_t *)w->q, w->d, w->m, w->n, out, threads);
    else
        i8_matmul(x, M, K, (const int8_t *)w->q, w->d, w->n, out, threads);
}

/* x [M, hidden]: the embeddings in; the last layer's MLP output out. residual [M, hidden]: the
 * residual stream before that output (the final norm adds them). scratch: at least
 * M * (2 hidden + 2 (q + kv) + 2 q + 3 intermediate) floats. Only safe while the blocks of
 * tables are referenced and the slots belong to blocks only these sequences write. */
void llama_decode_layers(const DecodeLayer *layers, int64_t num_layers, const DecodeShape *s,
                         float *x, float *residual, int64_t M, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, const int32_t *seq_lens,
                         const float *cos, const float *sin, float *scratch, int threads) {
    const int64_t H = s->hidden, D = s->head_dim, qn = s->heads * D, kvn = s->kv_heads * D;
    const int64_t qkvn = qn + 2 * kvn, I = s->intermediate;
    float *h = scratch, *qkv = h + M * H, *qr = qkv + M * qkvn, *kr = qr + M * qn, *attn = kr + M * kvn;
    float *gu = attn + M * qn, *act = gu + M * 2 * I;
    for (int64_t l = 0; l < num_layers; l++) {
        const DecodeLayer *L = layers + l;
        if (l == 0) {
            memcpy(residual, x, sizeof(float) * M * H);
            rms_norm(x, 0, 0, L->input_norm, s->eps, h, M, H, threads);
        } else {
            rms_norm(x, residual, residual, L->input_norm, s->eps, h, M, H, threads);
        }
        product(&L->qkv, h, M, H, qkv, threads);
        rotary(qkv, M, s->heads, D, qkvn, positions, cos, sin, qr);
        rotary(qkv + qn, M, s->kv_heads, D, qkvn, positions, cos, sin, kr);
        if (L->kv8) {
            paged_write_kv8(kr, qkv + qn + kvn, M, s->kv_heads, D, kvn, qkvn, L->kv8, slots, s->block_size,
                            threads);
            paged_decode_attention_kv8(qr, M, s->heads, s->kv_heads, D, L->kv8, tables, s->table_stride,
                                       seq_lens, s->block_size, L->window, s->scale, attn, threads);
        } else {
            paged_write(kr, M, s->kv_heads, D, kvn, L->k_cache, s->cache_sb, s->cache_st, s->cache_sh, slots,
                        s->block_size);
            paged_write(qkv + qn + kvn, M, s->kv_heads, D, qkvn, L->v_cache, s->cache_sb, s->cache_st,
                        s->cache_sh, slots, s->block_size);
            paged_decode_attention(qr, M, s->heads, s->kv_heads, D, L->k_cache, L->v_cache, s->cache_sb,
                                   s->cache_st, s->cache_sh, tables, s->table_stride, seq_lens, s->block_size,
                                   L->window, s->scale, attn, threads);
        }
        product(&L->o, attn, M, qn, x, threads);
        rms_norm(x, residual, residual, L->post_norm, s->eps, h, M, H, threads);
        product(&L->gate_up, h, M, H, gu, threads);
        for (int64_t r = 0; r < M; r++) {
            const float *g = gu + r * 2 * I, *u = g + I;
            float *a = act + r * I;
            for (int64_t j = 0; j < I; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
        }
        product(&L->down, act, M, I, x, threads);
    }
}
