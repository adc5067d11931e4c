// The fused optimizers, listed once for the whole C++ side (X-macros). ipex_train/optim/_registry.py is the Python
// side of the same list; ipex_train checks at import that both name the same optimizers with the same arguments.
//
// ITR_OPTIMIZERS(X): X(name, arguments) for each op ipex_train::<name>_step. `arguments` is the schema after the
// three arguments every step op starts with (params, aux, grads): the state lists, then fresh_buffers (SGD),
// state_steps (optimizers that count steps), then the scalars. ops.cpp registers each op, its CPU kernel
// <name>_step and its sparse refusal from this list; the SYCL host glue binds Runtime::<name>.
//
// ITR_KERNELS(X): X(entry, parameters, template flags...) for each entry of the per-ISA KernelTable (kernel_abi.h,
// filled by loops.h from functions of the same names) and each SYCL kernel template of kernels_xpu/rtc/steps.cpp;
// the flags are the suffixes of the instantiations after the layout (one ">" when the kernel has no flags).
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

// Lamb and Lars run two passes: the first returns sums of squares for the trust ratio.
#define ITR_KERNELS(X)                                                                                            \
  X(sgd, (Layout, const Chunk&, const updates::SgdCoef<double>&, bool momentum, bool nesterov),                   \
    ", false, false>", ", true, false>", ", true, true>")                                                         \
  X(adam, (Layout, const Chunk&, const updates::AdamCoef<double>&, bool amsgrad), ", false>", ", true>")         \
  X(adagrad, (Layout, const Chunk&, const updates::AdagradCoef<double>&), ">")                                    \
  X(lamb_moments, (Layout, const Chunk&, const updates::LambCoef<double>&, double* w_sq, double* u_sq), ">")     \
  X(lamb_apply, (Layout, const Chunk&, const updates::LambCoef<double>&), ">")                                    \
  X(lars_norms, (Layout, const Chunk&, double* w_sq, double* g_sq), ">")                                          \
  X(lars_apply, (Layout, const Chunk&, const updates::LarsCoef<double>&), ">")
