// AVX2 + FMA + F16C (Haswell / Zen and later). Only called after cpu_features.cpp has seen these features.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define ITR_ISA_NAME "avx2"
#define ITR_SIMD_BYTES 32
#define ITR_TABLE kAvx2Kernels
#include "loops.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
// Not an x86-64 build: the table exists (so ops.cpp links) but is never selected.
#include "kernel_abi.h"
namespace ipex_train {
extern const KernelTable kAvx2Kernels = {nullptr};
}
#endif
