// The non-finite-gradient guard's scan: the first tensor of a list holding a NaN or an Inf, or -1.
//
// One pass over the bits (a float is NaN or Inf exactly when its exponent bits are all ones), integer compares that
// the compiler vectorises, parallel over chunks of each tensor. The answer is a per-tensor "any", so it does not
// depend on the thread count or the chunking.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace ipex_train {
namespace {

constexpr int64_t kGrain = 1 << 16;   // elements per parallel chunk
constexpr int64_t kBlock = 4096;      // elements between early-exit checks

template <typename Bits>
bool any_nonfinite(const Bits* data, int64_t n, Bits mask) {
  std::atomic<bool> found{false};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end && !found.load(std::memory_order_relaxed); b += kBlock) {
      const int64_t e = b + kBlock < end ? b + kBlock : end;
      Bits hit = 0;
      for (int64_t i = b; i < e; ++i) {
        hit |= static_cast<Bits>((data[i] & mask) == mask);
      }
      if (hit) {
        found.store(true, std::memory_order_relaxed);
      }
    }
  });
  return found.load();
}

bool tensor_nonfinite(const at::Tensor& t) {
  if (!t.is_floating_point() || t.numel() == 0) {
    return false;
  }
  // A dense tensor (contiguous in any memory format) covers exactly numel() elements from its first one.
  const at::Tensor dense = t.is_non_overlapping_and_dense() ? t : t.contiguous();
  const int64_t n = dense.numel();
  const void* base = dense.data_ptr();
  switch (dense.scalar_type()) {
    case at::kFloat:
      return any_nonfinite(static_cast<const uint32_t*>(base), n, uint32_t{0x7f800000u});
    case at::kDouble:
      return any_nonfinite(static_cast<const uint64_t*>(base), n, uint64_t{0x7ff0000000000000ull});
    case at::kBFloat16:
      return any_nonfinite(static_cast<const uint16_t*>(base), n, uint16_t{0x7f80u});
    case at::kHalf:
      return any_nonfinite(static_cast<const uint16_t*>(base), n, uint16_t{0x7c00u});
    default:
      return !at::isfinite(dense).all().item<bool>();
  }
}

int64_t first_nonfinite(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device().is_cpu(), "ipex_train::first_nonfinite: tensors[", i, "] is on ",
                tensors[i].device(), "; kernels_cpu takes CPU tensors only");
    TORCH_CHECK(tensors[i].layout() == at::kStrided, "ipex_train::first_nonfinite: tensors[", i,
                "] is not a dense (strided) tensor");
    if (tensor_nonfinite(tensors[i])) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("first_nonfinite(Tensor[] tensors) -> int");
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("first_nonfinite", &ipex_train::first_nonfinite);
}
