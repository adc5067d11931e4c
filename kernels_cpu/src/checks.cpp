#include "checks.h"

namespace ipex_train {
namespace {

Layout layout_of(const char* op, size_t i, const at::Tensor& p, const at::Tensor& aux) {
  const auto pt = p.scalar_type();
  if (!aux.defined()) {
    if (pt == at::kFloat) return Layout::kF32;
    if (pt == at::kDouble) return Layout::kF64;
    TORCH_CHECK_TYPE(false, op, ": ", where("params", i), " has dtype ", pt, "; without ", where("aux", i),
                     " the kernel takes float32 or float64 params (a bfloat16 param needs an int16 residual or a "
                     "float32 master in aux, a float16 param a float32 master)");
  }
  const auto at = aux.scalar_type();
  if (at == at::kShort && pt == at::kBFloat16) return Layout::kSplitBF16;
  if (at == at::kFloat && pt == at::kBFloat16) return Layout::kBF16Master;
  if (at == at::kFloat && pt == at::kHalf) return Layout::kF16Master;
  TORCH_CHECK_TYPE(false, op, ": ", where("params", i), " (", pt, ") with ", where("aux", i), " (", at,
                   ") is not a storage layout; expected a bfloat16 param with an int16 residual (split), or a "
                   "bfloat16/float16 param with a float32 master");
}

at::ScalarType grad_dtype(Layout l) {
  switch (l) {
    case Layout::kF32: return at::kFloat;
    case Layout::kF64: return at::kDouble;
    case Layout::kSplitBF16:
    case Layout::kBF16Master: return at::kBFloat16;
    case Layout::kF16Master: return at::kHalf;
  }
  return at::kFloat;
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kF32: return "float32";
    case Layout::kF64: return "float64";
    case Layout::kSplitBF16: return "split bfloat16";
    case Layout::kBF16Master: return "bfloat16 with float32 master";
    case Layout::kF16Master: return "float16 with float32 master";
  }
  return "?";
}

bool is_q8(StateCodec c) { return c == StateCodec::kQ8Signed || c == StateCodec::kQ8Unsigned; }

// The format of a state tensor of dtype t for a parameter of layout l (kPlain: fp32/fp64, checked by the caller).
StateCodec codec_of(at::ScalarType t, Layout l) {
  if (l == Layout::kF64) return StateCodec::kPlain;
  if (t == at::kBFloat16) return StateCodec::kBF16;
  if (t == at::kChar) return StateCodec::kQ8Signed;
  if (t == at::kByte) return StateCodec::kQ8Unsigned;
  return StateCodec::kPlain;
}

}  // namespace

std::string where(const char* arg, size_t i) { return std::string(arg) + "[" + std::to_string(i) + "]"; }

void check_cpu_dense(const char* op, const at::Tensor& t, const std::string& name) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", name, " is a ", t.layout(),
                    " tensor; this fused kernel takes dense (strided) tensors only");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " is on ", t.device(),
                    "; kernels_cpu takes CPU tensors only");
}

void check_same_shape(const char* op, const at::Tensor& t, const std::string& name, const at::Tensor& param,
                      const std::string& pname) {
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), op, ": ", name, " has shape ", t.sizes(), " but ", pname,
                    " has shape ", param.sizes());
}

bool same_memory_order(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_non_overlapping_and_dense() || !b.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  return true;
}

std::vector<Slot> prepare(const char* op, at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux,
                          at::TensorList grads, const std::vector<StateArg>& states, int64_t stream_min,
                          int64_t state_key) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n, op, ": got ", n, " params but ", grads.size(), " grads");
  // An empty aux list means no parameter has one (torch.compile cannot functionalize None inside a mutable list).
  TORCH_CHECK_VALUE(aux.size() == n || aux.size() == 0, op, ": got ", n, " params but ", aux.size(),
                    " aux entries (pass one per param, None for a parameter without a residual or master, or an "
                    "empty list when none has one)");
  for (const auto& s : states)
    TORCH_CHECK_VALUE(s.tensors.size() == n, op, ": got ", n, " params but ", s.tensors.size(), " ", s.name);
  TORCH_CHECK_VALUE(states.size() <= 3, op, ": at most 3 state tensors per parameter");

  std::vector<Slot> slots(n);
  for (size_t i = 0; i < n; ++i) {
    Slot& s = slots[i];
    const std::string pname = where("params", i);
    check_cpu_dense(op, params[i], pname);
    const std::optional<at::Tensor> a = aux.size() == 0 ? std::nullopt : aux.get(i);
    const at::Tensor aux_t = a.has_value() ? *a : at::Tensor();
    if (aux_t.defined()) {
      check_cpu_dense(op, aux_t, where("aux", i));
      check_same_shape(op, aux_t, where("aux", i), params[i], pname);
    }
    s.layout = layout_of(op, i, params[i], aux_t);
    const at::Tensor& g = grads[i];
    TORCH_CHECK_VALUE(!g.defined() || !g.is_sparse(), op, ": ", where("grads", i),
                      " is sparse; the fused kernels take dense grads only");
    check_cpu_dense(op, g, where("grads", i));
    TORCH_CHECK_TYPE(g.scalar_type() == grad_dtype(s.layout), op, ": ", where("grads", i), " has dtype ",
                     g.scalar_type(), " but ", pname, " is stored as ", layout_name(s.layout), " and needs ",
                     grad_dtype(s.layout), " grads");
    check_same_shape(op, g, where("grads", i), params[i], pname);
    const auto state_dtype = s.layout == Layout::kF64 ? at::kDouble : at::kFloat;
    for (size_t k = 0; k < states.size(); ++k) {
      const at::Tensor& t = states[k].tensors[i];
      const std::string sname = where(states[k].name, i);
      check_cpu_dense(op, t, sname);
      s.codec[k] = codec_of(t.scalar_type(), s.layout);
      TORCH_CHECK_TYPE(t.scalar_type() == state_dtype || s.codec[k] != StateCodec::kPlain, op, ": ", sname,
                       " has dtype ", t.scalar_type(), "; optimizer state for a ", layout_name(s.layout),
                       " parameter is ", state_dtype,
                       s.layout == Layout::kF64 ? "" : " (or bfloat16, or packed int8/uint8 for reduced-byte state)");
      TORCH_CHECK_VALUE(k == 0 || (s.codec[k] == StateCodec::kPlain) == (s.codec[0] == StateCodec::kPlain), op,
                        ": ", sname, " and ", where(states[0].name, i), " mix fp32 and reduced-byte state");
      if (is_q8(s.codec[k])) {
        TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous() && t.numel() == q8_bytes(params[i].numel()), op, ": ",
                          sname, " is packed int8 state and must be a contiguous 1-D tensor of ",
                          q8_bytes(params[i].numel()), " bytes (scales, then codes), got shape ", t.sizes());
      } else {
        check_same_shape(op, t, sname, params[i], pname);
      }
    }

    bool aligned = params[i].is_non_overlapping_and_dense() && same_memory_order(params[i], g);
    if (aux_t.defined()) aligned = aligned && same_memory_order(params[i], aux_t);
    for (size_t k = 0; k < states.size(); ++k)
      if (!is_q8(s.codec[k])) aligned = aligned && same_memory_order(params[i], states[k].tensors[i]);
    // Packed int8 state is in the parameter's memory order, which a contiguous copy would not keep.
    TORCH_CHECK_VALUE(aligned || states.empty() || !is_q8(s.codec[0]), op, ": ", pname,
                      " has int8 state, so it, its grad and its aux must be dense and share one memory order");
    s.key = codec::param_key(uint64_t(state_key), uint64_t(i));

    if (aligned) {
      s.param = params[i];
      s.aux = aux_t;
      s.grad = g;
      for (size_t k = 0; k < states.size(); ++k) s.state[k] = states[k].tensors[i];
    } else {
      s.copied = true;
      s.param_out = params[i];
      s.aux_out = aux_t;
      s.param = params[i].contiguous();
      s.aux = aux_t.defined() ? aux_t.contiguous() : aux_t;
      s.grad = g.contiguous();
      for (size_t k = 0; k < states.size(); ++k) {
        s.state_out[k] = states[k].tensors[i];
        s.state[k] = states[k].tensors[i].contiguous();
      }
    }
  }
  int64_t group = 0;
  for (const Slot& s : slots) group += s.param.numel();
  // A copied parameter is read back from its copy right after the step, so that copy stays in cache.
  for (Slot& s : slots) s.stream16 = group >= stream_min && !s.copied;
  return slots;
}

void write_back(std::vector<Slot>& slots) {
  auto back = [](at::Tensor& dst, const at::Tensor& src) {
    if (dst.defined() && !dst.is_same(src)) dst.copy_(src);
  };
  for (Slot& s : slots) {
    if (!s.copied) continue;
    back(s.param_out, s.param);
    back(s.aux_out, s.aux);
    for (int k = 0; k < 3; ++k) back(s.state_out[k], s.state[k]);
  }
}

double step_of(const char* op, at::TensorList steps, size_t i) {
  const at::Tensor& t = steps[i];
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1 && t.device().is_cpu(), op, ": ", where("state_steps", i),
                    " must be a one-element CPU tensor holding the step count (already incremented)");
  const double step = t.item<double>();
  TORCH_CHECK_VALUE(step >= 1, op, ": ", where("state_steps", i), " is ", step,
                    "; increment the step before calling the kernel");
  return step;
}

void check_steps_len(const char* op, at::TensorList params, at::TensorList steps) {
  TORCH_CHECK_VALUE(steps.size() == params.size(), op, ": got ", params.size(), " params but ", steps.size(),
                    " state_steps");
}

}  // namespace ipex_train
