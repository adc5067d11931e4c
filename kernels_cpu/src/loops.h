// The CPU loops: how an optimizer walks a chunk, over the storage layouts, generic over the fused:: entries of the
// update headers (optimizers.h); the step of one element is the update header's (shared with the SYCL kernels).
//
// Each isa_*.cpp sets its compiler target, defines ITR_ISA_NAME and ITR_TABLE (and ITR_SIMD_BYTES where it has
// explicit vectors, simd.h), and includes this file once. The fp32-state layouts then run whole vectors through
// simd.h's access and the remaining elements one at a time, through the very same element code; without
// ITR_SIMD_BYTES (the scalar file) every element goes one at a time. Everything is local to the including file
// (anonymous namespace, IsaTag), so no function compiled for one ISA can be linked into another's place.
#ifdef ITR_SIMD_BYTES
#include "simd.h"  // before the element code, whose templates call the math overloads it declares
#endif

#include <type_traits>

#include "kernel_abi.h"

// ITR_LOOP tells the compiler that no iteration reads what another one writes (each parameter and its state are
// separate tensors).
#ifndef ITR_LOOP
#if defined(__clang__)
#define ITR_LOOP _Pragma("clang loop vectorize(enable) interleave(enable)")
#elif defined(__GNUC__)
#define ITR_LOOP _Pragma("GCC ivdep")
#else
#define ITR_LOOP
#endif
#endif

namespace ipex_train {
namespace {

struct IsaTag {};  // makes every storage and element template instantiated here local to this ISA's file

}  // namespace
}  // namespace ipex_train

#include "attention_rows.h"  // after IsaTag, whose scalar access it uses
#include "rms_norm_rows.h"   // after attention_rows.h, whose column helpers it uses
#include "add_norm_rows.h"   // after rms_norm_rows.h, whose row helpers it uses
#include "rope_rows.h"       // likewise
#include "swiglu_rows.h"     // likewise
#include "bias_gelu_rows.h"  // likewise

namespace ipex_train {
namespace {

template <Layout L>
using ScalarAccess = storage::Scalar<typename std::conditional<L == Layout::kF64, double, float>::type, IsaTag>;

template <class X>
using StorageOf = typename std::decay<X>::type;

// Calls body(storage, i, coefficients...) for every i of the chunk: whole vectors through simd.h's access where this
// ISA has one (the fp32-state layouts), then the remaining elements one at a time. The coefficients (double, from
// the host) are cast once to each working type.
template <Layout L, class Body, class... Coef>
void each(const Chunk& c, const Body& body, const Coef&... cd) {
  const int64_t n = c.n;  // a local: the stores below could otherwise alias c.n and force a reload per iteration
  int64_t i = 0;
#ifdef ITR_SIMD_BYTES
  if constexpr (L != Layout::kF64) {
    auto vectors = [&](auto access) {
      const typename storage::Of<decltype(access), L>::type st(c);
      [&](const auto&... k) {
        for (; i + math::vec::kVecWidth <= n; i += math::vec::kVecWidth) body(st, i, k...);
      }(updates::cast<math::vec::FV>(cd)...);
    };
    constexpr bool kMaster = L == Layout::kBF16Master || L == Layout::kF16Master;
    // Vector i starts kVecWidth * 2 * i bytes in, so an aligned chunk start aligns every vector's store.
    if (kMaster && c.stream16 && reinterpret_cast<uintptr_t>(c.param) % sizeof(math::vec::V16) == 0) {
      vectors(math::vec::AccessOf<kMaster>{});
      _mm_sfence();  // the streamed stores are ordered before anything after this chunk (other threads' reads too)
    } else {
      vectors(math::vec::Access{});
    }
  }
#endif
  using S = typename storage::Of<ScalarAccess<L>, L>::type;
  const S st(c);
  [&](const auto&... k) {
    ITR_LOOP
    for (; i < n; ++i) body(st, i, k...);
  }(updates::cast<typename S::T>(cd)...);
}

template <template <Layout> class Loop, class... Args>
void by_layout(Layout layout, Args&&... args) {
  switch (layout) {
    case Layout::kF32: return Loop<Layout::kF32>::run(args...);
    case Layout::kF64: return Loop<Layout::kF64>::run(args...);
    case Layout::kSplitBF16: return Loop<Layout::kSplitBF16>::run(args...);
    case Layout::kBF16Master: return Loop<Layout::kBF16Master>::run(args...);
    case Layout::kF16Master: return Loop<Layout::kF16Master>::run(args...);
  }
}

// Reduced-byte state (ipex_train/state_codec.h): a chunk whose state is not fp32 runs in blocks of kStage elements;
// each block's state is decoded into fp32 scratch (in L1), stepped by the very same loops as fp32 state, and encoded
// back. kStage is a whole number of int8 blocks, and chunks start on one (schedule.h's kChunk is a multiple).
constexpr int64_t kStage = 1024;
static_assert(kStage % kQ8Block == 0, "a stage must hold whole int8 blocks");

// Bytes per element of the param (and grad) and of the aux of layout L.
template <Layout L>
constexpr int64_t kParamBytes = L == Layout::kF64 ? 8 : L == Layout::kF32 ? 4 : 2;
template <Layout L>
constexpr int64_t kAuxBytes = L == Layout::kSplitBF16 ? 2 : 4;

inline void* skip(const void* p, int64_t bytes) {
  return p == nullptr ? nullptr : const_cast<char*>(static_cast<const char*>(p)) + bytes;
}

// The codec's run conversions: whole vectors through simd.h where this ISA has them.
inline void decode_state(StateCodec f, const void* codes, const float* scales, float* out, int64_t n) {
#ifdef ITR_SIMD_BYTES
  math::vec::decode_state(f, codes, scales, out, n);
#else
  codec::decode(f, codes, scales, out, n);
#endif
}

inline void encode_state(StateCodec f, const float* in, void* codes, float* scales, int64_t n, uint64_t key,
                         int64_t first) {
#ifdef ITR_SIMD_BYTES
  math::vec::encode_state(f, in, codes, scales, n, key, first);
#else
  codec::encode(f, in, codes, scales, n, key, first);
#endif
}

template <Layout L, class Run>
void staged(const Chunk& c, const Run& run) {
  if (c.codec[0] == StateCodec::kPlain && c.codec[1] == StateCodec::kPlain && c.codec[2] == StateCodec::kPlain)
    return run(c);
  alignas(64) float scratch[3][kStage];
  for (int64_t b = 0; b < c.n; b += kStage) {
    Chunk s = c;
    s.n = c.n - b < kStage ? c.n - b : kStage;
    s.first = c.first + b;
    s.param = skip(c.param, b * kParamBytes<L>);
    s.aux = skip(c.aux, b * kAuxBytes<L>);
    s.grad = skip(c.grad, b * kParamBytes<L>);
    for (int k = 0; k < 3; ++k) {
      if (c.state[k] == nullptr) continue;
      const StateCodec f = c.codec[k];
      if (f == StateCodec::kPlain) {
        s.state[k] = skip(c.state[k], b * 4);
        continue;
      }
      s.state[k] = skip(c.state[k], f == StateCodec::kBF16 ? 2 * b : b);
      s.scales[k] = c.scales[k] == nullptr ? nullptr : c.scales[k] + b / kQ8Block;
      decode_state(f, s.state[k], s.scales[k], scratch[k], s.n);
    }
    Chunk fp32 = s;
    for (int k = 0; k < 3; ++k)
      if (s.state[k] != nullptr && s.codec[k] != StateCodec::kPlain) fp32.state[k] = scratch[k];
    run(fp32);
    for (int k = 0; k < 3; ++k)
      if (s.state[k] != nullptr && s.codec[k] != StateCodec::kPlain)
        encode_state(s.codec[k], scratch[k], s.state[k], s.scales[k], s.n, s.key, s.first);
  }
}

// Sums of squares are kept in kLanes partial sums, element i in lane i % kLanes: every ISA variant then adds the
// same numbers in the same order (bit-identical norms), a vector adds its lanes without reassociating a single sum
// (which IEEE semantics forbid), and double neither overflows for |w| > 1.8e19 nor loses digits over a chunk,
// matching the reference's double norms. Whole vectors go to simd.h's register-resident sums, which are written
// into the lanes before the first single element (the loops run all vectors first) or at the end.
constexpr int64_t kLanes = 16;

class SquareSums {
 public:
  template <class R>
  void add(int64_t i, R x) {
#ifdef ITR_SIMD_BYTES
    if (vec_.added != 0) flush();
#endif
    lanes_[i % kLanes] += double(x) * double(x);
  }
#ifdef ITR_SIMD_BYTES
  void add(int64_t, math::vec::FV x) { vec_.add(x); }  // each() runs the vectors in order from element 0
#endif
  double total() {
#ifdef ITR_SIMD_BYTES
    if (vec_.added != 0) flush();
#endif
    double s = 0;
    for (int64_t j = 0; j < kLanes; ++j) s += lanes_[j];
    return s;
  }

 private:
  double lanes_[kLanes] = {};
#ifdef ITR_SIMD_BYTES
  static_assert(kLanes % math::vec::kVecWidth == 0, "a vector must not straddle the partial-sum lanes");
  math::vec::RegisterSquareSums<int(kLanes / math::vec::kVecWidth)> vec_;
  void flush() {  // only before any single element was added: the lanes are still zero
    vec_.store(lanes_);
    vec_ = {};
  }
#endif
};

template <Layout L>
using RealOf = typename ScalarAccess<L>::Real;

// Optimizer Opt's loops (the fused:: entry of its update header, optimizers.h): apply<V> on every element, and for
// two-pass optimizers norms() with its two sums of squares.
template <class Opt>
struct Loops {
  using Coef = typename Opt::template Coef<double>;

  template <Layout L>
  struct Apply {
    template <int V>
    static void go(const Chunk& chunk, const Coef& cd) {
      staged<L>(chunk, [&](const Chunk& c) {
        const auto s = state_of<RealOf<L>>(c);
        each<L>(c, [&](const auto& st, int64_t i, const auto& k) { Opt::template apply<V>(st, s, i, k); }, cd);
      });
    }
    // Runs go<variant>: one loop per apply<V> instantiation.
    template <int V = 0>
    static void run(const Chunk& c, const Coef& cd, int variant) {
      if constexpr (V + 1 < Opt::kVariants) {
        if (variant != V) return run<V + 1>(c, cd, variant);
      }
      go<V>(c, cd);
    }
  };

  template <Layout L>
  struct Norms {
    static void run(const Chunk& chunk, const Coef& cd, double* a_sq, double* b_sq) {
      SquareSums sa, sb;
      staged<L>(chunk, [&](const Chunk& c) {
        const auto s = state_of<RealOf<L>>(c);
        const int64_t base = c.first - chunk.first;  // lanes by the index in the whole chunk, staged or not
        each<L>(
            c,
            [&](const auto& st, int64_t i, const auto& k) {
              typename StorageOf<decltype(st)>::T a, b;
              Opt::norms(st, s, i, k, a, b);
              sa.add(base + i, a);
              sb.add(base + i, b);
            },
            cd);
      });
      *a_sq = sa.total();
      *b_sq = sb.total();
    }
  };

  static void apply(Layout l, const Chunk& c, const Coef& k, int variant) { by_layout<Apply>(l, c, k, variant); }
  static void norms(Layout l, const Chunk& c, const Coef& k, double* a_sq, double* b_sq) {
    by_layout<Norms>(l, c, k, a_sq, b_sq);
  }
  static constexpr Kernels<Opt> entry() {
    if constexpr (Opt::kTwoPass) return {apply, norms};
    else return {apply, nullptr};
  }
};

// Split and combine are the split-bf16 layout's store and load, run over a chunk whose param/aux are top/residual.
void split_bf16(const float* src, uint16_t* top, int16_t* residual, int64_t n) {
  const Chunk c{top, residual, nullptr, {nullptr, nullptr, nullptr}, n};
  each<Layout::kSplitBF16>(c, [&](const auto& st, int64_t i) { st.store(i, StorageOf<decltype(st)>::get(src, i)); });
}

void combine_bf16(const uint16_t* top, const int16_t* residual, float* dst, int64_t n) {
  const Chunk c{const_cast<uint16_t*>(top), const_cast<int16_t*>(residual), nullptr, {nullptr, nullptr, nullptr}, n};
  each<Layout::kSplitBF16>(c, [&](const auto& st, int64_t i) { StorageOf<decltype(st)>::put(dst, i, st.load(i)); });
}

void q8_encode(StateCodec c, const float* in, void* codes, float* scales, int64_t n) {
  encode_state(c, in, codes, scales, n, 0, 0);
}

void q8_decode(StateCodec c, const void* codes, const float* scales, float* out, int64_t n) {
  decode_state(c, codes, scales, out, n);
}

}  // namespace

#define ITR_ENTRY(name, args) Loops<fused::name>::entry(),
extern const KernelTable ITR_TABLE = {ITR_ISA_NAME, ITR_OPTIMIZERS(ITR_ENTRY) split_bf16, combine_bf16, q8_encode, q8_decode,
                                     attn::softmax_row, attn::softmax_grad_row, rmsn::rms_norm_row,
                                     rmsn::rms_norm_grad_row, rmsn::add_rms_norm_row, rmsn::add_rms_norm_grad_row,
                                     addn::add_norm_row, addn::add_norm_grad_row,
                                     rope::rope_row, swiglu::silu_mul, swiglu::silu_mul_grad,
                                     gelu::bias_gelu_row, gelu::bias_gelu_grad_row};
#undef ITR_ENTRY

}  // namespace ipex_train
