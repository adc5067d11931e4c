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
};

template <class T, class U>
ITR_FN SgdCoef<T> cast(const SgdCoef<U>& c) {
  return {T(c.lr), T(c.weight_decay), T(c.grad_sign), T(c.momentum), T(c.buf_keep), T(c.grad_keep)};
}

template <class T, bool MOMENTUM, bool NESTEROV>
ITR_FN void sgd(T& w, T g, T& buf, const SgdCoef<T>& c) {
  g = g * c.grad_sign;
  g = math::select(c.weight_decay != T(0), g + c.weight_decay * w, g);  // torch skips a zero decay (0 * Inf)
  if (MOMENTUM) {
    buf = c.buf_keep * buf + c.grad_keep * g;
    g = NESTEROV ? g + c.momentum * buf : buf;
  }
  w = w - c.lr * g;
}

}  // namespace updates
}  // namespace ipex_train
