// The fused optimizer steps as SYCL kernels, compiled at run time by SYCL-RTC (the kernel_compiler extension)
// from ipex_train.xpu; the host glue is kernels_xpu/host/module.cpp.
//
// The per-element math is not here: it is kernels_cpu's headers (ipex_train/elementwise.h with the storage layouts
// and the step of one element, updates/*.h, convert.h), handed to the compiler as include_files, so the CPU loops
// and these kernels run the same code. What this file adds is the device side of kernels_cpu/src/loops.h: one
// element per work-item, and work-group sums of squares for the two-pass optimizers (Lamb, Lars).
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

// Opt::norms, named through Opt so that only the first-pass kernels of two-pass optimizers (the ones instantiated)
// need it.
template <class Opt, int L>
static inline void norms(const Chunk& c, size_t i, const typename Opt::template Coef<real>& k, real& a, real& b) {
  Opt::norms(storage_of<L>(c), state_of<real>(c), i, k, a, b);
}

// Per optimizer of ITR_OPTIMIZERS (optimizers.h): itx::<name><layout, variant>, apply<variant> on one element per
// work-item, and itx::<name>_norms<layout>, the first pass of two-pass optimizers (instantiated only for those: the
// host registers the names it uses). The coefficient type is spelled out, not a template parameter (see above).
#define ITX_STEP(name, args)                                                                     \
  template <int L, int V>                                                                        \
  ITX_KERNEL void name(Chunk c, fused::name::Coef<real> k) {                                     \
    const size_t i = global_id();                                                                \
    if (i < size_t(c.n)) fused::name::apply<V>(storage_of<L>(c), state_of<real>(c), i, k);      \
  }                                                                                              \
  template <int L>                                                                               \
  ITX_KERNEL void name##_norms(Chunk c, fused::name::Coef<real> k, real* partial) {              \
    const size_t i = global_id();                                                                \
    real a = 0, b = 0;                                                                           \
    if (i < size_t(c.n)) norms<fused::name, L>(c, i, k, a, b);                                   \
    group_sums(a * a, b * b, partial);                                                           \
  }
ITR_OPTIMIZERS(ITX_STEP)
#undef ITX_STEP

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
