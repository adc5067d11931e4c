// The fused optimizers, listed once for the whole C++ side (X-macros). ipex_train/optim/registry.py is the Python
// side of the same list; ipex_train checks at import that both name the same optimizers with the same arguments.
//
// ITR_OPTIMIZERS(X): X(name, arguments) for each op ipex_train::<name>_step. `arguments` is the schema after the
// three arguments every step op starts with (params, aux, grads): the state lists, then fresh_buffers (SGD),
// state_steps (optimizers that count steps), then the scalars. Everything else is generated from this list and the
// struct fused::<name> its update header (include/ipex_train/updates/<name>.h) declares:
//   its base         Step<coefficient struct, number of state lists, what it takes per parameter (nothing,
//                    fresh_buffers or state_steps), one pass or two (a first pass, norms(), returning two sums of
//                    squares per tensor: Lamb, Lars), number of apply<V> variants (compile-time flags: amsgrad)>
//   Args             the scalars of `arguments` as fields, in order, with coef(ParamStep) (the coefficients, in
//                    double), with two passes finish(coef, norm_a, norm_b) (the coefficients once the tensor's
//                    norms are known), and where needed error() (a message, or null), states() (how many state
//                    lists this call uses) and variant()
//   apply<V>(st, s, i, k), and norms(st, s, i, k, a, b) with two passes: one element's (or one CPU vector's) step;
//                    st is its storage layout (ipex_train/elementwise.h), s the chunk's state arrays
// From them: the per-ISA KernelTable (kernel_abi.h) and its loops (loops.h), the op, its registration and its
// sparse refusal (ops.cpp), the SYCL kernels (kernels_xpu/rtc/steps.cpp) and Runtime::<name> (kernels_xpu/host).
#pragma once

#define ITR_OPTIMIZERS(X)                                                                                         \
  X(sgd,                                                                                                          \
    "Tensor(c!)[] momentum_buffers, bool[] fresh_buffers, float lr, float momentum, float dampening, "           \
    "float weight_decay, bool nesterov, bool maximize")                                                           \
  X(adam,                                                                                                         \
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, "       \
    "float lr, float beta1, float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, "            \
    "bool decoupled_weight_decay")                                                                                \
  X(adagrad,                                                                                                      \
    "Tensor(c!)[] state_sums, Tensor[] state_steps, float lr, float lr_decay, float weight_decay, float eps, "    \
    "bool maximize")                                                                                              \
  X(lamb,                                                                                                         \
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor[] state_steps, float lr, float beta1, float beta2, " \
    "float weight_decay, float eps, bool bias_correction")                                                        \
  X(lars, "Tensor(c!)[] momentum_buffers, float lr, float momentum, float weight_decay, float eeta, float epsilon")
