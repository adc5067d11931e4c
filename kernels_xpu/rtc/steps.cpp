// The fused optimizer steps as SYCL kernels, compiled at run time by SYCL-RTC (the kernel_compiler extension)
// from ipex_train.xpu; the host glue is kernels_xpu/host/module.cpp.
//
// The per-element math is not here: it is kernels_cpu's headers (updates/*.h, convert.h), handed to the compiler
// as include_files, so the CPU loops and these kernels run the same code. What this file adds is the device side
// of kernels_cpu/src/loops.h: how each storage layout reads and writes an element, one element per work-item, and
// work-group sums of squares for the Lamb and Lars trust ratios.
//
// The host prepends `#define ITX_REAL float` (every layout but float64) or `double` (float64, only on devices with
// fp64). It cannot be a template parameter: a free-function kernel taking a struct whose type depends on a
// template parameter (updates::AdamCoef<T>) crashes the 2026.2 SYCL-RTC compiler, while a fixed
// updates::AdamCoef<float> compiles.
#include <sycl/sycl.hpp>

#include "ipex_train/convert.h"
#include "kernel_abi.h"

namespace itx {

using namespace ipex_train;
namespace syclexp = sycl::ext::oneapi::experimental;
using real = ITX_REAL;

#define ITX_KERNEL SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))

// Storage layouts (same meaning as kernels_cpu/src/loops.h): the working value and grad of element i, and the
// write-back of a new value.
template <int L>
struct Storage;

template <>
struct Storage<int(Layout::kF32)> {
  using T = float;
  float* p;
  const float* g;
  explicit Storage(const Chunk& c) : p(static_cast<float*>(c.param)), g(static_cast<const float*>(c.grad)) {}
  T load(size_t i) const { return p[i]; }
  T grad(size_t i) const { return g[i]; }
  void store(size_t i, T w) const { p[i] = w; }
};

template <>
struct Storage<int(Layout::kF64)> {
  using T = double;
  double* p;
  const double* g;
  explicit Storage(const Chunk& c) : p(static_cast<double*>(c.param)), g(static_cast<const double*>(c.grad)) {}
  T load(size_t i) const { return p[i]; }
  T grad(size_t i) const { return g[i]; }
  void store(size_t i, T w) const { p[i] = w; }
};

template <>
struct Storage<int(Layout::kSplitBF16)> {
  using T = float;
  uint16_t* top;
  int16_t* res;
  const uint16_t* g;
  explicit Storage(const Chunk& c)
      : top(static_cast<uint16_t*>(c.param)),
        res(static_cast<int16_t*>(c.aux)),
        g(static_cast<const uint16_t*>(c.grad)) {}
  T load(size_t i) const { return convert::combine_bf16(top[i], res[i]); }
  T grad(size_t i) const { return convert::bf16_to_f32(g[i]); }
  void store(size_t i, T w) const {
    uint16_t t;
    int16_t r;
    convert::split_bf16(w, t, r);
    top[i] = t;
    res[i] = r;
  }
};

template <bool HALF>
struct Master16 {
  using T = float;
  uint16_t* p;
  float* master;
  const uint16_t* g;
  explicit Master16(const Chunk& c)
      : p(static_cast<uint16_t*>(c.param)),
        master(static_cast<float*>(c.aux)),
        g(static_cast<const uint16_t*>(c.grad)) {}
  T load(size_t i) const { return master[i]; }
  T grad(size_t i) const { return HALF ? convert::f16_to_f32(g[i]) : convert::bf16_to_f32(g[i]); }
  void store(size_t i, T w) const {
    master[i] = w;
    p[i] = HALF ? convert::f32_to_f16(w) : convert::f32_to_bf16(w);
  }
};

template <>
struct Storage<int(Layout::kBF16Master)> : Master16<false> {
  using Master16<false>::Master16;
};

template <>
struct Storage<int(Layout::kF16Master)> : Master16<true> {
  using Master16<true>::Master16;
};

// The layout's accessor, checked against the bundle's ITX_REAL (a float64 layout in a float bundle would narrow).
template <int L>
static inline Storage<L> storage(const Chunk& c) {
  static_assert(sizeof(typename Storage<L>::T) == sizeof(real), "layout built into the wrong ITX_REAL bundle");
  return Storage<L>(c);
}

static inline size_t global_id() { return sycl::ext::oneapi::this_work_item::get_nd_item<1>().get_global_id(0); }

static inline real* state(const Chunk& c, int k) { return static_cast<real*>(c.state[k]); }

// Work-group sums of a and b into partial[2 * group] and partial[2 * group + 1]; every work-item of the group must
// reach it (so out-of-range items contribute zeros instead of returning early).
static inline void group_sums(real a, real b, real* partial) {
  const auto it = sycl::ext::oneapi::this_work_item::get_nd_item<1>();
  const real sa = sycl::reduce_over_group(it.get_group(), a, sycl::plus<real>());
  const real sb = sycl::reduce_over_group(it.get_group(), b, sycl::plus<real>());
  if (it.get_local_id(0) == 0) {
    partial[2 * it.get_group(0)] = sa;
    partial[2 * it.get_group(0) + 1] = sb;
  }
}

template <int L, bool MOMENTUM, bool NESTEROV>
ITX_KERNEL void sgd(Chunk c, updates::SgdCoef<real> k) {
  const size_t i = global_id();
  if (i >= size_t(c.n)) return;
  const auto st = storage<L>(c);
  real w = st.load(i);
  real b = MOMENTUM ? state(c, 0)[i] : real(0);
  updates::sgd<real, MOMENTUM, NESTEROV>(w, st.grad(i), b, k);
  if (MOMENTUM) state(c, 0)[i] = b;
  st.store(i, w);
}

template <int L, bool AMSGRAD>
ITX_KERNEL void adam(Chunk c, updates::AdamCoef<real> k) {
  const size_t i = global_id();
  if (i >= size_t(c.n)) return;
  const auto st = storage<L>(c);
  real w = st.load(i);
  real m = state(c, 0)[i], v = state(c, 1)[i], vmax = AMSGRAD ? state(c, 2)[i] : real(0);
  updates::adam<real, AMSGRAD>(w, st.grad(i), m, v, vmax, k);
  state(c, 0)[i] = m;
  state(c, 1)[i] = v;
  if (AMSGRAD) state(c, 2)[i] = vmax;
  st.store(i, w);
}

template <int L>
ITX_KERNEL void adagrad(Chunk c, updates::AdagradCoef<real> k) {
  const size_t i = global_id();
  if (i >= size_t(c.n)) return;
  const auto st = storage<L>(c);
  real w = st.load(i);
  real sum = state(c, 0)[i];
  updates::adagrad<real>(w, st.grad(i), sum, k);
  state(c, 0)[i] = sum;
  st.store(i, w);
}

template <int L>
ITX_KERNEL void lamb_moments(Chunk c, updates::LambCoef<real> k, real* partial) {
  const size_t i = global_id();
  real w_sq = 0, u_sq = 0;
  if (i < size_t(c.n)) {
    const auto st = storage<L>(c);
    const real w = st.load(i);
    real m = state(c, 0)[i], v = state(c, 1)[i];
    const real u = updates::lamb_moments<real>(w, st.grad(i), m, v, k);
    state(c, 0)[i] = m;
    state(c, 1)[i] = v;
    w_sq = w * w;
    u_sq = u * u;
  }
  group_sums(w_sq, u_sq, partial);
}

template <int L>
ITX_KERNEL void lamb_apply(Chunk c, updates::LambCoef<real> k) {
  const size_t i = global_id();
  if (i >= size_t(c.n)) return;
  const auto st = storage<L>(c);
  real w = st.load(i);
  updates::lamb_apply<real>(w, state(c, 0)[i], state(c, 1)[i], k);
  st.store(i, w);
}

template <int L>
ITX_KERNEL void lars_norms(Chunk c, real* partial) {
  const size_t i = global_id();
  real w_sq = 0, g_sq = 0;
  if (i < size_t(c.n)) {
    const auto st = storage<L>(c);
    const real w = st.load(i), g = st.grad(i);
    w_sq = w * w;
    g_sq = g * g;
  }
  group_sums(w_sq, g_sq, partial);
}

template <int L>
ITX_KERNEL void lars_apply(Chunk c, updates::LarsCoef<real> k) {
  const size_t i = global_id();
  if (i >= size_t(c.n)) return;
  const auto st = storage<L>(c);
  real w = st.load(i);
  real b = state(c, 0)[i];
  updates::lars<real>(w, st.grad(i), b, k);
  state(c, 0)[i] = b;
  st.store(i, w);
}

ITX_KERNEL void split_bf16(const float* src, uint16_t* top, int16_t* residual, uint64_t n) {
  const size_t i = global_id();
  if (i >= n) return;
  uint16_t t;
  int16_t r;
  convert::split_bf16(src[i], t, r);
  top[i] = t;
  residual[i] = r;
}

ITX_KERNEL void combine_bf16(const uint16_t* top, const int16_t* residual, float* dst, uint64_t n) {
  const size_t i = global_id();
  if (i < n) dst[i] = convert::combine_bf16(top[i], residual[i]);
}

}  // namespace itx
