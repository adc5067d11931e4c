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
// block, which computes the block's absmax scale alone (no work-group reduction, no barrier; its work-items are a
// block apart, so the CPU device's vectorizer, which runs work-items in SIMD lanes, reads them with gathers).
template <int L>
constexpr int64_t kParamBytes = Layout(L) == Layout::kF32 ? 4 : 2;  // reduced state never has a float64 layout
template <int L>
constexpr int64_t kAuxBytes = Layout(L) == Layout::kSplitBF16 ? 2 : 4;

// p plus `bytes`; p is never null here. A null check (a select) made the CPU device's vectorizer read and write
// every offset pointer with gathers and scatters (bf16 state 2.3x slower, measured).
static inline void* skip(const void* p, int64_t bytes) {
  return const_cast<char*>(static_cast<const char*>(p)) + bytes;
}

static inline int64_t code_bytes(StateCodec f, int64_t n) { return f == StateCodec::kBF16 ? 2 * n : n; }

// The scale of element `first`'s int8 block in state list k (null for bf16 state).
static inline float* scales_at(const Chunk& c, int k, int64_t first) {
  return c.scales[k] == nullptr ? nullptr : c.scales[k] + first / kQ8Block;
}

// State list k of elements [first, first + m) of c as fp32: its fp32 array, or scratch holding the reduced state
// decoded by codec::decode; null where the list is absent.
template <int STAGE>
static inline float* stage_state(const Chunk& c, int k, int64_t first, int64_t m, float* scratch) {
  if (c.state[k] == nullptr) return nullptr;
  if (c.codec[k] == StateCodec::kPlain) return static_cast<float*>(skip(c.state[k], first * 4));
  // STAGE 1 holds bf16 state only (the host's choice): a constant format lets the compiler drop the int8 paths.
  const StateCodec f = STAGE == 1 ? StateCodec::kBF16 : c.codec[k];
  codec::decode(f, skip(c.state[k], code_bytes(f, first)), scales_at(c, k, first), scratch, m);
  return scratch;
}

// Encodes scratch back into reduced state list k (nothing for fp32 or absent state).
template <int STAGE>
static inline void unstage_state(const Chunk& c, int k, int64_t first, int64_t m, const float* scratch) {
  if (c.state[k] == nullptr || c.codec[k] == StateCodec::kPlain) return;
  const StateCodec f = STAGE == 1 ? StateCodec::kBF16 : c.codec[k];
  codec::encode(f, scratch, skip(c.state[k], code_bytes(f, first)), scales_at(c, k, first), m, c.key, first);
}

// Runs run(st, state, m) on elements [first, first + STAGE) of c, m of them (fewer at its end): st their storage
// layout, state their state as fp32 arrays. Each state list is handled by its own call, with no array indexed by
// the list: a private Chunk with such arrays kept the pointers in memory per work-item, which the CPU device's
// vectorizer read and wrote with gathers and scatters (bf16 state 1.8x slower, measured).
template <int L, int STAGE, class Run>
static inline void staged(const Chunk& c, int64_t first, const Run& run) {
  static_assert(STAGE == 1 || STAGE == kQ8Block, "int8 state needs whole blocks per work-item");
  const int64_t m = STAGE == 1 ? 1 : c.n - first < STAGE ? c.n - first : STAGE;
  float s0[STAGE], s1[STAGE], s2[STAGE];
  Chunk p{skip(c.param, first * kParamBytes<L>), nullptr, skip(c.grad, first * kParamBytes<L>), {}, m};
  if constexpr (Layout(L) != Layout::kF32) p.aux = skip(c.aux, first * kAuxBytes<L>);
  const State<float> state{stage_state<STAGE>(c, 0, first, m, s0), stage_state<STAGE>(c, 1, first, m, s1),
                           stage_state<STAGE>(c, 2, first, m, s2)};
  run(storage_of<L>(p), state, m);
  unstage_state<STAGE>(c, 0, first, m, s0);
  unstage_state<STAGE>(c, 1, first, m, s1);
  unstage_state<STAGE>(c, 2, first, m, s2);
}

// Opt::norms, named through Opt so that only the first-pass kernels of two-pass optimizers (the ones instantiated)
// need it.
template <class Opt, class S>
static inline void norms(const S& st, const State<real>& s, int64_t i, const typename Opt::template Coef<real>& k,
                         real& a, real& b) {
  Opt::norms(st, s, i, k, a, b);
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
    if (i < size_t(c.n)) norms<fused::name>(storage_of<L>(c), state_of<real>(c), i, k, a, b);    \
    group_sums(a * a, b * b, partial);                                                           \
  }                                                                                              \
  template <int L, int V, int STAGE>                                                             \
  ITX_KERNEL void name##_staged(Chunk c, fused::name::Coef<real> k) {                            \
    const int64_t first = int64_t(global_id()) * STAGE;                                          \
    if (first < c.n)                                                                             \
      staged<L, STAGE>(c, first, [&](const auto& st, const State<real>& state, int64_t m) {      \
        for (int64_t j = 0; j < m; ++j) fused::name::apply<V>(st, state, j, k);                  \
      });                                                                                        \
  }                                                                                              \
  template <int L, int STAGE>                                                                    \
  ITX_KERNEL void name##_norms_staged(Chunk c, fused::name::Coef<real> k, real* partial) {       \
    const int64_t first = int64_t(global_id()) * STAGE;                                          \
    real sa = 0, sb = 0;                                                                         \
    if (first < c.n)                                                                             \
      staged<L, STAGE>(c, first, [&](const auto& st, const State<real>& state, int64_t m) {      \
        for (int64_t j = 0; j < m; ++j) {                                                        \
          real a, b;                                                                             \
          norms<fused::name>(st, state, j, k, a, b);                                             \
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
