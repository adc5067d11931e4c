// One optimizer step of one element, for every storage layout: shared by the CPU loops (kernels_cpu/src/loops.h)
// and the SYCL kernels (kernels_xpu/rtc/steps.cpp), which differ only in how they walk the elements.
//
// Every type here is a template on a Tag that each translation unit makes unique (an anonymous-namespace type on
// the CPU): the instantiations then have internal linkage, so the copy compiled for one ISA can never be linked
// into another's place.
#pragma once

#include "common.h"
#include "convert.h"
#include "updates/adagrad.h"
#include "updates/adam.h"
#include "updates/lamb.h"
#include "updates/lars.h"
#include "updates/sgd.h"

namespace ipex_train {

// How one parameter is stored; chosen per parameter from the dtypes of param, aux and grad.
enum class Layout : int {
  kF32 = 0,         // fp32 param, fp32 grad, fp32 state
  kF64 = 1,         // fp64 param, fp64 grad, fp64 state
  kSplitBF16 = 2,   // bf16 top (the param), int16 residual (aux), bf16 grad, fp32 state
  kBF16Master = 3,  // bf16 param, fp32 master (aux), bf16 grad, fp32 state
  kF16Master = 4,   // fp16 param, fp32 master (aux), fp16 grad, fp32 state
};

// One contiguous run of elements of one parameter; every pointer is already offset to the run's start.
struct Chunk {
  void* param;
  void* aux;
  const void* grad;
  void* state[3];
  int64_t n;
};

namespace storage {

// A layout reads the working value and the grad of element i, and writes a new value back.
template <class Tag>
struct F32 {
  using T = float;
  float* p;
  const float* g;
  explicit F32(const Chunk& c) : p(static_cast<float*>(c.param)), g(static_cast<const float*>(c.grad)) {}
  T load(int64_t i) const { return p[i]; }
  T grad(int64_t i) const { return g[i]; }
  void store(int64_t i, T w) const { p[i] = w; }
};

template <class Tag>
struct F64 {
  using T = double;
  double* p;
  const double* g;
  explicit F64(const Chunk& c) : p(static_cast<double*>(c.param)), g(static_cast<const double*>(c.grad)) {}
  T load(int64_t i) const { return p[i]; }
  T grad(int64_t i) const { return g[i]; }
  void store(int64_t i, T w) const { p[i] = w; }
};

template <class Tag>
struct SplitBF16 {
  using T = float;
  uint16_t* top;
  int16_t* res;
  const uint16_t* g;
  explicit SplitBF16(const Chunk& c)
      : top(static_cast<uint16_t*>(c.param)), res(static_cast<int16_t*>(c.aux)), g(static_cast<const uint16_t*>(c.grad)) {}
  T load(int64_t i) const { return convert::combine_bf16(top[i], res[i]); }
  T grad(int64_t i) const { return convert::bf16_to_f32(g[i]); }
  void store(int64_t i, T w) const {
    uint16_t t;
    int16_t r;
    convert::split_bf16(w, t, r);
    top[i] = t;
    res[i] = r;
  }
};

template <class Tag, bool HALF>
struct Master16 {
  using T = float;
  uint16_t* p;
  float* master;
  const uint16_t* g;
  explicit Master16(const Chunk& c)
      : p(static_cast<uint16_t*>(c.param)), master(static_cast<float*>(c.aux)), g(static_cast<const uint16_t*>(c.grad)) {}
  T load(int64_t i) const { return master[i]; }
  T grad(int64_t i) const { return HALF ? convert::f16_to_f32(g[i]) : convert::bf16_to_f32(g[i]); }
  void store(int64_t i, T w) const {
    master[i] = w;
    p[i] = HALF ? convert::f32_to_f16(w) : convert::f32_to_bf16(w);
  }
};

template <class Tag, Layout L>
struct Of;
template <class Tag>
struct Of<Tag, Layout::kF32> { using type = F32<Tag>; };
template <class Tag>
struct Of<Tag, Layout::kF64> { using type = F64<Tag>; };
template <class Tag>
struct Of<Tag, Layout::kSplitBF16> { using type = SplitBF16<Tag>; };
template <class Tag>
struct Of<Tag, Layout::kBF16Master> { using type = Master16<Tag, false>; };
template <class Tag>
struct Of<Tag, Layout::kF16Master> { using type = Master16<Tag, true>; };

}  // namespace storage

// The optimizer state arrays of a chunk, in the layout's state type.
template <class T>
struct State {
  T* s0;
  T* s1;
  T* s2;
};

template <class T>
ITR_FN State<T> state_of(const Chunk& c) {
  return {static_cast<T*>(c.state[0]), static_cast<T*>(c.state[1]), static_cast<T*>(c.state[2])};
}

// One element's step. S is a storage layout, T its working type; i indexes the chunk.
namespace element {

template <class S, bool MOMENTUM, bool NESTEROV, class T = typename S::T>
ITR_FN void sgd(const S& st, const State<T>& s, int64_t i, const updates::SgdCoef<T>& k) {
  T w = st.load(i);
  T buf = MOMENTUM ? s.s0[i] : T(0);
  updates::sgd<T, MOMENTUM, NESTEROV>(w, st.grad(i), buf, k);
  if (MOMENTUM) s.s0[i] = buf;
  st.store(i, w);
}

template <class S, bool AMSGRAD, class T = typename S::T>
ITR_FN void adam(const S& st, const State<T>& s, int64_t i, const updates::AdamCoef<T>& k) {
  T w = st.load(i);
  T m = s.s0[i], v = s.s1[i], vmax = AMSGRAD ? s.s2[i] : T(0);
  updates::adam<T, AMSGRAD>(w, st.grad(i), m, v, vmax, k);
  s.s0[i] = m;
  s.s1[i] = v;
  if (AMSGRAD) s.s2[i] = vmax;
  st.store(i, w);
}

template <class S, class T = typename S::T>
ITR_FN void adagrad(const S& st, const State<T>& s, int64_t i, const updates::AdagradCoef<T>& k) {
  T w = st.load(i);
  T sum = s.s0[i];
  updates::adagrad<T>(w, st.grad(i), sum, k);
  s.s0[i] = sum;
  st.store(i, w);
}

// Lamb's first pass: updates the moments; w and u (the update direction) feed the caller's sums of squares.
template <class S, class T = typename S::T>
ITR_FN void lamb_moments(const S& st, const State<T>& s, int64_t i, const updates::LambCoef<T>& k, T& w, T& u) {
  w = st.load(i);
  T m = s.s0[i], v = s.s1[i];
  u = updates::lamb_moments<T>(w, st.grad(i), m, v, k);
  s.s0[i] = m;
  s.s1[i] = v;
}

template <class S, class T = typename S::T>
ITR_FN void lamb_apply(const S& st, const State<T>& s, int64_t i, const updates::LambCoef<T>& k) {
  T w = st.load(i);
  updates::lamb_apply<T>(w, s.s0[i], s.s1[i], k);
  st.store(i, w);
}

template <class S, class T = typename S::T>
ITR_FN void lars_apply(const S& st, const State<T>& s, int64_t i, const updates::LarsCoef<T>& k) {
  T w = st.load(i);
  T buf = s.s0[i];
  updates::lars<T>(w, st.grad(i), buf, k);
  s.s0[i] = buf;
  st.store(i, w);
}

}  // namespace element
}  // namespace ipex_train
