// The per-row math of ipex_train's RMSNorm (ipex_train/rms_norm): forward and backward of one row of bf16 x, fp32
// inside. Included by loops.h after attention_rows.h (whose column helpers it uses), so each ISA file compiles
// these very lines.
//
// Why: Hugging Face's LlamaRMSNorm runs ~10 elementwise passes under autograd (2.6 ms forward + backward on a
// (4, 256, 768) bf16 input at 2 threads); one pass to reduce and one to write per row here.
//
// The forward is bit-identical to that module on bf16 input: its mean(x^2) is torch's fp32 sum (a fixed order, see
// sum_of_squares) divided by n, rstd = 1 / sqrt(mean + eps), and y = w * bf16(x * rstd) rounded once more.
#pragma once

#include "kernel_abi.h"

namespace ipex_train {
namespace {
namespace rmsn {

// torch's fp32 sum over a contiguous last dim (aten/src/ATen/native/cpu/SumKernel.cpp, torch 2.x) adds
// 8-float vectors (its kernel's width on x86 in every CPU capability, checked against torch 2.14) in this order:
// vector i goes to partial sum i % 4 of a 4-level cascade (each level a block of 2^p vectors, p >= 4), the four
// partial sums are added in order, then the tail elements and the 8 lanes one by one. Squares of bf16 values are
// exact in fp32, so repeating that order repeats torch's mean bit for bit.
constexpr int64_t kLanes = 8;
constexpr int64_t kIlp = 4;
constexpr int64_t kLevels = 4;

struct Lanes {
  float v[kLanes];
};

ITR_FN float bf16_value(uint16_t h) { return convert::bf16_to_f32(uint32_t(h)); }

ITR_FN void zero(float& a) { a = 0.0f; }
ITR_FN void zero(Lanes& a) {
  for (int64_t l = 0; l < kLanes; ++l) a.v[l] = 0.0f;
}
ITR_FN void add(float& a, const float& b) { a += b; }
ITR_FN void add(Lanes& a, const Lanes& b) {
  for (int64_t l = 0; l < kLanes; ++l) a.v[l] += b.v[l];
}
// Adds the squares of element e (one value, or the vector of kLanes values at e * kLanes).
ITR_FN void add_square(float& a, const uint16_t* x, int64_t e) {
  const float f = bf16_value(x[e]);
  a += f * f;
}
ITR_FN void add_square(Lanes& a, const uint16_t* x, int64_t e) {
  for (int64_t l = 0; l < kLanes; ++l) {
    const float f = bf16_value(x[e * kLanes + l]);
    a.v[l] += f * f;
  }
}

ITR_FN int64_t ceil_log2(int64_t v) { return v <= 2 ? 1 : 64 - __builtin_clzll(uint64_t(v - 1)); }

// The sum of the squares of elements [0, size) of x, E being one value or a vector of kLanes (see above).
template <class E>
E cascade_sum(const uint16_t* x, int64_t size) {
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

ITR_FN float sum_of_squares(const uint16_t* x, int64_t n) {
  if (n < kLanes) return cascade_sum<float>(x, n);
  const int64_t vectors = n / kLanes;
  const Lanes v = cascade_sum<Lanes>(x, vectors);
  float total = 0.0f;
  for (int64_t j = vectors * kLanes; j < n; ++j) add_square(total, x, j);
  for (int64_t l = 0; l < kLanes; ++l) total += v.v[l];
  return total;
}

// bf16(v) as a float: round to nearest even and back.
template <class F>
ITR_FN F round_bf16(F v) {
  return convert::bf16_to_f32(convert::f32_to_bf16(v));
}

template <bool WIDE, class A>
ITR_FN typename A::T weight_at(const void* w, int64_t j) {
  if constexpr (WIDE) return attn::load_f32<A>(static_cast<const float*>(w), j);
  else return A::bf16(static_cast<const uint16_t*>(w), j);
}

template <bool WIDE>
float rms_norm_row_impl(const RmsNormRow& r) {
  // mean then + eps then 1 / sqrt, each rounded to fp32 as torch's pow(2).mean(), + eps and rsqrt are.
  const float mean = sum_of_squares(r.x, r.n) / float(r.n);
  const float rstd = 1.0f / math::sqrt_(mean + r.eps);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto y = weight_at<WIDE, A>(r.weight, j) * round_bf16(A::bf16(r.x, j) * rstd);
    if constexpr (WIDE) attn::store_f32<A>(static_cast<float*>(r.y), j, y);
    else A::put_bf16(static_cast<uint16_t*>(r.y), j, y);
  });
  return rstd;
}

template <bool WIDE, class A>
ITR_FN typename A::T grad_at(const void* dy, int64_t j) {
  if constexpr (WIDE) return attn::load_f32<A>(static_cast<const float*>(dy), j);
  else return A::bf16(static_cast<const uint16_t*>(dy), j);
}

template <bool WIDE>
void rms_norm_grad_row_impl(const RmsNormGradRow& r) {
  const float rstd = r.rstd;
  auto dot = attn::start<attn::Sum>(0.0f);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    dot.add(grad_at<WIDE, A>(r.dy, j) * weight_at<WIDE, A>(r.weight, j) * (A::bf16(r.x, j) * rstd));
  });
  const float c = dot.total() / float(r.n);
  attn::columns(r.n, [&](auto a, int64_t j) {
    using A = decltype(a);
    const auto dy = grad_at<WIDE, A>(r.dy, j);
    const auto xhat = A::bf16(r.x, j) * rstd;
    A::put_bf16(r.dx, j, (dy * weight_at<WIDE, A>(r.weight, j) - xhat * c) * rstd);
    // The weight's gradient is that of the forward as rounded: y = w * bf16(xhat).
    attn::store_f32<A>(r.dw, j, attn::load_f32<A>(r.dw, j) + dy * round_bf16(xhat));
  });
}

float rms_norm_row(const RmsNormRow& r) { return r.wide ? rms_norm_row_impl<true>(r) : rms_norm_row_impl<false>(r); }

void rms_norm_grad_row(const RmsNormGradRow& r) {
  if (r.wide) rms_norm_grad_row_impl<true>(r);
  else rms_norm_grad_row_impl<false>(r);
}

}  // namespace rmsn
}  // namespace
}  // namespace ipex_train
