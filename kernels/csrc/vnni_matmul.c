/* Weight-quantized CPU matmuls on AVX-512 VNNI (tokenwire.kernels.vnni_matmul builds and loads
 * this file; see that module for the layouts, the exactness and the measurements).
 *
 * y[M, N16] = x[M, K] @ W.T, W quantized per 32-element block along K, tiles of 16 rows:
 *   int4: W = d * code + mn, code in [0, 16): w4 [N16/16][K/8][64] bytes, byte 4r+j of k-group
 *         g holds row r's code of element 8g+j (low nibble) and 8g+4+j (high nibble);
 *   int8: W = d * code, code in [-128, 128) stored + 128: w8 [N16/16][K/4][64] bytes, byte
 *         4r+j of group g holds row r's element 4g+j;
 *   d, mn: fp16 [N16/16][K/32][16];
 *   int8 "k" (mode 16, GGUF Q8_0 / Q5_K / Q6_K kept exactly): W = d * code (+ mn), codes as
 *         int8's, d float32 per 16 elements [N16/16][K/16][16], mn float32 per 32 elements
 *         [N16/16][K/32][16] or absent (NULL).
 * x is quantized per 32-element block in two int8 parts, x ~ dx * (q1 + q2 / 254) with
 * dx = amax / 127: q1 as llama.cpp's Q8_1 (round to nearest even), q2 the rounded residual,
 * so x keeps ~15 bits against its block's largest value (more than bf16's 8). Every output
 * element is one fixed chain of operations over K, whatever M, the other rows and the thread
 * count: batch invariant.
 */
#include <immintrin.h>
#include <stdint.h>

#define RESIDUAL 254.0f

typedef struct {
  int8_t* q;    /* [M, K] q1 */
  int8_t* r;    /* [M, K] q2 (the residual) */
  float* d;     /* [M, K/32] scale */
  float* s;     /* [M, K/32] sum of the block's x (int4: the mn term) */
  int32_t* qs;  /* [M, K/32] sum of the block's q1 (int8: the +128 offset) */
  int32_t* rs;  /* [M, K/32] sum of the block's q2 */
  int32_t* qs16; /* [M, K/16] sum of each half block's q1 (mode 16's +128 offset) */
  int32_t* rs16; /* [M, K/16] sum of each half block's q2 */
} QuantX;

/* Bytes of scratch one call needs for M rows of K. */
static inline int64_t tw_vnni_scratch_bytes(int64_t m_rows, int64_t k) {
  return 2 * m_rows * k + 32 * m_rows * (k / 32);
}

/* halves: also each half block's sums (mode 16 only; the int4 / int8 paths skip them). */
static void quantize_rows(const float* x, int64_t m_rows, int64_t k, QuantX qx, int halves) {
  const int64_t nb = k / 32;
  for (int64_t m = 0; m < m_rows; m++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + m * k + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512 t0 = _mm512_mul_ps(v0, inv), t1 = _mm512_mul_ps(v1, inv);
      const __m512i i0 = _mm512_cvtps_epi32(t0), i1 = _mm512_cvtps_epi32(t1);
      const __m512 res = _mm512_set1_ps(RESIDUAL);
      const __m512i j0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t0, _mm512_cvtepi32_ps(i0)), res));
      const __m512i j1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t1, _mm512_cvtepi32_ps(i1)), res));
      _mm_storeu_si128((__m128i*)(qx.q + m * k + b * 32), _mm512_cvtsepi32_epi8(i0));
      _mm_storeu_si128((__m128i*)(qx.q + m * k + b * 32 + 16), _mm512_cvtsepi32_epi8(i1));
      _mm_storeu_si128((__m128i*)(qx.r + m * k + b * 32), _mm512_cvtsepi32_epi8(j0));
      _mm_storeu_si128((__m128i*)(qx.r + m * k + b * 32 + 16), _mm512_cvtsepi32_epi8(j1));
      qx.d[m * nb + b] = amax / 127.0f;
      qx.s[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      qx.qs[m * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
      qx.rs[m * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(j0, j1));
      if (!halves) continue;
      qx.qs16[m * 2 * nb + 2 * b] = _mm512_reduce_add_epi32(i0);
      qx.qs16[m * 2 * nb + 2 * b + 1] = _mm512_reduce_add_epi32(i1);
      qx.rs16[m * 2 * nb + 2 * b] = _mm512_reduce_add_epi32(j0);
      qx.rs16[m * 2 * nb + 2 * b + 1] = _mm512_reduce_add_epi32(j1);
    }
  }
}

/* One row of x against one 16-row tile over one 32-element block of int4 codes. */
static inline __m512 int4_block(const __m512i* lo, const __m512i* hi, const int8_t* q,
                                const int8_t* r, __m512 dv, __m512 mv, float dx, float sx,
                                __m512 acc) {
  __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
  __m512i ra = _mm512_setzero_si512(), rb = _mm512_setzero_si512();
  for (int g = 0; g < 4; g++) {
    ia = _mm512_dpbusd_epi32(ia, lo[g], _mm512_set1_epi32(*(const int32_t*)(q + 8 * g)));
    ib = _mm512_dpbusd_epi32(ib, hi[g], _mm512_set1_epi32(*(const int32_t*)(q + 8 * g + 4)));
    ra = _mm512_dpbusd_epi32(ra, lo[g], _mm512_set1_epi32(*(const int32_t*)(r + 8 * g)));
    rb = _mm512_dpbusd_epi32(rb, hi[g], _mm512_set1_epi32(*(const int32_t*)(r + 8 * g + 4)));
  }
  const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(dx));
  const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib));
  const __m512 rdot = _mm512_cvtepi32_ps(_mm512_add_epi32(ra, rb));
  const __m512 both = _mm512_fmadd_ps(rdot, _mm512_set1_ps(1.0f / RESIDUAL), dot);
  acc = _mm512_fmadd_ps(both, scale, acc);
  return _mm512_fmadd_ps(mv, _mm512_set1_ps(sx), acc);
}

/* Rows m0 .. m0+count-1 (count <= 4) of x against tile t of the int4 weight. */
static void int4_tile(const uint8_t* wt, const uint16_t* dt, const uint16_t* mt, int64_t k,
                      QuantX qx, int64_t m0, int64_t count, float* y, int64_t ldy, int64_t t) {
  const int64_t nb = k / 32;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (int64_t b = 0; b < nb; b++) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dt + b * 16)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mt + b * 16)));
    __m512i lo[4], hi[4];
    for (int g = 0; g < 4; g++) {
      const __m512i v = _mm512_loadu_si512((const void*)(wt + (b * 4 + g) * 64));
      lo[g] = _mm512_and_si512(v, mask);
      hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
    for (int64_t i = 0; i < count; i++) {
      const int64_t m = m0 + i;
      acc[i] = int4_block(lo, hi, qx.q + m * k + b * 32, qx.r + m * k + b * 32, dv, mv,
                          qx.d[m * nb + b], qx.s[m * nb + b], acc[i]);
    }
  }
  for (int64_t i = 0; i < count; i++) _mm512_storeu_ps(y + (m0 + i) * ldy + t * 16, acc[i]);
}

/* Rows m0 .. m0+count-1 (count <= 4) of x against tile t of the int8 weight. */
static void int8_tile(const uint8_t* wt, const uint16_t* dt, int64_t k, QuantX qx, int64_t m0,
                      int64_t count, float* y, int64_t ldy, int64_t t) {
  const int64_t nb = k / 32;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (int64_t b = 0; b < nb; b++) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dt + b * 16)));
    __m512i wv[8];
    for (int g = 0; g < 8; g++) wv[g] = _mm512_loadu_si512((const void*)(wt + (b * 8 + g) * 64));
    for (int64_t i = 0; i < count; i++) {
      const int64_t m = m0 + i;
      const int8_t* q = qx.q + m * k + b * 32;
      const int8_t* r = qx.r + m * k + b * 32;
      __m512i ia = _mm512_setzero_si512(), ra = _mm512_setzero_si512();
      for (int g = 0; g < 8; g++) {
        ia = _mm512_dpbusd_epi32(ia, wv[g], _mm512_set1_epi32(*(const int32_t*)(q + 4 * g)));
        ra = _mm512_dpbusd_epi32(ra, wv[g], _mm512_set1_epi32(*(const int32_t*)(r + 4 * g)));
      }
      const __m512i dot = _mm512_sub_epi32(ia, _mm512_set1_epi32(128 * qx.qs[m * nb + b]));
      const __m512i rdot = _mm512_sub_epi32(ra, _mm512_set1_epi32(128 * qx.rs[m * nb + b]));
      const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rdot), _mm512_set1_ps(1.0f / RESIDUAL),
                                          _mm512_cvtepi32_ps(dot));
      const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(qx.d[m * nb + b]));
      acc[i] = _mm512_fmadd_ps(both, scale, acc[i]);
    }
  }
  for (int64_t i = 0; i < count; i++) _mm512_storeu_ps(y + (m0 + i) * ldy + t * 16, acc[i]);
}

/* One half block (16 elements, k-groups g0 .. g0+3) of one row of mode 16: the integer dots
 * less the +128 offset, q2's scaled by 1/254 and added to q1's. */
static inline __m512 int8k_half(const __m512i* wv, int g0, const int8_t* q, const int8_t* r,
                                int32_t qsum, int32_t rsum) {
  __m512i ia = _mm512_setzero_si512(), ra = _mm512_setzero_si512();
  for (int g = g0; g < g0 + 4; g++) {
    ia = _mm512_dpbusd_epi32(ia, wv[g], _mm512_set1_epi32(*(const int32_t*)(q + 4 * g)));
    ra = _mm512_dpbusd_epi32(ra, wv[g], _mm512_set1_epi32(*(const int32_t*)(r + 4 * g)));
  }
  const __m512i dot = _mm512_sub_epi32(ia, _mm512_set1_epi32(128 * qsum));
  const __m512i rdot = _mm512_sub_epi32(ra, _mm512_set1_epi32(128 * rsum));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(rdot), _mm512_set1_ps(1.0f / RESIDUAL),
                         _mm512_cvtepi32_ps(dot));
}

/* Rows m0 .. m0+count-1 (count <= 4) of x against tile t of a mode-16 int8 weight (float32
 * scales per 16 elements, float32 minimums per 32 or none). */
static void int8k_tile(const uint8_t* wt, const float* dt, const float* mt, int64_t k, QuantX qx,
                       int64_t m0, int64_t count, float* y, int64_t ldy, int64_t t) {
  const int64_t nb = k / 32;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (int64_t b = 0; b < nb; b++) {
    const __m512 d0 = _mm512_loadu_ps(dt + 2 * b * 16), d1 = _mm512_loadu_ps(dt + (2 * b + 1) * 16);
    __m512i wv[8];
    for (int g = 0; g < 8; g++) wv[g] = _mm512_loadu_si512((const void*)(wt + (b * 8 + g) * 64));
    for (int64_t i = 0; i < count; i++) {
      const int64_t m = m0 + i, h = m * 2 * nb + 2 * b;
      const int8_t* q = qx.q + m * k + b * 32;
      const int8_t* r = qx.r + m * k + b * 32;
      const __m512 dx = _mm512_set1_ps(qx.d[m * nb + b]);
      const __m512 lo = int8k_half(wv, 0, q, r, qx.qs16[h], qx.rs16[h]);
      const __m512 hi = int8k_half(wv, 4, q, r, qx.qs16[h + 1], qx.rs16[h + 1]);
      acc[i] = _mm512_fmadd_ps(lo, _mm512_mul_ps(d0, dx), acc[i]);
      acc[i] = _mm512_fmadd_ps(hi, _mm512_mul_ps(d1, dx), acc[i]);
      if (mt != NULL)
        acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(mt + b * 16), _mm512_set1_ps(qx.s[m * nb + b]), acc[i]);
    }
  }
  for (int64_t i = 0; i < count; i++) _mm512_storeu_ps(y + (m0 + i) * ldy + t * 16, acc[i]);
}

/* x's rows quantized into scratch (tw_vnni_scratch_bytes(M, K) bytes); halves: for mode 16. */
static QuantX tw_vnni_quantize(const float* x, int64_t m_rows, int64_t k, void* scratch,
                               int halves) {
  const int64_t nb = k / 32;
  QuantX qx;
  qx.q = (int8_t*)scratch;
  qx.r = qx.q + m_rows * k;
  qx.d = (float*)(qx.r + m_rows * k);
  qx.s = qx.d + m_rows * nb;
  qx.qs = (int32_t*)(qx.s + m_rows * nb);
  qx.rs = qx.qs + m_rows * nb;
  qx.qs16 = qx.rs + m_rows * nb;
  qx.rs16 = qx.qs16 + 2 * m_rows * nb;
  quantize_rows(x, m_rows, k, qx, halves);
  return qx;
}

/* y[m, 16t ..] (row stride ldy) for every tile t of one weight against quantized rows.
 * mode: 4 (w4, fp16 d, mn), 8 (w8, fp16 d; mn unused) or 16 (w8, float32 d, mn or NULL). */
static void tw_vnni_tiles(int mode, QuantX qx, int64_t m_rows, int64_t k, const uint8_t* w,
                          const void* d, const void* mn, int64_t n16, float* y, int64_t ldy,
                          int threads) {
  const int64_t nb = k / 32, tiles = n16 / 16;
  const int64_t wbytes = mode == 4 ? k * 8 : k * 16; /* bytes per tile */
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t t = 0; t < tiles; t++) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += 4) {
      const int64_t count = m_rows - m0 < 4 ? m_rows - m0 : 4;
      if (mode == 4)
        int4_tile(w + t * wbytes, (const uint16_t*)d + t * nb * 16,
                  (const uint16_t*)mn + t * nb * 16, k, qx, m0, count, y, ldy, t);
      else if (mode == 8)
        int8_tile(w + t * wbytes, (const uint16_t*)d + t * nb * 16, k, qx, m0, count, y, ldy, t);
      else
        int8k_tile(w + t * wbytes, (const float*)d + t * nb * 32,
                   mn == NULL ? NULL : (const float*)mn + t * nb * 16, k, qx, m0, count, y, ldy, t);
    }
  }
}

/* One weight: x quantized into scratch, then its tiles (y's row stride n16). */
static void tw_vnni_matmul(int mode, const float* x, int64_t m_rows, int64_t k, const uint8_t* w,
                           const void* d, const void* mn, int64_t n16, float* y, void* scratch,
                           int threads) {
  const QuantX qx = tw_vnni_quantize(x, m_rows, k, scratch, mode == 16);
  tw_vnni_tiles(mode, qx, m_rows, k, w, d, mn, n16, y, n16, threads);
}
