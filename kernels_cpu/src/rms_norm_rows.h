// The per-row math of ipex_train's RMSNorm (ipex_train/rms_norm): forward and backward of one row of bf16 or fp32 x
// (the template parameter X: uint16_t holds bf16), fp32 inside. Included by loops.h after attention_rows.h (whose
// column helpers it uses), so each ISA file compiles these very lines.
//
// Why: Hugging Face's LlamaRMSNorm runs ~10 elementwise passes under autograd (2.6 ms forward + backward on a
// (4, 256, 768) input at 2 threads, bf16 or fp32); one pass to reduce and one to write per row here.
//
// The forward is bit-identical to that module: its mean(x^2) is torch's fp32 sum of the fp32 squares (a fixed
// order, see sum_of_squares) divided by n, rstd = 1 / sqrt(mean + eps), and y = w * round(x * rstd) with round the
// module's `.to(input_dtype)`: to bf16 for bf16 x, none for fp32 x; w * ... in fp32 and rounded to y's dtype.
#pragma once

#include "kernel_abi.h"

namespace ipex_train {
namespace {
namespace rmsn {

// torch's fp32 sum over a contiguous last dim (aten/src/ATen/native/cpu/SumKernel.cpp, torch 2.x) adds
// 8-float vectors (its kernel's width on x86 in every CPU capability, checked against torch 2.14) in this order:
// vector i goes to partial sum i % 4 of a 4-level cascade (each level a block of 2^p vectors, p >= 4), the four
// partial sums are added in order, then the tail elements and the 8 lanes one by one. Repeating that order on the
// same fp32 squares repeats torch's mean bit for bit. Squares of bf16 values are exact in fp32; those of fp32 values
// are rounded to fp32 before the add, as torch's pow(2) tensor is: setup.py compiles every ISA file with
// -ffp-contract=off, so `a += f * f` is never fused into one FMA (which would skip that rounding).
constexpr int64_t kLanes = 8;
constexpr int64_t kIlp = 4;
constexpr int64_t kLevels = 4;

struct Lanes {
  float v[kLanes];
};

// Element e of x as fp32.
ITR_FN float value(const uint16_t* x, int64_t e) { return convert::bf16_to_f32(uint32_t(x[e])); }
ITR_FN float value(const float* x, int64_t e) { return x[e]; }

ITR_FN void zero(float& a) { a = 0.0f; }
ITR_FN void zero(Lanes& a) {
  for (int64_t l = 0; l < kLanes; ++l) a.v[l] = 0.0f;
}
ITR_FN void add(float& a, const float& b) { a += b; }
ITR_FN void add(Lanes& a, const Lanes& b) {
  for (int64_t l = 0; l < kLanes; ++l) a.v[l] += b.v[l];
}
// Adds the squares of element e (one value, or the vector of kLanes values at e * kLanes).
template <class X>
ITR_FN void add_square(float& a, const X* x, int64_t e) {
  const float f = value(x, e);
  a += f * f;
}
template <class X>
ITR_FN void add_square(Lanes& a, const X* x, int64_t e) {
  for (int64_t l = 0; l < kLanes; ++l) {
    const float f = value(x, e * kLanes + l);
    a.v[l] += f * f;
  }
}

ITR_FN int64_t ceil_log2(int64_t v) { return v <= 2 ? 1 : 64 - __builtin_clzll(uint64_t(v - 1)); }

// The sum of the squares of elements [0, size) of x, E being one value or a vector of kLanes (see above).
template <class E, class X>
E cascade_sum(const X* x, int64_t size) {
  const int64_t rounds = size / kIlp;  // groups of kIlp elements, cascaded
  const int64_t power = ceil_log2(rounds) / kLevels > 4 ? ceil_log2(rounds) / kLevels : 4;
  const int64_t step = int64_t(1) << power;
  E acc[kLevels][kIlp];
  for (auto& level : acc)
    for (auto& a : level) zero(a);
  int64_t i = 0;
  while (i + step <= rounds) {
    for (int64_t end = i + step; i < end; ++i)
      for (int64_t k = 0; k < kIlp; ++k) add_square(acc[0][k], x, i * kIlp + k);
    for (int64_t j = 1; j < kLevels; ++j) {  // carry the finished block up while lower levels complete one
      for (int64_t k = 0; k < kIlp; ++k) {
        add(acc[j][k], acc[j - 1][k]);
        zero(acc[j - 1][k]);
      }
      if ((i & ((step - 1) << (j * power))) != 0) break;
    }
  }
  for (; i < rounds; ++i)
    for (int64_t k = 0; k < kIlp; ++k) add_square(acc[0][k], x, i * kIlp + k);
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kIlp; ++k) add(acc[0][k], acc[j][k]);
  for (int64_t e = rounds * kIlp; e < size; ++e) add_square(acc[0][0], x, e);
  for (int64_t k = 1; k < kIlp; ++k) add(acc[0][0], acc[0][k]);
  return acc[0][0];
}

template <class X>
ITR_FN float sum_of_squares(const X* x, int64_t n) {
  if (n < kLanes) return cascade_sum<float>(x, n);
  const int64_t vectors = n / kLanes;
  const Lanes v = cascade_sum<Lanes>(x, vectors);
  float total = 0.0f;
  for (int64_t j = vectors * kLanes; j < n; ++j) add_square(total, x, j);
  for (int64_t l = 0; l < kLanes; ++l) total += v.v[l];
  return total;
}

// Columns j.. of x (bf16 or fp32) as fp32, and their store in x's dtype.
template <class A, class X>
ITR_FN typename A::T x_at(const X* x, int64_t j) {
  if constexpr (std::is_same<X, float>::value) return attn::load_f32<A>(x, j);
  else return A::bf16(x, j);
}
template <class A, class X>
ITR_FN void put_x(X* p, int64_t j, typename A::T v) {
  if constexpr (std::is_same<X, float>::value) attn::store_f32<A>(p, j, v);
  else A::put_bf16(p, j, v);
}

// The module's `.to(input_dtype)` of x * rstd: round to nearest even bf16 for bf16 x, nothing for fp32 x.
template <class X, class F>
ITR_FN F as_input(F v) {
  if constexpr (std::is_same<X, float>::value) return v;
  else return convert::bf16_to_f32(convert::f32_to_bf16(v));
}

// An fp32 (F32) or bf16 vector of the row (weight, y, dy) at columns j.., as fp32.
template <bool F32, class A>
ITR_FN typename A::T load(const void* p, int64_t j) {
  if constexpr (F32) return attn::load_f32<A>(static_cast<const float*>(p), j);
  else return A::bf16(static_cast<const uint16_t*>(p), j);
}

// y (and dy) are fp32 when x or the weight is, as torch promotes `weight * h.to(input_dtype)`.
template <class X, bool W32>
constexpr bool kY32 = std::is_same<X, float>::value || W32;

template <class X, bool W32>
float rms_norm_row_impl(const RmsNormRow& r) {
  const X* x = static_cast<const X*>(r.x);
  // mean then + eps then 1 / sqrt, each rounded to fp32 as torch's pow(2).mean(), + eps and rsqrt are.
  const float mean = sum_of_squares(x, r.n) / float(r.n);
  const float rstd = 1.0f / math::sqrt_(mean + r.eps);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto y = load<W32, A>(r.weight, j) * as_input<X>(x_at<A>(x, j) * rstd);
    if constexpr (kY32<X, W32>) attn::store_f32<A>(static_cast<float*>(r.y), j, y);
    else A::put_bf16(static_cast<uint16_t*>(r.y), j, y);
  });
  return rstd;
}

// The backward of one row of x (bf16 or fp32) up to its rounding: put(a, j, g) receives columns j.. of x's fp32
// gradient (the caller stores it, adding any other gradient first); dw accumulates dy * round(xhat) in fp32.
template <class X, bool W32, class Put>
void grad_row(const void* dy, const X* x, const void* weight, float* dw, int64_t n, float rstd, const Put& put) {
  constexpr bool Y32 = kY32<X, W32>;
  auto dot = attn::start<attn::Sum>(0.0f);
  attn::columns(n, [&](auto a, int64_t j) {
    using A = decltype(a);
    dot.add(load<Y32, A>(dy, j) * load<W32, A>(weight, j) * (x_at<A>(x, j) * rstd));
  });
  const float c = dot.total() / float(n);
  attn::columns(n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto d = load<Y32, A>(dy, j);
    const auto xhat = x_at<A>(x, j) * rstd;
    put(a, j, (d * load<W32, A>(weight, j) - xhat * c) * rstd);
    // The weight's gradient is that of the forward as rounded: y = w * round(xhat).
    attn::store_f32<A>(dw, j, attn::load_f32<A>(dw, j) + d * as_input<X>(xhat));
  });
}

template <class X, bool W32>
void rms_norm_grad_row_impl(const RmsNormGradRow& r) {
  X* dx = static_cast<X*>(r.dx);
  grad_row<X, W32>(r.dy, static_cast<const X*>(r.x), r.weight, r.dw, r.n, r.rstd, [&](auto a, int64_t j, auto g) {
    put_x<decltype(a)>(dx, j, g);
  });
}

// Residual add + RMSNorm (ipex_train.rms_norm.add_rms_norm): the sum rounded to its dtype S (the residual's) and
// stored, then the RMSNorm row above on the stored sum, so y has the bits rms_norm gives on that sum.
template <class X, class S, bool W32>
float add_rms_norm_row_impl(const AddRmsNormRow& r) {
  const X* x = static_cast<const X*>(r.x);
  const S* res = static_cast<const S*>(r.residual);
  S* s = static_cast<S*>(r.sum);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    put_x<A>(s, j, x_at<A>(x, j) + x_at<A>(res, j));
  });
  return rms_norm_row_impl<S, W32>({r.sum, r.weight, r.y, r.n, r.eps, std::is_same<S, float>::value, W32});
}

// Its backward: the sum's total gradient (RMSNorm's plus the sum's own, dsum) rounded once to S, and to x's dtype
// when that differs (dx not null).
template <class X, class S, bool W32>
void add_rms_norm_grad_row_impl(const AddRmsNormGradRow& r) {
  const S* dsum = static_cast<const S*>(r.dsum);
  S* ds = static_cast<S*>(r.ds);
  X* dx = static_cast<X*>(r.dx);
  grad_row<S, W32>(r.dy, static_cast<const S*>(r.sum), r.weight, r.dw, r.n, r.rstd, [&](auto a, int64_t j, auto g) {
    using A = decltype(a);
    const auto total = g + x_at<A>(dsum, j);
    put_x<A>(ds, j, total);
    if (dx != nullptr) put_x<A>(dx, j, total);
  });
}

float rms_norm_row(const RmsNormRow& r) {
  if (r.x_f32) return r.w_f32 ? rms_norm_row_impl<float, true>(r) : rms_norm_row_impl<float, false>(r);
  return r.w_f32 ? rms_norm_row_impl<uint16_t, true>(r) : rms_norm_row_impl<uint16_t, false>(r);
}

void rms_norm_grad_row(const RmsNormGradRow& r) {
  if (r.x_f32) {
    if (r.w_f32) rms_norm_grad_row_impl<float, true>(r);
    else rms_norm_grad_row_impl<float, false>(r);
  } else {
    if (r.w_f32) rms_norm_grad_row_impl<uint16_t, true>(r);
    else rms_norm_grad_row_impl<uint16_t, false>(r);
  }
}

// The dispatch over the three (x, sum) dtype pairs (both fp32, bf16 x and an fp32 sum, both bf16) and the weight's.
template <class X, class S, class Row>
void add_rms_norm_grad_with(const Row& r) {
  if (r.w_f32) add_rms_norm_grad_row_impl<X, S, true>(r);
  else add_rms_norm_grad_row_impl<X, S, false>(r);
}

template <class X, class S>
float add_rms_norm_with(const AddRmsNormRow& r) {
  return r.w_f32 ? add_rms_norm_row_impl<X, S, true>(r) : add_rms_norm_row_impl<X, S, false>(r);
}

float add_rms_norm_row(const AddRmsNormRow& r) {
  if (r.x_f32) return add_rms_norm_with<float, float>(r);
  return r.s_f32 ? add_rms_norm_with<uint16_t, float>(r) : add_rms_norm_with<uint16_t, uint16_t>(r);
}

void add_rms_norm_grad_row(const AddRmsNormGradRow& r) {
  if (r.x_f32) add_rms_norm_grad_with<float, float>(r);
  else if (r.s_f32) add_rms_norm_grad_with<uint16_t, float>(r);
  else add_rms_norm_grad_with<uint16_t, uint16_t>(r);
}

}  // namespace rmsn
}  // namespace
}  // namespace ipex_train
