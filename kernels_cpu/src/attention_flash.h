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

// C[m][n] (+)= sum_k A[m][k] B[k][n]: A bf16 row-major (lda elements), B pair-packed ([k / 2][ldb_pairs][2]), C fp32
// (ldc); acc adds to C instead of storing. The host may hand the tiles oneDNN's batch-reduce GEMM this way.
using Product = void (*)(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb_pairs, int64_t ldc, bool acc,
                         const uint16_t* A, const uint16_t* B, float* C);

struct Args {
  int64_t b, hq, hk, s, t, d, dv;
  // The tiles' products: null runs the tiles' own (attention_flash_gemm.h).
  Product product;
  float scale;
  bool causal;
  // Inputs, contiguous.
  const uint16_t *q, *k, *v;
  // Packed key/value tiles (forward): k_d, v_r.
  const uint16_t *k_d, *v_r;
  // Packed query/grad tiles (dK/dV): q_d, q_r, g_d, g_r; key tiles transposed ([D][BN], for dQ^T += K^T dS^T).
  const uint16_t *q_d, *q_r, *g_d, *g_r, *k_t;
  // dQ^T per chunk of key tiles: [chunks][B * Hq][query tiles][D][BM] fp32 (not zeroed: see dq_written); the
  // chunks are added in order afterwards (ReduceDQTask).
  float* dq_part;
  // One flag per (chunk, query tile) of dq_part: set once the chunk wrote that tile (its first product stores,
  // later ones add), so no share is zero-filled and the host sums only written shares.
  uint8_t* dq_written;
  int64_t chunk_tiles;
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
  uint16_t *out, *dk_out, *dv_out;
};

// Scratch floats one task needs (per thread).
inline int64_t scratch_floats(const Args& a) {
  const int64_t dd = a.d > a.dv ? a.d : a.dv;
  return 4 * kBM * kBN + 2 * kBN * dd + kBM * dd + 8 * kBM + 64;
}

// One forward task: query tile i of (batch bi, query head h).
using ForwardTask = void (*)(const Args&, int64_t bi, int64_t h, int64_t i, float* scratch);
// dK/dV of the key tiles of one chunk of (bi, key/value head hk), and their share of dQ (dq_part).
using BackwardKVTask = void (*)(const Args&, int64_t bi, int64_t hk, int64_t chunk, float* scratch);

// dQ of query tile x of the B * Hq * query tiles: the chunks' shares in dq_part added in chunk order, written to dq
// ([B, Hq, S, D] bf16). Scratch: 1.5 * D * BM floats (within scratch_floats).
using ReduceDQTask = void (*)(const Args&, int64_t chunks, int64_t x, uint16_t* dq, float* scratch);

// Tile ti of one head's [rows][cols] bf16 block packed into `out` (zero rows past `rows`): pairs along the columns
// ([cols / 2][tile][2], PackTask pack_cols) or along the rows ([tile / 2][cols][2], pack_rows).
using PackTask = void (*)(const uint16_t* head, int64_t rows, int64_t cols, int64_t tile, int64_t ti, uint16_t* out);
// rowsum(grad * out) in fp32 for rows [r0, r1) of two [rows][dv] bf16 blocks.
using RowDeltaTask = void (*)(const uint16_t* grad, const uint16_t* out, int64_t dv, int64_t r0, int64_t r1,
                              float* delta);

struct Tasks {
  ForwardTask forward;
  BackwardKVTask backward_kv;
  ReduceDQTask reduce_dq;
  PackTask pack_cols;
  PackTask pack_rows;
  RowDeltaTask row_delta;
};

extern const Tasks kGenericTasks;
extern const Tasks kAvx512Bf16Tasks;  // forward == nullptr where not compiled (non-x86)

}  // namespace flash
}  // namespace ipex_train
