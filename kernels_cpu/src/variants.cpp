#include "variants.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

#include "cpu_features.h"

namespace ipex_train {
namespace {

struct Variant {
  const char* name;
  const KernelTable* table;
  std::vector<std::string> needs;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"avx512", &kAvx512Kernels, {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}},
      {"avx2", &kAvx2Kernels, {"avx2", "fma", "f16c"}},
      {"scalar", &kScalarKernels, {}},
  };
  return v;
}

std::string missing_features(const Variant& v) {
  std::string missing;
  for (const auto& f : v.needs)
    if (!has_feature(f)) missing += (missing.empty() ? "" : ", ") + f;
  return missing;
}

bool runs_here(const Variant& v) { return v.table->name != nullptr && missing_features(v).empty(); }

const KernelTable* best_table() {
  for (const auto& v : variants())
    if (runs_here(v)) return v.table;
  return &kScalarKernels;
}

std::atomic<const KernelTable*> g_table{nullptr};
// A variant request that could not be honoured (a bad IPEX_TRAIN_KERNEL, reported by Python at import): while no
// variant is chosen, every kernel call raises it instead of silently running another variant.
std::mutex g_error_mutex;
std::string g_request_error;

}  // namespace

const KernelTable& kernels() {
  const KernelTable* t = g_table.load();
  if (t == nullptr) {
    {
      std::lock_guard<std::mutex> lock(g_error_mutex);
      TORCH_CHECK_VALUE(g_request_error.empty(), g_request_error);
    }
    t = best_table();
    g_table.store(t);
  }
  return *t;
}

void set_kernel_variant_error(std::string message) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  g_request_error = std::move(message);
  g_table.store(nullptr);
}

std::string kernel_variant() { return kernels().name; }

void set_kernel_variant(std::string name) {
  // An explicit choice replaces a failed request; a failing one below leaves everything as it was.
  auto clear_error = [] {
    std::lock_guard<std::mutex> lock(g_error_mutex);
    g_request_error.clear();
  };
  if (name == "auto") {
    clear_error();
    g_table.store(best_table());
    return;
  }
  std::string known = "auto";
  for (const auto& v : variants()) {
    known += std::string(", ") + v.name;
    if (name != v.name) continue;
    TORCH_CHECK(v.table->name != nullptr, "kernel variant '", name, "' is not built for this architecture");
    const std::string missing = missing_features(v);
    TORCH_CHECK(missing.empty(), "kernel variant '", name, "' needs CPU features this machine lacks: ", missing);
    clear_error();
    g_table.store(v.table);
    return;
  }
  TORCH_CHECK_VALUE(false, "unknown kernel variant '", name, "'; expected one of: ", known);
}

std::vector<std::string> supported_kernel_variants() {
  std::vector<std::string> names;
  for (const auto& v : variants())
    if (runs_here(v)) names.emplace_back(v.name);
  return names;
}

std::string cpu_feature_string() {
  std::string s;
  for (const auto& f : cpu_features()) s += (s.empty() ? "" : ",") + f.first + "=" + (f.second ? "1" : "0");
  return s;
}

}  // namespace ipex_train
