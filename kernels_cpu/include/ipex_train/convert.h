// Conversions between fp32 and the 16-bit storage formats, written with integer bit operations so that every
// ISA variant (and the SYCL device) rounds identically.
//
// The formulas are templates on the float type F and its 32-bit unsigned bit type U: float/uint32_t one element at
// a time, or a whole CPU vector (kernels_cpu/src/simd.h), so the vectorized loops run these very lines. 16-bit
// values travel zero-extended in U (the residual sign-extended).
#pragma once

#include "common.h"

namespace ipex_train {
namespace convert {

template <class U>
ITR_FN auto bf16_to_f32(U h) {
  return math::f32_from_bits(h << 16);
}

// Round to nearest, ties to even, as torch's `.to(torch.bfloat16)` does; NaN becomes the quiet NaN 0x7FC0.
template <class F>
ITR_FN auto f32_to_bf16(F f) {
  const auto u = math::f32_bits(f);
  const decltype(u) rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return math::select(f != f, 0x7FC0u, rounded);
}

// Split bf16 storage: fp32 bits == (top << 16) + residual, computed in wrapping 32-bit integer arithmetic.
//
// top is the fp32 value rounded to the nearest bf16 with ties away from zero (only an exact tie, low half ==
// 0x8000, differs from torch's ties-to-even cast). Ties-to-even cannot be made lossless with a 16-bit residual:
// an even top has 65537 fp32 values rounding to it. With ties away, every top owns exactly the 65536 bit patterns
// [top<<16 - 0x8000, top<<16 + 0x7FFF], so the residual is an int16 and recombining gives back the original bits
// for every finite value, -0, +-Inf and subnormals included. Finite values above the largest bf16 midpoint have
// top = +-Inf (as the ties-to-even cast does) and still recombine exactly. NaN splits to a quiet NaN top of the
// same sign with residual 0 and recombines to that quiet NaN (the payload is not kept).
template <class F, class U>
ITR_FN void split_bf16(F f, U& top, U& residual) {
  const U u = math::f32_bits(f);
  const U t = (u + 0x8000u) >> 16;
  const auto nan = f != f;
  top = math::select(nan, (u >> 16) | 0x0040u, t);
  residual = math::select(nan, 0u, u - (t << 16));  // the low 16 bits are the int16 residual
}

// residual: the int16 residual sign-extended to 32 bits.
template <class U>
ITR_FN auto combine_bf16(U top, U residual) {
  return math::f32_from_bits((top << 16) + residual);
}

// IEEE binary16 -> fp32, exact for every number and Inf; a NaN keeps its sign and payload and comes out quiet (as
// F16C's vcvtph2ps, which the CPU's vector loops use).
template <class U>
ITR_FN auto f16_to_f32(U h) {
  const U sign = (h & 0x8000u) << 16;
  const U shifted = (h & 0x7FFFu) << 13;  // exponent and mantissa in fp32 position
  const U exp = shifted & 0x0F800000u;
  const auto normal = math::f32_from_bits(shifted + 0x38000000u);                             // rebias 15 -> 127
  const auto infnan = math::f32_from_bits((shifted + 0x70000000u) | math::select((h & 0x3FFu) == 0u, 0u, 0x00400000u));
  const decltype(normal) subnormal = math::f32_from_bits(shifted + 0x38800000u) - 6.103515625e-05f;  // m * 2^-24
  const decltype(normal) mag = math::select(exp == 0x0F800000u, infnan, math::select(exp == 0u, subnormal, normal));
  return math::f32_from_bits(math::f32_bits(mag) | sign);
}

// fp32 -> IEEE binary16, round to nearest even (as torch's `.to(torch.float16)`); overflow gives +-Inf; a NaN
// gives a quiet NaN of the same sign with the top 9 payload bits (as F16C's vcvtps2ph, which the CPU's vector loops
// use).
template <class F>
ITR_FN auto f32_to_f16(F f) {
  using U = decltype(math::f32_bits(f));
  const U u = math::f32_bits(f);
  const U sign = (u >> 16) & 0x8000u;
  const U a = u & 0x7FFFFFFFu;
  // Below 2^-14 the result is subnormal: adding 0.5 makes the FPU round the mantissa into the low bits.
  const U sub = math::f32_bits(math::f32_from_bits(a) + 0.5f) - 0x3F000000u;
  // Normal range: rebias the exponent and round the 13 dropped bits to nearest even.
  const U norm = (a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  U h = math::select(a < 0x38800000u, sub, norm);
  h = math::select(a >= 0x477FF000u, 0x7C00u, h);  // rounds to or above 65520: Inf
  h = math::select(a > 0x7F800000u, 0x7E00u | ((a >> 13) & 0x1FFu), h);  // NaN
  return h | sign;
}

}  // namespace convert
}  // namespace ipex_train
