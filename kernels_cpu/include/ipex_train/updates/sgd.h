// SGD with momentum, dampening, nesterov, weight decay and maximize, with torch.optim.SGD's meaning and order.
#pragma once

#include "../common.h"

namespace ipex_train {
namespace updates {

template <class T>
struct SgdCoef {
  T lr;
  T weight_decay;
  T grad_sign;  // -1 when maximizing
  T momentum;
  T buf_keep;   // momentum, or 0 on the step that creates the buffer
  T grad_keep;  // 1 - dampening, or 1 on the step that creates the buffer (torch clones the grad there)
  bool decay;   // weight_decay != 0: torch skips a zero decay (0 * Inf would be NaN); uniform, so a branch
};

template <class T, class U>
ITR_FN SgdCoef<T> cast(const SgdCoef<U>& c) {
  return {T(c.lr), T(c.weight_decay), T(c.grad_sign), T(c.momentum), T(c.buf_keep), T(c.grad_keep), c.decay};
}

// Host-side: fresh marks the step that creates the momentum buffer.
static inline SgdCoef<double> sgd_coef(double lr, double momentum, double dampening, double weight_decay,
                                       bool maximize, bool fresh) {
  return {lr, weight_decay, maximize ? -1.0 : 1.0, momentum, fresh ? 0.0 : momentum, fresh ? 1.0 : 1.0 - dampening,
          weight_decay != 0.0};
}

template <class T, bool MOMENTUM, bool NESTEROV>
ITR_FN void sgd(T& w, T g, T& buf, const SgdCoef<T>& c) {
  g = g * c.grad_sign;
  if (c.decay) g = g + c.weight_decay * w;
  if (MOMENTUM) {
    buf = c.buf_keep * buf + c.grad_keep * g;
    g = NESTEROV ? g + c.momentum * buf : buf;
  }
  w = w - c.lr * g;
}

}  // namespace updates

// The fused step ipex_train::sgd_step (kernels_cpu/src/optimizers.h says what a fused:: entry declares).
namespace fused {

// One state list (momentum_buffers); apply<0>: no momentum, <1>: momentum, <2>: nesterov.
struct sgd : Step<updates::SgdCoef, 1, PerParam::kFreshFlags, Passes::kOne, 3> {
  struct Args {
    double lr, momentum, dampening, weight_decay;
    bool nesterov, maximize;
    const char* error() const {
      return nesterov && (momentum == 0 || dampening != 0) ? "nesterov needs momentum > 0 and dampening == 0" : nullptr;
    }
    int states() const { return momentum != 0 ? 1 : 0; }
    int variant() const { return momentum == 0 ? 0 : nesterov ? 2 : 1; }
    Coef<double> coef(ParamStep p) const {
      return updates::sgd_coef(lr, momentum, dampening, weight_decay, maximize, p.fresh);
    }
  };

  template <int V, class S>
  ITR_FN void apply(const S& st, const State<typename S::Real>& s, int64_t i, const Coef<typename S::T>& k) {
    using T = typename S::T;
    constexpr bool kMomentum = V != 0;
    T w = st.load(i);
    T buf = kMomentum ? S::get(s.s0, i) : T(0);
    updates::sgd<T, kMomentum, V == 2>(w, st.grad(i), buf, k);
    if (kMomentum) S::put(s.s0, i, buf);
    st.store(i, w);
  }
};

}  // namespace fused
}  // namespace ipex_train
