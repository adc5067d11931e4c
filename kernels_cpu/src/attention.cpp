// ipex_train's bf16 attention for training (ipex_train/attention): the matmuls run as bf16 at::matmul (oneDNN), the
// softmax between them and its backward as one pass per row of the S x T tile (attention_rows.h, per ISA).
//
// Layout: q [B, Hq, S, D], k [B, Hk, T, D], v [B, Hk, T, Dv], Hq a multiple of Hk (grouped-query attention: query
// heads h*G .. h*G+G-1 share key/value head h). The G query heads of a group are stacked into one [G*S, D] matrix
// per key/value head, so the products need no repeated keys/values and dK, dV sum over the group by themselves.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "dropout_keys.h"
#include "variants.h"

namespace ipex_train {
namespace {

constexpr const char* kOp = "ipex_train::attention_forward";

// [B, Hq, S, X] -> [B, Hk, G*S, X] (a view when the G query heads of a group are adjacent in memory).
at::Tensor group(const at::Tensor& x, int64_t hk) {
  const int64_t g = x.size(1) / hk;
  return x.reshape({x.size(0), hk, g * x.size(2), x.size(3)});
}

at::Tensor ungroup(const at::Tensor& x, int64_t hq) {
  return x.reshape({x.size(0), hq, x.size(2) / (hq / x.size(1)), x.size(3)});
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 4, kOp, ": query, key and value must be 4-D CPU tensors");
    TORCH_CHECK_TYPE(t->scalar_type() == at::kBFloat16, kOp, ": query, key and value must be bfloat16, got ",
                     t->scalar_type());
  }
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == v.size(1) &&
                        k.size(2) == v.size(2) && k.size(3) == q.size(3) && k.size(1) > 0 &&
                        q.size(1) % k.size(1) == 0,
                    kOp, ": shapes query ", q.sizes(), ", key ", k.sizes(), ", value ", v.sizes(),
                    " do not form an attention (query heads must be a multiple of key/value heads)");
}

// The dropout seed travels as a one-element int64 tensor (drawn from torch's generator by the caller), so that
// torch.compile keeps it in the graph instead of reading a Python int out of it.
int64_t seed_of(const at::Tensor& seed) {
  TORCH_CHECK_VALUE(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(), kOp,
                    ": seed must be a one-element int64 CPU tensor");
  return seed.item<int64_t>();
}

// Rows r of [B, Hq, S] in parallel, each with its per-thread scratch of n floats.
template <class Body>
void each_row(int64_t rows, int64_t n, const Body& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(n));
    for (int64_t r = begin; r < end; ++r) body(r, scratch.data());
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                                 const at::Tensor& v_in,
                                                                 const std::optional<at::Tensor>& mask_in,
                                                                 double dropout_p, bool is_causal, double scale,
                                                                 const at::Tensor& seed_t) {
  check_inputs(q_in, k_in, v_in);
  // Contiguous copies first: on Hugging Face's transposed (batch, seq, heads, dim) views at::matmul copied the
  // transposed key by a slower path (0.55 ms against 0.30 + 0.04 for copy and product at b8 h12 s128 d64).
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t seed = seed_of(seed_t);
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, kOp, ": dropout_p must be in [0, 1), got ", dropout_p);
  const int64_t b = q.size(0), hq = q.size(1), hk = k.size(1), s = q.size(2), t = k.size(2);
  at::Tensor mask;
  if (mask_in.has_value() && mask_in->defined()) {
    TORCH_CHECK_TYPE(mask_in->scalar_type() == at::kFloat, kOp, ": attn_mask must be an additive float32 mask here");
    mask = mask_in->expand({b, hq, s, t});
    if (mask.stride(3) != 1) mask = mask.contiguous();
  }
  at::Tensor scores = at::matmul(group(q, hk), k.transpose(-1, -2)).contiguous();  // [B, Hk, G*S, T]
  at::Tensor p = scores;                                                           // softmax in place
  at::Tensor p_drop = dropout_p > 0.0 ? at::empty_like(scores) : at::empty({0}, scores.options());
  const KernelTable& kt = kernels();
  auto* sp = static_cast<uint16_t*>(scores.data_ptr());
  auto* dp = dropout_p > 0.0 ? static_cast<uint16_t*>(p_drop.data_ptr()) : nullptr;
  const float* mp = mask.defined() ? mask.const_data_ptr<float>() : nullptr;
  each_row(b * hq * s, t, [&](int64_t r, float* scratch) {
    const int64_t i = r % s, h = (r / s) % hq, bi = r / (s * hq);
    SoftmaxRow row{};
    row.scores = sp + r * t;  // rows of [B, Hk, G*S, T] are the rows of [B, Hq, S, T] in order
    row.mask = mp ? mp + bi * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2) : nullptr;
    row.p = sp + r * t;
    row.p_drop = dp ? dp + r * t : nullptr;
    row.scratch = scratch;
    row.n = t;
    row.valid = is_causal ? std::min(t, i + 1) : t;
    row.scale = static_cast<float>(scale);
    row.drop = dropout_of(dropout_p, seed, r);
    kt.softmax_row(row);
  });
  at::Tensor out = ungroup(at::matmul(dropout_p > 0.0 ? p_drop : p, v), hq);
  return {out, p, p_drop};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& grad, const at::Tensor& q_in,
                                                                  const at::Tensor& k_in, const at::Tensor& v_in,
                                                                  const at::Tensor& p, const at::Tensor& p_drop,
                                                                  double dropout_p, double scale,
                                                                  const at::Tensor& seed_t) {
  check_inputs(q_in, k_in, v_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t seed = seed_of(seed_t);
  const int64_t hq = q.size(1), hk = k.size(1), s = q.size(2), t = k.size(2);
  const at::Tensor g = group(grad.to(at::kBFloat16).contiguous(), hk);
  const at::Tensor qg = group(q, hk);
  at::Tensor dv = at::matmul((dropout_p > 0.0 ? p_drop : p).transpose(-1, -2), g);
  at::Tensor ds = at::matmul(g, v.transpose(-1, -2)).contiguous();  // dP, then dS in place
  const KernelTable& kt = kernels();
  const auto* pp = static_cast<const uint16_t*>(p.const_data_ptr());
  auto* dsp = static_cast<uint16_t*>(ds.data_ptr());
  each_row(q.size(0) * hq * s, t, [&](int64_t r, float*) {
    SoftmaxGradRow row{};
    row.p = pp + r * t;
    row.dp = dsp + r * t;
    row.ds = dsp + r * t;
    row.n = t;
    row.scale = static_cast<float>(scale);
    row.drop = dropout_of(dropout_p, seed, r);
    kt.softmax_grad_row(row);
  });
  at::Tensor dq = ungroup(at::matmul(ds, k), hq);
  at::Tensor dk = at::matmul(ds.transpose(-1, -2), qg);
  return {dq, dk, dv};
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "float scale, Tensor seed) -> (Tensor out, Tensor probs, Tensor dropped_probs)");
  m.def(
      "attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor probs, "
      "Tensor dropped_probs, float dropout_p, float scale, Tensor seed) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("attention_forward", &ipex_train::attention_forward);
  m.impl("attention_backward", &ipex_train::attention_backward);
}
