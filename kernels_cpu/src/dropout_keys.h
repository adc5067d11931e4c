// The seeded dropout of ipex_train's row kernels (attention, add_norm): a row's two keys from splitmix64's finalizer
// of the op's seed and the row's index, so that backward regenerates the forward's mask instead of saving it. The
// per-element keep test (a hash of the keys and the column) is in the kernels' row code.
#pragma once

#include <cstdint>

#include "kernel_abi.h"

namespace ipex_train {

inline Dropout dropout_of(double p, int64_t seed, int64_t row) {
  Dropout d{};
  d.enabled = p > 0.0;
  if (!d.enabled) return d;
  d.threshold = static_cast<uint32_t>(p * 16777216.0 + 0.5);
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  uint64_t k = static_cast<uint64_t>(seed) + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(row + 1);
  k = (k ^ (k >> 30)) * 0xbf58476d1ce4e5b9ULL;
  k = (k ^ (k >> 27)) * 0x94d049bb133111ebULL;
  k ^= k >> 31;
  d.key0 = static_cast<uint32_t>(k);
  d.key1 = static_cast<uint32_t>(k >> 32);
  return d;
}

}  // namespace ipex_train
