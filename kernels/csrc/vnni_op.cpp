// The torch operators over vnni_matmul.c and fused_layers.c (tokenwire.kernels.vnni_matmul and
// tokenwire.kernels.fused_layers load them; one dispatcher call each, eager and compiled):
//   tokenwire_vnni::matmul        one int4 / int8 weight-quantized linear;
//   tokenwire_vnni::fused_layers  a whole Llama-style decoder stack of int4 / int8 linears.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "vnni_matmul.c"
#include "fused_layers.c"

namespace {

at::Tensor vnni_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t bits, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tokenwire_vnni::matmul: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16,
              "tokenwire_vnni::matmul: bits must be 4, 8 or 16 (int8 with float32 scales)");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "tokenwire_vnni::matmul: K must be a multiple of 32");
  const int64_t n16 = bits == 4 ? weight.numel() * 2 / k : weight.numel() / k;
  const int64_t groups = bits == 16 ? k / 16 : k / 32;
  const bool no_mins = bits == 16 && mins.numel() == 0;
  TORCH_CHECK(n16 % 16 == 0 && n16 >= out_features && scales.numel() == n16 * groups &&
                  (bits != 16 || no_mins || mins.numel() == n16 * (k / 32)),
              "tokenwire_vnni::matmul: weight / scales do not match x's K");
  TORCH_CHECK(bits != 16 || (scales.scalar_type() == at::kFloat &&
                             (no_mins || mins.scalar_type() == at::kFloat)),
              "tokenwire_vnni::matmul: bits 16 takes float32 scales and minimums");
  at::Tensor y = at::empty({rows, n16}, x.options());
  if (rows > 0) {
    at::Tensor scratch = at::empty({tw_vnni_scratch_bytes(rows, k)}, x.options().dtype(at::kByte));
    tw_vnni_matmul(static_cast<int>(bits), x.data_ptr<float>(), rows, k,
                   weight.data_ptr<uint8_t>(), scales.data_ptr(),
                   no_mins ? nullptr : mins.data_ptr(), n16, y.data_ptr<float>(),
                   scratch.data_ptr(), at::get_num_threads());
  }
  return n16 == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

// Per layer in `weights`: input norm, post-attention norm, then per linear (qkv, o, gate_up,
// down) its parts' (weight, scales, mins), dims[4 + 4 * layer + linear] parts each (1 or 2:
// 14 tensors for a layer of one-part linears); the final norm last. A part's scales say its
// kind: fp16 int4 (vnni_matmul.c's mode 4), float32 int8 (mode 16, mins empty when none).
constexpr int64_t kLinears = 4;

QPart q_part(at::TensorList w, int64_t at, int64_t k) {
  const at::Tensor& codes = w[at];
  const at::Tensor& scales = w[at + 1];
  const at::Tensor& mins = w[at + 2];
  const bool int4 = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && k % 32 == 0 &&
                  scales.is_contiguous() && mins.is_contiguous() &&
                  (int4 || scales.scalar_type() == at::kFloat),
              "tokenwire_vnni::fused_layers: weights must be contiguous uint8 tiles with fp16 "
              "(int4) or float32 (int8) scales");
  const int64_t n16 = int4 ? codes.numel() * 2 / k : codes.numel() / k;
  const bool no_mins = !int4 && mins.numel() == 0;
  TORCH_CHECK(n16 % 16 == 0 && scales.numel() == n16 * (int4 ? k / 32 : k / 16) &&
                  (no_mins || mins.numel() == n16 * (k / 32)) &&
                  (no_mins || mins.scalar_type() == scales.scalar_type()),
              "tokenwire_vnni::fused_layers: a linear's scales do not match its weights");
  return QPart{int4 ? 4 : 16, codes.data_ptr<uint8_t>(), scales.data_ptr(),
               no_mins ? nullptr : mins.data_ptr(), n16};
}

QLinear q_linear(at::TensorList w, int64_t at, int64_t k, int64_t nparts) {
  TORCH_CHECK(nparts == 1 || nparts == 2, "tokenwire_vnni::fused_layers: 1 or 2 parts a linear");
  QLinear lin{};
  for (int64_t i = 0; i < nparts; i++) {
    lin.parts[i] = q_part(w, at + 3 * i, k);
    lin.n16 += lin.parts[i].n16;
  }
  lin.nparts = static_cast<int>(nparts);
  return lin;
}

// Layer i's tensors start at `base` of `w`; base moves past them.
FusedLayer fused_layer_at(at::TensorList w, at::TensorList caches, int64_t i, const FusedDims& dm,
                          at::IntArrayRef dims, int64_t& base) {
  const int64_t q_width = dm.heads * dm.head_dim;
  const at::Tensor& k_cache = caches[2 * i];
  const at::Tensor& v_cache = caches[2 * i + 1];
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous() &&
                  k_cache.size(1) == dm.block_size,
              "tokenwire_vnni::fused_layers: KV caches must be contiguous float32");
  const int64_t* parts = dims.data() + 4 + kLinears * i;
  int64_t tensors = 2;
  for (int64_t j = 0; j < kLinears; j++) tensors += 3 * parts[j];
  TORCH_CHECK(base + tensors < static_cast<int64_t>(w.size()),
              "tokenwire_vnni::fused_layers: weights do not match the parts in dims");
  const int64_t qkv = base + 2, o = qkv + 3 * parts[0], gu = o + 3 * parts[1];
  const int64_t down = gu + 3 * parts[2];
  FusedLayer layer{w[base].data_ptr<float>(), w[base + 1].data_ptr<float>(),
                   q_linear(w, qkv, dm.hidden, parts[0]), q_linear(w, o, q_width, parts[1]),
                   q_linear(w, gu, dm.hidden, parts[2]), q_linear(w, down, dm.inter, parts[3]),
                   k_cache.data_ptr<float>(), v_cache.data_ptr<float>()};
  base += tensors;
  TORCH_CHECK(layer.qkv.n16 >= q_width + 2 * dm.kv_heads * dm.head_dim &&
                  layer.gate_up.n16 >= 2 * dm.inter && layer.o.n16 >= dm.hidden &&
                  layer.down.n16 == layer.o.n16,
              "tokenwire_vnni::fused_layers: linear shapes do not match the dims");
  return layer;
}

at::Tensor fused_layers(const at::Tensor& hidden, const at::Tensor& positions,
                        const at::Tensor& slots, const at::Tensor& query_start_loc,
                        const at::Tensor& block_tables, const at::Tensor& cos_sin,
                        at::TensorList weights, at::TensorList caches, at::IntArrayRef dims,
                        double eps, double scale) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  static_cast<int64_t>(dims.size()) == 4 + kLinears * (static_cast<int64_t>(caches.size()) / 2),
              "tokenwire_vnni::fused_layers: unexpected argument types");
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2;
  FusedDims dm{hidden.size(0), hidden.size(1), dims[3], dims[0], dims[1], dims[2],
               layers > 0 ? caches[0].size(1) : 1, block_tables.size(1),
               static_cast<float>(eps), static_cast<float>(scale), at::get_num_threads()};
  TORCH_CHECK(dm.head_dim % 16 == 0 && dm.heads % dm.kv_heads == 0 &&
                  cos_sin.size(1) == dm.head_dim && dm.hidden % 32 == 0 && dm.inter % 32 == 0,
              "tokenwire_vnni::fused_layers: unsupported dims");
  const int64_t t_rows = dm.tokens, seqs = query_start_loc.size(0) - 1;
  TORCH_CHECK(positions.is_contiguous() && slots.is_contiguous() && query_start_loc.is_contiguous() &&
                  positions.numel() >= t_rows && slots.numel() >= t_rows,
              "tokenwire_vnni::fused_layers: positions and slots must cover every row");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  std::vector<int32_t> row_seq(t_rows, 0);
  int64_t max_pos = 0;
  for (int64_t s = 0; s < seqs; s++)
    for (int64_t t = qsl[s]; t < qsl[s + 1] && t < t_rows; t++) row_seq[t] = static_cast<int32_t>(s);
  for (int64_t t = 0; t < t_rows; t++) max_pos = std::max(max_pos, pos[t]);
  TORCH_CHECK(max_pos < dm.max_blocks * dm.block_size && max_pos < cos_sin.size(0),
              "tokenwire_vnni::fused_layers: positions past the block tables or rotary table");
  std::vector<FusedLayer> stack;
  int64_t base = 0;
  for (int64_t i = 0; i < layers; i++)
    stack.push_back(fused_layer_at(weights, caches, i, dm, dims, base));
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == base + 1,
              "tokenwire_vnni::fused_layers: weights do not match the caches");
  const FusedLayer* first = layers > 0 ? &stack[0] : nullptr;
  for (const FusedLayer& layer : stack)
    TORCH_CHECK(layer.qkv.n16 == first->qkv.n16 && layer.o.n16 == first->o.n16 &&
                    layer.gate_up.n16 == first->gate_up.n16,
                "tokenwire_vnni::fused_layers: the layers' linears differ in width");
  const int64_t qkv16 = first ? first->qkv.n16 : 16, proj16 = first ? first->o.n16 : dm.hidden;
  const int64_t gu16 = first ? first->gate_up.n16 : 16, q_width = dm.heads * dm.head_dim;
  const int64_t widest = std::max({dm.hidden, dm.inter, q_width});
  const int64_t group = dm.heads / dm.kv_heads;
  const int64_t floats = t_rows * (2 * dm.hidden + qkv16 + q_width + proj16 + gu16 + dm.inter) +
                         dm.threads * group * (max_pos + 1);
  at::Tensor work = at::empty({floats}, hidden.options());
  at::Tensor quant = at::empty({tw_vnni_scratch_bytes(t_rows, widest)},
                               hidden.options().dtype(at::kByte));
  float* p = work.data_ptr<float>();
  FusedBuffers buf;
  buf.residual = p; p += t_rows * dm.hidden;
  buf.x = p; p += t_rows * dm.hidden;
  buf.qkv = p; p += t_rows * qkv16;
  buf.attn = p; p += t_rows * q_width;
  buf.proj = p; p += t_rows * proj16;
  buf.gu = p; p += t_rows * gu16;
  buf.act = p; p += t_rows * dm.inter;
  buf.scores = p;
  buf.scores_per_thread = group * (max_pos + 1);
  buf.quant = quant.data_ptr();
  std::copy(hidden.data_ptr<float>(), hidden.data_ptr<float>() + t_rows * dm.hidden, buf.residual);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < layers; i++)
    fused_layer(&stack[i], i == 0, pos, slot, row_seq.data(), block_tables.data_ptr<int32_t>(),
                cos_sin.data_ptr<float>(), &dm, &buf);
  at::Tensor out = at::empty({t_rows, dm.hidden}, hidden.options());
  add_norm_rows(buf.residual, layers > 0 ? buf.proj : nullptr, proj16,
                weights[base].data_ptr<float>(), &dm, out.data_ptr<float>());
  for (int64_t t = 0; t < t_rows; t++)
    if (slot[t] < 0) std::fill(out.data_ptr<float>() + t * dm.hidden, out.data_ptr<float>() + (t + 1) * dm.hidden, 0.0f);
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenwire_vnni, m) {
  m.def("matmul(Tensor x, Tensor weight, Tensor scales, Tensor mins, int bits, int out_features)"
        " -> Tensor");
  m.def("fused_layers(Tensor hidden, Tensor positions, Tensor slots, Tensor query_start_loc,"
        " Tensor block_tables, Tensor cos_sin, Tensor[] weights, Tensor(a!)[] caches, int[] dims,"
        " float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenwire_vnni, CPU, m) {
  m.impl("matmul", vnni_matmul);
  m.impl("fused_layers", fused_layers);
}
