// CPU feature detection (cpuid + xgetbv), used to pick the kernel variant and reported by ipex_train.info().
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace ipex_train {

// (name, present) for avx2, fma, f16c, avx512f/bw/vl/dq, avx512_bf16, avx512_fp16, amx_bf16, avx_ne_convert.
// An instruction set counts as present only when the OS also saves its register state.
std::vector<std::pair<std::string, bool>> cpu_features();
bool has_feature(const std::string& name);

}  // namespace ipex_train
