// ipex_train's rotary position embedding for training (ipex_train/rope): Hugging Face's
// `x * cos + rotate_half(x) * sin` on the query and key projections in one pass each way (rope_rows.h, per ISA),
// fp32 inside.
//
// Layouts: the forward reads q [B, S, Hq, D] and k [B, S, Hk, D] as the projections give them (their
// `.view(B, S, H, D)`) and writes the rotated tensors as contiguous [B, H, S, D], the layout the attention kernels
// read, so neither the transposed views nor their copies are made. The backward reads the gradients in any layout
// and writes them back as [B, S, H, D], the projections' layout. cos and sin are [Bc, S, D] with Bc 1 or B.
//
// Numerics: per element out = x1 * c - x2 * s (first half) and x2 * c + x1 * s (second half), in fp32, rounded once
// to x's dtype. For fp32 x that is bit for bit torch's three ops (setup.py compiles with -ffp-contract=off, so no
// product is fused into the sum); for bf16 x torch rounds after each of them, here only at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "variants.h"

namespace ipex_train {
namespace {

constexpr const char* kOp = "ipex_train::rope";

void check_pair(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& x, int64_t b, int64_t s,
                int64_t d) {
  TORCH_CHECK_VALUE(cos.device().is_cpu() && sin.device().is_cpu(), kOp, ": cos and sin must be CPU tensors");
  TORCH_CHECK_TYPE(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), kOp,
                   ": cos and sin must have the query's dtype (", x.scalar_type(), "), got ", cos.scalar_type(),
                   " and ", sin.scalar_type());
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.dim() == 3 && (cos.size(0) == 1 || cos.size(0) == b) &&
                        cos.size(1) == s && cos.size(2) == d,
                    kOp, ": cos and sin must both be [1 or batch, seq, head_dim] = [1 or ", b, ", ", s, ", ", d,
                    "], got ", cos.sizes(), " and ", sin.sizes());
}

void check_x(const at::Tensor& x, const char* what) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.dim() == 4, kOp, ": ", what, " must be a 4-D CPU tensor, got ",
                    x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, kOp, ": ", what,
                   " must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.size(3) % 2 == 0, kOp, ": ", what, "'s head dim must be even, got ", x.size(3));
}

// Every (batch, position) row of x into out, one call of the ISA's rope_row per row (all heads of the position);
// strides in elements: x's and out's (batch, position, head) strides differ (the forward turns [B, S, H, D] into
// [B, H, S, D], the backward back).
struct Walk {
  int64_t b, s, h, d;
  int64_t in_b, in_s, in_h;
  int64_t out_b, out_s, out_h;
};

void dispatch(const Walk& w, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out,
              bool inverse) {
  if (w.b * w.s * w.h == 0) return;
  const KernelTable& kt = kernels();
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  const auto* cp = static_cast<const char*>(cos.const_data_ptr());
  const auto* sp = static_cast<const char*>(sin.const_data_ptr());
  auto* op = static_cast<char*>(out.data_ptr());
  const int64_t e = x.element_size();
  const bool per_batch = cos.size(0) != 1, f32 = x.scalar_type() == at::kFloat;
  at::parallel_for(0, w.b * w.s, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, w.h * w.d)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t r = begin; r < end; ++r) {
                       const int64_t bi = r / w.s, si = r % w.s;
                       const int64_t cs = ((per_batch ? bi : 0) * w.s + si) * w.d * e;
                       kt.rope_row({xp + (bi * w.in_b + si * w.in_s) * e, op + (bi * w.out_b + si * w.out_s) * e,
                                    cp + cs, sp + cs, w.h, w.in_h, w.out_h, w.d, f32, inverse});
                     }
                   });
}

// x [B, S, H, D] (last dim contiguous) -> contiguous [B, H, S, D].
at::Tensor forward_one(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2), d = x.size(3);
  at::Tensor out = at::empty({b, h, s, d}, x.options());
  dispatch({b, s, h, d, x.stride(0), x.stride(1), x.stride(2), h * s * d, d, s * d}, x, cos, sin, out, false);
  return out;
}

// grad [B, H, S, D] (last dim contiguous) -> contiguous [B, S, H, D].
at::Tensor backward_one(const at::Tensor& g_in, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor g = g_in.stride(3) == 1 ? g_in : g_in.contiguous();
  const int64_t b = g.size(0), h = g.size(1), s = g.size(2), d = g.size(3);
  at::Tensor out = at::empty({b, s, h, d}, g.options());
  dispatch({b, s, h, d, g.stride(0), g.stride(2), g.stride(1), s * h * d, h * d, d}, g, cos, sin, out, true);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_in,
                                                const at::Tensor& sin_in) {
  check_x(q, "query");
  check_x(k, "key");
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), kOp,
                    ": query [B, S, Hq, D] and key [B, S, Hk, D] must share B, S and D, got ", q.sizes(), " and ",
                    k.sizes());
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type(), kOp, ": query and key must share one dtype, got ",
                   q.scalar_type(), " and ", k.scalar_type());
  check_pair(cos_in, sin_in, q, q.size(0), q.size(1), q.size(3));
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  return {forward_one(q, cos, sin), forward_one(k, cos, sin)};
}

std::tuple<at::Tensor, at::Tensor> rope_backward(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& cos_in,
                                                 const at::Tensor& sin_in) {
  check_x(gq, "grad of the query");
  check_x(gk, "grad of the key");
  check_pair(cos_in, sin_in, gq, gq.size(0), gq.size(2), gq.size(3));
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  return {backward_one(gq, cos, sin), backward_one(gk, cos, sin)};
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("rope_forward(Tensor query, Tensor key, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rope_backward(Tensor grad_query, Tensor grad_key, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("rope_forward", &ipex_train::rope_forward);
  m.impl("rope_backward", &ipex_train::rope_backward);
}
