// Explicit CPU vectors for the ISA file that includes this (before loops.h), sized by ITR_SIMD_BYTES: 32 for AVX2,
// 64 for AVX-512. FV (floats), UV (their 32-bit unsigned bits) and Mask give the per-element math of
// ipex_train/updates/*.h and convert.h the operators it uses, so those very lines run kVecWidth elements at a time;
// Access is the storage access (ipex_train/elementwise.h) that reads and writes whole vectors.
//
// Why not leave it to the auto-vectorizer: GCC did vectorize the scalar loops, but its 16-bit packing and unpacking
// were slow. With these vectors (and uniform branches for the lerp form and weight decay) a compute-bound, in-cache
// split-bf16 Adam step went from 1.12 to 0.85 ns per element on one Zen 3 core, the fp32 one from 0.73 to 0.40.
//
// Built on GCC/Clang vector extensions; everything sits in an anonymous namespace, so each ISA file has its own copy.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "ipex_train/common.h"

#ifndef ITR_SIMD_BYTES
#error "simd.h needs ITR_SIMD_BYTES (32 or 64) from the ISA file"
#endif

namespace ipex_train {
namespace math {
namespace {  // this ISA file's own copy
namespace vec {

constexpr int64_t kVecWidth = ITR_SIMD_BYTES / 4;

typedef float vf __attribute__((vector_size(ITR_SIMD_BYTES)));
typedef uint32_t vu __attribute__((vector_size(ITR_SIMD_BYTES)));
typedef int32_t vi __attribute__((vector_size(ITR_SIMD_BYTES)));

#define ITR_V static inline __attribute__((always_inline))
#define ITR_VF inline __attribute__((always_inline))  // for friends, which cannot be static

struct Mask {  // all-ones / all-zeros lanes, from any comparison below
  vi m;
};

// Floats. Broadcasts implicitly from a scalar, so `w * c.decay`, `T(0.5)` and `x + 0.5f` read as they do for float.
struct FV {
  vf v;
  FV() = default;
  FV(float s) : v(vf{} + s) {}  // NOLINT: implicit on purpose (see above)
  static FV of(vf x) {
    FV r;
    r.v = x;
    return r;
  }
  friend ITR_VF FV operator+(FV a, FV b) { return of(a.v + b.v); }
  friend ITR_VF FV operator-(FV a, FV b) { return of(a.v - b.v); }
  friend ITR_VF FV operator*(FV a, FV b) { return of(a.v * b.v); }
  friend ITR_VF FV operator/(FV a, FV b) { return of(a.v / b.v); }
  friend ITR_VF Mask operator!=(FV a, FV b) { return {a.v != b.v}; }  // true for NaN lanes, as for float
  friend ITR_VF Mask operator>(FV a, FV b) { return {a.v > b.v}; }
};

// 32-bit unsigned lanes: shifts, masks and unsigned comparisons, as on uint32_t.
struct UV {
  vu v;
  UV() = default;
  UV(uint32_t s) : v(vu{} + s) {}  // NOLINT: implicit, as FV
  static UV of(vu x) {
    UV r;
    r.v = x;
    return r;
  }
  friend ITR_VF UV operator+(UV a, UV b) { return of(a.v + b.v); }
  friend ITR_VF UV operator-(UV a, UV b) { return of(a.v - b.v); }
  friend ITR_VF UV operator&(UV a, UV b) { return of(a.v & b.v); }
  friend ITR_VF UV operator|(UV a, UV b) { return of(a.v | b.v); }
  friend ITR_VF UV operator^(UV a, UV b) { return of(a.v ^ b.v); }
  friend ITR_VF UV operator*(UV a, UV b) { return of(a.v * b.v); }  // the low 32 bits, as uint32_t's *
  friend ITR_VF UV operator<<(UV a, int s) { return of(a.v << s); }
  friend ITR_VF UV operator>>(UV a, int s) { return of(a.v >> s); }
  friend ITR_VF Mask operator==(UV a, UV b) { return {a.v == b.v}; }
  friend ITR_VF Mask operator<(UV a, UV b) { return {a.v < b.v}; }
  friend ITR_VF Mask operator>(UV a, UV b) { return {a.v > b.v}; }
  friend ITR_VF Mask operator>=(UV a, UV b) { return {a.v >= b.v}; }
};

// The math namespace's scalar helpers (ipex_train/common.h), lane-wise.
ITR_V FV select(Mask c, FV a, FV b) { return FV::of(c.m ? a.v : b.v); }
ITR_V UV select(Mask c, UV a, UV b) { return UV::of(c.m ? a.v : b.v); }
ITR_V UV f32_bits(FV f) { return UV::of(reinterpret_cast<vu>(f.v)); }
ITR_V FV f32_from_bits(UV u) { return FV::of(reinterpret_cast<vf>(u.v)); }
ITR_V FV sqrt_(FV x) {
#if ITR_SIMD_BYTES == 64
  return FV::of(reinterpret_cast<vf>(_mm512_sqrt_ps(reinterpret_cast<__m512>(x.v))));
#else
  return FV::of(reinterpret_cast<vf>(_mm256_sqrt_ps(reinterpret_cast<__m256>(x.v))));
#endif
}

template <class V, class P>
ITR_V V load_bytes(const P* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// Code values (small, non-negative) between float and 32-bit lanes.
ITR_V UV trunc_u32(FV x) { return UV::of(reinterpret_cast<vu>(__builtin_convertvector(x.v, vi))); }
ITR_V FV u32_to_f32(UV q) { return FV::of(__builtin_convertvector(reinterpret_cast<vi>(q.v), vf)); }

}  // namespace vec
}  // namespace

template <>
struct ScalarOf<vec::FV> {
  using type = float;
};

// Qualified calls such as math::select(...) in the element templates are looked up where those are defined, and only
// among names declared directly in math: hence these using-declarations, seen before the element code is.
using vec::f32_bits;
using vec::f32_from_bits;
using vec::select;
using vec::sqrt_;
using vec::trunc_u32;

}  // namespace math
}  // namespace ipex_train

#include "ipex_train/convert.h"      // after the overloads above, which its formulas call for vectors
#include "ipex_train/state_codec.h"  // the same

namespace ipex_train {
namespace math {
namespace {
namespace vec {

// Lane-wise 16 <-> 32-bit moves. widen_u16/widen_i16 zero-/sign-extend kVecWidth 16-bit values from memory;
// narrow16 packs lanes that must already fit in 16 unsigned bits (the AVX2 pack saturates) into one V16.
#if ITR_SIMD_BYTES == 64
ITR_V UV widen_u16(const void* p) { return UV::of(reinterpret_cast<vu>(_mm512_cvtepu16_epi32(load_bytes<__m256i>(p)))); }
ITR_V UV widen_i16(const void* p) { return UV::of(reinterpret_cast<vu>(_mm512_cvtepi16_epi32(load_bytes<__m256i>(p)))); }
typedef __m256i V16;  // kVecWidth 16-bit values
ITR_V V16 narrow16(UV v) { return _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(v.v)); }  // truncates each lane
#else
ITR_V UV widen_u16(const void* p) { return UV::of(reinterpret_cast<vu>(_mm256_cvtepu16_epi32(load_bytes<__m128i>(p)))); }
ITR_V UV widen_i16(const void* p) { return UV::of(reinterpret_cast<vu>(_mm256_cvtepi16_epi32(load_bytes<__m128i>(p)))); }
typedef __m128i V16;
ITR_V V16 narrow16(UV v) {
  // packus works per 128-bit half (exact here: every lane is <= 0xFFFF); vpermq gathers the two results.
  const __m256i packed = _mm256_packus_epi32(reinterpret_cast<__m256i>(v.v), __m256i{});
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

// Stores one vector of 16-bit values. STREAM: a non-temporal store, which writes the line without reading it first
// and leaves it out of the caches; p must then be aligned to sizeof(V16), and the caller fences (_mm_sfence) before
// other threads may read.
template <bool STREAM>
ITR_V void put16(uint16_t* p, V16 h) {
  if constexpr (STREAM) {
#if ITR_SIMD_BYTES == 64
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
#else
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
#endif
  } else {
    __builtin_memcpy(p, &h, sizeof h);
  }
}

// The storage access (see storage::Scalar in ipex_train/elementwise.h) for whole vectors of fp32 layouts. Every
// conversion gives the same bits as convert.h's formulas (the kernel tests compare the variants bit for bit).
// STREAM16 writes the bf16/fp16 values with non-temporal stores (Chunk::stream16).
template <bool STREAM16>
struct AccessOf {
  using T = FV;
  using Real = float;
  ITR_V T get(const float* p, int64_t i) { return FV::of(load_bytes<vf>(p + i)); }
  ITR_V void put(float* p, int64_t i, T v) { __builtin_memcpy(p + i, &v.v, sizeof v.v); }
  ITR_V T bf16(const uint16_t* p, int64_t i) { return convert::bf16_to_f32(widen_u16(p + i)); }
  ITR_V void put_bf16(uint16_t* p, int64_t i, T v) { put16<STREAM16>(p + i, narrow16(convert::f32_to_bf16(v))); }
  // F16C rounds and handles subnormals, Inf and NaN exactly as convert.h's f16 formulas.
#if ITR_SIMD_BYTES == 64
  ITR_V T f16(const uint16_t* p, int64_t i) { return FV::of(reinterpret_cast<vf>(_mm512_cvtph_ps(load_bytes<__m256i>(p + i)))); }
  ITR_V void put_f16(uint16_t* p, int64_t i, T v) {
    put16<STREAM16>(p + i, _mm512_cvtps_ph(reinterpret_cast<__m512>(v.v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#else
  ITR_V T f16(const uint16_t* p, int64_t i) { return FV::of(reinterpret_cast<vf>(_mm256_cvtph_ps(load_bytes<__m128i>(p + i)))); }
  ITR_V void put_f16(uint16_t* p, int64_t i, T v) {
    put16<STREAM16>(p + i, _mm256_cvtps_ph(reinterpret_cast<__m256>(v.v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  ITR_V T split(const uint16_t* top, const int16_t* res, int64_t i) {
    return convert::combine_bf16(widen_u16(top + i), widen_i16(res + i));
  }
  // convert::split_bf16, rearranged: the residual's 16 bits are the low half of the fp32 bits (the top's multiple
  // of 2^16 leaves them alone), and top is the high half of bits + 0x8000; NaN gives (bits >> 16) | 0x40 and 0.
  ITR_V void put_split(uint16_t* top, int16_t* res, int64_t i, T v) {
    const UV u = f32_bits(v);
    const Mask nan = v != v;
#if ITR_SIMD_BYTES == 64
    put16<false>(top + i, narrow16(select(nan, (u >> 16) | 0x0040u, (u + 0x8000u) >> 16)));
    put16<false>(reinterpret_cast<uint16_t*>(res + i), narrow16(select(nan, 0u, u & 0xFFFFu)));
#else
    // Lanes of [residual | top << 16] by a word blend, then one byte shuffle and one qword permute put the eight
    // residuals in the low 128 bits and the eight tops in the high 128 bits.
    const __m256i ui = reinterpret_cast<__m256i>(u.v);
    __m256i y = _mm256_blend_epi16(ui, reinterpret_cast<__m256i>((u + 0x8000u).v), 0xAA);
    const UV y_nan = (u & 0xFFFF0000u) | 0x00400000u;
    y = reinterpret_cast<__m256i>(select(nan, y_nan, UV::of(reinterpret_cast<vu>(y))).v);
    const __m256i halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,  //
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    y = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(y, halves), 0xD8);
    const __m128i r = _mm256_castsi256_si128(y), t = _mm256_extracti128_si256(y, 1);
    __builtin_memcpy(res + i, &r, sizeof r);
    __builtin_memcpy(top + i, &t, sizeof t);
#endif
  }
};

using Access = AccessOf<false>;

// Reduced-byte state (ipex_train/state_codec.h) a whole vector at a time: codec::decode and codec::encode over a run,
// the vectors through the codec's element formulas, the elements after the last whole vector through the codec's
// own loops; the same bits either way.

// kVecWidth 8-bit codes widened to 32-bit lanes (sign- or zero-extended), and the low byte of each lane stored.
template <bool SIGNED>
ITR_V UV widen8(const void* p) {
#if ITR_SIMD_BYTES == 64
  const __m128i b = load_bytes<__m128i>(p);
  return UV::of(reinterpret_cast<vu>(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b)));
#else
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return UV::of(reinterpret_cast<vu>(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b)));
#endif
}

ITR_V void narrow8(void* p, UV v) {
#if ITR_SIMD_BYTES == 64
  const __m128i b = _mm512_cvtepi32_epi8(reinterpret_cast<__m512i>(v.v));  // truncates each lane
  __builtin_memcpy(p, &b, sizeof b);
#else
  // Byte 0 of each lane to bytes 0-3 of its 128-bit half, then the two halves' first dwords side by side.
  const __m256i bytes0 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i low = _mm256_shuffle_epi8(reinterpret_cast<__m256i>(v.v), bytes0);
  const __m256i pair = _mm256_permutevar8x32_epi32(low, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(static_cast<__m128i*>(p), _mm256_castsi256_si128(pair));
#endif
}

ITR_V FV load_f(const float* p) {
#if ITR_SIMD_BYTES == 64
  return FV::of(reinterpret_cast<vf>(_mm512_loadu_ps(p)));
#else
  return FV::of(reinterpret_cast<vf>(_mm256_loadu_ps(p)));
#endif
}

template <bool SIGNED>
ITR_V FV q8_decode(const void* codes, FV scale) {
  const UV q = widen8<SIGNED>(codes);
  if constexpr (SIGNED) {
    const UV neg = UV(0u) - (q >> 31);
    const FV mag = codec::q8_magnitude<true>(u32_to_f32((q ^ neg) - neg), scale);
    return f32_from_bits(f32_bits(mag) | (q & 0x80000000u));
  } else {
    return codec::q8_magnitude<false>(u32_to_f32(q), scale);
  }
}

template <bool SIGNED>
ITR_V void q8_encode_block(const float* in, void* codes, float* scale, int64_t m) {
  const int64_t whole = m - m % kVecWidth;
  // vpmaxud: a select on a comparison made GCC chain a compare and a masked move per vector (~4x slower).
#if ITR_SIMD_BYTES == 64
  __m512i top = _mm512_setzero_si512();
  for (int64_t j = 0; j < whole; j += kVecWidth)
    top = _mm512_max_epu32(top, reinterpret_cast<__m512i>((f32_bits(load_f(in + j)) & 0x7FFFFFFFu).v));
#else
  __m256i top = _mm256_setzero_si256();
  for (int64_t j = 0; j < whole; j += kVecWidth)
    top = _mm256_max_epu32(top, reinterpret_cast<__m256i>((f32_bits(load_f(in + j)) & 0x7FFFFFFFu).v));
#endif
  const UV lanes = UV::of(reinterpret_cast<vu>(top));
  uint32_t t = 0;
  for (int64_t k = 0; k < kVecWidth; ++k) t = lanes.v[k] > t ? lanes.v[k] : t;
  const float s = math::f32_from_bits(codec::q8_absmax_bits(in + whole, m - whole, t));
  *scale = s;
  const float inv = codec::q8_inverse(s);
  char* q = static_cast<char*>(codes);
  for (int64_t j = 0; j < whole; j += kVecWidth) {
    const FV x = load_f(in + j);
    if constexpr (SIGNED) narrow8(q + j, codec::q8_with_sign(codec::q8_code<true>(codec::q8_abs(x), FV(inv)), x));
    else narrow8(q + j, codec::q8_code<false>(codec::q8_positive(x), FV(inv)));
  }
  codec::q8_encode_codes<SIGNED>(in, q, inv, whole, m);
}

// Not inlined: called once per run of up to loops.h's kStage elements, and where they were inlined GCC 12 kept each
// loaded vector on the stack (a store and reloads per vector).
__attribute__((noinline)) static void decode_state(StateCodec c, const void* codes, const float* scales, float* out,
                                                   int64_t n) {
  const int64_t whole = n - n % kVecWidth;
  const char* q = static_cast<const char*>(codes);
  int64_t j = 0;
  if (c == StateCodec::kBF16) {
    for (; j < whole; j += kVecWidth) {
      const FV v = convert::bf16_to_f32(widen_u16(static_cast<const uint16_t*>(codes) + j));
      __builtin_memcpy(out + j, &v.v, sizeof v.v);
    }
  } else if (c == StateCodec::kQ8Signed) {
    for (; j < whole; j += kVecWidth) {
      const FV v = q8_decode<true>(q + j, FV(scales[j / kQ8Block]));
      __builtin_memcpy(out + j, &v.v, sizeof v.v);
    }
  } else {
    for (; j < whole; j += kVecWidth) {
      const FV v = q8_decode<false>(q + j, FV(scales[j / kQ8Block]));
      __builtin_memcpy(out + j, &v.v, sizeof v.v);
    }
  }
  codec::decode(c, codes, scales, out, n, j);
}

__attribute__((noinline)) static void encode_state(StateCodec c, const float* in, void* codes, float* scales,
                                                   int64_t n, uint64_t key, int64_t first) {
  if (c == StateCodec::kBF16) {
    uint16_t* p = static_cast<uint16_t*>(codes);
    const uint32_t base = codec::random_base(key, first), lo = uint32_t(uint64_t(first));
    UV weyl;  // (lo + j) * kWeyl of each lane, advanced by additions
    for (int64_t k = 0; k < kVecWidth; ++k) weyl.v[k] = (lo + uint32_t(k)) * codec::kWeyl;
    const uint32_t step = uint32_t(kVecWidth) * codec::kWeyl;
    const int64_t whole = n - n % kVecWidth;
    for (int64_t j = 0; j < whole; j += kVecWidth, weyl = weyl + step)
      put16<false>(p + j, narrow16(codec::bf16_stochastic(load_f(in + j), codec::random16_at(weyl, base))));
    return codec::encode(c, in + whole, p + whole, nullptr, n - whole, key, first + whole);
  }
  for (int64_t b = 0; b < n; b += kQ8Block) {
    const int64_t m = n - b < kQ8Block ? n - b : kQ8Block;
    char* q = static_cast<char*>(codes) + b;
    if (c == StateCodec::kQ8Signed) q8_encode_block<true>(in + b, q, scales + b / kQ8Block, m);
    else q8_encode_block<false>(in + b, q, scales + b / kQ8Block, m);
  }
}

// Sums of squares in double of whole vectors, kept in registers. G groups of kVecWidth partial sums take turns, so
// the vector added t-th (elements t * kVecWidth + j) goes to group t % G: element i lands in partial sum
// i % (G * kVecWidth), the lane the scalar loops give it, and every variant adds the same numbers in the same order.
template <int G>
struct RegisterSquareSums {
  typedef double vd __attribute__((vector_size(ITR_SIMD_BYTES)));
  vd sums[G][2] = {};  // [group][low, high half of the float vector]
  int64_t added = 0;

  ITR_VF void add(FV x) {
#if ITR_SIMD_BYTES == 64
    const __m512 f = reinterpret_cast<__m512>(x.v);
    const vd lo = reinterpret_cast<vd>(_mm512_cvtps_pd(_mm512_castps512_ps256(f)));
    const vd hi = reinterpret_cast<vd>(
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
#else
    const __m256 f = reinterpret_cast<__m256>(x.v);
    const vd lo = reinterpret_cast<vd>(_mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    const vd hi = reinterpret_cast<vd>(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
#endif
    // A float's square is exact in double, so the fused multiply-add rounds once, like the scalar loops' add.
#if ITR_SIMD_BYTES == 64
    sums[0][0] = reinterpret_cast<vd>(_mm512_fmadd_pd(reinterpret_cast<__m512d>(lo), reinterpret_cast<__m512d>(lo),
                                                      reinterpret_cast<__m512d>(sums[0][0])));
    sums[0][1] = reinterpret_cast<vd>(_mm512_fmadd_pd(reinterpret_cast<__m512d>(hi), reinterpret_cast<__m512d>(hi),
                                                      reinterpret_cast<__m512d>(sums[0][1])));
#else
    sums[0][0] = reinterpret_cast<vd>(_mm256_fmadd_pd(reinterpret_cast<__m256d>(lo), reinterpret_cast<__m256d>(lo),
                                                      reinterpret_cast<__m256d>(sums[0][0])));
    sums[0][1] = reinterpret_cast<vd>(_mm256_fmadd_pd(reinterpret_cast<__m256d>(hi), reinterpret_cast<__m256d>(hi),
                                                      reinterpret_cast<__m256d>(sums[0][1])));
#endif
    // Rotate so that sums[0] is always the group of the next vector (a register renaming once unrolled).
    for (int k = 0; k + 1 < G; ++k) {
      for (int h = 0; h < 2; ++h) {
        const vd t = sums[k][h];
        sums[k][h] = sums[k + 1][h];
        sums[k + 1][h] = t;
      }
    }
    ++added;
  }

  // Writes the partial sums into lanes[0, G * kVecWidth), each at its element's lane.
  ITR_VF void store(double* lanes) const {
    for (int k = 0; k < G; ++k) {
      const int64_t group = (added + k) % G;  // sums[k] is the group of the vector after the last one added
      __builtin_memcpy(lanes + group * kVecWidth, &sums[k][0], sizeof(vd));
      __builtin_memcpy(lanes + group * kVecWidth + kVecWidth / 2, &sums[k][1], sizeof(vd));
    }
  }
};

}  // namespace vec
}  // namespace
}  // namespace math
}  // namespace ipex_train

#undef ITR_V
#undef ITR_VF

