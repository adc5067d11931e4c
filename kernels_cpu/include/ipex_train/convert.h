// Conversions between fp32 and the 16-bit storage formats, written with integer bit operations so that every
// ISA variant (and the SYCL device) rounds identically and the compiler can vectorize them.
#pragma once

#include "common.h"

namespace ipex_train {
namespace convert {

ITR_FN float bf16_to_f32(uint16_t h) { return math::f32_from_bits(uint32_t(h) << 16); }

// Round to nearest, ties to even, as torch's `.to(torch.bfloat16)` does; NaN becomes the quiet NaN 0x7FC0.
ITR_FN uint16_t f32_to_bf16(float f) {
  const uint32_t u = math::f32_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return uint16_t(math::select(f != f, 0x7FC0u, rounded));
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
ITR_FN void split_bf16(float f, uint16_t& top, int16_t& residual) {
  const uint32_t u = math::f32_bits(f);
  const uint32_t t = (u + 0x8000u) >> 16;
  const bool nan = f != f;
  top = uint16_t(math::select(nan, (u >> 16) | 0x0040u, t));
  residual = int16_t(math::select(nan, 0u, u - (t << 16)));
}

ITR_FN float combine_bf16(uint16_t top, int16_t residual) {
  return math::f32_from_bits((uint32_t(top) << 16) + uint32_t(int32_t(residual)));
}

// IEEE binary16 -> fp32, exact for every input (subnormals, Inf and NaN included).
ITR_FN float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t shifted = uint32_t(h & 0x7FFFu) << 13;  // exponent and mantissa in fp32 position
  const uint32_t exp = shifted & 0x0F800000u;
  const float normal = math::f32_from_bits(shifted + 0x38000000u);                  // rebias 15 -> 127
  const float infnan = math::f32_from_bits(shifted + 0x70000000u);                  // exponent 31 -> 255
  const float subnormal = math::f32_from_bits(shifted + 0x38800000u) - 6.103515625e-05f;  // exact: m * 2^-24
  const float mag = math::select(exp == 0x0F800000u, infnan, math::select(exp == 0, subnormal, normal));
  return math::f32_from_bits(math::f32_bits(mag) | sign);
}

// fp32 -> IEEE binary16, round to nearest even (as torch's `.to(torch.float16)`); overflow gives +-Inf,
// NaN gives a quiet NaN of the same sign.
ITR_FN uint16_t f32_to_f16(float f) {
  const uint32_t u = math::f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Below 2^-14 the result is subnormal: adding 0.5 makes the FPU round the mantissa into the low bits.
  const uint32_t sub = math::f32_bits(math::f32_from_bits(a) + 0.5f) - 0x3F000000u;
  // Normal range: rebias the exponent and round the 13 dropped bits to nearest even.
  const uint32_t norm = (a - 0x38000000u + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  uint32_t h = math::select(a < 0x38800000u, sub, norm);
  h = math::select(a >= 0x477FF000u, 0x7C00u, h);  // rounds to or above 65520: Inf
  h = math::select(a > 0x7F800000u, 0x7E00u, h);   // NaN
  return uint16_t(h | sign);
}

}  // namespace convert
}  // namespace ipex_train
