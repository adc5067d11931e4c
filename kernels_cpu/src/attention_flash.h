// Tiled ("flash") attention of ipex_train (ipex_train/attention): the plain-data interface between the host code
// (attention_flash.cpp: checks, packing, scheduling) and the per-tile work, compiled twice: with AVX-512 BF16 dot
// products (attention_flash_avx512.cpp) and portably (attention_flash_generic.cpp). No ATen in the tile code, so
// the two compilations share no inline function built for different ISAs.
//
// Layouts (bf16 as uint16_t): q [B, Hq, S, D], k [B, Hk, T, D], v [B, Hk, T, Dv], out and grad [B, Hq, S, Dv],
// all contiguous; query head h reads key/value head h / (Hq / Hk). Packed copies are per tile of BM queries or BN
// keys, zero-padded past the sequence, in the pair-interleaved ("VNNI") order the bf16 dot product reads:
//   *_d: [D / 2][rows][2] (pairs along the head dim), *_r: [rows / 2][D][2] (pairs along the rows).
#pragma once

#include <cstdint>

namespace ipex_train {
namespace flash {

constexpr int64_t kBM = 64;  // queries per tile
constexpr int64_t kBN = 64;  // keys per tile

struct Args {
  int64_t b, hq, hk, s, t, d, dv;
  float scale;
  bool causal;
  // Inputs, contiguous.
  const uint16_t *q, *k, *v, *grad;
  // Packed key/value tiles: k_d, v_r (forward and dQ), v_d, k_r (dQ).
  const uint16_t *k_d, *v_r, *v_d, *k_r;
  // Packed query/grad tiles (dK/dV): q_d, q_r, g_d, g_r.
  const uint16_t *q_d, *q_r, *g_d, *g_r;
  // Additive fp32 mask [B, Hq, S, T] by strides (last stride 1), or null.
  const float* mask;
  int64_t mask_stride[3];
  // First key of each query's document [B, S] (packed sequences, causal within documents), or null.
  const int32_t* row_lo;
  // Dropout: keep when a hash of (row key, column) >= threshold; row keys from seed and the row's index.
  bool dropout;
  uint32_t drop_threshold;
  float drop_scale;
  int64_t seed;
  // Forward outputs / backward inputs: log-sum-exp per row (+inf for rows with no key), and rowsum(grad * out).
  float* lse;
  const float* delta;
  // Outputs.
  uint16_t *out, *dq_out, *dk_out, *dv_out;
};

// Scratch floats one task needs (per thread).
inline int64_t scratch_floats(const Args& a) {
  const int64_t dd = a.d > a.dv ? a.d : a.dv;
  return 4 * kBM * kBN + 2 * kBN * dd + kBM * dd + 8 * kBM + 64;
}

// One forward task: query tile i of (batch bi, query head h).
using ForwardTask = void (*)(const Args&, int64_t bi, int64_t h, int64_t i, float* scratch);
// dK/dV of key tile j of (bi, key/value head hk); dQ of query tile i of (bi, h).
using BackwardKVTask = void (*)(const Args&, int64_t bi, int64_t hk, int64_t j, float* scratch);
using BackwardQTask = void (*)(const Args&, int64_t bi, int64_t h, int64_t i, float* scratch);

struct Tasks {
  ForwardTask forward;
  BackwardKVTask backward_kv;
  BackwardQTask backward_q;
};

extern const Tasks kGenericTasks;
extern const Tasks kAvx512Bf16Tasks;  // forward == nullptr where not compiled (non-x86)

}  // namespace flash
}  // namespace ipex_train
