// The step ops of kernels_cpu and their registration: one generic op checks its group (checks.h), computes the
// per-parameter coefficients with the optimizer's update header, and runs the kernel variant's loops over the
// group's chunks (schedule.h). The per-element math is in include/ipex_train/updates/*.h and the loops in loops.h;
// this file never touches an element. Which ops exist, and their schemas, is optimizers.h's list.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "optimizers.h"
#include "schedule.h"
#include "step_args.h"
#include "variants.h"

namespace ipex_train {
namespace {

// The op ipex_train::<name>_step of optimizer Opt (a fused:: entry, optimizers.h), boxed: its arguments are read
// from the stack in schema order (params, aux, grads, the Opt::kStates state lists, fresh_buffers, state_steps, the
// scalars), so one function serves every optimizer's schema.
template <class Opt>
void step(const c10::OperatorHandle& handle, torch::jit::Stack* stack) {
  using Coef = typename Opt::template Coef<double>;
  const auto& schema = handle.schema();
  const char* op = schema.name().c_str();
  const size_t n_args = schema.arguments().size();
  const auto args = torch::jit::last(*stack, n_args);
  const std::vector<at::Tensor> params = args[0].toTensorVector();
  const auto aux = args[1].to<c10::List<std::optional<at::Tensor>>>();
  const std::vector<at::Tensor> grads = args[2].toTensorVector();
  size_t k = 3;
  std::vector<at::Tensor> lists[Opt::kStates];
  for (auto& l : lists) l = args[k++].toTensorVector();
  c10::List<bool> fresh;
  std::vector<at::Tensor> steps;
  if constexpr (Opt::kFreshFlags) fresh = args[k++].toBoolList();
  if constexpr (Opt::kCountsSteps) steps = args[k++].toTensorVector();
  TORCH_INTERNAL_ASSERT(n_args - k == step_args::field_count<typename Opt::Args>() + 1, op,
                        ": the schema's scalars and the fields of its fused:: entry's Args differ");
  const int64_t state_key = args[n_args - 1].toInt();  // every step op's last argument (ITR_STEP_SCHEMA)
  const auto a = step_args::scalars<typename Opt::Args>([&](size_t j, auto type) -> decltype(type) {
    if constexpr (std::is_same_v<decltype(type), bool>) return args[k + j].toBool();
    else return args[k + j].toDouble();
  });
  const char* error = step_args::error<Opt>(a);
  TORCH_CHECK_VALUE(error == nullptr, op, ": ", error);
  const int n_states = step_args::states<Opt>(a);
  std::vector<StateArg> states;
  for (int i = 0; i < n_states; ++i) states.push_back({schema.arguments()[3 + i].name().c_str(), lists[i]});
  if (Opt::kFreshFlags && n_states > 0)
    TORCH_CHECK_VALUE(fresh.size() == params.size(), op, ": got ", params.size(), " params but ", fresh.size(),
                      " fresh_buffers flags");
  if (Opt::kCountsSteps) check_steps_len(op, params, steps);
  auto slots = prepare(op, params, aux, grads, states, kStreamMin, state_key);
  std::vector<Coef> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    coef[i] = a.coef({Opt::kCountsSteps ? step_of(op, steps, i) : 0.0,
                      Opt::kFreshFlags && n_states > 0 && fresh.get(i)});
  const Kernels<Opt>& kernel = kernels_of<Opt>(kernels());
  const int variant = step_args::variant<Opt>(a);
  if constexpr (Opt::kTwoPass) {
    two_passes(
        slots,
        [&](int64_t i, const Chunk& c, double* a_sq, double* b_sq) {
          kernel.norms(slots[i].layout, c, coef[i], a_sq, b_sq);
        },
        [&](size_t i, double a_norm, double b_norm) { a.finish(coef[i], a_norm, b_norm); },
        [&](int64_t i, const Chunk& c) { kernel.apply(slots[i].layout, c, coef[i], variant); });
  } else {
    int64_t total;
    const auto jobs = jobs_of(slots, &total);
    for_each_chunk(slots, jobs, total,
                   [&](int64_t i, const Chunk& c, int64_t) { kernel.apply(slots[i].layout, c, coef[i], variant); });
  }
  write_back(slots);
  torch::jit::drop(*stack, n_args);
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

// The packed int8 state (fp32 scales, then the codes) of a 1-D fp32 tensor, as the steps store it: to check the
// kernel variants' encoders against the Python reference (ipex_train/optim/state_formats.py) on chosen values.
at::Tensor q8_encode(const at::Tensor& x_in, bool is_signed) {
  const char* op = "ipex_train::q8_encode";
  check_cpu_dense(op, x_in, "x");
  TORCH_CHECK_TYPE(x_in.scalar_type() == at::kFloat, op, ": x has dtype ", x_in.scalar_type(), "; expected float32");
  TORCH_CHECK_VALUE(x_in.dim() == 1, op, ": x has ", x_in.dim(), " dimensions; expected 1");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel(), blocks = q8_blocks(n);
  at::Tensor out = at::empty({4 * blocks + n}, x.options().dtype(is_signed ? at::kChar : at::kByte));
  char* bytes = static_cast<char*>(out.data_ptr());
  kernels().q8_encode(is_signed ? StateCodec::kQ8Signed : StateCodec::kQ8Unsigned, x.const_data_ptr<float>(),
                      bytes + 4 * blocks, reinterpret_cast<float*>(bytes), n);
  return out;
}

// Decodes packed int8 state (as q8_encode writes it) into the fp32 1-D tensor `out` of its element count: what
// checkpoints save, at the speed of the steps' own decoding. Split at block boundaries, so the bits do not depend
// on the thread count (each element is decoded alone anyway).
void q8_decode(const at::Tensor& packed, at::Tensor& out) {
  const char* op = "ipex_train::q8_decode";
  check_cpu_dense(op, packed, "packed");
  check_cpu_dense(op, out, "out");
  const bool is_signed = packed.scalar_type() == at::kChar;
  TORCH_CHECK_TYPE(is_signed || packed.scalar_type() == at::kByte, op, ": packed has dtype ", packed.scalar_type(),
                   "; expected int8 or uint8");
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, op, ": out has dtype ", out.scalar_type(), "; expected float32");
  TORCH_CHECK_VALUE(packed.dim() == 1 && out.dim() == 1 && packed.is_contiguous() && out.is_contiguous(), op,
                    ": packed and out must be contiguous 1-D tensors");
  const int64_t n = out.numel(), blocks = q8_blocks(n);
  TORCH_CHECK_VALUE(packed.numel() == 4 * blocks + n, op, ": packed has ", packed.numel(), " bytes; ", n,
                    " elements take ", 4 * blocks + n);
  const char* bytes = static_cast<const char*>(packed.const_data_ptr());
  const auto* scales = reinterpret_cast<const float*>(bytes);
  const char* codes = bytes + 4 * blocks;
  float* o = out.data_ptr<float>();
  const StateCodec c = is_signed ? StateCodec::kQ8Signed : StateCodec::kQ8Unsigned;
  const KernelTable& k = kernels();
  // ~1 MiB of output per task; scales are indexed from the run's first block.
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    const int64_t first = b0 * kQ8Block, count = std::min(b1 * kQ8Block, n) - first;
    k.q8_decode(c, codes + first, scales + b0, o + first, count);
  });
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

// state_key: the stochastic-rounding key of bf16 optimizer state for this call (ipex_train/state_codec.h).
#define ITR_STEP_SCHEMA(name, args) \
  #name "_step(Tensor(a!)[] params, Tensor(b!)?[] aux, Tensor[] grads, " args ", int state_key=0) -> ()"

TORCH_LIBRARY(ipex_train, m) {
#define ITR_DEF(name, args) m.def(ITR_STEP_SCHEMA(name, args));
  ITR_OPTIMIZERS(ITR_DEF)
#undef ITR_DEF
  m.def("split_bf16(Tensor src) -> (Tensor top, Tensor residual)");
  m.def("combine_bf16(Tensor top, Tensor residual) -> Tensor");
  m.def("q8_encode(Tensor x, bool signed) -> Tensor");
  m.def("q8_decode(Tensor packed, Tensor(a!) out) -> ()");
  m.def("kernel_variant() -> str", &ipex_train::kernel_variant);
  m.def("set_kernel_variant(str name) -> ()", &ipex_train::set_kernel_variant);
  m.def("set_kernel_variant_error(str message) -> ()", &ipex_train::set_kernel_variant_error);
  m.def("supported_kernel_variants() -> str[]", &ipex_train::supported_kernel_variants);
  m.def("optimizer_names() -> str[]", &ipex_train::optimizer_names);
  m.def("cpu_features() -> str", &ipex_train::cpu_feature_string);
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
#define ITR_IMPL(name, args) \
  m.impl(#name "_step", torch::CppFunction::makeFromBoxedFunction<&ipex_train::step<ipex_train::fused::name>>());
  ITR_OPTIMIZERS(ITR_IMPL)
#undef ITR_IMPL
  m.impl("split_bf16", &ipex_train::split_bf16);
  m.impl("combine_bf16", &ipex_train::combine_bf16);
  m.impl("q8_encode", &ipex_train::q8_encode);
  m.impl("q8_decode", &ipex_train::q8_decode);
}

TORCH_LIBRARY_IMPL(ipex_train, SparseCPU, m) {
#define ITR_SPARSE(name, args) \
  m.impl(#name "_step", torch::CppFunction::makeFromBoxedFunction<&ipex_train::reject_sparse>());
  ITR_OPTIMIZERS(ITR_SPARSE)
#undef ITR_SPARSE
}
