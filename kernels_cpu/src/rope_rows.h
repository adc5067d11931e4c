// The per-row math of ipex_train's rotary position embedding (ipex_train/rope): one sequence position of every head
// of a query or key, x1 * cos - x2 * sin and x2 * cos + x1 * sin over the two halves of each head (or the transpose,
// for the backward), fp32 inside and rounded once to x's dtype. Included by loops.h after rms_norm_rows.h (whose
// load/store helpers it uses), so each ISA file compiles these very lines.
//
// Why: Hugging Face's apply_rotary_pos_emb runs four elementwise ops and a concatenation per tensor on transposed
// views (and as many backward), then the attention copies the result to contiguous memory; here one pass reads the
// projection's row and writes the attention's layout.
#pragma once

#include "kernel_abi.h"

namespace ipex_train {
namespace {
namespace rope {

template <class X>
void rope_row_impl(const RopeRow& r) {
  const int64_t half = r.d / 2;
  const X* c = static_cast<const X*>(r.cos);
  const X* s = static_cast<const X*>(r.sin);
  // Forward: (c1, -s1 | c2, s2) on (x1, x2); backward (the transpose): (c1, s2 | c2, -s1) on (g1, g2).
  const X* s_first = r.inverse ? s + half : s;
  const X* s_second = r.inverse ? s : s + half;
  const float sign_first = r.inverse ? 1.0f : -1.0f;
  for (int64_t h = 0; h < r.heads; ++h) {
    const X* x = static_cast<const X*>(r.x) + h * r.x_head_stride;
    X* out = static_cast<X*>(r.out) + h * r.out_head_stride;
    attn::columns(half, [&](auto a, int64_t j) {
      using A = decltype(a);
      const auto x1 = rmsn::x_at<A>(x, j), x2 = rmsn::x_at<A>(x, j + half);
      const auto first = x1 * rmsn::x_at<A>(c, j) + x2 * rmsn::x_at<A>(s_first, j) * sign_first;
      const auto second = x2 * rmsn::x_at<A>(c, j + half) - x1 * rmsn::x_at<A>(s_second, j) * sign_first;
      rmsn::put_x<A>(out, j, first);
      rmsn::put_x<A>(out, j + half, second);
    });
  }
}

void rope_row(const RopeRow& r) {
  if (r.f32) rope_row_impl<float>(r);
  else rope_row_impl<uint16_t>(r);
}

}  // namespace rope
}  // namespace
}  // namespace ipex_train
