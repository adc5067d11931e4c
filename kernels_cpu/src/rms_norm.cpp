// ipex_train's RMSNorm for training (ipex_train/rms_norm): bf16 or fp32 x over its last dim, a bf16 or fp32 weight,
// one pass per row forward and backward (rms_norm_rows.h, per ISA), fp32 inside. y has the dtype torch promotes
// weight * x to (bf16 only when both are bf16, as in Hugging Face's `self.weight * hidden_states.to(input_dtype)`).
// add_rms_norm: the residual add before it fused in (a Llama decoder layer's `residual + h` then
// post_attention_layernorm), returning the rounded sum too; its backward adds the sum's own gradient in the same pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "variants.h"

namespace ipex_train {
namespace {

constexpr const char* kOp = "ipex_train::rms_norm";
// Rows per partial sum of the weight's gradient: the partials and their reduction do not depend on the thread count,
// so the gradient is the same bits with any number of threads.
constexpr int64_t kBlockRows = 64;

void check_inputs(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && weight.device().is_cpu(), kOp, ": x and weight must be CPU tensors");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, kOp,
                   ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat, kOp,
                   ": weight must be bfloat16 or float32, got ", weight.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1) && x.size(-1) > 0, kOp,
                    ": weight must be 1-D with x's last dimension (", x.dim() >= 1 ? x.size(-1) : 0,
                    " > 0), got x ", x.sizes(), ", weight ", weight.sizes());
}

// rows in parallel, about 16K elements per task.
template <class Body>
void each_row(int64_t rows, int64_t n, const Body& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_inputs(x_in, weight_in);
  TORCH_CHECK_VALUE(eps >= 0.0, kOp, ": eps must be >= 0, got ", eps);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const bool x_f32 = x.scalar_type() == at::kFloat, w_f32 = weight.scalar_type() == at::kFloat;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(x_f32 || w_f32 ? at::kFloat : at::kBFloat16));
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const KernelTable& kt = kernels();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  const void* wp = weight.const_data_ptr();
  auto* yp = static_cast<char*>(y.data_ptr());
  float* rp = rstd.data_ptr<float>();
  const int64_t x_row_bytes = n * x.element_size(), y_row_bytes = n * y.element_size();
  each_row(rows, n, [&](int64_t r) {
    // eps as the fp32 that torch's `variance + eps` adds.
    rp[r] = kt.rms_norm_row({xp + r * x_row_bytes, wp, yp + r * y_row_bytes, n, static_cast<float>(eps), x_f32,
                             w_f32});
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x_in,
                                                     const at::Tensor& weight_in, const at::Tensor& rstd_in) {
  check_inputs(x_in, weight_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  TORCH_CHECK_VALUE(grad_y.sizes() == x.sizes(), kOp, ": grad_y must have x's shape ", x.sizes(), ", got ",
                    grad_y.sizes());
  TORCH_CHECK_VALUE(rstd_in.scalar_type() == at::kFloat && rstd_in.numel() == rows, kOp,
                    ": rstd must be the float32 per-row values of the forward");
  const bool x_f32 = x.scalar_type() == at::kFloat, w_f32 = weight.scalar_type() == at::kFloat;
  const at::Tensor dy = grad_y.to(x_f32 || w_f32 ? at::kFloat : at::kBFloat16).contiguous();  // y's dtype
  const at::Tensor rstd = rstd_in.contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options());
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor partial = at::zeros({std::max<int64_t>(blocks, 1), n}, x.options().dtype(at::kFloat));
  const KernelTable& kt = kernels();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  const auto* dyp = static_cast<const char*>(dy.const_data_ptr());
  const void* wp = weight.const_data_ptr();
  const float* rp = rstd.const_data_ptr<float>();
  auto* dxp = static_cast<char*>(dx.data_ptr());
  float* pp = partial.data_ptr<float>();
  const int64_t x_row_bytes = n * x.element_size(), dy_row_bytes = n * dy.element_size();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = b * kBlockRows; r < std::min(rows, (b + 1) * kBlockRows); ++r)
        kt.rms_norm_grad_row({dyp + r * dy_row_bytes, xp + r * x_row_bytes, wp, dxp + r * x_row_bytes, pp + b * n, n,
                              rp[r], x_f32, w_f32});
    }
  });
  at::Tensor dw = blocks > 1 ? partial.sum(0) : partial[0];
  return {dx, dw.to(weight.scalar_type())};
}

constexpr const char* kAddOp = "ipex_train::add_rms_norm";

void check_add_inputs(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(residual.device().is_cpu(), kAddOp, ": residual must be a CPU tensor");
  TORCH_CHECK_TYPE(residual.scalar_type() == x.scalar_type() || residual.scalar_type() == at::kFloat, kAddOp,
                   ": residual must have x's dtype (", x.scalar_type(), ") or float32, got ", residual.scalar_type());
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), kAddOp, ": residual must have x's shape ", x.sizes(), ", got ",
                    residual.sizes());
  check_inputs(x, weight);
}

// y = rms_norm(s), s = x + residual rounded to the residual's dtype (returned: the next residual), rstd per row.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& x_in, const at::Tensor& res_in,
                                                                    const at::Tensor& weight_in, double eps) {
  check_add_inputs(x_in, res_in, weight_in);
  TORCH_CHECK_VALUE(eps >= 0.0, kAddOp, ": eps must be >= 0, got ", eps);
  const at::Tensor x = x_in.contiguous(), residual = res_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const bool x_f32 = x.scalar_type() == at::kFloat, s_f32 = residual.scalar_type() == at::kFloat;
  const bool w_f32 = weight.scalar_type() == at::kFloat;
  at::Tensor sum = at::empty(x.sizes(), residual.options());
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(s_f32 || w_f32 ? at::kFloat : at::kBFloat16));
  at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const KernelTable& kt = kernels();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  const auto* rsp = static_cast<const char*>(residual.const_data_ptr());
  auto* sp = static_cast<char*>(sum.data_ptr());
  auto* yp = static_cast<char*>(y.data_ptr());
  float* rp = rstd.data_ptr<float>();
  const int64_t x_row = n * x.element_size(), s_row = n * sum.element_size(), y_row = n * y.element_size();
  each_row(rows, n, [&](int64_t r) {
    rp[r] = kt.add_rms_norm_row({xp + r * x_row, rsp + r * s_row, weight.const_data_ptr(), sp + r * s_row,
                                 yp + r * y_row, n, static_cast<float>(eps), x_f32, s_f32, w_f32});
  });
  return {y, sum, rstd};
}

// The sum's total gradient (grad_sum + RMSNorm's), x's (empty when x has the sum's dtype: the same tensor) and the
// weight's, summed over blocks of kBlockRows rows in block order.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& grad_sum, const at::Tensor& sum_in, const at::Tensor& weight_in,
    const at::Tensor& rstd_in, at::ScalarType x_dtype) {
  check_inputs(sum_in, weight_in);
  TORCH_CHECK_TYPE(x_dtype == sum_in.scalar_type() || (x_dtype == at::kBFloat16 && sum_in.scalar_type() == at::kFloat),
                   kAddOp, ": x_dtype ", x_dtype, " does not go with a sum of ", sum_in.scalar_type());
  const at::Tensor sum = sum_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = sum.size(-1), rows = sum.numel() / n;
  TORCH_CHECK_VALUE(grad_y.sizes() == sum.sizes() && grad_sum.sizes() == sum.sizes(), kAddOp,
                    ": grad_y and grad_sum must have the sum's shape ", sum.sizes(), ", got ", grad_y.sizes(), " and ",
                    grad_sum.sizes());
  TORCH_CHECK_VALUE(rstd_in.scalar_type() == at::kFloat && rstd_in.numel() == rows, kAddOp,
                    ": rstd must be the float32 per-row values of the forward");
  const bool s_f32 = sum.scalar_type() == at::kFloat, w_f32 = weight.scalar_type() == at::kFloat;
  const at::Tensor dy = grad_y.to(s_f32 || w_f32 ? at::kFloat : at::kBFloat16).contiguous();  // y's dtype
  const at::Tensor dsum = grad_sum.to(sum.scalar_type()).contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const bool own_dx = x_dtype != sum.scalar_type();
  at::Tensor ds = at::empty(sum.sizes(), sum.options());
  at::Tensor dx = at::empty(own_dx ? sum.sizes() : at::IntArrayRef{0}, sum.options().dtype(x_dtype));
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::Tensor partial = at::zeros({std::max<int64_t>(blocks, 1), n}, sum.options().dtype(at::kFloat));
  const KernelTable& kt = kernels();
  const auto* sp = static_cast<const char*>(sum.const_data_ptr());
  const auto* dsump = static_cast<const char*>(dsum.const_data_ptr());
  const auto* dyp = static_cast<const char*>(dy.const_data_ptr());
  auto* dsp = static_cast<char*>(ds.data_ptr());
  auto* dxp = own_dx ? static_cast<char*>(dx.data_ptr()) : nullptr;
  const float* rp = rstd.const_data_ptr<float>();
  float* pp = partial.data_ptr<float>();
  const int64_t s_row = n * sum.element_size(), dy_row = n * dy.element_size(), x_row = n * dx.element_size();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = b * kBlockRows; r < std::min(rows, (b + 1) * kBlockRows); ++r)
        kt.add_rms_norm_grad_row({dyp + r * dy_row, dsump + r * s_row, sp + r * s_row, weight.const_data_ptr(),
                                  dsp + r * s_row, own_dx ? dxp + r * x_row : nullptr, pp + b * n, n, rp[r],
                                  x_dtype == at::kFloat, s_f32, w_f32});
    }
  });
  at::Tensor dw = blocks > 1 ? partial.sum(0) : partial[0];
  return {ds, dx, dw.to(weight.scalar_type())};
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd) -> (Tensor grad_x, Tensor grad_weight)");
  m.def("add_rms_norm_forward(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor y, Tensor sum, "
        "Tensor rstd)");
  m.def("add_rms_norm_backward(Tensor grad_y, Tensor grad_sum, Tensor sum, Tensor weight, Tensor rstd, "
        "ScalarType x_dtype) -> (Tensor grad_sum_total, Tensor grad_x, Tensor grad_weight)");
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("rms_norm_forward", &ipex_train::rms_norm_forward);
  m.impl("rms_norm_backward", &ipex_train::rms_norm_backward);
  m.impl("add_rms_norm_forward", &ipex_train::add_rms_norm_forward);
  m.impl("add_rms_norm_backward", &ipex_train::add_rms_norm_backward);
}
