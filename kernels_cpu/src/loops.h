// The loops: one template per optimizer over the storage layouts, instantiated once per ISA.
//
// Each isa_*.cpp sets its compiler target, defines ITR_ISA_NS and ITR_TABLE, and includes this file; the
// compiler vectorizes the loops for that target (the per-element math has no branches the vectorizer cannot
// if-convert). Everything lives in an anonymous namespace so no function compiled for one ISA can be linked into
// another's place.
#include "kernel_abi.h"
#include "ipex_train/convert.h"

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

using uint16 = uint16_t;

// Storage layouts: how to read the working value and the grad of element i, and how to write the value back.
struct F32 {
  using T = float;
  float* p;
  const float* g;
  explicit F32(const Chunk& c) : p(static_cast<float*>(c.param)), g(static_cast<const float*>(c.grad)) {}
  T load(int64_t i) const { return p[i]; }
  T grad(int64_t i) const { return g[i]; }
  void store(int64_t i, T w) const { p[i] = w; }
};

struct F64 {
  using T = double;
  double* p;
  const double* g;
  explicit F64(const Chunk& c) : p(static_cast<double*>(c.param)), g(static_cast<const double*>(c.grad)) {}
  T load(int64_t i) const { return p[i]; }
  T grad(int64_t i) const { return g[i]; }
  void store(int64_t i, T w) const { p[i] = w; }
};

struct SplitBF16 {
  using T = float;
  uint16* top;
  int16_t* res;
  const uint16* g;
  explicit SplitBF16(const Chunk& c)
      : top(static_cast<uint16*>(c.param)), res(static_cast<int16_t*>(c.aux)), g(static_cast<const uint16*>(c.grad)) {}
  T load(int64_t i) const { return convert::combine_bf16(top[i], res[i]); }
  T grad(int64_t i) const { return convert::bf16_to_f32(g[i]); }
  void store(int64_t i, T w) const {
    uint16 t;
    int16_t r;
    convert::split_bf16(w, t, r);
    top[i] = t;
    res[i] = r;
  }
};

template <bool HALF>
struct Master16 {
  using T = float;
  uint16* p;
  float* master;
  const uint16* g;
  explicit Master16(const Chunk& c)
      : p(static_cast<uint16*>(c.param)), master(static_cast<float*>(c.aux)), g(static_cast<const uint16*>(c.grad)) {}
  T load(int64_t i) const { return master[i]; }
  T grad(int64_t i) const { return HALF ? convert::f16_to_f32(g[i]) : convert::bf16_to_f32(g[i]); }
  void store(int64_t i, T w) const {
    master[i] = w;
    p[i] = HALF ? convert::f32_to_f16(w) : convert::f32_to_bf16(w);
  }
};

template <template <class> class Loop, class... Args>
void by_layout(Layout layout, Args&&... args) {
  switch (layout) {
    case Layout::kF32: return Loop<F32>::run(args...);
    case Layout::kF64: return Loop<F64>::run(args...);
    case Layout::kSplitBF16: return Loop<SplitBF16>::run(args...);
    case Layout::kBF16Master: return Loop<Master16<false>>::run(args...);
    case Layout::kF16Master: return Loop<Master16<true>>::run(args...);
  }
}

template <class T>
T* state(const Chunk& c, int k) {
  return static_cast<T*>(c.state[k]);
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

template <class L>
struct SgdLoop {
  template <bool MOMENTUM, bool NESTEROV>
  static void go(const Chunk& c, const updates::SgdCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto k = updates::cast<T>(cd);
    T* buf = MOMENTUM ? state<T>(c, 0) : nullptr;
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) {
      T w = st.load(i);
      T b = MOMENTUM ? buf[i] : T(0);
      updates::sgd<T, MOMENTUM, NESTEROV>(w, st.grad(i), b, k);
      if (MOMENTUM) buf[i] = b;
      st.store(i, w);
    }
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
    const auto k = updates::cast<T>(cd);
    T* m = state<T>(c, 0);
    T* v = state<T>(c, 1);
    T* vmax = AMSGRAD ? state<T>(c, 2) : nullptr;
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) {
      T w = st.load(i);
      T mi = m[i], vi = v[i], vmi = AMSGRAD ? vmax[i] : T(0);
      updates::adam<T, AMSGRAD>(w, st.grad(i), mi, vi, vmi, k);
      m[i] = mi;
      v[i] = vi;
      if (AMSGRAD) vmax[i] = vmi;
      st.store(i, w);
    }
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
    const auto k = updates::cast<T>(cd);
    T* sum = state<T>(c, 0);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) {
      T w = st.load(i);
      T s = sum[i];
      updates::adagrad<T>(w, st.grad(i), s, k);
      sum[i] = s;
      st.store(i, w);
    }
  }
};

template <class L>
struct LambMomentsLoop {
  static void run(const Chunk& c, const updates::LambCoef<double>& cd, double* w_sq, double* u_sq) {
    using T = typename L::T;
    const L st(c);
    const auto k = updates::cast<T>(cd);
    T* m = state<T>(c, 0);
    T* v = state<T>(c, 1);
    double aw[kLanes] = {}, au[kLanes] = {};
    const int64_t body = c.n - c.n % kLanes;
    for (int64_t i0 = 0; i0 < body; i0 += kLanes) {
      ITR_LOOP
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t i = i0 + j;
        const T w = st.load(i);
        T mi = m[i], vi = v[i];
        const T u = updates::lamb_moments<T>(w, st.grad(i), mi, vi, k);
        m[i] = mi;
        v[i] = vi;
        aw[j] += double(w) * double(w);
        au[j] += double(u) * double(u);
      }
    }
    for (int64_t i = body; i < c.n; ++i) {
      const T w = st.load(i);
      T mi = m[i], vi = v[i];
      const T u = updates::lamb_moments<T>(w, st.grad(i), mi, vi, k);
      m[i] = mi;
      v[i] = vi;
      aw[i - body] += double(w) * double(w);
      au[i - body] += double(u) * double(u);
    }
    *w_sq = lanes_total(aw);
    *u_sq = lanes_total(au);
  }
};

template <class L>
struct LambApplyLoop {
  static void run(const Chunk& c, const updates::LambCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto k = updates::cast<T>(cd);
    const T* m = state<T>(c, 0);
    const T* v = state<T>(c, 1);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) {
      T w = st.load(i);
      updates::lamb_apply<T>(w, m[i], v[i], k);
      st.store(i, w);
    }
  }
};

template <class L>
struct LarsNormsLoop {
  static void run(const Chunk& c, double* w_sq, double* g_sq) {
    using T = typename L::T;
    const L st(c);
    double aw[kLanes] = {}, ag[kLanes] = {};
    const int64_t body = c.n - c.n % kLanes;
    for (int64_t i0 = 0; i0 < body; i0 += kLanes) {
      ITR_LOOP
      for (int64_t j = 0; j < kLanes; ++j) {
        const T w = st.load(i0 + j), g = st.grad(i0 + j);
        aw[j] += double(w) * double(w);
        ag[j] += double(g) * double(g);
      }
    }
    for (int64_t i = body; i < c.n; ++i) {
      const T w = st.load(i), g = st.grad(i);
      aw[i - body] += double(w) * double(w);
      ag[i - body] += double(g) * double(g);
    }
    *w_sq = lanes_total(aw);
    *g_sq = lanes_total(ag);
  }
};

template <class L>
struct LarsApplyLoop {
  static void run(const Chunk& c, const updates::LarsCoef<double>& cd) {
    using T = typename L::T;
    const L st(c);
    const auto k = updates::cast<T>(cd);
    T* buf = state<T>(c, 0);
    ITR_LOOP
    for (int64_t i = 0; i < c.n; ++i) {
      T w = st.load(i);
      T b = buf[i];
      updates::lars<T>(w, st.grad(i), b, k);
      buf[i] = b;
      st.store(i, w);
    }
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

void split_bf16(const float* src, uint16* top, int16_t* residual, int64_t n) {
  ITR_LOOP
  for (int64_t i = 0; i < n; ++i) {
    uint16 t;
    int16_t r;
    convert::split_bf16(src[i], t, r);
    top[i] = t;
    residual[i] = r;
  }
}

void combine_bf16(const uint16* top, const int16_t* residual, float* dst, int64_t n) {
  ITR_LOOP
  for (int64_t i = 0; i < n; ++i) dst[i] = convert::combine_bf16(top[i], residual[i]);
}

}  // namespace

extern const KernelTable ITR_TABLE = {
    ITR_ISA_NAME, sgd, adam, adagrad, lamb_moments, lamb_apply, lars_norms, lars_apply, split_bf16, combine_bf16,
};

}  // namespace ipex_train
