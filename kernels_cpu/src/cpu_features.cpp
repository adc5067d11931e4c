#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace ipex_train {

namespace {

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

#if defined(__x86_64__) || defined(_M_X64)
Regs cpuid(unsigned leaf, unsigned sub) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) return Regs{};
  return r;
}

unsigned long long xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
#endif

bool bit(unsigned reg, int b) { return (reg >> b) & 1u; }

std::vector<std::pair<std::string, bool>> detect() {
  bool avx2 = false, fma = false, f16c = false, f = false, bw = false, vl = false, dq = false, bf16 = false,
       fp16 = false, amx = false, ne = false;
#if defined(__x86_64__) || defined(_M_X64)
  const Regs l1 = cpuid(1, 0);
  const bool osxsave = bit(l1.c, 27);
  const unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6;        // xmm and ymm state
  const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;   // plus opmask and zmm state
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;  // tile config and tile data
  const unsigned max_leaf = cpuid(0, 0).a;
  const Regs l7 = max_leaf >= 7 ? cpuid(7, 0) : Regs{};
  const Regs l7s1 = (max_leaf >= 7 && l7.a >= 1) ? cpuid(7, 1) : Regs{};
  const bool avx = bit(l1.c, 28) && os_avx;
  fma = avx && bit(l1.c, 12);
  f16c = avx && bit(l1.c, 29);
  avx2 = avx && bit(l7.b, 5);
  f = os_avx512 && bit(l7.b, 16);
  dq = f && bit(l7.b, 17);
  bw = f && bit(l7.b, 30);
  vl = f && bit(l7.b, 31);
  bf16 = f && bit(l7s1.a, 5);
  fp16 = f && bit(l7.d, 23);
  amx = os_amx && bit(l7.d, 22) && bit(l7.d, 24);
  ne = avx && bit(l7s1.d, 5);
#endif
  return {{"avx2", avx2},   {"fma", fma},     {"f16c", f16c},   {"avx512f", f},
          {"avx512bw", bw}, {"avx512vl", vl}, {"avx512dq", dq}, {"avx512_bf16", bf16},
          {"avx512_fp16", fp16}, {"amx_bf16", amx}, {"avx_ne_convert", ne}};
}

}  // namespace

std::vector<std::pair<std::string, bool>> cpu_features() {
  static const std::vector<std::pair<std::string, bool>> features = detect();
  return features;
}

bool has_feature(const std::string& name) {
  for (const auto& f : cpu_features())
    if (f.first == name) return f.second;
  return false;
}

}  // namespace ipex_train
