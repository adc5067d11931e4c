// The emulated bf16 compute policy's linear on fp32 activations with bf16 weights (ipex_train/compute_policy):
// y = x W^T + b computed in fp32 from the bf16 W and b, returned in fp32, as one autograd node.
//
// Why in C++: the same result through autograd-tracked casts needs saved-tensor hooks in Python (so that autograd
// keeps the bf16 weight, not its fp32 copy) and more graph nodes per layer; that took 60 us more than this node in
// forward and 30 us more in backward (a 136x192 @ 192x768 layer, 2 threads), against 8 us for the cast. Here the node
// saves the input and the bf16 weight, and forward and backward each cast the weight into the caller's scratch
// buffer (reused every step: no page faults on fresh multi-megabyte tensors), or into a fresh tensor when the
// backward builds a graph of its own (create_graph).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <functional>
#include <thread>

namespace ipex_train {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// w cast to fp32 into scratch[0, numel) when scratch is large enough (a buffer only valid until the next cast
// into it), else into a fresh tensor.
at::Tensor cast_up(const at::Tensor& w, const at::Tensor& scratch) {
  if (!scratch.defined() || scratch.numel() < w.numel() || !w.is_contiguous()) {
    return w.to(at::kFloat);
  }
  return scratch.narrow(0, 0, w.numel()).view(w.sizes()).copy_(w);
}

int64_t this_thread() {
  return static_cast<int64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()));
}

struct EmulatedLinear : public torch::autograd::Function<EmulatedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& b, const at::Tensor& scratch) {
    ctx->save_for_backward({x, w});
    // The buffer is held as plain data, not a saved variable: other ops write it between forward and backward
    // (its version changes by design), and this node only reads it after casting into it again.
    ctx->saved_data["scratch"] = scratch;
    // The buffer is the forward thread's: a backward run on another thread (while this one may be casting into
    // it) takes a fresh cast instead.
    ctx->saved_data["thread"] = this_thread();
    ctx->saved_data["bias_dtype"] = b.has_value() ? b->scalar_type() : at::kFloat;
    at::Tensor b32 = b.has_value() ? b->to(at::kFloat) : at::Tensor();
    return at::linear(x, cast_up(w, scratch), b32);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& g = grads[0];
    // With create_graph the cast is part of the new graph and must outlive this node.
    const bool own_buffer = !at::GradMode::is_enabled() && ctx->saved_data["thread"].toInt() == this_thread();
    at::Tensor w32 = own_buffer ? cast_up(w, ctx->saved_data["scratch"].toTensor()) : w.to(at::kFloat);
    at::Tensor gx, gw, gb;
    // One (rows, out_features) matrix for all three grads: a strided grad (a permuted layout's) is copied once.
    at::Tensor g2 = g.reshape({-1, w.size(0)});
    if (ctx->needs_input_grad(0)) {
      gx = at::mm(g2, w32).view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      gw = at::mm(g2.t(), x.reshape({-1, w.size(1)})).to(w.scalar_type());
    }
    if (ctx->needs_input_grad(2)) {
      gb = g2.sum(0).to(ctx->saved_data["bias_dtype"].toScalarType());
    }
    return {gx, gw, gb, at::Tensor()};
  }
};

at::Tensor emulated_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                           const at::Tensor& scratch) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "emulated_linear: expects an fp32 input and a 2-D bf16 weight, got ", x.scalar_type(), " and ",
              w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(!b.has_value() || b->dim() == 1, "emulated_linear: bias must be 1-D");
  TORCH_CHECK(!scratch.defined() || scratch.numel() == 0 ||
                  (scratch.scalar_type() == at::kFloat && scratch.dim() == 1 && scratch.is_contiguous()),
              "emulated_linear: scratch must be a contiguous 1-D fp32 tensor");
  return EmulatedLinear::apply(x, w, b, scratch);
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("emulated_linear(Tensor input, Tensor weight, Tensor? bias, Tensor scratch) -> Tensor");
}

TORCH_LIBRARY_IMPL(ipex_train, CompositeImplicitAutograd, m) {
  m.impl("emulated_linear", &ipex_train::emulated_linear);
}
