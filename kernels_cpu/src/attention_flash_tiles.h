// The per-tile work of ipex_train's tiled attention (attention_flash.h), included by attention_flash_avx512.cpp
// (FLASH_DPBF16: products by AVX-512 BF16 dot products, 512-bit vectors elsewhere) and attention_flash_generic.cpp
// (plain C++). FLASH_TABLE names the Tasks table the including file defines.
//
// Products: C[m][n] (+)= sum_k A[m][k] B[k][n], A bf16 row-major with the reduction contiguous, B packed in pairs
// along the reduction ([K / 2][n][2]), fp32 accumulation. Forward, per query tile: S = Q K^T, an online softmax
// (running max and sum in fp32), O += P V. Backward recomputes P from the saved log-sum-exp, per key tile:
// S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, and dQ^T += K^T dS^T into the buffer of the key tile's
// chunk. Each output element is summed by one task in a fixed order (and the chunks' dQ in chunk order), so results
// do not depend on the thread count. The products are the host's when it hands the tiles one (Args::product: oneDNN's
// batch-reduce GEMM), else the tiles' own (attention_flash_gemm.h).
//
// The row loops keep 16 partial maxima/sums (combined in a fixed order) so that the compiler vectorizes them
// without reassociating floating-point sums.
#pragma once

#include <cstdint>
#include <cstring>

#include "attention_flash.h"

#ifdef FLASH_DPBF16
#include <immintrin.h>
#endif

namespace ipex_train {
namespace flash {
namespace {

constexpr float kInf = __builtin_inff();
constexpr int kLanes = 16;

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bf16_to_f32(uint16_t x) { return bits_to_f32(uint32_t(x) << 16); }
inline uint16_t f32_to_bf16(float f) {  // round to nearest even (finite values)
  const uint32_t u = f32_to_bits(f);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
inline float maxf(float a, float b) { return a > b ? a : b; }

// e^x, relative error ~2e-7 for x in [-88, 88]; 0 for x = -inf, NaN for NaN (a NaN score's row: a NaN log-sum-exp).
// 2^t = 2^n 2^f, n = round(t), |f| <= 1/2.
inline float fexp(float x) {
  float t = x * 1.44269504088896341f;
  t = t < -127.0f ? -127.0f : t;  // NaN passes both clamps
  t = t > 127.0f ? 127.0f : t;
  const float shifted = t + 12582912.0f;  // 1.5 * 2^23: the low mantissa bits hold round(t)
  const float n = shifted - 12582912.0f;
  const float f = (t - n) * 0.693147180559945309f;
  const float poly = 1.0f + f * (1.0f + f * (0.5f + f * (1.66666667e-1f + f * (4.16666667e-2f + f *
                     (8.33333333e-3f + f * 1.38888889e-3f)))));
  const uint32_t n_bits = f32_to_bits(shifted) - f32_to_bits(12582912.0f);
  return poly * bits_to_f32((n_bits + 127u) << 23);  // n = -127 gives 0
}

// The dropout of ipex_train's attention (attention_rows.h): row keys from splitmix64 of the seed and the row's index
// in [B, Hq, S]; element (row, column) kept when a murmur3 finalizer hash of the keys and the column is >= threshold.
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
inline void row_keys(const Args& a, int64_t row, uint32_t* key0, uint32_t* key1) {
  uint64_t x = static_cast<uint64_t>(a.seed) + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(row + 1);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x = x ^ (x >> 31);
  *key0 = static_cast<uint32_t>(x);
  *key1 = static_cast<uint32_t>(x >> 32);
}
inline float keep_scale(const Args& a, uint32_t column, uint32_t key0, uint32_t key1) {
  const uint32_t h = fmix32(fmix32(column ^ key0) + key1);
  return (h >> 8) >= a.drop_threshold ? a.drop_scale : 0.0f;
}

#include "attention_flash_gemm.h"

// ---- per-tile context ------------------------------------------------------------------------------------------
inline int64_t n_query_tiles(const Args& a) { return (a.s + kBM - 1) / kBM; }
inline int64_t n_key_tiles(const Args& a) { return (a.t + kBN - 1) / kBN; }

// Rows i0 .. i0 + rows of (bi, h): each query's key range [lo, hi), its log-sum-exp, delta and dropout keys.
struct QueryRows {
  int64_t i0, rows;
  int32_t lo[kBM], hi[kBM];
  float lse[kBM], delta[kBM];
  uint32_t key0[kBM], key1[kBM];
};

inline void query_rows(const Args& a, int64_t bi, int64_t h, int64_t it, bool backward, QueryRows* q) {
  q->i0 = it * kBM;
  q->rows = min64(kBM, a.s - q->i0);
  for (int64_t r = 0; r < kBM; ++r) {
    const int64_t i = q->i0 + r;
    const int64_t row = (bi * a.hq + h) * a.s + i;
    if (r >= q->rows) {  // padding rows: no key
      q->lo[r] = 1;
      q->hi[r] = 0;
      q->lse[r] = kInf;
      q->delta[r] = 0.0f;
      q->key0[r] = q->key1[r] = 0;
      continue;
    }
    q->lo[r] = a.row_lo ? a.row_lo[bi * a.s + i] : 0;
    q->hi[r] = static_cast<int32_t>(a.causal ? min64(i + 1, a.t) : a.t);
    if (backward) {
      q->lse[r] = a.lse[row];
      q->delta[r] = a.delta[row];
    }
    if (a.dropout) row_keys(a, row, &q->key0[r], &q->key1[r]);
  }
}

// Key tiles any of the rows reaches: the rows' ranges grow with the row (lo and hi are nondecreasing).
inline void key_tiles(const QueryRows& q, int64_t* first, int64_t* end) {
  const int64_t lo = q.lo[0], hi = q.hi[q.rows - 1];
  *first = lo / kBN;
  *end = hi > lo ? (hi + kBN - 1) / kBN : *first;
}

inline const float* mask_row(const Args& a, int64_t bi, int64_t h, int64_t i) {
  return a.mask + bi * a.mask_stride[0] + h * a.mask_stride[1] + i * a.mask_stride[2];
}

#ifndef FLASH_DPBF16
// One row of a score tile: scale, mask, and -inf outside [clo, chi).
inline void score_row(const Args& a, float* sr, int64_t clo, int64_t chi, const float* mr) {
  const float scale = a.scale;
  for (int64_t c = 0; c < kBN; ++c) {
    const float x = sr[c] * scale;
    sr[c] = (c >= clo && c < chi) ? x : -kInf;
  }
  if (mr != nullptr)
    for (int64_t c = clo; c < chi; ++c) sr[c] += mr[c];
}
#endif

#include "attention_flash_vec.h"

// ---- forward ---------------------------------------------------------------------------------------------------
// p = e^(s - m) of one row: summed (16 partial sums) and written in bf16, dropped and rescaled under dropout.
template <bool DROPOUT>
inline void exp_row(const Args& a, const float* sr, float m, uint16_t* pr, float* sums, uint32_t j0, uint32_t key0,
                    uint32_t key1) {
  const uint32_t threshold = a.drop_threshold;
  const float drop_scale = a.drop_scale;
  for (int64_t c0 = 0; c0 < kBN; c0 += kLanes) {
    for (int l2 = 0; l2 < kLanes; ++l2) {
      const int64_t c = c0 + l2;
      const float e = fexp(sr[c] - m);
      sums[l2] += e;
      float kept = e;
      if constexpr (DROPOUT) {
        const uint32_t h = fmix32(fmix32((j0 + uint32_t(c)) ^ key0) + key1);
        kept = (h >> 8) >= threshold ? e * drop_scale : 0.0f;
      }
      pr[c] = f32_to_bf16(kept);
    }
  }
}

// Online softmax of row r of the tile at key j0: updates the running max m and sum l (kLanes partial sums, added
// at the end), rescales the output row, writes the row's (dropped) probabilities in bf16 for P V.
inline void online_row(const Args& a, const QueryRows& q, int64_t r, int64_t j0, float* sr, uint16_t* pr, float* m,
                       float* l, float* orow) {
  float part[kLanes];
  bool nan = *m != *m;
  for (int l2 = 0; l2 < kLanes; ++l2) part[l2] = -kInf;
  for (int64_t c0 = 0; c0 < kBN; c0 += kLanes) {
    for (int l2 = 0; l2 < kLanes; ++l2) {
      part[l2] = maxf(part[l2], sr[c0 + l2]);
      nan |= sr[c0 + l2] != sr[c0 + l2];
    }
  }
  float mx = -kInf;
  for (int l2 = 0; l2 < kLanes; ++l2) mx = maxf(mx, part[l2]);
  const float m_new = nan ? __builtin_nanf("") : maxf(*m, mx);  // a NaN score makes the row's max NaN for good
  if (!(m_new > -kInf)) {  // no key yet (or a NaN score: the row's output is NaN, written at the end)
    *m = m_new;
    for (int64_t c = 0; c < kBN; ++c) pr[c] = 0;
    return;
  }
  const float alpha = fexp(*m - m_new);
  float sums[kLanes] = {};
  if (a.dropout) exp_row<true>(a, sr, m_new, pr, sums, uint32_t(j0), q.key0[r], q.key1[r]);
  else exp_row<false>(a, sr, m_new, pr, sums, uint32_t(j0), 0, 0);
  for (int l2 = 0; l2 < kLanes; ++l2) l[l2] = l[l2] * alpha + sums[l2];
  *m = m_new;
  if (alpha != 1.0f)
    for (int64_t c = 0; c < a.dv; ++c) orow[c] *= alpha;
}

#ifndef FLASH_DPBF16
// The online softmax of a score tile, row by row (attention_flash_vec.h has the 512-bit one).
inline void forward_rows(const Args& a, const QueryRows& q, int64_t bi, int64_t h, int64_t j0, float* S, uint16_t* P,
                         float* m, float* l, float* O) {
  for (int64_t r = 0; r < q.rows; ++r) {
    const int64_t clo = max64(q.lo[r] - j0, 0), chi = min64(q.hi[r] - j0, kBN);
    score_row(a, S + r * kBN, clo, chi, a.mask ? mask_row(a, bi, h, q.i0 + r) + j0 : nullptr);
    online_row(a, q, r, j0, S + r * kBN, P + r * kBN, &m[r], l + r * kLanes, O + r * a.dv);
  }
}
#endif

void forward_task(const Args& a, int64_t bi, int64_t h, int64_t it, float* scratch) {
  const int64_t g = a.hq / a.hk, hk = h / g, ntn = n_key_tiles(a);
  QueryRows q;
  query_rows(a, bi, h, it, false, &q);
  float* S = scratch;
  auto* P = reinterpret_cast<uint16_t*>(scratch + kBM * kBN);
  float* O = scratch + 2 * kBM * kBN;
  // Each row's running sum as kLanes partial sums (one vector with 512-bit rows), added in order at the end.
  alignas(64) float m[kBM], l[kBM * kLanes];
  for (int64_t r = 0; r < kBM; ++r) m[r] = -kInf;  // padding rows too: the 512-bit pass reads m 16 rows at a time
  for (int64_t x = 0; x < kBM * kLanes; ++x) l[x] = 0.0f;
  for (int64_t x = 0; x < q.rows * a.dv; ++x) O[x] = 0.0f;
  const uint16_t* qrow = a.q + ((bi * a.hq + h) * a.s + q.i0) * a.d;
  int64_t jt0, jt1;
  key_tiles(q, &jt0, &jt1);
  for (int64_t jt = jt0; jt < jt1; ++jt) {
    const int64_t j0 = jt * kBN, tile = (bi * a.hk + hk) * ntn + jt;
    product(a, qrow, a.d, q.rows, a.k_d + tile * a.d * kBN, 2 * kBN, kBN, a.d / 2, S, kBN, false);
    forward_rows(a, q, bi, h, j0, S, P, m, l, O);
    product(a, P, kBN, q.rows, a.v_r + tile * kBN * a.dv, 2 * a.dv, a.dv, kBN / 2, O, a.dv, true);
  }
  for (int64_t r = 0; r < q.rows; ++r) {
    const int64_t row = (bi * a.hq + h) * a.s + q.i0 + r;
    uint16_t* out = a.out + row * a.dv;
    float sum = 0.0f;
    for (int l2 = 0; l2 < kLanes; ++l2) sum += l[r * kLanes + l2];
    if (m[r] != m[r] || sum != sum) {  // a NaN score, or inf - inf from an infinite one: NaN out, as torch's
                                       // attention gives, and a NaN log-sum-exp for the backward
      for (int64_t c = 0; c < a.dv; ++c) out[c] = 0x7FC0;
      a.lse[row] = __builtin_nanf("");
    } else if (sum > 0.0f) {
      const float inv = 1.0f / sum;
      for (int64_t c = 0; c < a.dv; ++c) out[c] = f32_to_bf16(O[r * a.dv + c] * inv);
      a.lse[row] = m[r] + __builtin_logf(sum);
    } else {  // no key: zeros, as torch's attention gives; +inf makes the backward's probabilities 0
      for (int64_t c = 0; c < a.dv; ++c) out[c] = 0;
      a.lse[row] = kInf;
    }
  }
}

// ---- backward --------------------------------------------------------------------------------------------------
// First query row past those that reach keys below `key_end` (documents: lo is nondecreasing).
inline int64_t rows_reaching(const Args& a, int64_t bi, int64_t key_end) {
  if (a.row_lo == nullptr) return a.s;
  int64_t lo = 0, hi = a.s;
  const int32_t* rl = a.row_lo + bi * a.s;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (rl[mid] < key_end) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

#ifndef FLASH_DPBF16
// One key row n (key index `key`) of the transposed tiles: P^T and dS^T over the tile's queries.
template <bool DROPOUT>
inline void transposed_row_impl(const Args& a, const QueryRows& q, int64_t key, float* st, const float* dpt,
                                uint16_t* pt, uint16_t* dst) {
  const float scale = a.scale, drop_scale = a.drop_scale;
  const uint32_t threshold = a.drop_threshold;
  const int32_t k32 = static_cast<int32_t>(key);
  for (int64_t m = 0; m < kBM; ++m) {
    const bool valid = (k32 >= q.lo[m]) & (k32 < q.hi[m]);
    const float e = fexp(st[m] - q.lse[m]);
    const float p = valid ? e : 0.0f;
    float keep = 1.0f;
    if constexpr (DROPOUT) {
      const uint32_t h = fmix32(fmix32(uint32_t(key) ^ q.key0[m]) + q.key1[m]);
      keep = (h >> 8) >= threshold ? drop_scale : 0.0f;
    }
    pt[m] = f32_to_bf16(p * keep);
    dst[m] = f32_to_bf16(p * (dpt[m] * keep - q.delta[m]) * scale);
  }
}

inline void transposed_row(const Args& a, const QueryRows& q, int64_t bi, int64_t h, int64_t key, float* st,
                           const float* dpt, uint16_t* pt, uint16_t* dst) {
  const float scale = a.scale;
  if (a.mask) {
    for (int64_t m = 0; m < kBM; ++m) st[m] *= scale;
    for (int64_t m = 0; m < q.rows; ++m) st[m] += mask_row(a, bi, h, q.i0 + m)[key];
  } else {
    for (int64_t m = 0; m < kBM; ++m) st[m] *= scale;
  }
  if (a.dropout) transposed_row_impl<true>(a, q, key, st, dpt, pt, dst);
  else transposed_row_impl<false>(a, q, key, st, dpt, pt, dst);
}

#endif

// dS^T [BN][BM] -> pairs along the keys [BN / 2][BM][2], rows past `keys` as zeros: the B operand of
// dQ^T += K^T dS^T.
inline void interleave_keys(const uint16_t* dst, int64_t keys, uint16_t* out) {
#ifdef FLASH_DPBF16
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t n = 0; n < kBN; n += 2) {
    for (int v = 0; v < kBM / 16; ++v) {
      const __m512i even = n < keys ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(dst + n * kBM + 16 * v))) : zero;
      const __m512i odd = n + 1 < keys ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                             reinterpret_cast<const __m256i*>(dst + (n + 1) * kBM + 16 * v))) : zero;
      _mm512_storeu_si512(out + n * kBM + 32 * v, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
  }
#else
  for (int64_t n = 0; n < kBN; ++n)
    for (int64_t m = 0; m < kBM; ++m) out[((n / 2) * kBM + m) * 2 + n % 2] = n < keys ? dst[n * kBM + m] : 0;
#endif
}

// Key tile jt of (bi, hk): dK and dV (complete: every query reaching these keys), and this chunk's share of dQ^T
// (summed over the chunk's key tiles; the host adds the chunks in order).
void backward_key_tile(const Args& a, int64_t bi, int64_t hk, int64_t jt, int64_t chunk, float* scratch) {
  const int64_t g = a.hq / a.hk, ntm = n_query_tiles(a), ntn = n_key_tiles(a);
  const int64_t j0 = jt * kBN, keys = min64(kBN, a.t - j0);
  float* ST = scratch;
  float* dPT = scratch + kBM * kBN;
  auto* PT = reinterpret_cast<uint16_t*>(scratch + 2 * kBM * kBN);
  auto* dST = PT + kBM * kBN;
  auto* dSTi = dST + kBM * kBN;
  float* dK = scratch + 4 * kBM * kBN;
  float* dV = dK + kBN * a.d;
  for (int64_t x = 0; x < keys * a.d; ++x) dK[x] = 0.0f;
  for (int64_t x = 0; x < keys * a.dv; ++x) dV[x] = 0.0f;
  const uint16_t* krow = a.k + ((bi * a.hk + hk) * a.t + j0) * a.d;
  const uint16_t* vrow = a.v + ((bi * a.hk + hk) * a.t + j0) * a.dv;
  const uint16_t* kt = a.k_t + ((bi * a.hk + hk) * ntn + jt) * a.d * kBN;
  const int64_t i_begin = a.causal ? j0 : 0, i_end = rows_reaching(a, bi, j0 + keys);
  QueryRows q;
  for (int64_t h = hk * g; h < (hk + 1) * g && i_begin < i_end; ++h) {
    for (int64_t it = i_begin / kBM; it < (i_end + kBM - 1) / kBM; ++it) {
      query_rows(a, bi, h, it, true, &q);
      const int64_t tile = (bi * a.hq + h) * ntm + it;
      product(a, krow, a.d, keys, a.q_d + tile * a.d * kBM, 2 * kBM, kBM, a.d / 2, ST, kBM, false);
      product(a, vrow, a.dv, keys, a.g_d + tile * a.dv * kBM, 2 * kBM, kBM, a.dv / 2, dPT, kBM, false);
      for (int64_t n = 0; n < keys; ++n)
        transposed_row(a, q, bi, h, j0 + n, ST + n * kBM, dPT + n * kBM, PT + n * kBM, dST + n * kBM);
      product(a, PT, kBM, keys, a.g_r + tile * kBM * a.dv, 2 * a.dv, a.dv, kBM / 2, dV, a.dv, true);
      product(a, dST, kBM, keys, a.q_r + tile * kBM * a.d, 2 * a.d, a.d, kBM / 2, dK, a.d, true);
      interleave_keys(dST, keys, dSTi);
      const int64_t part = chunk * a.b * a.hq * ntm + tile;
      product(a, kt, kBN, a.d, dSTi, 2 * kBM, kBM, kBN / 2, a.dq_part + part * a.d * kBM, kBM,
              a.dq_written[part] != 0);
      a.dq_written[part] = 1;
    }
  }
  const int64_t first = (bi * a.hk + hk) * a.t + j0;
  for (int64_t x = 0; x < keys * a.d; ++x) a.dk_out[first * a.d + x] = f32_to_bf16(dK[x]);
  for (int64_t x = 0; x < keys * a.dv; ++x) a.dv_out[first * a.dv + x] = f32_to_bf16(dV[x]);
}

void backward_kv_task(const Args& a, int64_t bi, int64_t hk, int64_t chunk, float* scratch) {
  const int64_t end = min64(n_key_tiles(a), (chunk + 1) * a.chunk_tiles);
  for (int64_t jt = chunk * a.chunk_tiles; jt < end; ++jt) backward_key_tile(a, bi, hk, jt, chunk, scratch);
}



// dQ of query tile x (of B * Hq * query tiles): the written chunks' shares summed in chunk order in fp32, rounded
// once to bf16 (in the shares' transposed layout, where the loop is contiguous), then written back as [S][D] rows.
void reduce_dq_task(const Args& a, int64_t chunks, int64_t x, uint16_t* dq, float* scratch) {
  const int64_t tiles = a.b * a.hq * n_query_tiles(a), n = a.d * kBM;
  float* acc = scratch;
  uint16_t* rounded = reinterpret_cast<uint16_t*>(scratch + n);
  for (int64_t i = 0; i < n; ++i) acc[i] = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (!a.dq_written[c * tiles + x]) continue;  // no key of chunk c reaches these queries
    const float* part = a.dq_part + (c * tiles + x) * n;
    for (int64_t i = 0; i < n; ++i) acc[i] += part[i];
  }
  for (int64_t i = 0; i < n; ++i) rounded[i] = f32_to_bf16(acc[i]);
  const int64_t ntm = n_query_tiles(a), bh = x / ntm, i0 = (x % ntm) * kBM, rows = min64(kBM, a.s - i0);
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* row = dq + (bh * a.s + i0 + m) * a.d;
    for (int64_t col = 0; col < a.d; ++col) row[col] = rounded[col * kBM + m];
  }
}

// ---- packing ---------------------------------------------------------------------------------------------------
// Row r of a head's [rows][cols] block, or null past the end (the packs write zeros there).
inline const uint16_t* src_row(const uint16_t* head, int64_t rows, int64_t cols, int64_t row) {
  return row < rows ? head + row * cols : nullptr;
}

// Tile ti of one head [rows][cols] -> [cols / 2][tile][2] (pairs along the columns): a transpose of 32-bit pairs.
void pack_cols_task(const uint16_t* head, int64_t rows, int64_t cols, int64_t tile, int64_t ti, uint16_t* out) {
  const int64_t pairs = cols / 2;
  auto* o = reinterpret_cast<uint32_t*>(out);
#ifdef FLASH_DPBF16
  for (int64_t r0 = 0; r0 < tile; r0 += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      const int64_t np = min64(16, pairs - p0);
      const __mmask16 lanes = static_cast<__mmask16>((1u << np) - 1u);
      __m512i x[16];
      for (int r = 0; r < 16; ++r) {
        const uint16_t* sr = src_row(head, rows, cols, ti * tile + r0 + r);
        x[r] = sr ? _mm512_maskz_loadu_epi32(lanes, sr + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16x32(x);
      for (int64_t p = 0; p < np; ++p) _mm512_storeu_si512(o + (p0 + p) * tile + r0, x[p]);
    }
  }
#else
  for (int64_t r = 0; r < tile; ++r) {
    const uint16_t* sr = src_row(head, rows, cols, ti * tile + r);
    uint32_t pair = 0;
    for (int64_t p = 0; p < pairs; ++p) {
      if (sr) std::memcpy(&pair, sr + 2 * p, 4);
      o[p * tile + r] = pair;
    }
  }
#endif
}

// Tile ti of one head [rows][cols] -> [tile / 2][cols][2] (pairs along the rows): two rows interleaved.
void pack_rows_task(const uint16_t* head, int64_t rows, int64_t cols, int64_t tile, int64_t ti, uint16_t* out) {
  for (int64_t r = 0; r < tile; r += 2) {
    const uint16_t* a = src_row(head, rows, cols, ti * tile + r);
    const uint16_t* b = src_row(head, rows, cols, ti * tile + r + 1);
    uint16_t* o = out + (r / 2) * cols * 2;
#ifdef FLASH_DPBF16
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t c = 0; c < cols; c += 32) {
      const __mmask32 lanes = cols - c >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (cols - c)) - 1u);
      const __m512i va = a ? _mm512_maskz_loadu_epi16(lanes, a + c) : _mm512_setzero_si512();
      const __m512i vb = b ? _mm512_maskz_loadu_epi16(lanes, b + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + 2 * c, _mm512_permutex2var_epi16(va, lo, vb));
      if (cols - c > 16) _mm512_storeu_si512(o + 2 * c + 32, _mm512_permutex2var_epi16(va, hi, vb));
    }
#else
    for (int64_t c = 0; c < cols; ++c) {
      o[2 * c] = a ? a[c] : 0;
      o[2 * c + 1] = b ? b[c] : 0;
    }
#endif
  }
}

// rowsum(grad * out) in fp32 for rows [r0, r1) of [rows][dv] (dv a multiple of 16 under FLASH_DPBF16).
void row_delta_task(const uint16_t* g, const uint16_t* o, int64_t dv, int64_t r0, int64_t r1, float* delta) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t *gr = g + r * dv, *orow = o + r * dv;
#ifdef FLASH_DPBF16
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < dv; c += 16) {
      const __m512 gv = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gr + c))), 16));
      const __m512 ov = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(orow + c))), 16));
      acc = _mm512_fmadd_ps(gv, ov, acc);
    }
    delta[r] = _mm512_reduce_add_ps(acc);
#else
    float sum = 0.0f;
    for (int64_t c = 0; c < dv; ++c) sum += bf16_to_f32(gr[c]) * bf16_to_f32(orow[c]);
    delta[r] = sum;
#endif
  }
}

}  // namespace

extern const Tasks FLASH_TABLE = {&forward_task,   &backward_kv_task, &reduce_dq_task,
                                  &pack_cols_task, &pack_rows_task,   &row_delta_task};

}  // namespace flash
}  // namespace ipex_train
