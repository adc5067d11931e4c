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

// One element's (or one CPU vector's) step: S is a storage layout (ipex_train/elementwise.h), S::T its working type,
// s the chunk's state arrays; i indexes the chunk.
namespace element {

template <class S>
ITR_FN void lars_apply(const S& st, const State<typename S::Real>& s, int64_t i,
                       const updates::LarsCoef<typename S::T>& k) {
  using T = typename S::T;
  with_one_state(st, s, i, [&](T& w, T g, T& buf) { updates::lars<T>(w, g, buf, k); });
}

}  // namespace element
}  // namespace ipex_train
