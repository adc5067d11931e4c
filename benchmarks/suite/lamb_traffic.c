/* Lamb's memory traffic with next to no arithmetic: the floor any two-pass Lamb kernel of the same storage layout
 * can reach on this machine, for bench_step to time next to the real kernel and torch's fused Adam.
 *
 * Each tensor goes through the fused kernel's two passes over the same 32Ki-element chunks, taken by the threads in
 * turn: pass 1 (forward) reads the value, the grad and both moments and writes the moments; pass 2 (backward, as
 * kernels_cpu/src/ops.cpp walks it) reads the value and both moments and writes the value, plus, for the master
 * layouts, the 16-bit param with non-temporal stores. The arithmetic is one multiply-add per array touched, only to
 * keep every load and store alive. Built by bench_step with the system C compiler (plain C, OpenMP) and loaded after
 * torch, so its OpenMP regions run on torch's own libgomp thread pool, as the fused kernel's do: a second pool would
 * fight torch's spinning workers for the cores.
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

enum { LAYOUT_F32 = 0, LAYOUT_SPLIT = 1, LAYOUT_MASTER = 2 };
enum { CHUNK = 1 << 15 };

typedef struct {
  int64_t n;
  void* param;       /* fp32 value; split: bf16 top; master: 16-bit param */
  void* aux;         /* split: int16 residual; master: fp32 master */
  const void* grad;  /* fp32 or 16-bit */
  float* m;
  float* v;
} Tensor;

#define INLINE static inline __attribute__((always_inline))

INLINE float f32_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
INLINE uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* The passes, written once and inlined with a constant layout (see run_chunk), with restrict-qualified locals so
 * that the compiler vectorizes them (built with -ffast-math, which lets it reassociate the checksum). */
INLINE float first(const Tensor* t, const int layout, int64_t b, int64_t e) {
  const float* restrict wf = (const float*)(layout == LAYOUT_MASTER ? t->aux : t->param);
  const uint16_t* restrict top = (const uint16_t*)t->param;
  const uint16_t* restrict res = (const uint16_t*)t->aux;
  const float* restrict gf = (const float*)t->grad;
  const int16_t* restrict g16 = (const int16_t*)t->grad;
  float* restrict m = t->m;
  float* restrict v = t->v;
  float acc = 0;
  for (int64_t i = b; i < e; ++i) {
    const float g = layout == LAYOUT_F32 ? gf[i] : (float)g16[i] * 1e-6f;  /* never a subnormal */
    const float w = layout == LAYOUT_SPLIT ? f32_of(((uint32_t)top[i] << 16) | res[i]) : wf[i];
    const float mi = m[i] * 0.9f + g, vi = v[i] * 0.99f + g;
    m[i] = mi;
    v[i] = vi;
    acc += w * mi + vi;
  }
  return acc;
}

INLINE void second(const Tensor* t, const int layout, int64_t b, int64_t e) {
  float* restrict wf = (float*)(layout == LAYOUT_MASTER ? t->aux : t->param);
  uint16_t* restrict top = (uint16_t*)t->param;
  uint16_t* restrict res = (uint16_t*)t->aux;
  const float* restrict m = t->m;
  const float* restrict v = t->v;
  for (int64_t i = b; i < e; ++i) {
    const float w0 = layout == LAYOUT_SPLIT ? f32_of(((uint32_t)top[i] << 16) | res[i]) : wf[i];
    const float w = w0 - 1e-3f * m[i] + v[i] * 1e-9f;
    if (layout == LAYOUT_SPLIT) {
      top[i] = (uint16_t)(bits_of(w) >> 16);
      res[i] = (uint16_t)bits_of(w);
    } else {
      wf[i] = w;
    }
  }
  if (layout == LAYOUT_MASTER) { /* the 16-bit copy (the high halves), with streaming stores as the kernel writes it */
    int64_t i = b;
    for (; i < e && ((uintptr_t)(top + i) & 15); ++i) top[i] = (uint16_t)(bits_of(wf[i]) >> 16);
#ifdef __AVX2__
    for (; i + 8 <= e; i += 8) {
      const __m256i u = _mm256_srli_epi32(_mm256_castps_si256(_mm256_loadu_ps(wf + i)), 16);
      _mm_stream_si128((__m128i*)(top + i), _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
    }
#else
    for (; i + 2 <= e; i += 2)
      _mm_stream_si32((int*)(top + i), (int)((bits_of(wf[i]) >> 16) | (bits_of(wf[i + 1]) & 0xFFFF0000u)));
#endif
    for (; i < e; ++i) top[i] = (uint16_t)(bits_of(wf[i]) >> 16);
  }
}

static float run_chunk(const Tensor* t, int layout, int pass, int64_t b, int64_t e) {
  switch (layout * 2 + pass - 1) {
    case 0: return first(t, LAYOUT_F32, b, e);
    case 1: return second(t, LAYOUT_F32, b, e), 0.0f;
    case 2: return first(t, LAYOUT_SPLIT, b, e);
    case 3: return second(t, LAYOUT_SPLIT, b, e), 0.0f;
    case 4: return first(t, LAYOUT_MASTER, b, e);
    default: return second(t, LAYOUT_MASTER, b, e), 0.0f;
  }
}

static float run_pass(const Tensor* t, int layout, int pass, int threads) {
  const int64_t chunks = (t->n + CHUNK - 1) / CHUNK;
  atomic_long next;
  atomic_init(&next, 0);
  float sum = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
  {
    _mm_setcsr(_mm_getcsr() | 0x8040); /* flush-to-zero, denormals-are-zero: no slow subnormal arithmetic */
    for (long j; (j = atomic_fetch_add(&next, 1)) < chunks;) {
      const long c = pass == 1 ? j : chunks - 1 - j;
      const int64_t b = c * CHUNK, e = b + CHUNK < t->n ? b + CHUNK : t->n;
      sum += run_chunk(t, layout, pass, b, e);
    }
    _mm_sfence();
  }
  return sum;
}

/* One Lamb-shaped step over `count` tensors; returns a checksum so that nothing can be optimized away. */
float lamb_traffic(const Tensor* tensors, int count, int layout, int threads) {
  if (threads < 1) threads = 1;
  float checksum = 0;
  for (int k = 0; k < count; ++k) {
    checksum += run_pass(&tensors[k], layout, 1, threads);
    run_pass(&tensors[k], layout, 2, threads);
  }
  return checksum;
}
