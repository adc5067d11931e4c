// The boundary between the torch-facing op layer (ops.cpp, built for the baseline ISA) and the loops (built once
// per ISA in isa_*.cpp). Plain pointers and PODs only: nothing here may pull in torch or the standard library.
#pragma once

#include <stdint.h>

#include "ipex_train/updates/adagrad.h"
#include "ipex_train/updates/adam.h"
#include "ipex_train/updates/lamb.h"
#include "ipex_train/updates/lars.h"
#include "ipex_train/updates/sgd.h"

namespace ipex_train {

// How one parameter is stored; chosen per parameter from the dtypes of param, aux and grad.
enum class Layout : int {
  kF32 = 0,         // fp32 param, fp32 grad, fp32 state
  kF64 = 1,         // fp64 param, fp64 grad, fp64 state
  kSplitBF16 = 2,   // bf16 top (the param), int16 residual (aux), bf16 grad, fp32 state
  kBF16Master = 3,  // bf16 param, fp32 master (aux), bf16 grad, fp32 state
  kF16Master = 4,   // fp16 param, fp32 master (aux), fp16 grad, fp32 state
};

// One contiguous run of elements of one parameter; every pointer is already offset to the run's start.
struct Chunk {
  void* param;
  void* aux;
  const void* grad;
  void* state[3];
  int64_t n;
};

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
