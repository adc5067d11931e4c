// ipex_train's dropout + residual add + LayerNorm for training (ipex_train/add_norm): y = LayerNorm(dropout(x) +
// residual) over the last dim, one pass per row each way (add_norm_rows.h, per ISA), fp32 inside. x and residual
// bf16 or fp32, of one dtype or bf16 x with an fp32 residual; y and the sum in the residual's dtype (torch's
// promotion of x + residual); weight and bias fp32 or the residual's dtype. The forward also returns the sum (the
// backward's only activation, and a pre-norm block's residual stream) and the per-row mean and rstd; the dropout mask
// is regenerated from the seed. The backward takes the sum's own gradient when the sum was used (pre-norm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "dropout_keys.h"
#include "variants.h"

namespace ipex_train {
namespace {

constexpr const char* kOp = "ipex_train::add_layer_norm";
// Rows per partial sum of the weight's and bias's gradients, reduced over the blocks in block order: the result does
// not depend on the thread count.
constexpr int64_t kBlockRows = 64;

bool is_bf16_or_f32(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat; }

// s: the residual (or the sum), whose dtype the parameters may have.
void check_params(const at::Tensor& s, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK_VALUE(weight.device().is_cpu() && bias.device().is_cpu(), kOp, ": weight and bias must be CPU tensors");
  TORCH_CHECK_TYPE(weight.scalar_type() == bias.scalar_type() &&
                       (weight.scalar_type() == at::kFloat || weight.scalar_type() == s.scalar_type()),
                   kOp, ": weight and bias must share one dtype, float32 or the residual's (", s.scalar_type(),
                   "), got ", weight.scalar_type(), " and ", bias.scalar_type());
  const int64_t n = s.size(-1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && bias.dim() == 1 && weight.size(0) == n && bias.size(0) == n, kOp,
                    ": weight and bias must be 1-D of x's last dimension (", n, "), got ", weight.sizes(), " and ",
                    bias.sizes());
}

void check_activation(const at::Tensor& x, const char* what) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), kOp, ": ", what, " must be a CPU tensor");
  TORCH_CHECK_TYPE(is_bf16_or_f32(x), kOp, ": ", what, " must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, kOp, ": ", what,
                    " must have a non-empty last dimension, got shape ", x.sizes());
}

// The dropout seed travels as a one-element int64 tensor (drawn from torch's generator by the caller), so that
// torch.compile keeps it in the graph instead of reading a Python int out of it.
int64_t seed_of(const at::Tensor& seed) {
  TORCH_CHECK_VALUE(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(), kOp,
                    ": seed must be a one-element int64 CPU tensor");
  return seed.item<int64_t>();
}

void check_p(double p) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, kOp, ": p must be in [0, 1), got ", p);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x_in, const at::Tensor& residual_in, const at::Tensor& weight_in, const at::Tensor& bias_in,
    double eps, double p, const at::Tensor& seed_t) {
  check_activation(x_in, "x");
  check_activation(residual_in, "residual");
  TORCH_CHECK_TYPE(residual_in.scalar_type() == x_in.scalar_type() || residual_in.scalar_type() == at::kFloat, kOp,
                   ": residual must have x's dtype (", x_in.scalar_type(), ") or float32, got ",
                   residual_in.scalar_type());
  TORCH_CHECK_VALUE(residual_in.sizes() == x_in.sizes(), kOp, ": residual must have x's shape ", x_in.sizes(),
                    ", got ", residual_in.sizes());
  check_params(residual_in, weight_in, bias_in);
  TORCH_CHECK_VALUE(eps >= 0.0 && std::isfinite(eps), kOp, ": eps must be finite and >= 0, got ", eps);
  check_p(p);
  const int64_t seed = seed_of(seed_t);
  const at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous();
  const at::Tensor weight = weight_in.contiguous(), bias = bias_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  at::Tensor y = at::empty(x.sizes(), residual.options());
  at::Tensor sum = at::empty(x.sizes(), residual.options());
  const auto stats_shape = x.sizes().slice(0, x.dim() - 1);
  at::Tensor mean = at::empty(stats_shape, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty(stats_shape, x.options().dtype(at::kFloat));
  const KernelTable& kt = kernels();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  const auto* rp = static_cast<const char*>(residual.const_data_ptr());
  auto* yp = static_cast<char*>(y.data_ptr());
  auto* sp = static_cast<char*>(sum.data_ptr());
  float* mp = mean.data_ptr<float>();
  float* sdp = rstd.data_ptr<float>();
  const int64_t x_row = n * x.element_size(), s_row = n * sum.element_size();
  const bool x_f32 = x.scalar_type() == at::kFloat, s_f32 = sum.scalar_type() == at::kFloat;
  const bool w_f32 = weight.scalar_type() == at::kFloat;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      // eps as the fp32 that torch's LayerNorm adds.
      kt.add_norm_row({xp + r * x_row, rp + r * s_row, weight.const_data_ptr(), bias.const_data_ptr(), yp + r * s_row,
                       sp + r * s_row, mp + r, sdp + r, n, static_cast<float>(eps), x_f32, s_f32, w_f32,
                       dropout_of(p, seed, r)});
    }
  });
  return {y, sum, mean, rstd};
}

// Columns [first, first + width) of partial ([blocks, columns] fp32), each summed over the blocks in block order.
at::Tensor reduce_blocks(const at::Tensor& partial, int64_t first, int64_t width) {
  const int64_t blocks = partial.size(0), stride = partial.size(1);
  at::Tensor out = at::empty({width}, partial.options());
  const float* pp = partial.const_data_ptr<float>() + first;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, width, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) acc += pp[b * stride + c];
      op[c] = acc;
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& sum_in, const at::Tensor& weight_in, const at::Tensor& mean_in,
    const at::Tensor& rstd_in, double p, const at::Tensor& seed_t, at::ScalarType x_dtype,
    const std::optional<at::Tensor>& grad_sum_in) {
  check_activation(sum_in, "sum");
  check_params(sum_in, weight_in, weight_in);
  check_p(p);
  TORCH_CHECK_TYPE(x_dtype == sum_in.scalar_type() || (x_dtype == at::kBFloat16 && sum_in.scalar_type() == at::kFloat),
                   kOp, ": x_dtype ", x_dtype, " does not go with a sum of ", sum_in.scalar_type());
  const int64_t seed = seed_of(seed_t);
  const at::Tensor sum = sum_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = sum.size(-1), rows = sum.numel() / n;
  TORCH_CHECK_VALUE(grad_y.sizes() == sum.sizes(), kOp, ": grad_y must have the sum's shape ", sum.sizes(), ", got ",
                    grad_y.sizes());
  for (const auto* t : {&mean_in, &rstd_in})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->numel() == rows, kOp,
                      ": mean and rstd must be the float32 per-row values of the forward");
  const at::Tensor dy = grad_y.to(sum.scalar_type()).contiguous();  // y's dtype
  // The sum's own gradient (a pre-norm block's residual stream), absent (undefined) on the post-norm path.
  const bool has_dsum = grad_sum_in.has_value() && grad_sum_in->defined();
  if (has_dsum)
    TORCH_CHECK_VALUE(grad_sum_in->sizes() == sum.sizes(), kOp, ": grad_sum must have the sum's shape ", sum.sizes(),
                      ", got ", grad_sum_in->sizes());
  const at::Tensor dsum = has_dsum ? grad_sum_in->to(sum.scalar_type()).contiguous() : at::Tensor();
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const bool dropout = p > 0.0, own_dx = dropout || x_dtype != sum.scalar_type();
  at::Tensor ds = at::empty(sum.sizes(), sum.options());
  // Without dropout, and x of the sum's dtype, grad_x is grad_residual (the caller uses that one tensor for both).
  at::Tensor dx = at::empty(own_dx ? sum.sizes() : at::IntArrayRef{0}, sum.options().dtype(x_dtype));
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor partial = at::zeros({std::max<int64_t>(blocks, 1), 2 * n}, sum.options().dtype(at::kFloat));
  const KernelTable& kt = kernels();
  const auto* sp = static_cast<const char*>(sum.const_data_ptr());
  const auto* dyp = static_cast<const char*>(dy.const_data_ptr());
  const auto* dsump = has_dsum ? static_cast<const char*>(dsum.const_data_ptr()) : nullptr;
  auto* dsp = static_cast<char*>(ds.data_ptr());
  auto* dxp = own_dx ? static_cast<char*>(dx.data_ptr()) : nullptr;
  const float* mp = mean.const_data_ptr<float>();
  const float* rp = rstd.const_data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  const int64_t s_row = n * sum.element_size(), x_row = n * dx.element_size();
  const bool x_f32 = x_dtype == at::kFloat, s_f32 = sum.scalar_type() == at::kFloat;
  const bool w_f32 = weight.scalar_type() == at::kFloat;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = b * kBlockRows; r < std::min(rows, (b + 1) * kBlockRows); ++r) {
        const int64_t off = r * s_row;
        kt.add_norm_grad_row({dyp + off, has_dsum ? dsump + off : nullptr, sp + off, weight.const_data_ptr(), dsp + off,
                              own_dx ? dxp + r * x_row : nullptr, pp + b * 2 * n, pp + b * 2 * n + n, n, mp[r],
                              rp[r], x_f32, s_f32, w_f32, dropout_of(p, seed, r)});
      }
    }
  });
  return {ds, dx, reduce_blocks(partial, 0, n).to(weight.scalar_type()),
          reduce_blocks(partial, n, n).to(weight.scalar_type())};
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("add_layer_norm_forward(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps, float p, "
        "Tensor seed) -> (Tensor y, Tensor sum, Tensor mean, Tensor rstd)");
  m.def("add_layer_norm_backward(Tensor grad_y, Tensor sum, Tensor weight, Tensor mean, Tensor rstd, float p, "
        "Tensor seed, ScalarType x_dtype, Tensor? grad_sum=None) -> (Tensor grad_residual, Tensor grad_x, Tensor grad_weight, "
        "Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("add_layer_norm_forward", &ipex_train::add_layer_norm_forward);
  m.impl("add_layer_norm_backward", &ipex_train::add_layer_norm_backward);
}
