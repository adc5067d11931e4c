// Shared building blocks for the per-element optimizer math.
//
// Everything here is header-only, free of the C++ standard library and of torch, so the same code compiles
//  - in every ISA translation unit of kernels_cpu (each built for a different -m target; internal linkage keeps
//    an AVX-512 copy of a helper from ever being picked by the linker for the AVX2 or scalar build), and
//  - as SYCL device code (kernels_xpu compiles these headers at run time with SYCL-RTC).
#pragma once

#include <stdint.h>

#if defined(__SYCL_DEVICE_ONLY__) || defined(IPEX_TRAIN_SYCL)
#define ITR_FN static inline
#else
#define ITR_FN static inline __attribute__((always_inline))
#endif

namespace ipex_train {
namespace math {

ITR_FN float sqrt_(float x) { return __builtin_sqrtf(x); }
ITR_FN double sqrt_(double x) { return __builtin_sqrt(x); }

// NaN-propagating max, as torch.maximum does (amsgrad keeps a NaN once it appears, like torch).
template <class T>
ITR_FN T maximum(T a, T b) {
  return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
}

// torch's lerp formula (aten/src/ATen/native/Lerp.h): the branch picks the form that is exact at weight 0 or 1.
template <class T>
ITR_FN T lerp(T self, T end, T weight) {
  return (weight < T(0.5)) ? self + weight * (end - self) : end - (end - self) * (T(1) - weight);
}

ITR_FN uint32_t f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
ITR_FN float f32_from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }

}  // namespace math
}  // namespace ipex_train
