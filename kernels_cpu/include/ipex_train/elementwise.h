// The storage layouts, and with updates/*.h (one per optimizer: its math and fused::<name>, the step of one
// element or of one CPU vector of elements) everything the CPU loops (kernels_cpu/src/loops.h) and the SYCL kernels
// (kernels_xpu/rtc/steps.cpp) share; they differ only in how they walk the elements and in the access
// (storage::Scalar, or kernels_cpu/src/simd.h's vectors) they read with.
#pragma once

#include "common.h"
#include "convert.h"
#include "state_codec.h"
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
  // CPU only: write the 16-bit param of the master layouts with non-temporal stores. Nothing in the step reads those
  // lines, so a plain store first reads each line from memory; for groups far larger than the caches that is 2
  // wasted bytes per element (measured: benchmarks/reports/kernels_cpu.md). The SYCL kernels ignore it.
  bool stream16 = false;
  // Reduced-byte state (state_codec.h), CPU only: the format of each state list (state[k] then points at this
  // run's first code), the scale of the run's first int8 block per list, the stochastic-rounding key of this
  // parameter's step, and the index of the run's first element in its parameter.
  StateCodec codec[3] = {StateCodec::kPlain, StateCodec::kPlain, StateCodec::kPlain};
  float* scales[3] = {nullptr, nullptr, nullptr};
  uint64_t key = 0;
  int64_t first = 0;
};

namespace storage {

// How a layout reads and writes memory: one element at a time (Scalar, below), or a whole CPU vector at a time
// (kernels_cpu/src/simd.h, which may use conversion instructions but must give the same bits). T is the working
// type (a value or a vector of values), Real the scalar type of the fp32/fp64 arrays and of the optimizer state.
//
// Tag is a type each translation unit makes unique (an anonymous-namespace type on the CPU): every instantiation
// then has internal linkage, so the copy compiled for one ISA can never be linked into another's place.
template <class R, class Tag>
struct Scalar {
  using T = R;
  using Real = R;
  ITR_FN T get(const R* p, int64_t i) { return p[i]; }
  ITR_FN void put(R* p, int64_t i, T v) { p[i] = v; }
  ITR_FN T bf16(const uint16_t* p, int64_t i) { return convert::bf16_to_f32(uint32_t(p[i])); }
  ITR_FN void put_bf16(uint16_t* p, int64_t i, T v) { p[i] = uint16_t(convert::f32_to_bf16(v)); }
  ITR_FN T f16(const uint16_t* p, int64_t i) { return convert::f16_to_f32(uint32_t(p[i])); }
  ITR_FN void put_f16(uint16_t* p, int64_t i, T v) { p[i] = uint16_t(convert::f32_to_f16(v)); }
  ITR_FN T split(const uint16_t* top, const int16_t* res, int64_t i) {
    return convert::combine_bf16(uint32_t(top[i]), uint32_t(int32_t(res[i])));
  }
  ITR_FN void put_split(uint16_t* top, int16_t* res, int64_t i, T v) {
    uint32_t t, r;
    convert::split_bf16(v, t, r);
    top[i] = uint16_t(t);
    res[i] = int16_t(uint16_t(r));
  }
};

// A layout reads the working value and the grad of element i, and writes a new value back; A is its access.
template <class A>
struct Plain : A {  // fp32 or fp64 param and grad, as A::Real
  using Real = typename A::Real;
  Real* p;
  const Real* g;
  explicit Plain(const Chunk& c) : p(static_cast<Real*>(c.param)), g(static_cast<const Real*>(c.grad)) {}
  typename A::T load(int64_t i) const { return A::get(p, i); }
  typename A::T grad(int64_t i) const { return A::get(g, i); }
  void store(int64_t i, typename A::T w) const { A::put(p, i, w); }
};

template <class A>
struct SplitBF16 : A {
  uint16_t* top;
  int16_t* res;
  const uint16_t* g;
  explicit SplitBF16(const Chunk& c)
      : top(static_cast<uint16_t*>(c.param)), res(static_cast<int16_t*>(c.aux)), g(static_cast<const uint16_t*>(c.grad)) {}
  typename A::T load(int64_t i) const { return A::split(top, res, i); }
  typename A::T grad(int64_t i) const { return A::bf16(g, i); }
  void store(int64_t i, typename A::T w) const { A::put_split(top, res, i, w); }
};

template <class A, bool HALF>
struct Master16 : A {
  uint16_t* p;
  float* master;
  const uint16_t* g;
  explicit Master16(const Chunk& c)
      : p(static_cast<uint16_t*>(c.param)), master(static_cast<float*>(c.aux)), g(static_cast<const uint16_t*>(c.grad)) {}
  typename A::T load(int64_t i) const { return A::get(master, i); }
  typename A::T grad(int64_t i) const { return HALF ? A::f16(g, i) : A::bf16(g, i); }
  void store(int64_t i, typename A::T w) const {
    A::put(master, i, w);
    if (HALF) A::put_f16(p, i, w);
    else A::put_bf16(p, i, w);
  }
};

// The layout L read and written through access A (whose Real must be double for kF64 and float otherwise).
template <class A, Layout L>
struct Of;
template <class A>
struct Of<A, Layout::kF32> { using type = Plain<A>; };
template <class A>
struct Of<A, Layout::kF64> { using type = Plain<A>; };
template <class A>
struct Of<A, Layout::kSplitBF16> { using type = SplitBF16<A>; };
template <class A>
struct Of<A, Layout::kBF16Master> { using type = Master16<A, false>; };
template <class A>
struct Of<A, Layout::kF16Master> { using type = Master16<A, true>; };

}  // namespace storage

template <class R>
ITR_FN State<R> state_of(const Chunk& c) {
  return {static_cast<R*>(c.state[0]), static_cast<R*>(c.state[1]), static_cast<R*>(c.state[2])};
}

}  // namespace ipex_train
