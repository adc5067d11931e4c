// Reduced-byte optimizer state: how one state tensor is stored when it is not fp32 (a StateCodec). The loops
// (kernels_cpu/src/loops.h) decode a block of state into fp32 scratch, run the optimizer's own per-element step on
// it (updates/*.h, untouched), and encode the block back: the format is a layout of the state, not a second copy of
// the math. Plain integer and IEEE float operations only (no contraction, no approximations), so every ISA variant
// gives the same bits.
//
// Formats (ipex_train/optim/state_formats.py is the Python side and must give the same bits):
//   kBF16        bf16, one per element. Encoding rounds stochastically: the fp32 bits plus 16 random bits, cut to
//                the top half, so E[stored] = value. The random bits of element i are the top half of
//                i * 0x9E3779B1 + base (mod 2^32), base a hash of the step's key: for one element a fresh uniform
//                draw each step (unbiased), across a tensor an equidistributed (Weyl) sequence; reproducible, and
//                independent of threads, chunking and ISA. No multiply per element: the vector loops step the
//                product by additions.
//   kQ8Signed    blocks of kQ8Block elements: an fp32 scale (the block's absmax) and one int8 code per element,
//                value = scale * sign(q) * (|q| * fl(1/127))^4. A fourth-power map: the relative step shrinks
//                toward small values more slowly than a square law's, so first moments and momentum a tenth or a
//                thousandth of their block's largest still move when updated (round-to-nearest on a square law left
//                them stuck: Lamb's digits loss was +0.5% to +1.6% against fp32 state; -0.46% mean on this map).
//   kQ8Unsigned  as kQ8Signed for state that is never negative (second moments): uint8 codes,
//                value = scale * (q * fl(1/255))^4.
// The int8 formats round to nearest in the code domain: r = min(|x| * fl(1/scale), 1), q = trunc(sqrt(sqrt(r)) *
// 127 + 1/2) (signed) or trunc(sqrt(sqrt(r)) * 255 + 1/2) (unsigned), all in fp32 (one division per block, none per
// element). encode(decode(q)) == q holds for every block: the block's largest element decodes to exactly the scale
// (127 * fl(1/127) == 1 and 255 * fl(1/255) == 1 in fp32), so re-encoding finds the same scale, and every other
// decoded value re-encodes within a few ulps of its code.
// A packed int8 state tensor holds the scales first (4 bytes per block), then the codes.
//
// The element formulas are templates on the float type F (and its 32-bit unsigned bit type): float one element at a
// time, or a whole CPU vector (kernels_cpu/src/simd.h, which declares the vector overloads of the math:: helpers
// used here before it includes this header), as convert.h's are.
#pragma once

#include "common.h"

namespace ipex_train {

enum class StateCodec : uint8_t { kPlain = 0, kBF16 = 1, kQ8Signed = 2, kQ8Unsigned = 3 };

constexpr int64_t kQ8Block = 256;  // elements per int8 block (one fp32 scale)

namespace math {
// float <-> 32-bit integer lanes, for code values (small, non-negative).
ITR_FN uint32_t trunc_u32(float x) { return uint32_t(int32_t(x)); }
}  // namespace math

namespace codec {

// murmur3's 32-bit finalizer: a bijection with full avalanche.
template <class U>
ITR_FN U fmix32(U h) {
  h = h ^ (h >> 16);
  h = h * 0x85EBCA6Bu;
  h = h ^ (h >> 13);
  h = h * 0xC2B2AE35u;
  return h ^ (h >> 16);
}

constexpr uint32_t kWeyl = 0x9E3779B1u;  // 2^32 / golden ratio, odd

// The per-run part of random16: a hash of the key and of the index's high 32 bits (a run never crosses a multiple
// of 2^32).
ITR_FN uint32_t random_base(uint64_t key, int64_t first) {
  return fmix32(uint32_t(key) + fmix32(uint32_t(uint64_t(first) >> 32) ^ uint32_t(key >> 32)));
}

// The 16 random bits of the elements whose indices have low 32 bits lo, from weyl = lo * kWeyl and their run's
// random_base.
template <class U>
ITR_FN U random16_at(U weyl, uint32_t base) {
  return (weyl + base) >> 16;
}

// The 16 random bits of element `index` of a state tensor stepped with rounding key `key`.
ITR_FN uint32_t random16(uint64_t key, int64_t index) {
  return random16_at(uint32_t(uint64_t(index)) * kWeyl, random_base(key, index));
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

// x rounded to bf16 by adding r (16 random bits) to its low half; NaN stays a quiet NaN of the same sign. The result
// is the bf16 bits, zero-extended.
template <class F, class U>
ITR_FN U bf16_stochastic(F x, U r) {
  const U u = math::f32_bits(x);
  return math::select(x != x, (u >> 16) | 0x40u, (u + r) >> 16);
}

constexpr float kInv127 = 1.0f / 127.0f;
constexpr float kInv255 = 1.0f / 255.0f;

// |value| of a code of magnitude t (as a float) in a block of scale `scale`.
template <bool SIGNED, class F>
ITR_FN F q8_magnitude(F t, F scale) {
  t = t * F(SIGNED ? kInv127 : kInv255);
  const F t2 = t * t;
  return (t2 * t2) * scale;
}

// The fp32 value of code q (as its int32 value) in a block of scale `scale`.
ITR_FN float q8_decode(int32_t q, float scale, bool is_signed) {
  const float t = float(q < 0 ? -q : q);
  const float mag = is_signed ? q8_magnitude<true>(t, scale) : q8_magnitude<false>(t, scale);
  return q < 0 ? -mag : mag;
}

// The per-block factor of the codes, fl(1/scale) (an all-zero block, scale 0, gets codes 0).
ITR_FN float q8_inverse(float scale) { return 1.0f / (scale > 0.0f ? scale : 1.0f); }

// The code magnitude (as 32-bit lanes) of a = |x| (signed) or max(x, 0) (unsigned) in a block of inverse scale inv.
template <bool SIGNED, class F>
ITR_FN auto q8_code(F a, F inv) {
  F r = a * inv;
  r = math::select(F(1.0f) > r, r, F(1.0f));  // clamps rounding above the scale, and NaN (a NaN scale), to the top
  const F root = math::sqrt_(math::sqrt_(r));
  return math::trunc_u32(root * F(SIGNED ? 127.0f : 255.0f) + 0.5f);
}

// A signed code: the magnitude q with x's sign (two's complement in the 32-bit lanes).
template <class F, class U>
ITR_FN U q8_with_sign(U q, F x) {
  const U neg = U(0u) - (math::f32_bits(x) >> 31);  // all ones for a negative x
  return (q ^ neg) - neg;
}

// |x| and max(x, 0) (NaN -> 0): what the signed and unsigned codes measure.
template <class F>
ITR_FN F q8_abs(F x) {
  return math::f32_from_bits(math::f32_bits(x) & 0x7FFFFFFFu);
}
template <class F>
ITR_FN F q8_positive(F x) {
  return math::select(x > F(0.0f), x, F(0.0f));
}

// The scale of a block: its absmax as the largest |x| bit pattern (for non-negative floats integer order is float
// order, and NaN patterns are above Inf's, so a NaN element makes the scale, and the whole block, NaN).
ITR_FN uint32_t q8_absmax_bits(const float* in, int64_t m, uint32_t top) {
  for (int64_t j = 0; j < m; ++j) {
    const uint32_t a = math::f32_bits(in[j]) & 0x7FFFFFFFu;
    top = a > top ? a : top;
  }
  return top;
}

// Codes of in[j0, m) in a block of inverse scale inv.
template <bool SIGNED>
ITR_FN void q8_encode_codes(const float* in, void* codes, float inv, int64_t j0, int64_t m) {
  for (int64_t j = j0; j < m; ++j) {
    if constexpr (SIGNED) {
      static_cast<int8_t*>(codes)[j] = int8_t(q8_with_sign(q8_code<true>(q8_abs(in[j]), inv), in[j]));
    } else {
      static_cast<uint8_t*>(codes)[j] = uint8_t(q8_code<false>(q8_positive(in[j]), inv));
    }
  }
}

// Decodes n elements (a whole number of kQ8Block blocks, except at the end of a tensor) starting at element `first`
// of a state tensor in format c; `codes` points at element `first`, `scales` at its block's scale. Elements before
// j0 are left alone (the vector loops did them).
ITR_FN void decode(StateCodec c, const void* codes, const float* scales, float* out, int64_t n, int64_t j0 = 0) {
  if (c == StateCodec::kBF16) {
    const uint16_t* p = static_cast<const uint16_t*>(codes);
    for (int64_t j = j0; j < n; ++j) out[j] = math::f32_from_bits(uint32_t(p[j]) << 16);
    return;
  }
  const bool is_signed = c == StateCodec::kQ8Signed;
  for (int64_t j = j0; j < n; ++j) {
    const int32_t q = is_signed ? static_cast<const int8_t*>(codes)[j] : static_cast<const uint8_t*>(codes)[j];
    out[j] = q8_decode(q, scales[j / kQ8Block], is_signed);
  }
}

// Encodes n fp32 values (see decode); `key` and `first` give kBF16's random bits.
ITR_FN void encode(StateCodec c, const float* in, void* codes, float* scales, int64_t n, uint64_t key, int64_t first) {
  if (c == StateCodec::kBF16) {
    uint16_t* p = static_cast<uint16_t*>(codes);
    const uint32_t base = random_base(key, first), lo = uint32_t(uint64_t(first));
    for (int64_t j = 0; j < n; ++j)
      p[j] = uint16_t(bf16_stochastic(in[j], random16_at((lo + uint32_t(j)) * kWeyl, base)));
    return;
  }
  for (int64_t b = 0; b < n; b += kQ8Block) {
    const int64_t m = n - b < kQ8Block ? n - b : kQ8Block;
    const float s = math::f32_from_bits(q8_absmax_bits(in + b, m, 0));
    scales[b / kQ8Block] = s;
    char* q = static_cast<char*>(codes) + b;
    if (c == StateCodec::kQ8Signed) q8_encode_codes<true>(in + b, q, q8_inverse(s), 0, m);
    else q8_encode_codes<false>(in + b, q, q8_inverse(s), 0, m);
  }
}

}  // namespace codec
}  // namespace ipex_train
