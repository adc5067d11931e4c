// Adagrad with torch.optim.Adagrad's meaning and order: lr_decay, weight_decay, eps, maximize
// (initial_accumulator_value only sets the state's starting value).
#pragma once

#include "../common.h"

namespace ipex_train {
namespace updates {

template <class T>
struct AdagradCoef {
  T grad_sign;
  T weight_decay;
  T clr;  // lr / (1 + (step - 1) * lr_decay)
  T eps;
  bool decay;  // weight_decay != 0 (torch skips a zero decay); uniform, so a branch
};

template <class T, class U>
ITR_FN AdagradCoef<T> cast(const AdagradCoef<U>& c) {
  return {T(c.grad_sign), T(c.weight_decay), T(c.clr), T(c.eps), c.decay};
}

static inline AdagradCoef<double> adagrad_coef(double lr, double lr_decay, double weight_decay, double eps,
                                               bool maximize, double step) {
  return {maximize ? -1.0 : 1.0, weight_decay, lr / (1.0 + (step - 1.0) * lr_decay), eps, weight_decay != 0.0};
}

template <class T>
ITR_FN void adagrad(T& w, T g, T& sum, const AdagradCoef<T>& c) {
  g = g * c.grad_sign;
  if (c.decay) g = g + c.weight_decay * w;
  sum = sum + g * g;
  const T std = math::sqrt_(sum) + c.eps;
  w = w - c.clr * (g / std);
}

}  // namespace updates

// The fused step ipex_train::adagrad_step (kernels_cpu/src/optimizers.h says what a fused:: entry declares).
namespace fused {

struct adagrad : Step<updates::AdagradCoef, 1, PerParam::kStateSteps, Passes::kOne> {
  struct Args {
    double lr, lr_decay, weight_decay, eps;
    bool maximize;
    Coef<double> coef(ParamStep p) const {
      return updates::adagrad_coef(lr, lr_decay, weight_decay, eps, maximize, p.step);
    }
  };

  template <int V, class S>
  ITR_FN void apply(const S& st, const State<typename S::Real>& s, int64_t i, const Coef<typename S::T>& k) {
    using T = typename S::T;
    element::with_one_state(st, s, i, [&](T& w, T g, T& sum) { updates::adagrad<T>(w, g, sum, k); });
  }
};

}  // namespace fused
}  // namespace ipex_train
