// The tiles of ipex_train's tiled attention with AVX-512 BF16 dot products (vdpbf16ps) for the products and 512-bit
// vectors for the row passes. Only called after cpu_features.cpp has seen avx512_bf16 and OS support for zmm state.
#if defined(__x86_64__) && !defined(__clang__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,prefer-vector-width=512")
// GCC 12 warns inside its own intrinsics headers (_mm512_undefined_* in reductions and masked ops).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define FLASH_DPBF16 1
#define FLASH_TABLE kAvx512Bf16Tasks
#include "attention_flash_tiles.h"
#elif defined(__x86_64__) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"))), \
                             apply_to = function)
#define FLASH_DPBF16 1
#define FLASH_TABLE kAvx512Bf16Tasks
#include "attention_flash_tiles.h"
#pragma clang attribute pop
#else
#include "attention_flash.h"
namespace ipex_train {
namespace flash {
extern const Tasks kAvx512Bf16Tasks = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
}
}  // namespace ipex_train
#endif
