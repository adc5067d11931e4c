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
// Unlike the other row headers (setup.py compiles with -ffp-contract=off), the multiply-adds here may contract into
// FMAs: the erf polynomial and the exp are the kernel's cost (without FMAs the forward took 1.86 ms against torch's
// gelu 0.70 ms at 1024 x 3072 bf16, with them 1.29 ms; backward 2.10 -> 1.49 ms). A column always takes the same
// path whatever the thread count, so results stay thread-count independent; the ISA variants (the scalar one has no
// FMA) agree within the accuracy bound, not bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
namespace gelu {

// The normal CDF Phi(x) = (1 + erf(x / sqrt(2))) / 2 and e^(-x^2 / 2) (the density's exp, which the backward
// needs too), from one exp and no 1 + erf cancellation for negative x: with a = |x| / sqrt(2) and t = 1 / (1 + p a),
// erfc(a) = t P(t) e^(-a^2), P a degree-9 fit of erfcx(a) / t (erfcx(a) = e^(a^2) erfc(a), smooth on [0, inf) in t;
// max relative error 4e-9 on a in [0, 10]), and Phi = 1 - erfc / 2 for x > 0, erfc / 2 otherwise. In fp32 the
// rounding of -a^2 (and the exp's, relative ~2e-7, attention_rows.h; 0 below -88) dominates: Phi within ~5e-7
// relative for x > -1, growing as x^2 below (1.5e-5 at x = -13). NaN gives NaN through the callers' x * Phi.
template <class F>
struct Gauss {
  F cdf;
  F e;  // e^(-x^2 / 2)
};

template <class F>
ITR_FN Gauss<F> gauss(F x) {
  const F z = x * 0.70710678118654752f;
  const F a = math::f32_from_bits(math::f32_bits(z) & 0x7fffffffu);
  const F e = attn::exp_nonpositive(0.0f - z * z);
  const F t = 1.0f / (1.0f + 0.3275911f * a);
  const F p = 1.847790331e-01f + t * (1.857943833e-01f + t * (1.656360179e-01f + t * (2.059502751e-01f + t *
              (-5.037711933e-02f + t * (5.013608336e-01f + t * (-5.600376129e-01f + t * (6.273425817e-01f + t *
              (-3.171241581e-01f + t * 5.667572469e-02f))))))));
  const F half_erfc = 0.5f * ((t * p) * e);
  return {math::select(z > 0.0f, 1.0f - half_erfc, half_erfc), e};
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
    rmsn::put_x<A>(static_cast<X*>(r.y), j, v * gauss(v).cdf);
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
    const auto g = gauss(v);
    // gelu'(x) = Phi(x) + x * phi(x), phi(x) = e^(-x^2 / 2) / sqrt(2 pi): torch's gelu_backward (cdf + x * pdf).
    const auto d = rmsn::x_at<A>(dy, j) * (g.cdf + v * (0.39894228040143268f * g.e));
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
#pragma GCC pop_options
}  // namespace
}  // namespace ipex_train
