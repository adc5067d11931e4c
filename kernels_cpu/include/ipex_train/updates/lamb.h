// Lamb (You et al., "Large Batch Optimization for Deep Learning"): Adam moments, then a per-tensor trust ratio
// ||w|| / ||u|| on the update direction u. Two passes over each tensor: `lamb_moments` updates the moments and
// yields u (the caller accumulates ||w||^2 and ||u||^2), `lamb_direction` recomputes u from the stored moments
// so the apply pass needs no full-size buffer.
#pragma once

#include "../common.h"

namespace ipex_train {
namespace updates {

template <class T>
struct LambCoef {
  T beta1;
  T one_minus_beta1;
  T beta2;
  T one_minus_beta2;
  T inv_bc1;  // 1 / (1 - beta1^step), or 1 without bias correction
  T inv_bc2;  // 1 / (1 - beta2^step), or 1 without bias correction
  T eps;
  T weight_decay;
  T lr_trust;  // lr * trust ratio; set per tensor between the two passes
};

template <class T, class U>
ITR_FN LambCoef<T> cast(const LambCoef<U>& c) {
  return {T(c.beta1), T(c.one_minus_beta1), T(c.beta2), T(c.one_minus_beta2), T(c.inv_bc1), T(c.inv_bc2),
          T(c.eps),   T(c.weight_decay),    T(c.lr_trust)};
}

static inline LambCoef<double> lamb_coef(double beta1, double beta2, double eps, double weight_decay,
                                         bool bias_correction, double step) {
  return {beta1,
          1.0 - beta1,
          beta2,
          1.0 - beta2,
          bias_correction ? 1.0 / (1.0 - __builtin_pow(beta1, step)) : 1.0,
          bias_correction ? 1.0 / (1.0 - __builtin_pow(beta2, step)) : 1.0,
          eps,
          weight_decay,
          0.0};
}

// Trust ratio ||w|| / ||u||, and 1 when either norm is zero (a zero-initialised bias must still move).
static inline double lamb_trust_ratio(double w_norm, double u_norm) {
  return (w_norm > 0.0 && u_norm > 0.0) ? w_norm / u_norm : 1.0;
}

template <class T>
ITR_FN T lamb_direction(T w, T m, T v, const LambCoef<T>& c) {
  return (m * c.inv_bc1) / (math::sqrt_(v * c.inv_bc2) + c.eps) + c.weight_decay * w;
}

template <class T>
ITR_FN T lamb_moments(T w, T g, T& m, T& v, const LambCoef<T>& c) {
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  return lamb_direction(w, m, v, c);
}

template <class T>
ITR_FN void lamb_apply(T& w, T m, T v, const LambCoef<T>& c) {
  w = w - c.lr_trust * lamb_direction(w, m, v, c);
}

}  // namespace updates

// The fused step ipex_train::lamb_step (kernels_cpu/src/optimizers.h says what a fused:: entry declares).
namespace fused {

struct lamb : Step<updates::LambCoef, 2, PerParam::kStateSteps, Passes::kTwo> {
  struct Args {
    double lr, beta1, beta2, weight_decay, eps;
    bool bias_correction;
    Coef<double> coef(ParamStep p) const {
      return updates::lamb_coef(beta1, beta2, eps, weight_decay, bias_correction, p.step);
    }
    void finish(Coef<double>& c, double w_norm, double u_norm) const {
      c.lr_trust = lr * updates::lamb_trust_ratio(w_norm, u_norm);
    }
  };

  // First pass: updates the moments; w and u (the update direction) feed the caller's sums of squares.
  template <class S, class T = typename S::T>
  ITR_FN void norms(const S& st, const State<typename S::Real>& s, int64_t i, const Coef<T>& k, T& w, T& u) {
    w = st.load(i);
    T m = S::get(s.s0, i), v = S::get(s.s1, i);
    u = updates::lamb_moments<T>(w, st.grad(i), m, v, k);
    S::put(s.s0, i, m);
    S::put(s.s1, i, v);
  }

  template <int V, class S>
  ITR_FN void apply(const S& st, const State<typename S::Real>& s, int64_t i, const Coef<typename S::T>& k) {
    using T = typename S::T;
    T w = st.load(i);
    updates::lamb_apply<T>(w, S::get(s.s0, i), S::get(s.s1, i), k);
    st.store(i, w);
  }
};

}  // namespace fused
}  // namespace ipex_train
