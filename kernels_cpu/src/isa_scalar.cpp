// Portable fallback: the baseline target with auto-vectorization off, i.e. the per-element math one element at a
// time. Chosen on CPUs without AVX2+FMA+F16C, or with IPEX_TRAIN_KERNEL=scalar.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-tree-vectorize")
#endif
#define ITR_ISA_NAME "scalar"
#define ITR_TABLE kScalarKernels
#if defined(__clang__)
#define ITR_LOOP _Pragma("clang loop vectorize(disable) interleave(disable)")
#endif
#include "loops.h"
