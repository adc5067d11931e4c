// ipex_train's SwiGLU for training (ipex_train/swiglu): y = silu(gate) * up and its backward, one pass over the
// elements each way (swiglu_rows.h, per ISA), fp32 inside, every output rounded once to the inputs' dtype (bf16 or
// fp32). The backward reads gate and up (the forward saves them, not the product) and recomputes the sigmoid.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "variants.h"

namespace ipex_train {
namespace {

constexpr const char* kOp = "ipex_train::silu_mul";
// Elements per task of the parallel loop: fixed blocks (a multiple of every vector width), so which element takes
// the vector or the scalar path does not depend on the thread count.
constexpr int64_t kBlock = 16384;

void check_operand(const at::Tensor& t, const char* what, const at::Tensor& gate) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), kOp, ": ", what, " must be a CPU tensor");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, kOp, ": ", what,
                   " must be bfloat16 or float32, got ", t.scalar_type());
  TORCH_CHECK_TYPE(t.scalar_type() == gate.scalar_type(), kOp, ": ", what, " must have gate's dtype (",
                   gate.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == gate.sizes(), kOp, ": ", what, " must have gate's shape ", gate.sizes(), ", got ",
                    t.sizes());
}

// Runs body(first, count) over [0, n) in blocks of kBlock elements.
template <class Body>
void blocks(int64_t n, const Body& body) {
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) body(b * kBlock, std::min(kBlock, n - b * kBlock));
  });
}

at::Tensor silu_mul_forward(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_operand(gate_in, "gate", gate_in);
  check_operand(up_in, "up", gate_in);
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor y = at::empty(gate.sizes(), gate.options());
  const KernelTable& kt = kernels();
  const int64_t size = gate.element_size();
  const auto* gp = static_cast<const char*>(gate.const_data_ptr());
  const auto* up_p = static_cast<const char*>(up.const_data_ptr());
  auto* yp = static_cast<char*>(y.data_ptr());
  const bool f32 = gate.scalar_type() == at::kFloat;
  blocks(gate.numel(), [&](int64_t first, int64_t count) {
    const int64_t off = first * size;
    kt.silu_mul({gp + off, up_p + off, yp + off, count, f32});
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate_in,
                                                     const at::Tensor& up_in) {
  check_operand(gate_in, "gate", gate_in);
  check_operand(up_in, "up", gate_in);
  TORCH_CHECK_VALUE(grad.device().is_cpu() && grad.sizes() == gate_in.sizes(), kOp,
                    ": grad must be a CPU tensor of gate's shape ", gate_in.sizes(), ", got ", grad.sizes());
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  const at::Tensor dy = grad.to(gate.scalar_type()).contiguous();  // y's dtype
  at::Tensor d_gate = at::empty(gate.sizes(), gate.options());
  at::Tensor d_up = at::empty(gate.sizes(), gate.options());
  const KernelTable& kt = kernels();
  const int64_t size = gate.element_size();
  const auto* gp = static_cast<const char*>(gate.const_data_ptr());
  const auto* up_p = static_cast<const char*>(up.const_data_ptr());
  const auto* dyp = static_cast<const char*>(dy.const_data_ptr());
  auto* dgp = static_cast<char*>(d_gate.data_ptr());
  auto* dup = static_cast<char*>(d_up.data_ptr());
  const bool f32 = gate.scalar_type() == at::kFloat;
  blocks(gate.numel(), [&](int64_t first, int64_t count) {
    const int64_t off = first * size;
    kt.silu_mul_grad({dyp + off, gp + off, up_p + off, dgp + off, dup + off, count, f32});
  });
  return {d_gate, d_up};
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("silu_mul_forward(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_backward(Tensor grad, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("silu_mul_forward", &ipex_train::silu_mul_forward);
  m.impl("silu_mul_backward", &ipex_train::silu_mul_backward);
}
