// The per-element math of ipex_train's SwiGLU (ipex_train/swiglu): y = silu(gate) * up and its backward over one
// contiguous span of bf16 or fp32 elements (the template parameter X: uint16_t holds bf16), fp32 inside, each
// output rounded once. Included by loops.h after rms_norm_rows.h (whose load/store helpers it uses), so each ISA
// file compiles these very lines: whole simd.h vectors where the ISA has them, then the remaining elements one at a
// time.
//
// Why: a Llama-family MLP's `act_fn(gate_proj(x)) * up_proj(x)` is silu, a multiply and, backward, silu_backward and
// two more multiplies under autograd: five passes over the [tokens, intermediate] activations; one each way here.
#pragma once

#include "kernel_abi.h"

namespace ipex_train {
namespace {
namespace swiglu {

// sigmoid(x) from e = exp(-|x|), which never overflows: 1 / (1 + e) for x > 0, e / (1 + e) otherwise (the exp of
// attention_rows.h, relative error ~2e-7; NaN gives e = 0, and the NaN comes back through x in the callers).
template <class F>
ITR_FN F sigmoid_(F x) {
  const auto pos = x > 0.0f;
  const F e = attn::exp_nonpositive(math::select(pos, 0.0f - x, x));
  const F inv = 1.0f / (1.0f + e);
  return math::select(pos, inv, e * inv);
}

template <class X>
void silu_mul_impl(const SiluMulSpan& r) {
  const X* gate = static_cast<const X*>(r.gate);
  const X* up = static_cast<const X*>(r.up);
  X* y = static_cast<X*>(r.y);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto x = rmsn::x_at<A>(gate, j);
    rmsn::put_x<A>(y, j, x * sigmoid_(x) * rmsn::x_at<A>(up, j));
  });
}

// d_gate = dy * up * silu'(gate), silu'(x) = s * (1 + x * (1 - s)); d_up = dy * silu(gate).
template <class X>
void silu_mul_grad_impl(const SiluMulGradSpan& r) {
  const X* gate = static_cast<const X*>(r.gate);
  const X* up = static_cast<const X*>(r.up);
  const X* dy = static_cast<const X*>(r.dy);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto x = rmsn::x_at<A>(gate, j);
    const auto s = sigmoid_(x);
    const auto d = rmsn::x_at<A>(dy, j);
    rmsn::put_x<A>(static_cast<X*>(r.d_gate), j, d * rmsn::x_at<A>(up, j) * (s * (1.0f + x * (1.0f - s))));
    rmsn::put_x<A>(static_cast<X*>(r.d_up), j, d * (x * s));
  });
}

void silu_mul(const SiluMulSpan& r) {
  if (r.f32) silu_mul_impl<float>(r);
  else silu_mul_impl<uint16_t>(r);
}

void silu_mul_grad(const SiluMulGradSpan& r) {
  if (r.f32) silu_mul_grad_impl<float>(r);
  else silu_mul_grad_impl<uint16_t>(r);
}

}  // namespace swiglu
}  // namespace
}  // namespace ipex_train
