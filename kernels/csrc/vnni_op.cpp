// The torch operator tokenwire_vnni::matmul over the VNNI kernels in vnni_matmul.c
// (tokenwire.kernels.vnni_matmul loads it; one dispatcher call per matmul, eager and compiled).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vnni_matmul.c"

namespace {

at::Tensor vnni_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t bits, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "tokenwire_vnni::matmul: x must be a contiguous float32 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "tokenwire_vnni::matmul: bits must be 4 or 8");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "tokenwire_vnni::matmul: K must be a multiple of 32");
  const int64_t n16 = weight.numel() * (8 / bits) / k;
  TORCH_CHECK(n16 % 16 == 0 && n16 >= out_features && scales.numel() == n16 * (k / 32),
              "tokenwire_vnni::matmul: weight / scales do not match x's K");
  at::Tensor y = at::empty({rows, n16}, x.options());
  if (rows > 0) {
    at::Tensor scratch = at::empty({2 * rows * k + 16 * rows * (k / 32)}, x.options().dtype(at::kByte));
    tw_vnni_matmul(static_cast<int>(bits), x.data_ptr<float>(), rows, k,
                   weight.data_ptr<uint8_t>(), static_cast<const uint16_t*>(scales.data_ptr()),
                   static_cast<const uint16_t*>(mins.data_ptr()), n16, y.data_ptr<float>(),
                   scratch.data_ptr(), at::get_num_threads());
  }
  return n16 == out_features ? y : y.narrow(1, 0, out_features).contiguous();
}

}  // namespace

TORCH_LIBRARY(tokenwire_vnni, m) {
  m.def("matmul(Tensor x, Tensor weight, Tensor scales, Tensor mins, int bits, int out_features)"
        " -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenwire_vnni, CPU, m) { m.impl("matmul", vnni_matmul); }
