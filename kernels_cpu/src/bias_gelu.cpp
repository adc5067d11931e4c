// ipex_train's bias + GELU for training (ipex_train/bias_gelu): y = gelu(x + bias) over the last dim with exact
// (erf) GELU, one pass per row each way (bias_gelu_rows.h, per ISA), fp32 inside. x is a bias-free GEMM output, bf16
// or fp32; x + bias is rounded to x's dtype (what the GEMM with its bias would have written) before the GELU; y in
// x's dtype. The backward reads x and the bias (the forward saves them, not the pre-activation: recomputing x + bias
// costs less than writing it) and also returns the bias gradient, summed over fixed 64-row blocks in block order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "variants.h"

namespace ipex_train {
namespace {

constexpr const char* kOp = "ipex_train::bias_gelu";
// Rows per partial sum of the bias gradient, reduced over the blocks in block order: the result does not depend on
// the thread count.
constexpr int64_t kBlockRows = 64;

void check_operands(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), kOp, ": x must be a CPU tensor");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, kOp,
                   ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, kOp, ": x must have a non-empty last dimension, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(bias.device().is_cpu(), kOp, ": bias must be a CPU tensor");
  TORCH_CHECK_TYPE(bias.scalar_type() == at::kFloat || bias.scalar_type() == x.scalar_type(), kOp,
                   ": bias must be float32 or x's dtype (", x.scalar_type(), "), got ", bias.scalar_type());
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == x.size(-1), kOp, ": bias must be 1-D of x's last dimension (",
                    x.size(-1), "), got ", bias.sizes());
}

at::Tensor bias_gelu_forward(const at::Tensor& x_in, const at::Tensor& bias_in) {
  check_operands(x_in, bias_in);
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor y = at::empty(x.sizes(), x.options());
  const KernelTable& kt = kernels();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  auto* yp = static_cast<char*>(y.data_ptr());
  const int64_t row = n * x.element_size();
  const bool f32 = x.scalar_type() == at::kFloat, b32 = bias.scalar_type() == at::kFloat;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) kt.bias_gelu_row({xp + r * row, bias.const_data_ptr(), yp + r * row, n, f32, b32});
  });
  return y;
}

// The bias gradient: partial ([blocks, n] fp32) summed over the blocks in block order.
at::Tensor reduce_blocks(const at::Tensor& partial) {
  const int64_t blocks = partial.size(0), n = partial.size(1);
  at::Tensor out = at::empty({n}, partial.options());
  const float* pp = partial.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) acc += pp[b * n + c];
      op[c] = acc;
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad, const at::Tensor& x_in,
                                                      const at::Tensor& bias_in) {
  check_operands(x_in, bias_in);
  TORCH_CHECK_VALUE(grad.device().is_cpu() && grad.sizes() == x_in.sizes(), kOp,
                    ": grad must be a CPU tensor of x's shape ", x_in.sizes(), ", got ", grad.sizes());
  const at::Tensor x = x_in.contiguous(), bias = bias_in.contiguous();
  const at::Tensor dy = grad.to(x.scalar_type()).contiguous();  // y's dtype
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor partial = at::zeros({std::max<int64_t>(blocks, 1), n}, x.options().dtype(at::kFloat));
  const KernelTable& kt = kernels();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  const auto* dyp = static_cast<const char*>(dy.const_data_ptr());
  auto* dxp = static_cast<char*>(dx.data_ptr());
  float* pp = partial.data_ptr<float>();
  const int64_t row = n * x.element_size();
  const bool f32 = x.scalar_type() == at::kFloat, b32 = bias.scalar_type() == at::kFloat;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = b * kBlockRows; r < std::min(rows, (b + 1) * kBlockRows); ++r) {
        const int64_t off = r * row;
        kt.bias_gelu_grad_row({dyp + off, xp + off, bias.const_data_ptr(), dxp + off, pp + b * n, n, f32, b32});
      }
    }
  });
  return {dx, reduce_blocks(partial).to(bias.scalar_type())};
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("bias_gelu_forward(Tensor x, Tensor bias) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor bias) -> (Tensor grad_x, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("bias_gelu_forward", &ipex_train::bias_gelu_forward);
  m.impl("bias_gelu_backward", &ipex_train::bias_gelu_backward);
}
