// The step ops of kernels_cpu and their registration: each op checks its group (checks.h), computes the
// per-parameter coefficients with its update header, and runs the kernel variant's loops over the group's chunks
// (schedule.h). The per-element math is in include/ipex_train/updates/*.h and the loops in loops.h; this file
// never touches an element. Which ops exist, and their schemas, is optimizers.h's list.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "optimizers.h"
#include "schedule.h"
#include "variants.h"

namespace ipex_train {
namespace {

void sgd_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
              at::TensorList momentum_buffers, c10::List<bool> fresh_buffers, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool maximize) {
  const char* op = "ipex_train::sgd_step";
  const bool use_momentum = momentum != 0;
  TORCH_CHECK_VALUE(!nesterov || (use_momentum && dampening == 0), op,
                    ": nesterov needs momentum > 0 and dampening == 0");
  std::vector<StateArg> states;
  if (use_momentum) {
    states.push_back({"momentum_buffers", momentum_buffers});
    TORCH_CHECK_VALUE(fresh_buffers.size() == params.size(), op, ": got ", params.size(), " params but ",
                      fresh_buffers.size(), " fresh_buffers flags");
  }
  auto slots = prepare(op, params, aux, grads, states, kStreamMin);
  std::vector<updates::SgdCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const bool fresh = use_momentum && fresh_buffers.get(i);
    coef[i] = updates::sgd_coef(lr, momentum, dampening, weight_decay, maximize, fresh);
  }
  int64_t total;
  const auto jobs = jobs_of(slots, &total);
  const KernelTable& k = kernels();
  for_each_chunk(slots, jobs, total, [&](int64_t i, const Chunk& c, int64_t) {
    k.sgd(slots[i].layout, c, coef[i], use_momentum, nesterov);
  });
  write_back(slots);
}

void adam_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
               at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
               at::TensorList state_steps, double lr, double beta1, double beta2, double weight_decay, double eps,
               bool amsgrad, bool maximize, bool decoupled_weight_decay) {
  const char* op = "ipex_train::adam_step";
  std::vector<StateArg> states = {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}};
  if (amsgrad) states.push_back({"max_exp_avg_sqs", max_exp_avg_sqs});
  check_steps_len(op, params, state_steps);
  auto slots = prepare(op, params, aux, grads, states, kStreamMin);
  std::vector<updates::AdamCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    coef[i] = updates::adam_coef(lr, beta1, beta2, weight_decay, eps, maximize, decoupled_weight_decay,
                                 step_of(op, state_steps, i));
  int64_t total;
  const auto jobs = jobs_of(slots, &total);
  const KernelTable& k = kernels();
  for_each_chunk(slots, jobs, total,
                 [&](int64_t i, const Chunk& c, int64_t) { k.adam(slots[i].layout, c, coef[i], amsgrad); });
  write_back(slots);
}

void adagrad_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
                  at::TensorList state_sums, at::TensorList state_steps, double lr, double lr_decay,
                  double weight_decay, double eps, bool maximize) {
  const char* op = "ipex_train::adagrad_step";
  check_steps_len(op, params, state_steps);
  auto slots = prepare(op, params, aux, grads, {{"state_sums", state_sums}}, kStreamMin);
  std::vector<updates::AdagradCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    coef[i] = updates::adagrad_coef(lr, lr_decay, weight_decay, eps, maximize, step_of(op, state_steps, i));
  int64_t total;
  const auto jobs = jobs_of(slots, &total);
  const KernelTable& k = kernels();
  for_each_chunk(slots, jobs, total,
                 [&](int64_t i, const Chunk& c, int64_t) { k.adagrad(slots[i].layout, c, coef[i]); });
  write_back(slots);
}

void lamb_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
               at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList state_steps, double lr,
               double beta1, double beta2, double weight_decay, double eps, bool bias_correction) {
  const char* op = "ipex_train::lamb_step";
  check_steps_len(op, params, state_steps);
  auto slots = prepare(op, params, aux, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}}, kStreamMin);
  std::vector<updates::LambCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    coef[i] = updates::lamb_coef(beta1, beta2, eps, weight_decay, bias_correction, step_of(op, state_steps, i));
  const KernelTable& k = kernels();
  two_passes(
      slots,
      [&](int64_t i, const Chunk& c, double* w_sq, double* u_sq) { k.lamb_moments(slots[i].layout, c, coef[i], w_sq, u_sq); },
      [&](size_t i, double w_norm, double u_norm) { coef[i].lr_trust = lr * updates::lamb_trust_ratio(w_norm, u_norm); },
      [&](int64_t i, const Chunk& c) { k.lamb_apply(slots[i].layout, c, coef[i]); });
  write_back(slots);
}

void lars_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
               at::TensorList momentum_buffers, double lr, double momentum, double weight_decay, double eeta,
               double epsilon) {
  const char* op = "ipex_train::lars_step";
  auto slots = prepare(op, params, aux, grads, {{"momentum_buffers", momentum_buffers}}, kStreamMin);
  const KernelTable& k = kernels();
  std::vector<updates::LarsCoef<double>> coef(slots.size());
  two_passes(
      slots, [&](int64_t i, const Chunk& c, double* w_sq, double* g_sq) { k.lars_norms(slots[i].layout, c, w_sq, g_sq); },
      [&](size_t i, double w_norm, double g_norm) {
        coef[i] = {momentum, weight_decay, lr * updates::lars_local_lr(w_norm, g_norm, eeta, weight_decay, epsilon)};
      },
      [&](int64_t i, const Chunk& c) { k.lars_apply(slots[i].layout, c, coef[i]); });
  write_back(slots);
}

std::tuple<at::Tensor, at::Tensor> split_bf16(const at::Tensor& src_in) {
  const char* op = "ipex_train::split_bf16";
  check_cpu_dense(op, src_in, "src");
  TORCH_CHECK_TYPE(src_in.scalar_type() == at::kFloat, op, ": src has dtype ", src_in.scalar_type(),
                   "; expected float32");
  const at::Tensor src = src_in.is_non_overlapping_and_dense() ? src_in : src_in.contiguous();
  at::Tensor top = at::empty_like(src, src.options().dtype(at::kBFloat16));
  at::Tensor res = at::empty_like(src, src.options().dtype(at::kShort));
  TORCH_INTERNAL_ASSERT(same_memory_order(src, top) && same_memory_order(src, res));
  const float* s = src.const_data_ptr<float>();
  auto* t = static_cast<uint16_t*>(top.data_ptr());
  auto* r = static_cast<int16_t*>(res.data_ptr());
  const KernelTable& k = kernels();
  parallel_chunks(src.numel(), [&](int64_t b, int64_t n) { k.split_bf16(s + b, t + b, r + b, n); });
  return {top, res};
}

at::Tensor combine_bf16(const at::Tensor& top_in, const at::Tensor& res_in) {
  const char* op = "ipex_train::combine_bf16";
  check_cpu_dense(op, top_in, "top");
  check_cpu_dense(op, res_in, "residual");
  TORCH_CHECK_TYPE(top_in.scalar_type() == at::kBFloat16, op, ": top has dtype ", top_in.scalar_type(),
                   "; expected bfloat16");
  TORCH_CHECK_TYPE(res_in.scalar_type() == at::kShort, op, ": residual has dtype ", res_in.scalar_type(),
                   "; expected int16");
  check_same_shape(op, res_in, "residual", top_in, "top");
  at::Tensor top = top_in.is_non_overlapping_and_dense() ? top_in : top_in.contiguous();
  at::Tensor res = same_memory_order(top, res_in) ? res_in : res_in.contiguous();
  if (!same_memory_order(top, res)) top = top.contiguous();
  at::Tensor out = at::empty_like(top, top.options().dtype(at::kFloat));
  const auto* t = static_cast<const uint16_t*>(top.const_data_ptr());
  const auto* r = static_cast<const int16_t*>(res.const_data_ptr());
  float* o = out.data_ptr<float>();
  const KernelTable& k = kernels();
  parallel_chunks(out.numel(), [&](int64_t b, int64_t n) { k.combine_bf16(t + b, r + b, o + b, n); });
  return out;
}

// Sparse grads dispatch to the SparseCPU key, before the CPU kernel's own checks could name the argument.
void reject_sparse(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto args = torch::jit::last(*stack, schema.arguments().size());
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    if (!args[a].isTensorList()) continue;
    const auto list = args[a].toTensorList();
    for (size_t i = 0; i < list.size(); ++i)
      TORCH_CHECK_VALUE(!at::Tensor(list[i]).is_sparse(), schema.name(), ": ", where(schema.arguments()[a].name().c_str(), i),
                        " is sparse; the fused kernels take dense tensors only (ipex_train.optimize runs sparse "
                        "grads through the optimizer's own step)");
  }
  TORCH_CHECK_VALUE(false, schema.name(), ": sparse tensors are not supported");
}

std::vector<std::string> optimizer_names() {
  std::vector<std::string> names;
#define ITR_NAME(name, args) names.emplace_back(#name);
  ITR_OPTIMIZERS(ITR_NAME)
#undef ITR_NAME
  return names;
}

}  // namespace
}  // namespace ipex_train

#define ITR_STEP_SCHEMA(name, args) \
  #name "_step(Tensor(a!)[] params, Tensor(b!)?[] aux, Tensor[] grads, " args ") -> ()"

TORCH_LIBRARY(ipex_train, m) {
#define ITR_DEF(name, args) m.def(ITR_STEP_SCHEMA(name, args));
  ITR_OPTIMIZERS(ITR_DEF)
#undef ITR_DEF
  m.def("split_bf16(Tensor src) -> (Tensor top, Tensor residual)");
  m.def("combine_bf16(Tensor top, Tensor residual) -> Tensor");
  m.def("kernel_variant() -> str", &ipex_train::kernel_variant);
  m.def("set_kernel_variant(str name) -> ()", &ipex_train::set_kernel_variant);
  m.def("supported_kernel_variants() -> str[]", &ipex_train::supported_kernel_variants);
  m.def("optimizer_names() -> str[]", &ipex_train::optimizer_names);
  m.def("cpu_features() -> str", &ipex_train::cpu_feature_string);
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
#define ITR_IMPL(name, args) m.impl(#name "_step", &ipex_train::name##_step);
  ITR_OPTIMIZERS(ITR_IMPL)
#undef ITR_IMPL
  m.impl("split_bf16", &ipex_train::split_bf16);
  m.impl("combine_bf16", &ipex_train::combine_bf16);
}

TORCH_LIBRARY_IMPL(ipex_train, SparseCPU, m) {
#define ITR_SPARSE(name, args) \
  m.impl(#name "_step", torch::CppFunction::makeFromBoxedFunction<&ipex_train::reject_sparse>());
  ITR_OPTIMIZERS(ITR_SPARSE)
#undef ITR_SPARSE
}
