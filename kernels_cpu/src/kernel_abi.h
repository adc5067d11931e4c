// The boundary between the torch-facing op layer (ops.cpp, built for the baseline ISA) and the loops (built once
// per ISA in isa_*.cpp). Plain pointers and PODs only: nothing here may pull in torch or the standard library.
#pragma once

#include <stdint.h>

#include "ipex_train/elementwise.h"  // Layout, Chunk, the per-element steps
#include "optimizers.h"

namespace ipex_train {

// Per-ISA entry points: one per ITR_KERNELS entry (optimizers.h), then the split-bf16 conversions.
struct KernelTable {
  const char* name;
#define ITR_ENTRY(entry, params, ...) void(*entry) params;
  ITR_KERNELS(ITR_ENTRY)
#undef ITR_ENTRY
  void (*split_bf16)(const float* src, uint16_t* top, int16_t* residual, int64_t n);
  void (*combine_bf16)(const uint16_t* top, const int16_t* residual, float* dst, int64_t n);
};

extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;

}  // namespace ipex_train
