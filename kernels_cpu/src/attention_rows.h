// The per-row math of ipex_train's attention (ipex_train/attention): softmax of one row of bf16 scores with scale,
// additive mask, causal limit and dropout, and its backward, each in one pass over the row's data (fp32 inside).
// Included by loops.h, so each ISA file compiles these very lines: whole simd.h vectors where the ISA has them,
// then the remaining columns one at a time.
//
// Why: with bf16 matmuls for Q K^T, P V and the backward's four products (oneDNN, 630-750 GFLOP/s at b8 h12 d64
// here), torch's pointwise ops around the S x T tiles (scale, mask, softmax, casts, dropout, softmax backward) took
// ~80% of an attention's forward + backward time.
#pragma once

#include "kernel_abi.h"

namespace ipex_train {
namespace {
namespace attn {

// The access to use for whole vectors (simd.h) and for single columns.
#ifdef ITR_SIMD_BYTES
using VecAccess = math::vec::AccessOf<false>;
constexpr int64_t kWidth = math::vec::kVecWidth;
#endif
using OneAccess = storage::Scalar<float, IsaTag>;

// Columns j, j+1, ... of the working type F (a vector or float) as 32-bit lanes.
template <class A>
ITR_FN auto column_index(int64_t j) {
#ifdef ITR_SIMD_BYTES
  if constexpr (!std::is_same<typename A::T, float>::value) {
    math::vec::UV iota;  // a constant once the loop is unrolled
    for (int64_t l = 0; l < kWidth; ++l) iota.v[l] = uint32_t(l);
    return math::vec::UV(uint32_t(j)) + iota;
  } else
#endif
  {
    return uint32_t(j);
  }
}

template <class A>
ITR_FN typename A::T load_f32(const float* p, int64_t j) {
  if constexpr (std::is_same<typename A::T, float>::value) return p[j];
  else return A::get(p, j);
}

template <class A>
ITR_FN void store_f32(float* p, int64_t j, typename A::T v) {
  if constexpr (std::is_same<typename A::T, float>::value) p[j] = v;
  else A::put(p, j, v);
}

// e^x for x <= 0 (softmax arguments after subtracting the row max), relative error ~2e-7; 0 below -88 (and for
// -inf and NaN, which only fully masked columns produce). 2^t = 2^n * 2^f with n = round(t), |f| <= 1/2: 2^f by
// its degree-6 Taylor polynomial, 2^n by building the exponent bits.
template <class F>
ITR_FN F exp_nonpositive(F x) {
  const F t0 = x * 1.44269504088896341f;
  const F t = math::select(t0 > -127.0f, t0, F(-127.0f));
  const F shifted = t + 12582912.0f;  // 1.5 * 2^23: the sum's low mantissa bits hold round(t)
  const F n = shifted - 12582912.0f;
  const F f = (t - n) * 0.693147180559945309f;
  const F poly = 1.0f + f * (1.0f + f * (0.5f + f * (1.66666667e-1f + f * (4.16666667e-2f + f * (8.33333333e-3f + f *
                 1.38888889e-3f)))));
  const auto n_bits = math::f32_bits(shifted) - math::f32_bits(F(12582912.0f));  // round(t), wrapped
  return poly * math::f32_from_bits((n_bits + 127u) << 23);  // t >= -127: the exponent field is >= 0
}

// Keep-scale of columns j.. of a row under dropout d: d.scale where kept, 0 where dropped.
template <class A>
ITR_FN typename A::T keep_scale(const Dropout& d, int64_t j) {
  using F = typename A::T;
  // The dropout decision of column j is a hash of the row's two keys and j (the state codec's finalizer), so
  // forward and backward (and any thread split) draw the same mask without storing it.
  const auto h = codec::fmix32(codec::fmix32(column_index<A>(j) ^ d.key0) + d.key1);
  return math::select((h >> 8) >= d.threshold, F(d.scale), F(0.0f));
}

// Runs body(access, j) over columns [0, n): whole vectors first where the ISA has them.
template <class Body>
ITR_FN void columns(int64_t n, const Body& body) {
  int64_t j = 0;
#ifdef ITR_SIMD_BYTES
  for (; j + kWidth <= n; j += kWidth) body(VecAccess{}, j);
#endif
  for (; j < n; ++j) body(OneAccess{}, j);
}

template <class F>
ITR_FN float lane_max(F v) {
#ifdef ITR_SIMD_BYTES
  if constexpr (!std::is_same<F, float>::value) {
    float m = v.v[0];
    for (int64_t l = 1; l < kWidth; ++l) m = (v.v[l] > m || v.v[l] != v.v[l]) ? v.v[l] : m;  // NaN sticks
    return m;
  } else
#endif
  {
    return v;
  }
}

template <class F>
ITR_FN float lane_sum(F v) {
#ifdef ITR_SIMD_BYTES
  if constexpr (!std::is_same<F, float>::value) {
    float s = 0.0f;
    for (int64_t l = 0; l < kWidth; ++l) s += v.v[l];
    return s;
  } else
#endif
  {
    return v;
  }
}

// A running max and sum: one vector accumulator (lanes reduced at the end) and one float for the single columns.
template <class Reduce>
struct Acc {
#ifdef ITR_SIMD_BYTES
  math::vec::FV vec;
#endif
  float one;
  template <class F>
  inline __attribute__((always_inline)) void add(F x) {
    if constexpr (std::is_same<F, float>::value) one = Reduce::op(one, x);
#ifdef ITR_SIMD_BYTES
    else vec = Reduce::op(vec, x);
#endif
  }
  inline __attribute__((always_inline)) float total() const {
#ifdef ITR_SIMD_BYTES
    return Reduce::op(one, Reduce::lanes(vec));
#else
    return one;
#endif
  }
};
struct Max {
  template <class F>
  // NaN sticks (as torch's max): a NaN accumulator stays, a NaN operand wins.
  static inline __attribute__((always_inline)) F op(F a, F b) {
    return math::select(a != a, a, math::select(a > b, a, b));
  }
  template <class F>
  static inline __attribute__((always_inline)) float lanes(F v) { return lane_max(v); }
};
struct Sum {
  template <class F>
  static inline __attribute__((always_inline)) F op(F a, F b) { return a + b; }
  template <class F>
  static inline __attribute__((always_inline)) float lanes(F v) { return lane_sum(v); }
};

template <class Reduce>
ITR_FN Acc<Reduce> start(float init) {
  Acc<Reduce> a;
#ifdef ITR_SIMD_BYTES
  a.vec = math::vec::FV(init);
#endif
  a.one = init;
  return a;
}

template <bool MASKED>
void softmax_row_impl(const SoftmaxRow& r) {
  const int64_t valid = r.valid;
  float* x = r.scratch;
  auto mx = start<Max>(-__builtin_inff());
  columns(valid, [&](auto a, int64_t j) {
    using A = decltype(a);
    auto s = A::bf16(r.scores, j) * r.scale;
    if constexpr (MASKED) s = s + load_f32<A>(r.mask, j);
    store_f32<A>(x, j, s);
    mx.add(s);
  });
  const float m = mx.total();
  const bool dropout = r.p_drop != nullptr;
  if (m != m) {  // a NaN score: NaN probabilities over the row's keys, as torch's attention gives (never hidden)
    for (int64_t j = 0; j < r.n; ++j) {
      r.p[j] = j < valid ? 0x7FC0 : 0;
      if (dropout) r.p_drop[j] = r.p[j];
    }
    return;
  }
  if (!(m > -__builtin_inff())) {  // every column masked (or no columns): zeros, as torch's attention gives
    columns(r.n, [&](auto a, int64_t j) {
      using A = decltype(a);
      A::put_bf16(r.p, j, 0.0f);
      if (dropout) A::put_bf16(r.p_drop, j, 0.0f);
    });
    return;
  }
  auto sum = start<Sum>(0.0f);
  columns(valid, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto e = exp_nonpositive(load_f32<A>(x, j) - m);
    store_f32<A>(x, j, e);
    sum.add(e);
  });
  const float inv = 1.0f / sum.total();
  columns(valid, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto p = load_f32<A>(x, j) * inv;
    A::put_bf16(r.p, j, p);
    if (dropout) A::put_bf16(r.p_drop, j, p * keep_scale<A>(r.drop, j));
  });
  for (int64_t j = valid; j < r.n; ++j) {
    r.p[j] = 0;
    if (dropout) r.p_drop[j] = 0;
  }
}

// dS = P * (dP - sum_j dP_j P_j) * scale, dP being the gradient of the dropped P scaled back (dropout's backward).
template <bool DROPOUT>
void softmax_grad_row_impl(const SoftmaxGradRow& r) {
  auto dot = start<Sum>(0.0f);
  columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    auto dp = A::bf16(r.dp, j);
    if constexpr (DROPOUT) dp = dp * keep_scale<A>(r.drop, j);
    dot.add(dp * A::bf16(r.p, j));
  });
  const float c = dot.total();
  columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    auto dp = A::bf16(r.dp, j);
    if constexpr (DROPOUT) dp = dp * keep_scale<A>(r.drop, j);
    A::put_bf16(r.ds, j, A::bf16(r.p, j) * (dp - c) * r.scale);
  });
}

void softmax_row(const SoftmaxRow& r) {
  if (r.mask != nullptr) softmax_row_impl<true>(r);
  else softmax_row_impl<false>(r);
}

void softmax_grad_row(const SoftmaxGradRow& r) {
  if (r.drop.enabled) softmax_grad_row_impl<true>(r);
  else softmax_grad_row_impl<false>(r);
}

}  // namespace attn
}  // namespace
}  // namespace ipex_train
