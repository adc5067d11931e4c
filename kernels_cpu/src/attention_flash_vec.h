// Part of attention_flash_tiles.h, included there inside its namespaces: the 512-bit row passes (FLASH_DPBF16).
#pragma once

#ifdef FLASH_DPBF16
// ---- 512-bit row passes (the compiler left the portable ones partly scalar) -------------------------------------
inline __m512 vexp(__m512 x) {  // fexp on 16 lanes (fused multiply-adds: not the portable build's bits)
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  t = _mm512_max_ps(_mm512_set1_ps(-127.0f), t);  // NaN stays NaN (max and min return their second operand)
  t = _mm512_min_ps(_mm512_set1_ps(127.0f), t);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 shifted = _mm512_add_ps(t, magic);
  const __m512 n = _mm512_sub_ps(shifted, magic);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 poly = _mm512_set1_ps(1.38888889e-3f);
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(8.33333333e-3f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(4.16666667e-2f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.66666667e-1f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.0f));
  const __m512i n_bits = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_castps_si512(magic));
  const __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(n_bits, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(poly, _mm512_castsi512_ps(pow2));
}

inline __m512i vfmix32(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int32_t>(0x85EBCA6Bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int32_t>(0xC2B2AE35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// Dropout keep-scale of 16 elements: columns `column` (lanes) under row keys key0, key1 (lanes).
inline __m512 vkeep(const Args& a, __m512i column, __m512i key0, __m512i key1) {
  const __m512i h = vfmix32(_mm512_add_epi32(vfmix32(_mm512_xor_si512(column, key0)), key1));
  const __mmask16 kept = _mm512_cmp_epu32_mask(_mm512_srli_epi32(h, 8), _mm512_set1_epi32(static_cast<int32_t>(
                                               a.drop_threshold)), _MM_CMPINT_NLT);
  return _mm512_maskz_mov_ps(kept, _mm512_set1_ps(a.drop_scale));
}

inline void store_bf16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

inline __m512i iota16() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// Lanes [clo, chi) of the 16 columns from c0.
inline __mmask16 range_mask(int64_t c0, int64_t clo, int64_t chi) {
  const __m512i c = _mm512_add_epi32(iota16(), _mm512_set1_epi32(static_cast<int32_t>(c0)));
  return _mm512_cmp_epi32_mask(c, _mm512_set1_epi32(static_cast<int32_t>(clo)), _MM_CMPINT_NLT) &
         _mm512_cmp_epi32_mask(c, _mm512_set1_epi32(static_cast<int32_t>(chi)), _MM_CMPINT_LT);
}

// Scores of one tile row: scale, mask (read only inside [clo, chi)), -inf outside.
inline void score_vectors(const Args& a, const float* sr, int64_t clo, int64_t chi, const float* mr, __m512* x) {
  const __m512 scale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(-kInf);
  for (int v = 0; v < kBN / 16; ++v) {
    const __mmask16 k = range_mask(16 * v, clo, chi);
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * v), scale);
    if (mr != nullptr) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(k, mr + 16 * v));
    x[v] = _mm512_mask_blend_ps(k, ninf, s);
  }
}

// The online softmax of a whole score tile, in three passes: each row's scaled, masked scores (written back) and
// maximum; then the new running maxima and rescale factors of 16 rows at a time; then each row's probabilities. Row by
// row, every row waited on a scalar exp of its own (the running maximum's rescale factor) between two horizontal
// reductions: half the forward's own time on the AMX VM (perf, b1 h16 s2048 d64 causal). The running sums stay 16
// lanes wide (l: kLanes partials a row).
inline void forward_rows(const Args& a, const QueryRows& q, int64_t bi, int64_t h, int64_t j0, float* S, uint16_t* P,
                         float* m, float* l, float* O) {
  alignas(64) float row_max[kBM], alpha[kBM];
  for (int64_t r = 0; r < kBM; ++r) row_max[r] = -kInf;
  for (int64_t r = 0; r < q.rows; ++r) {
    const int64_t clo = max64(q.lo[r] - j0, 0), chi = min64(q.hi[r] - j0, kBN);
    __m512 x[kBN / 16];
    score_vectors(a, S + r * kBN, clo, chi, a.mask ? mask_row(a, bi, h, q.i0 + r) + j0 : nullptr, x);
    __m512 mx = x[0];
    __mmask16 nan = 0;
    for (int v = 1; v < kBN / 16; ++v) mx = _mm512_max_ps(mx, x[v]);
    for (int v = 0; v < kBN / 16; ++v) {
      _mm512_storeu_ps(S + r * kBN + 16 * v, x[v]);
      nan |= _mm512_cmp_ps_mask(x[v], x[v], _CMP_UNORD_Q);
    }
    row_max[r] = nan ? __builtin_nanf("") : _mm512_reduce_max_ps(mx);
  }
  const __m512 ninf = _mm512_set1_ps(-kInf), one = _mm512_set1_ps(1.0f);
  for (int64_t r0 = 0; r0 < kBM; r0 += 16) {
    const __m512 m_old = _mm512_loadu_ps(m + r0);
    const __m512 rm = _mm512_loadu_ps(row_max + r0);
    // maxf(m_old, row max), NaN where either is: a NaN score makes the row's max NaN for good (its output is NaN)
    const __mmask16 nan = _mm512_cmp_ps_mask(m_old, rm, _CMP_UNORD_Q);
    const __m512 m_new = _mm512_mask_blend_ps(nan, _mm512_max_ps(m_old, rm), _mm512_set1_ps(__builtin_nanf("")));
    const __mmask16 reached = _mm512_cmp_ps_mask(m_new, ninf, _CMP_GT_OQ);  // rows with a key so far (not NaN)
    _mm512_storeu_ps(alpha + r0, _mm512_mask_blend_ps(reached, one, vexp(_mm512_sub_ps(m_old, m_new))));
    _mm512_storeu_ps(m + r0, m_new);
  }
  for (int64_t r = 0; r < q.rows; ++r) {
    const float* sr = S + r * kBN;
    uint16_t* pr = P + r * kBN;
    if (!(m[r] > -kInf)) {  // no key yet, or a NaN score (the row's output is NaN, written at the end)
      for (int v = 0; v < kBN / 16; ++v) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * v),
                                                               _mm256_setzero_si256());
      continue;
    }
    const __m512 mv = _mm512_set1_ps(m[r]);
    __m512 sum = _mm512_setzero_ps();
    const __m512i key0 = _mm512_set1_epi32(static_cast<int32_t>(q.key0[r]));
    const __m512i key1 = _mm512_set1_epi32(static_cast<int32_t>(q.key1[r]));
    for (int v = 0; v < kBN / 16; ++v) {
      const __m512 e = vexp(_mm512_sub_ps(_mm512_loadu_ps(sr + 16 * v), mv));
      sum = _mm512_add_ps(sum, e);
      if (a.dropout) {
        const __m512i col = _mm512_add_epi32(iota16(), _mm512_set1_epi32(static_cast<int32_t>(j0 + 16 * v)));
        store_bf16(pr + 16 * v, _mm512_mul_ps(e, vkeep(a, col, key0, key1)));
      } else {
        store_bf16(pr + 16 * v, e);
      }
    }
    float* lr = l + r * kLanes;  // the row's 16 partial sums: no horizontal add per tile
    _mm512_storeu_ps(lr, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(alpha[r])), sum));
    if (alpha[r] != 1.0f) {
      float* orow = O + r * a.dv;
      const __m512 av = _mm512_set1_ps(alpha[r]);
      for (int64_t c = 0; c < a.dv; c += 16) _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), av));
    }
  }
}

inline void transposed_row(const Args& a, const QueryRows& q, int64_t bi, int64_t h, int64_t key, float* st,
                           const float* dpt, uint16_t* pt, uint16_t* dst) {
  const __m512 scale = _mm512_set1_ps(a.scale);
  if (a.mask) {
    for (int64_t m = 0; m < q.rows; ++m) st[m] = st[m] * a.scale + mask_row(a, bi, h, q.i0 + m)[key];
  } else {
    for (int v = 0; v < kBM / 16; ++v) _mm512_storeu_ps(st + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(st + 16 * v), scale));
  }
  const __m512i kv = _mm512_set1_epi32(static_cast<int32_t>(key));
  for (int v = 0; v < kBM / 16; ++v) {
    const __m512i lo = _mm512_loadu_si512(q.lo + 16 * v), hi = _mm512_loadu_si512(q.hi + 16 * v);
    const __mmask16 valid = _mm512_cmp_epi32_mask(kv, lo, _MM_CMPINT_NLT) & _mm512_cmp_epi32_mask(kv, hi, _MM_CMPINT_LT);
    const __m512 p = _mm512_maskz_mov_ps(valid, vexp(_mm512_sub_ps(_mm512_loadu_ps(st + 16 * v),
                                                                    _mm512_loadu_ps(q.lse + 16 * v))));
    __m512 dp = _mm512_loadu_ps(dpt + 16 * v), pk = p;
    if (a.dropout) {
      const __m512 keep = vkeep(a, kv, _mm512_loadu_si512(q.key0 + 16 * v), _mm512_loadu_si512(q.key1 + 16 * v));
      dp = _mm512_mul_ps(dp, keep);
      pk = _mm512_mul_ps(p, keep);
    }
    store_bf16(pt + 16 * v, pk);
    store_bf16(dst + 16 * v, _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(dp, _mm512_loadu_ps(q.delta + 16 * v))),
                                           scale));
  }
}
// x[r] = row r of a 16 x 16 block of 32-bit elements, in place -> x[c] = column c.
inline void transpose16x32(__m512i* x) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(x[i], x[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(x[i], x[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    x[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    x[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    x[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    x[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now x[4j + k] holds, in each 128-bit lane L, elements (rows 4j..4j+3) of column 4L + k. Gather the lanes.
  for (int i = 0; i < 4; ++i) {
    const __m512i a = _mm512_shuffle_i32x4(x[i], x[i + 4], 0x88), b = _mm512_shuffle_i32x4(x[i], x[i + 4], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(x[i + 8], x[i + 12], 0x88),
                  d = _mm512_shuffle_i32x4(x[i + 8], x[i + 12], 0xDD);
    t[i] = _mm512_shuffle_i32x4(a, c, 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(b, d, 0x88);
    t[i + 8] = _mm512_shuffle_i32x4(a, c, 0xDD);
    t[i + 12] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) x[i] = t[i];
}
#endif  // FLASH_DPBF16
