/* A Llama-style decoder stack in one call, for the CPU fast path (tokenwire.kernels.fused_layers
 * builds the operator and says which models it serves): RMSNorm, the VNNI int4 / int8 linears
 * of vnni_matmul.c, rotary, the paged KV-cache write and causal attention over the paged cache,
 * SwiGLU and the residual stream, all on float32 buffers with no dispatcher call between them.
 *
 * Every token row is computed on its own: norms, rotary and activations per row, attention of
 * one row over its own keys [0, position] in one fixed order (one thread per (row, KV head)),
 * and the linears batch invariant (vnni_matmul.c). So a row's bits depend on its sequence
 * alone: not on the other rows, their count or the thread count. Rows whose slot is -1 are
 * padding: nothing is stored for them and their output is zero.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

typedef struct {
  int64_t tokens, hidden, inter, heads, kv_heads, head_dim, block_size, max_blocks;
  float eps, scale;
  int threads;
} FusedDims;

typedef struct {  /* one weight of vnni_matmul.c: mode 4 (int4) or 16 (int8 "k") */
  int mode;
  const uint8_t* w;
  const void* d;
  const void* mn;  /* NULL: none (mode 16 only) */
  int64_t n16;     /* its output columns (padded to 16) */
} QPart;

typedef struct {  /* one linear: up to two parts side by side along the output (Q4_K_M's q/k
                     int4 beside its v int8), each a whole number of 16-column tiles */
  QPart parts[2];
  int nparts;
  int64_t n16;  /* output row stride: the parts' columns together */
} QLinear;

typedef struct {
  const float* in_norm;
  const float* post_norm;
  QLinear qkv, o, gate_up, down;
  float* k_cache; /* [blocks, block_size, kv_heads, head_dim] */
  float* v_cache;
} FusedLayer;

typedef struct {  /* per-call buffers, [tokens, width] each */
  float* residual; /* hidden */
  float* x;        /* hidden: the normed input of a linear */
  float* qkv;      /* qkv.n16 */
  float* attn;     /* heads * head_dim */
  float* proj;     /* max(o.n16, down.n16) */
  float* gu;       /* gate_up.n16 */
  float* act;      /* inter */
  void* quant;     /* vnni_matmul.c's scratch for the widest K */
  float* scores;   /* threads x (heads / kv_heads) x max positions */
  int64_t scores_per_thread;
} FusedBuffers;

static float sum_squares(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float total = _mm512_reduce_add_ps(acc);
  for (; i < n; i++) total += x[i] * x[i];
  return total;
}

/* out = w * (x * rsqrt(mean(x^2) + eps)), as HF's LlamaRMSNorm in float32. */
static void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float r = 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* residual += add (unless add is NULL), then x = rms_norm(residual); rows of padding too. */
static void add_norm_rows(float* residual, const float* add, int64_t add_stride,
                          const float* w, const FusedDims* dm, float* x) {
  const int64_t n = dm->hidden;
#pragma omp parallel for num_threads(dm->threads) if (dm->tokens >= 16) schedule(static)
  for (int64_t t = 0; t < dm->tokens; t++) {
    float* r = residual + t * n;
    if (add != NULL)
      for (int64_t i = 0; i < n; i++) r[i] += add[t * add_stride + i];
    rms_norm_row(r, w, dm->eps, n, x + t * n);
  }
}

/* HF's rotate_half rotary on the q and k heads of every row, in place. cos_sin: [pos, D]
 * with cos in [:D/2] and sin in [D/2:]. */
static void rotary_rows(float* qkv, int64_t stride, const int64_t* positions,
                        const float* cos_sin, const FusedDims* dm) {
  const int64_t d = dm->head_dim, half = d / 2, rot_heads = dm->heads + dm->kv_heads;
  for (int64_t t = 0; t < dm->tokens; t++) {
    const float* c = cos_sin + positions[t] * d;
    const float* s = c + half;
    for (int64_t h = 0; h < rot_heads; h++) {
      float* v = qkv + t * stride + h * d;
      for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + -b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

/* Row t's K and V (after rotary) into its cache slot. */
static void store_rows(const float* qkv, int64_t stride, const int64_t* slots,
                       const FusedDims* dm, float* k_cache, float* v_cache) {
  const int64_t width = dm->kv_heads * dm->head_dim, q_size = dm->heads * dm->head_dim;
  for (int64_t t = 0; t < dm->tokens; t++) {
    if (slots[t] < 0) continue;
    memcpy(k_cache + slots[t] * width, qkv + t * stride + q_size, width * sizeof(float));
    memcpy(v_cache + slots[t] * width, qkv + t * stride + q_size + width, width * sizeof(float));
  }
}

static inline float dot_head(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

/* One row, one KV head: its query heads over keys [0, n_keys) of the row's block table. */
static void attend_one(const float* q, const int32_t* table, int64_t n_keys, int64_t g,
                       const float* k_cache, const float* v_cache, const FusedDims* dm,
                       float* scores, float* out) {
  const int64_t d = dm->head_dim, group = dm->heads / dm->kv_heads;
  const int64_t width = dm->kv_heads * d, bs = dm->block_size;
  for (int64_t j = 0; j < n_keys; j++) {
    const float* k = k_cache + ((int64_t)table[j / bs] * bs + j % bs) * width + g * d;
    for (int64_t h = 0; h < group; h++) scores[h * n_keys + j] = dot_head(q + h * d, k, d) * dm->scale;
  }
  for (int64_t h = 0; h < group; h++) {
    float* sc = scores + h * n_keys;
    float mx = sc[0], total = 0.0f;
    for (int64_t j = 1; j < n_keys; j++) mx = sc[j] > mx ? sc[j] : mx;
    for (int64_t j = 0; j < n_keys; j++) {
      sc[j] = expf(sc[j] - mx);
      total += sc[j];
    }
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < n_keys; j++) sc[j] *= inv;
  }
  for (int64_t h = 0; h < group; h++) memset(out + h * d, 0, d * sizeof(float));
  for (int64_t j = 0; j < n_keys; j++) {
    const float* v = v_cache + ((int64_t)table[j / bs] * bs + j % bs) * width + g * d;
    for (int64_t h = 0; h < group; h++) {
      const __m512 p = _mm512_set1_ps(scores[h * n_keys + j]);
      for (int64_t i = 0; i < d; i += 16) {
        float* o = out + h * d + i;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(p, _mm512_loadu_ps(v + i), _mm512_loadu_ps(o)));
      }
    }
  }
}

/* Every row's attention: row t (of sequence row_seq[t]) sees positions [0, positions[t]]. */
static void attend_rows(const float* qkv, int64_t stride, const int64_t* positions,
                        const int64_t* slots, const int32_t* row_seq, const int32_t* tables,
                        const FusedLayer* layer, const FusedDims* dm, FusedBuffers* buf) {
  const int64_t items = dm->tokens * dm->kv_heads, group = dm->heads / dm->kv_heads;
  const int64_t d = dm->head_dim, q_width = dm->heads * d;
#pragma omp parallel for num_threads(dm->threads) schedule(static)
  for (int64_t item = 0; item < items; item++) {
    const int64_t t = item / dm->kv_heads, g = item % dm->kv_heads;
    float* out = buf->attn + t * q_width + g * group * d;
    if (slots[t] < 0) {
      memset(out, 0, group * d * sizeof(float));
      continue;
    }
    float* scores = buf->scores + omp_get_thread_num() * buf->scores_per_thread;
    const int32_t* table = tables + (int64_t)row_seq[t] * dm->max_blocks;
    attend_one(qkv + t * stride + g * group * d, table, positions[t] + 1, g, layer->k_cache,
               layer->v_cache, dm, scores, out);
  }
}

/* act = silu(gate) * up, as HF's LlamaMLP (silu(x) = x / (1 + exp(-x))). */
static void silu_and_mul_rows(const float* gu, int64_t stride, const FusedDims* dm, float* act) {
  const int64_t n = dm->inter;
#pragma omp parallel for num_threads(dm->threads) if (dm->tokens >= 16) schedule(static)
  for (int64_t t = 0; t < dm->tokens; t++) {
    const float* gate = gu + t * stride;
    for (int64_t i = 0; i < n; i++) {
      const float x = gate[i];
      act[t * n + i] = x / (1.0f + expf(-x)) * gate[n + i];
    }
  }
}

static void linear(const QLinear* lin, const float* x, int64_t k, const FusedDims* dm,
                   float* y, void* quant) {
  const int halves = lin->parts[0].mode == 16 || (lin->nparts > 1 && lin->parts[1].mode == 16);
  const QuantX qx = tw_vnni_quantize(x, dm->tokens, k, quant, halves);
  int64_t col = 0;
  for (int i = 0; i < lin->nparts; i++) {
    const QPart* p = &lin->parts[i];
    tw_vnni_tiles(p->mode, qx, dm->tokens, k, p->w, p->d, p->mn, p->n16, y + col, lin->n16,
                  dm->threads);
    col += p->n16;
  }
}

/* One decoder layer: residual (and the previous layer's MLP output in buf->proj, unless
 * first) -> this layer's MLP output in buf->proj, the residual updated. */
static void fused_layer(const FusedLayer* layer, int first, const int64_t* positions,
                        const int64_t* slots, const int32_t* row_seq, const int32_t* tables,
                        const float* cos_sin, const FusedDims* dm, FusedBuffers* buf) {
  const int64_t q_width = dm->heads * dm->head_dim;
  add_norm_rows(buf->residual, first ? NULL : buf->proj, layer->down.n16, layer->in_norm, dm,
                buf->x);
  linear(&layer->qkv, buf->x, dm->hidden, dm, buf->qkv, buf->quant);
  rotary_rows(buf->qkv, layer->qkv.n16, positions, cos_sin, dm);
  store_rows(buf->qkv, layer->qkv.n16, slots, dm, layer->k_cache, layer->v_cache);
  attend_rows(buf->qkv, layer->qkv.n16, positions, slots, row_seq, tables, layer, dm, buf);
  linear(&layer->o, buf->attn, q_width, dm, buf->proj, buf->quant);
  add_norm_rows(buf->residual, buf->proj, layer->o.n16, layer->post_norm, dm, buf->x);
  linear(&layer->gate_up, buf->x, dm->hidden, dm, buf->gu, buf->quant);
  silu_and_mul_rows(buf->gu, layer->gate_up.n16, dm, buf->act);
  linear(&layer->down, buf->act, dm->inter, dm, buf->proj, buf->quant);
}
