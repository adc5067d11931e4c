// The fused optimizer steps as SYCL kernels, compiled at run time by SYCL-RTC (the kernel_compiler extension)
// from ipex_train.xpu; the host glue is kernels_xpu/host/module.cpp.
//
// The per-element math is not here: it is kernels_cpu's headers (ipex_train/elementwise.h with the storage layouts
// and the step of one element, updates/*.h, convert.h), handed to the compiler as include_files, so the CPU loops
// and these kernels run the same code. What this file adds is the device side of kernels_cpu/src/loops.h: one
// element per work-item, work-group sums of squares for the two-pass optimizers (Lamb, Lars), and the staging of
// reduced-byte state through ipex_train/state_codec.h.
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

// Reduced-byte optimizer state (ipex_train/state_codec.h), the device side of kernels_cpu/src/loops.h's staged():
// a work-item takes STAGE elements, decodes their state into private fp32 scratch with codec::decode, runs the
// optimizer's element step on that scratch as if the state were fp32, and encodes it back with codec::encode. The
// formats' math is state_codec.h's alone, so the bits are the CPU kernels'. STAGE is 1 when every reduced state
// list is bf16 (one element per work-item, as the fp32 kernels), and kQ8Block with int8 state: one work-item per
// block, which computes the block's absmax scale alone (no work-group reduction, no barrier). Measured on the SYCL
// CPU device (README, SYCL section): the staging, not the formats, is what costs there; the runtime vectorizes
// these kernels with gathers and scatters where the fp32 ones get plain vector loads.
template <int L>
constexpr int64_t kParamBytes = Layout(L) == Layout::kF32 ? 4 : 2;  // reduced state never has a float64 layout
template <int L>
constexpr int64_t kAuxBytes = Layout(L) == Layout::kSplitBF16 ? 2 : 4;

static inline void* skip(const void* p, int64_t bytes) {
  return p == nullptr ? nullptr : const_cast<char*>(static_cast<const char*>(p)) + bytes;
}

// Runs run(s) on elements [first, first + STAGE) of c (fewer at its end) as the chunk s with fp32 state.
template <int L, int STAGE, class Run>
static inline void staged(const Chunk& c, int64_t first, const Run& run) {
  static_assert(STAGE == 1 || STAGE == kQ8Block, "int8 state needs whole blocks per work-item");
  const int64_t m = STAGE == 1 ? 1 : c.n - first < STAGE ? c.n - first : STAGE;
  float scratch[3][STAGE];
  void* codes[3] = {nullptr, nullptr, nullptr};
  float* scales[3] = {nullptr, nullptr, nullptr};
  Chunk s = c;
  s.n = m;
  s.first = first;
  s.param = skip(c.param, first * kParamBytes<L>);
  s.aux = skip(c.aux, first * kAuxBytes<L>);
  s.grad = skip(c.grad, first * kParamBytes<L>);
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    if (c.state[k] == nullptr) continue;
    if (c.codec[k] == StateCodec::kPlain) {
      s.state[k] = skip(c.state[k], first * 4);
      continue;
    }
    codes[k] = skip(c.state[k], c.codec[k] == StateCodec::kBF16 ? 2 * first : first);
    if (c.scales[k] != nullptr) scales[k] = c.scales[k] + first / kQ8Block;
    // STAGE 1 holds bf16 state only (the host's choice): a constant format lets the compiler drop the int8 paths.
    codec::decode(STAGE == 1 ? StateCodec::kBF16 : c.codec[k], codes[k], scales[k], scratch[k], m);
    s.state[k] = scratch[k];
  }
  run(s);
#pragma unroll
  for (int k = 0; k < 3; ++k)
    if (codes[k] != nullptr)
      codec::encode(STAGE == 1 ? StateCodec::kBF16 : c.codec[k], scratch[k], codes[k], scales[k], m, c.key, first);
}

// Opt::norms, named through Opt so that only the first-pass kernels of two-pass optimizers (the ones instantiated)
// need it.
template <class Opt, int L>
static inline void norms(const Chunk& c, size_t i, const typename Opt::template Coef<real>& k, real& a, real& b) {
  Opt::norms(storage_of<L>(c), state_of<real>(c), i, k, a, b);
}

// Per optimizer of ITR_OPTIMIZERS (optimizers.h): itx::<name><layout, variant>, apply<variant> on one element per
// work-item, and itx::<name>_norms<layout>, the first pass of two-pass optimizers (instantiated only for those: the
// host registers the names it uses); with reduced-byte state itx::<name>_staged<layout, variant, STAGE> and
// itx::<name>_norms_staged<layout, STAGE>, the same over staged(). The coefficient type is spelled out, not a
// template parameter (see above).
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
  }                                                                                              \
  template <int L, int V, int STAGE>                                                             \
  ITX_KERNEL void name##_staged(Chunk c, fused::name::Coef<real> k) {                            \
    const int64_t first = int64_t(global_id()) * STAGE;                                          \
    if (first < c.n)                                                                             \
      staged<L, STAGE>(c, first, [&](const Chunk& s) {                                           \
        const auto st = storage_of<L>(s);                                                        \
        const auto state = state_of<real>(s);                                                    \
        for (int64_t j = 0; j < s.n; ++j) fused::name::apply<V>(st, state, j, k);                \
      });                                                                                        \
  }                                                                                              \
  template <int L, int STAGE>                                                                    \
  ITX_KERNEL void name##_norms_staged(Chunk c, fused::name::Coef<real> k, real* partial) {       \
    const int64_t first = int64_t(global_id()) * STAGE;                                          \
    real sa = 0, sb = 0;                                                                         \
    if (first < c.n)                                                                             \
      staged<L, STAGE>(c, first, [&](const Chunk& s) {                                           \
        for (int64_t j = 0; j < s.n; ++j) {                                                      \
          real a, b;                                                                             \
          norms<fused::name, L>(s, j, k, a, b);                                                  \
          sa += a * a;                                                                           \
          sb += b * b;                                                                           \
        }                                                                                        \
      });                                                                                        \
    group_sums(sa, sb, partial);                                                                 \
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
