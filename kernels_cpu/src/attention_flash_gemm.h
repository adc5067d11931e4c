// Part of attention_flash_tiles.h, included there inside its namespaces: the bf16 products of the tiles.
#pragma once

// ---- products ------------------------------------------------------------------------------------------------
#ifdef FLASH_DPBF16
template <int MR, int NV>
inline __attribute__((always_inline)) void micro(const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                                 int64_t kp, float* C, int64_t ldc, bool acc) {
  __m512 c[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = acc ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + 32 * v);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, 4);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], x, b[v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
}

template <int MR, int NV>
void micro_tail(int64_t rem, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int64_t kp, float* C,
                int64_t ldc, bool acc) {
  if constexpr (MR > 0) {
    if (rem == MR) micro<MR, NV>(A, lda, B, ldb, kp, C, ldc, acc);
    else micro_tail<MR - 1, NV>(rem, A, lda, B, ldb, kp, C, ldc, acc);
  }
}

template <int MR, int NV>
void column_block(const uint16_t* A, int64_t lda, int64_t m, const uint16_t* B, int64_t ldb, int64_t kp, float* C,
                  int64_t ldc, bool acc) {
  int64_t r = 0;
  for (; r + MR <= m; r += MR) micro<MR, NV>(A + r * lda, lda, B, ldb, kp, C + r * ldc, ldc, acc);
  if (r < m) micro_tail<MR - 1, NV>(m - r, A + r * lda, lda, B, ldb, kp, C + r * ldc, ldc, acc);
}

// n a multiple of 16; ldb = 2 * (packed columns).
void gemm(const uint16_t* A, int64_t lda, int64_t m, const uint16_t* B, int64_t ldb, int64_t n, int64_t kp,
          float* C, int64_t ldc, bool acc) {
  int64_t c0 = 0;
  for (; c0 + 64 <= n; c0 += 64) column_block<6, 4>(A, lda, m, B + 2 * c0, ldb, kp, C + c0, ldc, acc);
  for (; c0 + 32 <= n; c0 += 32) column_block<12, 2>(A, lda, m, B + 2 * c0, ldb, kp, C + c0, ldc, acc);
  for (; c0 + 16 <= n; c0 += 16) column_block<12, 1>(A, lda, m, B + 2 * c0, ldb, kp, C + c0, ldc, acc);
}
#else
// Not loop-vectorized: GCC 12 at -O3 vectorized the two chained fp32 sums over p into wrong results (the portable
// build's scores were off by ~10% on x86-64; -O2 and -fno-tree-loop-vectorize gave the exact sums).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-vectorize")))
#endif
void gemm(const uint16_t* A, int64_t lda, int64_t m, const uint16_t* B, int64_t ldb, int64_t n, int64_t kp,
          float* C, int64_t ldc, bool acc) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      float sum = acc ? C[r * ldc + c] : 0.0f;
      for (int64_t p = 0; p < kp; ++p) {
        const uint16_t* a = A + r * lda + 2 * p;
        const uint16_t* b = B + p * ldb + 2 * c;
        sum += bf16_to_f32(a[1]) * bf16_to_f32(b[1]);
        sum += bf16_to_f32(a[0]) * bf16_to_f32(b[0]);
      }
      C[r * ldc + c] = sum;
    }
  }
}
#endif


// The products of the tiles: the host's (Args::product) when it gave one, else gemm above. ldb counts uint16_t.
inline void product(const Args& a, const uint16_t* A, int64_t lda, int64_t m, const uint16_t* B, int64_t ldb,
                    int64_t n, int64_t kp, float* C, int64_t ldc, bool acc) {
  if (a.product != nullptr) a.product(m, n, 2 * kp, lda, ldb / 2, ldc, acc, A, B, C);
  else gemm(A, lda, m, B, ldb, n, kp, C, ldc, acc);
}
