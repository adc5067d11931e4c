// The boundary between the torch-facing op layer (ops.cpp, built for the baseline ISA) and the loops (built once
// per ISA in isa_*.cpp). Plain pointers and PODs only: nothing here may pull in torch or the standard library.
#pragma once

#include <stdint.h>

#include "ipex_train/elementwise.h"  // Layout, Chunk, the fused:: entries of the update headers
#include "optimizers.h"

namespace ipex_train {

// One optimizer's loops over a chunk of any layout (loops.h).
template <class Opt>
struct Kernels {
  using Coef = typename Opt::template Coef<double>;
  void (*apply)(Layout, const Chunk&, const Coef&, int variant);
  // Two-pass optimizers only (null otherwise): the first pass, returning the chunk's two sums of squares.
  void (*norms)(Layout, const Chunk&, const Coef&, double* a_sq, double* b_sq);
};

// Attention dropout (attention_rows.h): element j of a row is kept when hash(j, key0, key1) >> 8 >= threshold
// (threshold = p * 2^24) and then multiplied by scale (1 / (1 - p)).
struct Dropout {
  bool enabled;
  uint32_t threshold;
  float scale;
  uint32_t key0, key1;  // the row's keys
};

// One row of attention scores for the softmax forward: p = softmax(scores * scale + mask) over columns [0, valid),
// 0 in [valid, n); p_drop = p with dropout (null without). p may alias scores; scratch holds n floats.
struct SoftmaxRow {
  const uint16_t* scores;
  const float* mask;  // the row's additive mask, or null
  uint16_t* p;
  uint16_t* p_drop;
  float* scratch;
  int64_t n, valid;
  float scale;
  Dropout drop;
};

// One row of the softmax backward: ds = p * (dp' - sum(dp' * p)) * scale, dp' = dp with the row's dropout applied
// (when drop.enabled). ds may alias dp.
struct SoftmaxGradRow {
  const uint16_t* p;
  const uint16_t* dp;
  uint16_t* ds;
  int64_t n;
  float scale;
  Dropout drop;
};

// One row of RMSNorm forward (rms_norm_rows.h): rstd = 1 / sqrt(mean(x^2) + eps), y = w * round(x * rstd), fp32
// inside, rounded as Hugging Face's LlamaRMSNorm (round: to bf16 for bf16 x, none for fp32 x). x_f32: x is fp32
// (else bf16); w_f32: the weight is fp32 (else bf16); y is fp32 if either is (else bf16), as torch promotes w * x.
struct RmsNormRow {
  const void* x;
  const void* weight;
  void* y;
  int64_t n;
  float eps;
  bool x_f32;
  bool w_f32;
};

// One row of its backward: g = dy * w, dx = rstd * (g - xhat * mean(g * xhat)), dw += dy * round(xhat), xhat =
// x * rstd. dy has y's dtype and dx x's (flags as above); dw is an fp32 accumulator of n.
struct RmsNormGradRow {
  const void* dy;
  const void* x;
  const void* weight;
  void* dx;
  float* dw;
  int64_t n;
  float rstd;
  bool x_f32;
  bool w_f32;
};

// One row of residual add + RMSNorm forward (rms_norm_rows.h): s = round(x + residual) (round: to the residual's
// dtype, as torch's `residual + x` rounds), then the RmsNormRow of s (y; the row's rstd returned). x is bf16 or fp32
// (x_f32); residual and sum share one dtype (s_f32: fp32, else bf16, then x is bf16 too); w_f32 as RmsNormRow's.
struct AddRmsNormRow {
  const void* x;
  const void* residual;
  const void* weight;
  void* sum;
  void* y;
  int64_t n;
  float eps;
  bool x_f32;
  bool s_f32;
  bool w_f32;
};

// Its backward: ds = RmsNormGradRow's dx of the sum + dsum, rounded once to the sum's dtype (dsum has it); dx = ds in
// x's dtype, written only when dx is not null; dw += dy * round(xhat) into an fp32 accumulator of n.
struct AddRmsNormGradRow {
  const void* dy;
  const void* dsum;
  const void* sum;
  const void* weight;
  void* ds;
  void* dx;
  float* dw;
  int64_t n;
  float rstd;
  bool x_f32;
  bool s_f32;
  bool w_f32;
};

// One row of dropout + residual add + LayerNorm forward (add_norm_rows.h): s = round(x * keep + residual) (round: to
// the residual's dtype, as the unfused module's `h + input_tensor` rounds), mean and rstd = 1 / sqrt(var(s) + eps)
// in fp32, y = (s - mean) * rstd * w + b. keep: drop's keep-scale of each column (1 when !drop.enabled). x is bf16
// or fp32 (x_f32); residual, sum and y share one dtype (s_f32: fp32, else bf16, then x is bf16 too); weight and bias
// share one (w_f32: fp32, else bf16).
struct AddNormRow {
  const void* x;
  const void* residual;
  const void* weight;
  const void* bias;
  void* y;
  void* sum;
  float* mean;  // the row's mean and rstd, written
  float* rstd;
  int64_t n;
  float eps;
  bool x_f32;
  bool s_f32;
  bool w_f32;
  Dropout drop;
};

// One row of its backward: g = dy * w, xhat = (s - mean) * rstd, ds = rstd * (g - mean(g) - xhat * mean(g * xhat))
// + dsum (the residual's gradient, in the sum's dtype; dsum, the gradient of the sum as an output of its own in
// pre-norm blocks, only when not null), dx = ds * keep in x's dtype (written only when dx is not null), dw += dy *
// xhat and db += dy into fp32 accumulators of n. dy and dsum have the sum's dtype.
struct AddNormGradRow {
  const void* dy;
  const void* dsum;
  const void* sum;
  const void* weight;
  void* ds;
  void* dx;
  float* dw;
  float* db;
  int64_t n;
  float mean;
  float rstd;
  bool x_f32;
  bool s_f32;
  bool w_f32;
  Dropout drop;
};

// One sequence position of a rotary embedding (rope_rows.h): for each of `heads` vectors of d elements (x at
// x + h * x_head_stride, out likewise; strides in elements), out = x1 * cos - x2 * sin | x2 * cos + x1 * sin over the
// halves, or its transpose when `inverse` (the backward). x, out, cos and sin share one dtype, fp32 when f32 else
// bf16; cos and sin are the position's d values.
struct RopeRow {
  const void* x;
  void* out;
  const void* cos;
  const void* sin;
  int64_t heads;
  int64_t x_head_stride;
  int64_t out_head_stride;
  int64_t d;
  bool f32;
  bool inverse;
};

// A contiguous span of SwiGLU (swiglu_rows.h): y = silu(gate) * up, fp32 inside, rounded once. gate, up and y share
// one dtype (f32: fp32, else bf16).
struct SiluMulSpan {
  const void* gate;
  const void* up;
  void* y;
  int64_t n;
  bool f32;
};

// Its backward: d_gate = dy * up * silu'(gate), d_up = dy * silu(gate), in fp32 and rounded once; every tensor of
// the span in one dtype (f32 as above).
struct SiluMulGradSpan {
  const void* dy;
  const void* gate;
  const void* up;
  void* d_gate;
  void* d_up;
  int64_t n;
  bool f32;
};

// One row of bias + GELU (bias_gelu_rows.h): y = gelu(round(x + bias)), exact (erf) GELU in fp32, rounded once. x and
// y of one dtype (f32: fp32, else bf16); bias (n values) fp32 (bias_f32) or x's dtype.
struct BiasGeluRow {
  const void* x;
  const void* bias;
  void* y;
  int64_t n;
  bool f32;
  bool bias_f32;
};

// Its backward: dx = dy * gelu'(round(x + bias)) in fp32, rounded once to x's dtype (dy's too); d_bias[j] (fp32, the
// row's block's partial sum) += the unrounded value.
struct BiasGeluGradRow {
  const void* dy;
  const void* x;
  const void* bias;
  void* dx;
  float* d_bias;
  int64_t n;
  bool f32;
  bool bias_f32;
};

// Per-ISA entry points: one per optimizer of ITR_OPTIMIZERS (optimizers.h), then the split-bf16 conversions.
struct KernelTable {
  const char* name;
#define ITR_ENTRY(name, args) Kernels<fused::name> name;
  ITR_OPTIMIZERS(ITR_ENTRY)
#undef ITR_ENTRY
  void (*split_bf16)(const float* src, uint16_t* top, int16_t* residual, int64_t n);
  void (*combine_bf16)(const uint16_t* top, const int16_t* residual, float* dst, int64_t n);
  // Encodes n fp32 values in an int8 format (the state encoding of the steps, ipex_train/state_codec.h).
  void (*q8_encode)(StateCodec c, const float* in, void* codes, float* scales, int64_t n);
  // Decodes n values of that format to fp32 (n a multiple of the block size, or the tensor's last block).
  void (*q8_decode)(StateCodec c, const void* codes, const float* scales, float* out, int64_t n);
  void (*softmax_row)(const SoftmaxRow& row);  // attention_rows.h
  void (*softmax_grad_row)(const SoftmaxGradRow& row);
  float (*rms_norm_row)(const RmsNormRow& row);  // rms_norm_rows.h; returns the row's rstd
  void (*rms_norm_grad_row)(const RmsNormGradRow& row);
  float (*add_rms_norm_row)(const AddRmsNormRow& row);  // rms_norm_rows.h; returns the row's rstd
  void (*add_rms_norm_grad_row)(const AddRmsNormGradRow& row);
  void (*add_norm_row)(const AddNormRow& row);  // add_norm_rows.h
  void (*add_norm_grad_row)(const AddNormGradRow& row);
  void (*rope_row)(const RopeRow& row);  // rope_rows.h
  void (*silu_mul)(const SiluMulSpan& span);  // swiglu_rows.h
  void (*silu_mul_grad)(const SiluMulGradSpan& span);
  void (*bias_gelu_row)(const BiasGeluRow& row);  // bias_gelu_rows.h
  void (*bias_gelu_grad_row)(const BiasGeluGradRow& row);
};

// The entry of optimizer Opt in table t.
template <class Opt>
const Kernels<Opt>& kernels_of(const KernelTable& t);
#define ITR_ENTRY(name, args) \
  template <>                 \
  inline const Kernels<fused::name>& kernels_of<fused::name>(const KernelTable& t) { return t.name; }
ITR_OPTIMIZERS(ITR_ENTRY)
#undef ITR_ENTRY

extern const KernelTable kScalarKernels;
extern const KernelTable kAvx2Kernels;
extern const KernelTable kAvx512Kernels;

}  // namespace ipex_train
