// Adam / AdamW with torch.optim.Adam's meaning and order: L2 weight decay (Adam) or decoupled (AdamW, and Adam
// with decoupled_weight_decay=True), amsgrad, maximize, bias correction.
#pragma once

#include "../common.h"

namespace ipex_train {
namespace updates {

template <class T>
struct AdamCoef {
  T grad_sign;        // -1 when maximizing
  T l2;               // weight_decay for Adam's L2 form, else 0
  T decay;            // 1 - lr * weight_decay for the decoupled form, else 1
  T one_minus_beta1;  // lerp weight of exp_avg toward the grad
  T beta2;
  T one_minus_beta2;
  T step_size;        // lr / (1 - beta1^step)
  T inv_bc2_sqrt;     // 1 / sqrt(1 - beta2^step): a multiply, not a second divide per element
  T eps;
  bool l2_on;       // l2 != 0 (torch skips a zero decay, 0 * Inf); uniform, so a branch
  bool lerp_low;    // which of torch's two lerp forms the (uniform) weight one_minus_beta1 takes
};

template <class T, class U>
ITR_FN AdamCoef<T> cast(const AdamCoef<U>& c) {
  return {T(c.grad_sign), T(c.l2), T(c.decay), T(c.one_minus_beta1), T(c.beta2), T(c.one_minus_beta2),
          T(c.step_size), T(c.inv_bc2_sqrt), T(c.eps), c.l2_on, math::lerp_low<T>(c.one_minus_beta1)};
}

// Host-side: the per-parameter coefficients for `step` (computed in double, as torch's Python code does).
static inline AdamCoef<double> adam_coef(double lr, double beta1, double beta2, double weight_decay, double eps,
                                         bool maximize, bool decoupled, double step) {
  return {maximize ? -1.0 : 1.0,
          decoupled ? 0.0 : weight_decay,
          decoupled ? 1.0 - lr * weight_decay : 1.0,
          1.0 - beta1,
          beta2,
          1.0 - beta2,
          lr / (1.0 - __builtin_pow(beta1, step)),
          1.0 / __builtin_sqrt(1.0 - __builtin_pow(beta2, step)),
          eps,
          !decoupled && weight_decay != 0.0,
          math::lerp_low<double>(1.0 - beta1)};  // cast<float> decides it again in float
}

template <class T, bool AMSGRAD>
ITR_FN void adam(T& w, T g, T& m, T& v, T& vmax, const AdamCoef<T>& c) {
  g = g * c.grad_sign;
  if (c.l2_on) g = g + c.l2 * w;
  w = w * c.decay;
  m = math::lerp(m, g, c.one_minus_beta1, c.lerp_low);
  v = v * c.beta2 + c.one_minus_beta2 * g * g;
  T second = v;
  if (AMSGRAD) {
    vmax = math::maximum(vmax, v);
    second = vmax;
  }
  const T denom = math::sqrt_(second) * c.inv_bc2_sqrt + c.eps;
  w = w - c.step_size * (m / denom);
}

}  // namespace updates

// The fused step ipex_train::adam_step (kernels_cpu/src/optimizers.h says what a fused:: entry declares).
namespace fused {

// Three state lists (exp_avgs, exp_avg_sqs, max_exp_avg_sqs); apply<1>: amsgrad.
struct adam : Step<updates::AdamCoef, 3, PerParam::kStateSteps, Passes::kOne, 2> {
  struct Args {
    double lr, beta1, beta2, weight_decay, eps;
    bool amsgrad, maximize, decoupled_weight_decay;
    int states() const { return amsgrad ? 3 : 2; }
    int variant() const { return amsgrad ? 1 : 0; }
    Coef<double> coef(ParamStep p) const {
      return updates::adam_coef(lr, beta1, beta2, weight_decay, eps, maximize, decoupled_weight_decay, p.step);
    }
  };

  template <int V, class S>
  ITR_FN void apply(const S& st, const State<typename S::Real>& s, int64_t i, const Coef<typename S::T>& k) {
    using T = typename S::T;
    constexpr bool kAmsgrad = V == 1;
    T w = st.load(i);
    T m = S::get(s.s0, i), v = S::get(s.s1, i), vmax = kAmsgrad ? S::get(s.s2, i) : T(0);
    updates::adam<T, kAmsgrad>(w, st.grad(i), m, v, vmax, k);
    S::put(s.s0, i, m);
    S::put(s.s1, i, v);
    if (kAmsgrad) S::put(s.s2, i, vmax);
    st.store(i, w);
  }
};

}  // namespace fused
}  // namespace ipex_train
