// The boundary between the torch-facing op layer (ops.cpp, built for the baseline ISA) and the loops (built once
// per ISA in isa_*.cpp). Plain pointers and PODs only: nothing here may pull in torch or the standard library.
#pragma once

#include <stdint.h>

#include "ipex_train/elementwise.h"  // Layout, Chunk, the per-element steps

namespace ipex_train {

// Per-ISA entry points. Lamb and Lars run two passes: the first returns sums of squares for the trust ratio.
struct KernelTable {
  const char* name;
  void (*sgd)(Layout, const Chunk&, const updates::SgdCoef<double>&, bool momentum, bool nesterov);
  void (*adam)(Layout, const Chunk&, const updates::AdamCoef<double>&, bool amsgrad);
  void (*adagrad)(Layout, const Chunk&, const updates::AdagradCoef<double>&);
  void (*lamb_moments)(Layout, const Chunk&, const updates::LambCoef<double>&, double* w_sq, double* u_sq);
  void (*lamb_apply)(Layout, const Chunk&, const updates::LambCoef<double>&);
  void (*lars_norms)(Layout, const Chunk&, double* w_sq, double* g_sq);
  void (*lars_apply)(Layout, const Chunk&, const updates::LarsCoef<double>&);
  void (*split_bf16)(const float* src, uint16_t* top, int16_t* residual, int64_t n);
  void (*combine_bf16)(const uint16_t* top, const int16_t* residual, float* dst, int64_t n);
};

extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;

}  // namespace ipex_train
