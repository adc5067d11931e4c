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

ITR_FN uint32_t f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
ITR_FN float f32_from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }

// Branch-free selects: c ? a : b through bit masks. Written this way because GCC turns some plain `?:` chains
// back into branches, which stops it from vectorizing the whole loop.
ITR_FN uint32_t mask32(bool c) { return 0u - uint32_t(c); }
ITR_FN uint32_t select(bool c, uint32_t a, uint32_t b) { return (a & mask32(c)) | (b & ~mask32(c)); }
ITR_FN float select(bool c, float a, float b) {
  return __builtin_bit_cast(float, select(c, __builtin_bit_cast(uint32_t, a), __builtin_bit_cast(uint32_t, b)));
}
ITR_FN double select(bool c, double a, double b) {
  const uint64_t m = 0ull - uint64_t(c);
  return __builtin_bit_cast(double, (__builtin_bit_cast(uint64_t, a) & m) | (__builtin_bit_cast(uint64_t, b) & ~m));
}

// NaN-propagating max, as torch.maximum does (amsgrad keeps a NaN once it appears, like torch).
template <class T>
ITR_FN T maximum(T a, T b) {
  return select(a != a, a, select(b != b, b, select(a > b, a, b)));
}

// The scalar type of a working type T: T itself, or a CPU vector's lane type (kernels_cpu/src/simd.h adds those).
template <class T>
struct ScalarOf {
  using type = T;
};

// torch's lerp formula (aten/src/ATen/native/Lerp.h), the form that is exact at weight 0 or 1: self + w * (end -
// self) for w < 0.5, else end - (end - self) * (1 - w). The optimizers' weights are the same for every element, so
// the host picks the form once (lerp_low, in the kernel's precision) and the loop has no per-element select.
template <class T, class U>
ITR_FN bool lerp_low(U weight) {
  return typename ScalarOf<T>::type(weight) < typename ScalarOf<T>::type(0.5);
}

template <class T>
ITR_FN T lerp(T self, T end, T weight, bool low) {
  const T diff = end - self;
  if (low) return self + weight * diff;
  return end - diff * (T(1) - weight);
}
}  // namespace math

// The optimizer state arrays of a chunk, in the layout's Real type.
template <class R>
struct State {
  R* s0;
  R* s1;
  R* s2;
};

namespace fused {

// What a fused step's op takes per parameter after its state lists (kernels_cpu/src/optimizers.h).
enum class PerParam { kNothing, kFreshFlags, kStateSteps };
enum class Passes { kOne, kTwo };  // kTwo: a first pass, norms(), yields two sums of squares per tensor

// The base of each fused:: entry: its coefficient type C<T>, number of state lists, what it takes per parameter,
// its passes and its number of apply<V> variants.
template <template <class> class C, int STATES, PerParam PER_PARAM, Passes PASSES, int VARIANTS = 1>
struct Step {
  template <class T>
  using Coef = C<T>;
  static constexpr int kStates = STATES;
  static constexpr bool kFreshFlags = PER_PARAM == PerParam::kFreshFlags;
  static constexpr bool kCountsSteps = PER_PARAM == PerParam::kStateSteps;
  static constexpr bool kTwoPass = PASSES == Passes::kTwo;
  static constexpr int kVariants = VARIANTS;
};

}  // namespace fused

// What the host knows of one parameter when it computes its coefficients: its (already incremented) step count,
// for optimizers that count steps, and whether its state was just created (SGD's momentum buffer).
struct ParamStep {
  double step;
  bool fresh;
};

namespace element {

// The step of element i of an optimizer whose state is one tensor: update(w, g, x) on the element's working value
// w, grad g and state x, read and written through storage layout S (ipex_train/elementwise.h).
template <class S, class Update>
ITR_FN void with_one_state(const S& st, const State<typename S::Real>& s, int64_t i, const Update& update) {
  typename S::T w = st.load(i);
  typename S::T x = S::get(s.s0, i);
  update(w, st.grad(i), x);
  S::put(s.s0, i, x);
  st.store(i, w);
}

}  // namespace element

}  // namespace ipex_train
