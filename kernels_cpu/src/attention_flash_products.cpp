// Which products the tiles of ipex_train's tiled attention run (attention_flash_products.h).
#include "attention_flash_products.h"

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "cpu_features.h"

namespace ipex_train {
namespace {

// The AVX-512 BF16 tiles' products by oneDNN's batch-reduce GEMM micro-kernel, through torch's cpublas as torch's own
// flash attention does. On a Zen 5 VM (AVX-512 BF16, no AMX) whole attention calls took the same time with these and
// with the tiles' own dot-product loops; on AMX CPUs oneDNN runs the tiles on AMX, which the own loops cannot use.
void onednn_product(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb_pairs, int64_t ldc, bool acc,
                    const uint16_t* A, const uint16_t* B, float* C) {
  // No is_vnni argument (pair-packed B, its default where it exists): older torch releases lack the parameter.
  at::native::cpublas::brgemm(m, n, k, lda, ldb_pairs, ldc, acc, reinterpret_cast<const at::BFloat16*>(A),
                              reinterpret_cast<const at::BFloat16*>(B), C);
}

// Whether onednn_product computes exact products here (a stored product, then an added one, on small integers whose
// sums fp32 holds exactly): cpublas may fall back to code that reads B in another layout, or refuse, on CPUs oneDNN's
// bf16 micro-kernels do not serve. Checked once per process.
bool onednn_products_work() {
  static const bool ok = [] {
    if (flash::kAvx512Bf16Tasks.forward == nullptr || !has_feature("avx512_bf16")) return false;
    constexpr int64_t m = 7, n = 32, k = 64;
    auto a_at = [](int64_t r, int64_t p) { return static_cast<int>((r * k + p) * 7 % 5) - 2; };
    auto b_at = [](int64_t p, int64_t c) { return static_cast<int>((p * 3 + c) % 7) - 3; };
    auto bf16 = [](int v) { return c10::BFloat16(static_cast<float>(v)).x; };
    std::vector<uint16_t> A(m * k), B(k * n);
    std::vector<float> C(m * n, 0.0f);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t p = 0; p < k; ++p) A[r * k + p] = bf16(a_at(r, p));
    for (int64_t p = 0; p < k; ++p)  // B[p][c] at [p / 2][c][p % 2]
      for (int64_t c = 0; c < n; ++c) B[((p / 2) * n + c) * 2 + p % 2] = bf16(b_at(p, c));
    try {
      onednn_product(m, n, k, k, n, n, false, A.data(), B.data(), C.data());
      onednn_product(m, n, k, k, n, n, true, A.data(), B.data(), C.data());
      at::native::cpublas::brgemm_release();
    } catch (const std::exception&) {
      return false;
    }
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        int64_t sum = 0;
        for (int64_t p = 0; p < k; ++p) sum += a_at(r, p) * b_at(p, c);
        if (C[r * n + c] != static_cast<float>(2 * sum)) return false;
      }
    }
    return true;
  }();
  return ok;
}

// Which products the AVX-512 BF16 tiles use: 1 oneDNN's (the default where onednn_products_work), 0 their own.
std::atomic<int> g_onednn_products{-1};

bool use_onednn_products() {
  int v = g_onednn_products.load();
  if (v < 0) {
    v = onednn_products_work() ? 1 : 0;
    g_onednn_products.store(v);
  }
  return v == 1;
}

// The products the attention tiles run: "onednn" or "own" (set: choice; none: the one in effect). With the portable
// tiles (no AVX-512 BF16, or IPEX_TRAIN_KERNEL=avx2) the tiles always run their own.
std::string attention_products(const std::optional<std::string>& choice) {
  if (choice.has_value()) {
    TORCH_CHECK_VALUE(*choice == "onednn" || *choice == "own",
                      "attention_products: choice must be 'onednn' or 'own', got '", *choice, "'");
    TORCH_CHECK_VALUE(*choice == "own" || onednn_products_work(),
                      "attention_products: oneDNN's bf16 batch-reduce GEMM does not run on this CPU");
    g_onednn_products.store(*choice == "onednn" ? 1 : 0);
  }
  return use_onednn_products() ? "onednn" : "own";
}

}  // namespace

flash::Product tile_product(const flash::Tasks& tasks) {
  return &tasks == &flash::kAvx512Bf16Tasks && use_onednn_products() ? &onednn_product : nullptr;
}

void release_tile_products() { at::native::cpublas::brgemm_release(); }

}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def("attention_products(str? choice=None) -> str", &ipex_train::attention_products);
}
