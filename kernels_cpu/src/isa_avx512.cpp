// AVX-512 F/BW/VL/DQ (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4 and later), 512-bit vectors.
// Only called after cpu_features.cpp has seen these features and OS support for the zmm state.
#if defined(__x86_64__) || defined(_M_X64)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,prefer-vector-width=512")
#endif
#define ITR_ISA_NAME "avx512"
#define ITR_SIMD_BYTES 64
#define ITR_TABLE kAvx512Kernels
#include "loops.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#else
#include "kernel_abi.h"
namespace ipex_train {
extern const KernelTable kAvx512Kernels = {nullptr};
}
#endif
