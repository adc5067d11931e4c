// The per-row math of ipex_train's dropout + residual add + LayerNorm (ipex_train/add_norm): forward and backward of
// one row, fp32 inside. x is bf16 or fp32 (the template parameter X: uint16_t holds bf16); the residual, the sum and
// y share the dtype S (a bf16 dense output meets an fp32 residual stream in models whose embeddings stay fp32).
// Included by loops.h after rms_norm_rows.h (whose load/store helpers it uses), so each ISA file compiles these very
// lines.
//
// Why: a post-norm transformer block (Hugging Face's BertSelfOutput / BertOutput) runs dropout, the residual add and
// LayerNorm as three passes over the activations forward and more backward; here each direction reads and writes a
// row once (the row stays in L1 between the sweeps below).
//
// Dropout: the keep decision of column j is attention_rows.h's hash of the row's two keys and j (keep_scale), so the
// backward regenerates the forward's mask from the seed instead of saving it.
#pragma once

#include "kernel_abi.h"

namespace ipex_train {
namespace {
namespace addn {

template <class X, class S, bool W32, bool DROP>
void add_norm_row_impl(const AddNormRow& r) {
  const X* x = static_cast<const X*>(r.x);
  const S* res = static_cast<const S*>(r.residual);
  S* s = static_cast<S*>(r.sum);
  const int64_t n = r.n;
  // s rounded to its dtype and stored (the backward's input); the statistics are those of the stored values.
  auto total = attn::start<attn::Sum>(0.0f);
  attn::columns(n, [&](auto a, int64_t j) {
    using A = decltype(a);
    auto v = rmsn::x_at<A>(x, j);
    if constexpr (DROP) v = v * attn::keep_scale<A>(r.drop, j);
    v = rmsn::as_input<S>(v + rmsn::x_at<A>(res, j));
    rmsn::put_x<A>(s, j, v);
    total.add(v);
  });
  const float mean = total.total() / float(n);
  // Two sweeps (sum, then squared deviations) rather than E[s^2] - mean^2, which cancels badly when |mean| >> std.
  auto dev = attn::start<attn::Sum>(0.0f);
  attn::columns(n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto d = rmsn::x_at<A>(s, j) - mean;
    dev.add(d * d);
  });
  const float rstd = 1.0f / math::sqrt_(dev.total() / float(n) + r.eps);
  attn::columns(n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto xhat = (rmsn::x_at<A>(s, j) - mean) * rstd;
    rmsn::put_x<A>(static_cast<S*>(r.y), j, xhat * rmsn::load<W32, A>(r.weight, j) + rmsn::load<W32, A>(r.bias, j));
  });
  *r.mean = mean;
  *r.rstd = rstd;
}

template <class X, class S, bool W32, bool DROP, bool DSUM>
void add_norm_grad_row_impl(const AddNormGradRow& r) {
  const S* s = static_cast<const S*>(r.sum);
  const S* dy = static_cast<const S*>(r.dy);
  const int64_t n = r.n;
  const float mean = r.mean, rstd = r.rstd;
  auto g_sum = attn::start<attn::Sum>(0.0f);
  auto gx_sum = attn::start<attn::Sum>(0.0f);
  attn::columns(n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto g = rmsn::x_at<A>(dy, j) * rmsn::load<W32, A>(r.weight, j);
    g_sum.add(g);
    gx_sum.add(g * ((rmsn::x_at<A>(s, j) - mean) * rstd));
  });
  const float c1 = g_sum.total() / float(n), c2 = gx_sum.total() / float(n);
  X* dx = static_cast<X*>(r.dx);
  attn::columns(n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto d = rmsn::x_at<A>(dy, j);
    const auto xhat = (rmsn::x_at<A>(s, j) - mean) * rstd;
    auto ds = (d * rmsn::load<W32, A>(r.weight, j) - c1 - xhat * c2) * rstd;
    // The sum's own gradient (pre-norm blocks pass the sum on as the residual stream), added in fp32 before the one
    // rounding.
    if constexpr (DSUM) ds = ds + rmsn::x_at<A>(static_cast<const S*>(r.dsum), j);
    rmsn::put_x<A>(static_cast<S*>(r.ds), j, ds);
    if constexpr (DROP) rmsn::put_x<A>(dx, j, ds * attn::keep_scale<A>(r.drop, j));
    else if (dx != nullptr) rmsn::put_x<A>(dx, j, ds);
    attn::store_f32<A>(r.dw, j, attn::load_f32<A>(r.dw, j) + d * xhat);
    attn::store_f32<A>(r.db, j, attn::load_f32<A>(r.db, j) + d);
  });
}

template <class X, class S, bool W32, bool DROP>
struct Forward {
  static void run(const AddNormRow& r) { add_norm_row_impl<X, S, W32, DROP>(r); }
};
template <class X, class S, bool W32, bool DROP>
struct Backward {
  static void run(const AddNormGradRow& r) {
    // A template flag, so that the post-norm path (no gradient of the sum) runs the loop it ran without it.
    if (r.dsum != nullptr) add_norm_grad_row_impl<X, S, W32, DROP, true>(r);
    else add_norm_grad_row_impl<X, S, W32, DROP, false>(r);
  }
};

// The dispatch over (x dtype, sum dtype, weight dtype, dropout) of a row function F: the three dtype pairs the op
// accepts (x and the sum alike, or bf16 x and an fp32 sum).
template <template <class, class, bool, bool> class F, class X, class S, class Row>
void with_flags(const Row& r) {
  if (r.w_f32) r.drop.enabled ? F<X, S, true, true>::run(r) : F<X, S, true, false>::run(r);
  else r.drop.enabled ? F<X, S, false, true>::run(r) : F<X, S, false, false>::run(r);
}

template <template <class, class, bool, bool> class F, class Row>
void dispatch(const Row& r) {
  if (r.x_f32) with_flags<F, float, float>(r);
  else if (r.s_f32) with_flags<F, uint16_t, float>(r);
  else with_flags<F, uint16_t, uint16_t>(r);
}

void add_norm_row(const AddNormRow& r) { dispatch<Forward>(r); }
void add_norm_grad_row(const AddNormGradRow& r) { dispatch<Backward>(r); }

}  // namespace addn
}  // namespace
}  // namespace ipex_train
