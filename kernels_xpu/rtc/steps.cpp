// The fused optimizer steps as SYCL kernels, compiled at run time by SYCL-RTC (the kernel_compiler extension)
// from ipex_train.xpu; the host glue is kernels_xpu/host/module.cpp.
//
// The per-element math is not here: it is kernels_cpu's headers (ipex_train/elementwise.h with the storage layouts
// and the step of one element, updates/*.h, convert.h), handed to the compiler as include_files, so the CPU loops
// and these kernels run the same code. What this file adds is the device side of kernels_cpu/src/loops.h: one
// element per work-item, and work-group sums of squares for the Lamb and Lars trust ratios.
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

struct SyclTag {};

// The layout's accessor (ipex_train/elementwise.h), checked against the bundle's ITX_REAL (a float64 layout in a
// float bundle would narrow).
template <int L>
using Storage = typename storage::Of<storage::Scalar<real, SyclTag>, Layout(L)>::type;

template <int L>
static inline Storage<L> storage_of(const Chunk& c) {
  static_assert(sizeof(typename Storage<L>::T) == sizeof(real), "layout built into the wrong ITX_REAL bundle");
  return Storage<L>(c);
}

static inline size_t global_id() { return sycl::ext::oneapi::this_work_item::get_nd_item<1>().get_global_id(0); }

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
  if (i < size_t(c.n)) element::sgd<MOMENTUM, NESTEROV>(storage_of<L>(c), state_of<real>(c), i, k);
}

template <int L, bool AMSGRAD>
ITX_KERNEL void adam(Chunk c, updates::AdamCoef<real> k) {
  const size_t i = global_id();
  if (i < size_t(c.n)) element::adam<AMSGRAD>(storage_of<L>(c), state_of<real>(c), i, k);
}

template <int L>
ITX_KERNEL void adagrad(Chunk c, updates::AdagradCoef<real> k) {
  const size_t i = global_id();
  if (i < size_t(c.n)) element::adagrad(storage_of<L>(c), state_of<real>(c), i, k);
}

template <int L>
ITX_KERNEL void lamb_moments(Chunk c, updates::LambCoef<real> k, real* partial) {
  const size_t i = global_id();
  real w = 0, u = 0;
  if (i < size_t(c.n)) element::lamb_moments(storage_of<L>(c), state_of<real>(c), i, k, w, u);
  group_sums(w * w, u * u, partial);
}

template <int L>
ITX_KERNEL void lamb_apply(Chunk c, updates::LambCoef<real> k) {
  const size_t i = global_id();
  if (i < size_t(c.n)) element::lamb_apply(storage_of<L>(c), state_of<real>(c), i, k);
}

template <int L>
ITX_KERNEL void lars_norms(Chunk c, real* partial) {
  const size_t i = global_id();
  real w = 0, g = 0;
  if (i < size_t(c.n)) {
    const auto st = storage_of<L>(c);
    w = st.load(i);
    g = st.grad(i);
  }
  group_sums(w * w, g * g, partial);
}

template <int L>
ITX_KERNEL void lars_apply(Chunk c, updates::LarsCoef<real> k) {
  const size_t i = global_id();
  if (i < size_t(c.n)) element::lars_apply(storage_of<L>(c), state_of<real>(c), i, k);
}

ITX_KERNEL void split_bf16(const float* src, uint16_t* top, int16_t* residual, uint64_t n) {
  const size_t i = global_id();
  if (i >= n) return;
  uint32_t t, r;
  convert::split_bf16(src[i], t, r);
  top[i] = uint16_t(t);
  residual[i] = int16_t(uint16_t(r));
}

ITX_KERNEL void combine_bf16(const uint16_t* top, const int16_t* residual, float* dst, uint64_t n) {
  const size_t i = global_id();
  if (i < n) dst[i] = convert::combine_bf16(uint32_t(top[i]), uint32_t(int32_t(residual[i])));
}

}  // namespace itx
