// Lars (You et al., "Large Batch Training of Convolutional Networks", Algorithm 1): a per-tensor local learning
// rate eeta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon), with the global lr inside the momentum:
//   buf = momentum * buf + lr * local_lr * (g + weight_decay * w);   w = w - buf
// The buffer starts at zero, so the first step is buf = lr * local_lr * (g + weight_decay * w).
#pragma once

#include "../common.h"

namespace ipex_train {
namespace updates {

template <class T>
struct LarsCoef {
  T momentum;
  T weight_decay;
  T scale;  // lr * local_lr; set per tensor from the norms pass
};

template <class T, class U>
ITR_FN LarsCoef<T> cast(const LarsCoef<U>& c) {
  return {T(c.momentum), T(c.weight_decay), T(c.scale)};
}

// The local lr, and 1 when either norm is zero (a zero-initialised tensor, or one with a zero grad, still moves
// by its plain SGD step).
static inline double lars_local_lr(double w_norm, double g_norm, double eeta, double weight_decay, double eps) {
  return (w_norm > 0.0 && g_norm > 0.0) ? eeta * w_norm / (g_norm + weight_decay * w_norm + eps) : 1.0;
}

template <class T>
ITR_FN void lars(T& w, T g, T& buf, const LarsCoef<T>& c) {
  buf = c.momentum * buf + c.scale * (g + c.weight_decay * w);
  w = w - buf;
}

}  // namespace updates

// The fused step ipex_train::lars_step (kernels_cpu/src/optimizers.h says what a fused:: entry declares).
namespace fused {

struct lars : Step<updates::LarsCoef, 1, PerParam::kNothing, Passes::kTwo> {
  struct Args {
    double lr, momentum, weight_decay, eeta, epsilon;
    Coef<double> coef(ParamStep) const { return {momentum, weight_decay, 0.0}; }
    void finish(Coef<double>& c, double w_norm, double g_norm) const {
      c.scale = lr * updates::lars_local_lr(w_norm, g_norm, eeta, weight_decay, epsilon);
    }
  };

  // First pass: the weight and the grad feed the caller's sums of squares.
  template <class S, class T = typename S::T>
  ITR_FN void norms(const S& st, const State<typename S::Real>&, int64_t i, const Coef<T>&, T& w, T& g) {
    w = st.load(i);
    g = st.grad(i);
  }

  template <int V, class S>
  ITR_FN void apply(const S& st, const State<typename S::Real>& s, int64_t i, const Coef<typename S::T>& k) {
    using T = typename S::T;
    element::with_one_state(st, s, i, [&](T& w, T g, T& buf) { updates::lars<T>(w, g, buf, k); });
  }
};

}  // namespace fused
}  // namespace ipex_train
