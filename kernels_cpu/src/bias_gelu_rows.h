// The per-row math of ipex_train's bias + GELU (ipex_train/bias_gelu): y = gelu(round(x + bias)) with exact (erf)
// GELU over one row of bf16 or fp32 x (the template parameter X: uint16_t holds bf16), bias fp32 or x's dtype, fp32
// inside, and its backward, which also adds the row's bias gradient into a block's fp32 partial sum. Included by
// loops.h after rms_norm_rows.h (whose load/store helpers it uses), so each ISA file compiles these very lines.
//
// Why: a BERT-style intermediate block's `gelu(dense(x))` is addmm, a GELU pass and, backward, gelu_backward and a
// separate sum over the rows for the bias gradient; the GEMM here runs without its bias and the rest is one pass
// each way.
#pragma once

#include "kernel_abi.h"

namespace ipex_train {
namespace {
namespace gelu {

// Phi(x) = (1 + erf(x / sqrt(2))) / 2, the normal CDF, without the cancellation of 1 + erf for negative x. With
// z = x / sqrt(2) and a = |z|: for a < 1, erf(z) = z * P(z^2) (P a degree-6 fit of erf(z) / z on [0, 1], max
// relative error 1.2e-9, ~1.7e-7 with fp32 rounding); for a >= 1, erfc(a) = t * exp(-a^2 + Q(t)), t = 1 / (1 + a/2)
// (Numerical Recipes' erfcc, relative error 1.2e-7 in exact arithmetic; the fp32 rounding of -a^2 makes it ~1.6e-6
// at a = 4, where erf is within 2e-8 of 1), and Phi = 1 - erfc / 2 or erfc / 2. The exp is attention_rows.h's
// (relative error ~2e-7, 0 below -88). NaN gives NaN through the caller's x * Phi.
template <class F>
ITR_FN F normal_cdf(F x) {
  const F z = x * 0.70710678118654752f;
  const F a = math::f32_from_bits(math::f32_bits(z) & 0x7fffffffu);
  const F s = z * z;
  const F p = 1.12837911e+0f + s * (-3.76126260e-1f + s * (1.12835854e-1f + s * (-2.68538129e-2f + s *
              (5.18832961e-3f + s * (-8.01020768e-4f + s * 7.85390439e-5f)))));
  const F small = 0.5f + 0.5f * (z * p);
  const F t = 1.0f / (1.0f + 0.5f * a);
  const F q = -1.26551223f + t * (1.00002368f + t * (0.37409196f + t * (0.09678418f + t * (-0.18628806f + t *
              (0.27886807f + t * (-1.13520398f + t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
  const F half_erfc = 0.5f * (t * attn::exp_nonpositive(q - s));
  const F large = math::select(z > 0.0f, 1.0f - half_erfc, half_erfc);
  return math::select(F(1.0f) > a, small, large);
}

// gelu'(x) = Phi(x) + x * phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi): torch's gelu_backward formula (cdf + x * pdf).
template <class F>
ITR_FN F gelu_grad(F x, F cdf) {
  return cdf + x * (0.39894228040143268f * attn::exp_nonpositive(-0.5f * (x * x)));
}

// x + bias in fp32, rounded to x's dtype (the pre-activation a GEMM with its bias would have written), as fp32.
template <class X, bool B32, class A>
ITR_FN typename A::T pre_at(const X* x, const void* bias, int64_t j) {
  return rmsn::as_input<X>(rmsn::x_at<A>(x, j) + rmsn::load<B32, A>(bias, j));
}

template <class X, bool B32>
void bias_gelu_row_impl(const BiasGeluRow& r) {
  const X* x = static_cast<const X*>(r.x);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto v = pre_at<X, B32, A>(x, r.bias, j);
    rmsn::put_x<A>(static_cast<X*>(r.y), j, v * normal_cdf(v));
  });
}

// dx = dy * gelu'(pre), rounded once to x's dtype; d_bias[j] += that fp32 value (unrounded), the row's share of the
// bias gradient in its block's partial sum (the caller adds the rows of a block in order).
template <class X, bool B32>
void bias_gelu_grad_row_impl(const BiasGeluGradRow& r) {
  const X* x = static_cast<const X*>(r.x);
  const X* dy = static_cast<const X*>(r.dy);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto v = pre_at<X, B32, A>(x, r.bias, j);
    const auto d = rmsn::x_at<A>(dy, j) * gelu_grad(v, normal_cdf(v));
    rmsn::put_x<A>(static_cast<X*>(r.dx), j, d);
    attn::store_f32<A>(r.d_bias, j, attn::load_f32<A>(r.d_bias, j) + d);
  });
}

void bias_gelu_row(const BiasGeluRow& r) {
  if (r.f32) r.bias_f32 ? bias_gelu_row_impl<float, true>(r) : bias_gelu_row_impl<float, false>(r);
  else if (r.bias_f32) bias_gelu_row_impl<uint16_t, true>(r);
  else bias_gelu_row_impl<uint16_t, false>(r);
}

void bias_gelu_grad_row(const BiasGeluGradRow& r) {
  if (r.f32) r.bias_f32 ? bias_gelu_grad_row_impl<float, true>(r) : bias_gelu_grad_row_impl<float, false>(r);
  else if (r.bias_f32) bias_gelu_grad_row_impl<uint16_t, true>(r);
  else bias_gelu_grad_row_impl<uint16_t, false>(r);
}

}  // namespace gelu
}  // namespace
}  // namespace ipex_train
