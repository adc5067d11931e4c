// Reduced-byte optimizer state: how one state tensor is stored when it is not fp32 (a StateCodec). The loops
// (kernels_cpu/src/loops.h) decode a block of state into fp32 scratch, run the optimizer's own per-element step on
// it (updates/*.h, untouched), and encode the block back: the format is a layout of the state, not a second copy of
// the math. Plain integer and IEEE float operations only (no contraction, no approximations), so every ISA variant
// gives the same bits.
//
// Formats (ipex_train/optim/_state_formats.py is the Python side and must give the same bits):
//   kBF16        bf16, one per element. Encoding rounds stochastically: the fp32 bits plus 16 random bits, cut to
//                the top half, so E[stored] = value. The random bits are a counter-based hash of (key, element
//                index): reproducible, and independent of threads, chunking and ISA.
//   kQ8Signed    blocks of kQ8Block elements: an fp32 scale (the block's absmax) and one int8 code per element,
//                value = scale * sign(q) * (|q| / 127)^4. A fourth-power map: the relative step shrinks toward
//                small values more slowly than a square law's, so first moments and momentum a tenth or a
//                thousandth of their block's largest still move when updated (round-to-nearest on a square law
//                left them stuck: Lamb's digits loss was 1.5-3% above fp32 state; 127 levels on the fourth root).
//   kQ8Unsigned  as kQ8Signed for state that is never negative (second moments): uint8 codes,
//                value = scale * (q / 255)^4.
// The int8 formats round to nearest (in the code domain), and encode(decode(q)) == q holds for every block: the
// block's largest element decodes to exactly the scale, so re-encoding finds the same scale and codes.
// A packed int8 state tensor holds the scales first (4 bytes per block), then the codes.
#pragma once

#include "common.h"

namespace ipex_train {

enum class StateCodec : uint8_t { kPlain = 0, kBF16 = 1, kQ8Signed = 2, kQ8Unsigned = 3 };

constexpr int64_t kQ8Block = 256;  // elements per int8 block (one fp32 scale)

namespace codec {

// murmur3's 32-bit finalizer: a bijection with full avalanche.
ITR_FN uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// The 16 random bits of element `index` of a state tensor stepped with rounding key `key`.
ITR_FN uint32_t random16(uint64_t key, int64_t index) {
  const uint32_t lo = uint32_t(uint64_t(index)), hi = uint32_t(uint64_t(index) >> 32);
  return fmix32(lo * 0x9E3779B1u + uint32_t(key) + fmix32(hi ^ uint32_t(key >> 32))) >> 16;
}

// splitmix64's finalizer.
ITR_FN uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The rounding key of the parameter at position `index` of a step call with key `call_key` (the ops' state_key),
// so that each parameter draws its own random bits; the CPU ops and the SYCL host both derive it here.
ITR_FN uint64_t param_key(uint64_t call_key, uint64_t index) {
  return mix64(call_key ^ mix64(index + 0x9E3779B97F4A7C15ull));
}

// x rounded to bf16 by adding r (16 random bits) to its low half; NaN stays a quiet NaN of the same sign.
ITR_FN uint16_t bf16_stochastic(float x, uint32_t r) {
  const uint32_t u = math::f32_bits(x);
  return uint16_t(x != x ? (u >> 16) | 0x40u : (u + r) >> 16);
}

ITR_FN float q8_decode(int32_t q, float scale, bool is_signed) {
  const float t = float(q < 0 ? -q : q) / (is_signed ? 127.0f : 255.0f);
  const float mag = ((t * t) * (t * t)) * scale;
  return q < 0 ? -mag : mag;
}

// The code of x in a block of scale `scale` (> 0). Branch-free, so the encode loops vectorize.
template <bool SIGNED>
ITR_FN int32_t q8_encode(float x, float scale) {
  const uint32_t bits = math::f32_bits(x);
  float r = math::f32_from_bits(bits & 0x7FFFFFFFu) / scale;
  r = math::select(r < 1.0f, r, 1.0f);  // clamps rounding above the scale, and NaN ratios, to the largest code
  const float y = __builtin_sqrtf(__builtin_sqrtf(r)) * (SIGNED ? 127.0f : 255.0f);
  const int32_t q = int32_t(y + 0.5f);
  const int32_t neg = -int32_t(bits >> 31);  // all ones for a negative x
  return (q ^ neg) - neg;
}

// Decodes n elements (a whole number of kQ8Block blocks, except at the end of a tensor) starting at element `first`
// of a state tensor in format c; `codes` points at element `first`, `scales` at its block's scale.
ITR_FN void decode(StateCodec c, const void* codes, const float* scales, float* out, int64_t n) {
  if (c == StateCodec::kBF16) {
    const uint16_t* p = static_cast<const uint16_t*>(codes);
    for (int64_t j = 0; j < n; ++j) out[j] = math::f32_from_bits(uint32_t(p[j]) << 16);
    return;
  }
  const bool is_signed = c == StateCodec::kQ8Signed;
  for (int64_t b = 0; b < n; b += kQ8Block) {
    const int64_t m = n - b < kQ8Block ? n - b : kQ8Block;
    const float s = scales[b / kQ8Block];
    if (is_signed) {
      const int8_t* q = static_cast<const int8_t*>(codes) + b;
      for (int64_t j = 0; j < m; ++j) out[b + j] = q8_decode(q[j], s, true);
    } else {
      const uint8_t* q = static_cast<const uint8_t*>(codes) + b;
      for (int64_t j = 0; j < m; ++j) out[b + j] = q8_decode(q[j], s, false);
    }
  }
}

// Encodes n fp32 values (see decode); `key` and `first` give kBF16's random bits.
ITR_FN void encode(StateCodec c, const float* in, void* codes, float* scales, int64_t n, uint64_t key, int64_t first) {
  if (c == StateCodec::kBF16) {
    uint16_t* p = static_cast<uint16_t*>(codes);
    // random16 with its per-2^32-elements term hoisted: the callers' runs (loops.h's stages) never cross one.
    const uint32_t base = uint32_t(key) + fmix32(uint32_t(uint64_t(first) >> 32) ^ uint32_t(key >> 32));
    const uint32_t lo = uint32_t(uint64_t(first));
    for (int64_t j = 0; j < n; ++j)
      p[j] = bf16_stochastic(in[j], fmix32((lo + uint32_t(j)) * 0x9E3779B1u + base) >> 16);
    return;
  }
  const bool is_signed = c == StateCodec::kQ8Signed;
  for (int64_t b = 0; b < n; b += kQ8Block) {
    const int64_t m = n - b < kQ8Block ? n - b : kQ8Block;
    // The absmax as the largest |x| bit pattern: for non-negative floats integer order is float order, and NaN
    // patterns are above Inf's, so a NaN element makes the scale (and the whole block) NaN.
    uint32_t top = 0;
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t a = math::f32_bits(in[b + j]) & 0x7FFFFFFFu;
      top = a > top ? a : top;
    }
    const float s = math::f32_from_bits(top);
    scales[b / kQ8Block] = s;
    const float safe = s > 0.0f ? s : 1.0f;  // an all-zero block: codes 0
    if (is_signed) {
      int8_t* q = static_cast<int8_t*>(codes) + b;
      for (int64_t j = 0; j < m; ++j) q[j] = int8_t(q8_encode<true>(in[b + j], safe));
    } else {
      uint8_t* q = static_cast<uint8_t*>(codes) + b;
      for (int64_t j = 0; j < m; ++j) q[j] = uint8_t(q8_encode<false>(math::select(in[b + j] > 0.0f, in[b + j], 0.0f), safe));
    }
  }
}

}  // namespace codec
}  // namespace ipex_train
