// The CPU loops: how each optimizer walks a chunk, over the storage layouts; the step of one element is
// ipex_train/elementwise.h (shared with the SYCL kernels).
//
// Each isa_*.cpp sets its compiler target, defines ITR_ISA_NAME and ITR_TABLE, and includes this file once; the
// compiler vectorizes the loops for that target (the per-element math is branch-free). Everything is local to the
// including file (anonymous namespace, IsaTag), so no function compiled for one ISA can be linked into another's
// place.
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

template <template <class> class Loop, class... Args>
void by_layout(Layout layout, Args&&... args) {
  switch (layout) {
    case Layout::kF32: return Loop<storage::F32<IsaTag>>::run(args...);
    case Layout::kF64: return Loop<storage::F64<IsaTag>>::run(args...);
    case Layout::kSplitBF16: return Loop<storage::SplitBF16<IsaTag>>::run(args...);
    case Layout::kBF16Master: return Loop<storage::Master16<IsaTag, false>>::run(args...);
    case Layout::kF16Master: return Loop<storage::Master16<IsaTag, true>>::run(args...);
  }
}

// Sums of squares are kept in kLanes independent double partial sums: the vectorizer may then use one vector lane
// per partial sum without reassociating a single sum (which IEEE semantics forbid), and double neither overflows
// for |w| > 1.8e19 nor loses digits over a chunk, matching the reference's double norms.
constexpr int64_t kLanes = 16;

double lanes_total(const double (&acc)[kLanes]) {
  double s = 0;
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// Runs body(i, lane) over the chunk, lane = i % kLanes, in blocks of kLanes the vectorizer can map onto vectors.
template <class Body>
void lanes_loop(int64_t n, const Body& body) {
  const int64_t full = n - n % kLanes;
  for (int64_t i0 = 0; i0 < full; i0 += kLanes) {
    ITR_LOOP
    for (int64_t j = 0; j < kLanes; ++j) body(i0 + j, j);
  }
  for (int64_t i = full; i < n; ++i) body(i, i - full);
}

template <class L>
struct SgdLoop {
  template <bool MOMENTUM, bool NESTEROV>
  static void go(const Chunk& c, const updates::SgdCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto s = state_of<T>(c);
    const auto k = updates::cast<T>(cd);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) element::sgd<L, MOMENTUM, NESTEROV>(st, s, i, k);
  }
  static void run(const Chunk& c, const updates::SgdCoef<double>& cd, bool momentum, bool nesterov) {
    if (!momentum) return go<false, false>(c, cd);
    return nesterov ? go<true, true>(c, cd) : go<true, false>(c, cd);
  }
};

template <class L>
struct AdamLoop {
  template <bool AMSGRAD>
  static void go(const Chunk& c, const updates::AdamCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto s = state_of<T>(c);
    const auto k = updates::cast<T>(cd);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) element::adam<L, AMSGRAD>(st, s, i, k);
  }
  static void run(const Chunk& c, const updates::AdamCoef<double>& cd, bool amsgrad) {
    return amsgrad ? go<true>(c, cd) : go<false>(c, cd);
  }
};

template <class L>
struct AdagradLoop {
  static void run(const Chunk& c, const updates::AdagradCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto s = state_of<T>(c);
    const auto k = updates::cast<T>(cd);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) element::adagrad<L>(st, s, i, k);
  }
};

template <class L>
struct LambMomentsLoop {
  static void run(const Chunk& c, const updates::LambCoef<double>& cd, double* w_sq, double* u_sq) {
    using T = typename L::T;
    const L st(c);
    const auto s = state_of<T>(c);
    const auto k = updates::cast<T>(cd);
    double aw[kLanes] = {}, au[kLanes] = {};
    lanes_loop(c.n, [&](int64_t i, int64_t j) {
      T w, u;
      element::lamb_moments<L>(st, s, i, k, w, u);
      aw[j] += double(w) * double(w);
      au[j] += double(u) * double(u);
    });
    *w_sq = lanes_total(aw);
    *u_sq = lanes_total(au);
  }
};

template <class L>
struct LambApplyLoop {
  static void run(const Chunk& c, const updates::LambCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto s = state_of<T>(c);
    const auto k = updates::cast<T>(cd);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) element::lamb_apply<L>(st, s, i, k);
  }
};

template <class L>
struct LarsNormsLoop {
  static void run(const Chunk& c, double* w_sq, double* g_sq) {
    const L st(c);
    double aw[kLanes] = {}, ag[kLanes] = {};
    lanes_loop(c.n, [&](int64_t i, int64_t j) {
      const double w = st.load(i), g = st.grad(i);
      aw[j] += w * w;
      ag[j] += g * g;
    });
    *w_sq = lanes_total(aw);
    *g_sq = lanes_total(ag);
  }
};

template <class L>
struct LarsApplyLoop {
  static void run(const Chunk& c, const updates::LarsCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto s = state_of<T>(c);
    const auto k = updates::cast<T>(cd);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) element::lars_apply<L>(st, s, i, k);
  }
};

void sgd(Layout l, const Chunk& c, const updates::SgdCoef<double>& k, bool momentum, bool nesterov) {
  by_layout<SgdLoop>(l, c, k, momentum, nesterov);
}
void adam(Layout l, const Chunk& c, const updates::AdamCoef<double>& k, bool amsgrad) {
  by_layout<AdamLoop>(l, c, k, amsgrad);
}
void adagrad(Layout l, const Chunk& c, const updates::AdagradCoef<double>& k) { by_layout<AdagradLoop>(l, c, k); }
void lamb_moments(Layout l, const Chunk& c, const updates::LambCoef<double>& k, double* w_sq, double* u_sq) {
  by_layout<LambMomentsLoop>(l, c, k, w_sq, u_sq);
}
void lamb_apply(Layout l, const Chunk& c, const updates::LambCoef<double>& k) { by_layout<LambApplyLoop>(l, c, k); }
void lars_norms(Layout l, const Chunk& c, double* w_sq, double* g_sq) { by_layout<LarsNormsLoop>(l, c, w_sq, g_sq); }
void lars_apply(Layout l, const Chunk& c, const updates::LarsCoef<double>& k) { by_layout<LarsApplyLoop>(l, c, k); }

void split_bf16(const float* src, uint16_t* top, int16_t* residual, int64_t n) {
  ITR_LOOP
  for (int64_t i = 0; i < n; ++i) {
    uint16_t t;
    int16_t r;
    convert::split_bf16(src[i], t, r);
    top[i] = t;
    residual[i] = r;
  }
}

void combine_bf16(const uint16_t* top, const int16_t* residual, float* dst, int64_t n) {
  ITR_LOOP
  for (int64_t i = 0; i < n; ++i) dst[i] = convert::combine_bf16(top[i], residual[i]);
}

}  // namespace

extern const KernelTable ITR_TABLE = {
    ITR_ISA_NAME, sgd, adam, adagrad, lamb_moments, lamb_apply, lars_norms, lars_apply, split_bf16, combine_bf16,
};

}  // namespace ipex_train
