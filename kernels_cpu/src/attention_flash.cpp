// ipex_train's tiled ("flash") bf16 attention for training at any sequence length (ipex_train/attention): the ops,
// their checks, the packing of the operands into the tiles' pair-interleaved order, and the scheduling of the
// tiles over the threads. The tiles themselves are in attention_flash_tiles.h (per ISA).
//
// Memory per call grows with the sequence, not its square: forward keeps the output and one log-sum-exp per row;
// backward packs copies of Q, K and dO (each the size of its tensor), recomputes the probabilities tile by tile, and
// keeps dQ in fp32 once per chunk of key tiles (at most kChunks; fewer when batch x key/value heads is large).
// Backward's tasks are (batch, key/value head, chunk of key tiles): each computes dK, dV of its keys completely
// (summing over the query heads of the group and the query tiles) and its chunk's share of dQ, so a batch of 1 still
// yields (key/value heads x chunks) tasks with five products per tile pair (dQ needs no second pass); the chunks'
// dQ shares are added in chunk order afterwards. Every output is summed in a fixed order, so the bits do not depend
// on the number of threads. The backward's scratch memory (shares, packs, deltas) is one buffer kept between calls
// (workspace()).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "attention_flash.h"
#include "attention_flash_products.h"
#include "cpu_features.h"
#include "variants.h"

namespace ipex_train {
namespace {

using flash::kBM;
using flash::kBN;

constexpr const char* kFwd = "ipex_train::attention_flash_forward";

const flash::Tasks& flash_tasks() {
  if (flash::kAvx512Bf16Tasks.forward != nullptr && kernel_variant() == "avx512" && has_feature("avx512_bf16")) {
    return flash::kAvx512Bf16Tasks;
  }
  return flash::kGenericTasks;
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 4, kFwd, ": query, key and value must be 4-D CPU tensors");
    TORCH_CHECK_TYPE(t->scalar_type() == at::kBFloat16, kFwd, ": query, key and value must be bfloat16, got ",
                     t->scalar_type());
  }
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == v.size(1) &&
                        k.size(2) == v.size(2) && k.size(3) == q.size(3) && k.size(1) > 0 &&
                        q.size(1) % k.size(1) == 0,
                    kFwd, ": shapes query ", q.sizes(), ", key ", k.sizes(), ", value ", v.sizes(),
                    " do not form an attention (query heads must be a multiple of key/value heads)");
  TORCH_CHECK_VALUE(q.size(3) % 16 == 0 && v.size(3) % 16 == 0 && q.size(3) > 0 && v.size(3) > 0, kFwd,
                    ": head dims must be positive multiples of 16, got ", q.size(3), " and ", v.size(3));
}

int64_t seed_of(const at::Tensor& seed) {
  TORCH_CHECK_VALUE(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(), kFwd,
                    ": seed must be a one-element int64 CPU tensor");
  return seed.item<int64_t>();
}

// The shapes, scale, causal flag, mask, document starts and dropout of a call.
flash::Args base_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal) {
  flash::Args a{};
  a.b = q.size(0);
  a.hq = q.size(1);
  a.hk = k.size(1);
  a.s = q.size(2);
  a.t = k.size(2);
  a.d = q.size(3);
  a.dv = v.size(3);
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  return a;
}

at::Tensor set_mask(flash::Args& a, const std::optional<at::Tensor>& mask_in) {
  if (!mask_in.has_value() || !mask_in->defined()) return at::Tensor();
  TORCH_CHECK_TYPE(mask_in->scalar_type() == at::kFloat, kFwd, ": attn_mask must be an additive float32 mask here");
  TORCH_CHECK_VALUE(mask_in->dim() <= 4, kFwd, ": attn_mask must have at most 4 dims");
  at::Tensor mask = mask_in->expand({a.b, a.hq, a.s, a.t});
  if (mask.stride(3) != 1) mask = mask.contiguous();
  a.mask = mask.const_data_ptr<float>();
  for (int i = 0; i < 3; ++i) a.mask_stride[i] = mask.stride(i);
  return mask;
}

at::Tensor set_row_lo(flash::Args& a, const std::optional<at::Tensor>& lo_in) {
  if (!lo_in.has_value() || !lo_in->defined()) return at::Tensor();
  TORCH_CHECK_VALUE(a.causal && a.s == a.t, kFwd, ": document starts (packed sequences) need is_causal and as many "
                    "queries as keys");
  TORCH_CHECK_VALUE(lo_in->dim() == 2 && lo_in->size(0) == a.b && lo_in->size(1) == a.s, kFwd,
                    ": document starts must have shape (batch, seq) = (", a.b, ", ", a.s, "), got ", lo_in->sizes());
  at::Tensor lo = lo_in->to(at::kInt).contiguous();
  const int32_t* p = lo.const_data_ptr<int32_t>();
  for (int64_t bi = 0; bi < a.b; ++bi) {
    for (int64_t i = 0; i < a.s; ++i) {
      const int32_t x = p[bi * a.s + i];
      TORCH_CHECK_VALUE(x >= 0 && x <= i && (i == 0 || x >= p[bi * a.s + i - 1]), kFwd,
                        ": document starts must satisfy 0 <= start[i] <= i and not decrease along a row");
    }
  }
  a.row_lo = p;
  return lo;
}

void set_dropout(flash::Args& a, double p, const at::Tensor& seed) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, kFwd, ": dropout_p must be in [0, 1), got ", p);
  a.seed = seed_of(seed);
  a.dropout = p > 0.0;
  a.drop_threshold = static_cast<uint32_t>(p * 16777216.0 + 0.5);
  a.drop_scale = static_cast<float>(1.0 / (1.0 - p));
}

const uint16_t* bits(const at::Tensor& t) { return static_cast<const uint16_t*>(t.const_data_ptr()); }
uint16_t* bits_mut(at::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

// Elements of a packed copy of src [B, H, rows, cols] in tiles of `tile` rows (zero rows past the end).
int64_t packed_size(const at::Tensor& src, int64_t tile) {
  return src.size(0) * src.size(1) * ((src.size(2) + tile - 1) / tile) * tile * src.size(3);
}

// src [heads, rows, cols] -> per head and tile of `tile` rows, `pack` (a PackTask of the tiles: pairs along the
// columns or along the rows), zero rows past the end.
void pack(const at::Tensor& src, int64_t tile, flash::PackTask task, uint16_t* o) {
  const int64_t heads = src.size(0) * src.size(1), rows = src.size(2), cols = src.size(3);
  const int64_t tiles = (rows + tile - 1) / tile;
  const uint16_t* s = bits(src);
  at::parallel_for(0, heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) task(s + (x / tiles) * rows * cols, rows, cols, tile, x % tiles,
                                               o + x * cols * tile);
  });
}

// src [heads, rows, cols] -> [heads, tiles, cols, tile]: each tile transposed, zero rows past the end.
void pack_transposed(const at::Tensor& src, int64_t tile, uint16_t* o) {
  const int64_t heads = src.size(0) * src.size(1), rows = src.size(2), cols = src.size(3);
  const int64_t tiles = (rows + tile - 1) / tile;
  const uint16_t* s = bits(src);
  at::parallel_for(0, heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) {
      const int64_t hh = x / tiles, ti = x % tiles;
      uint16_t* ot = o + x * cols * tile;
      for (int64_t r = 0; r < tile; ++r) {
        const int64_t row = ti * tile + r;
        const uint16_t* sr = s + (hh * rows + row) * cols;
        for (int64_t c = 0; c < cols; ++c) ot[c * tile + r] = row < rows ? sr[c] : 0;
      }
    }
  });
}

// Key tiles per chunk of the backward's dK/dV tasks: each chunk adds its share of dQ into a buffer of its own (fp32,
// the size of dQ), summed in chunk order after all tasks. As few chunks as give kMinTasks tasks (batch x key/value
// heads x chunks), at most kChunks: every chunk costs a dQ-sized buffer and its pass in the sum. The split depends on
// the shape only, never on the thread count.
constexpr int64_t kChunks = 4;
constexpr int64_t kMinTasks = 32;
int64_t chunk_tiles(int64_t key_tiles, int64_t kv_heads) {
  const int64_t chunks = std::min(kChunks, std::max<int64_t>(1, (kMinTasks + kv_heads - 1) / kv_heads));
  return (key_tiles + chunks - 1) / chunks;
}

// The backward's scratch memory (its fp32 dQ shares, the packed copies of Q, K and dO, the row deltas), kept between
// calls in one buffer. Allocated per call, the shares alone (up to 4x dQ in fp32, tens of MiB at 2048 tokens) came
// from mmap and went back at free, and the kernel's zeroing of their fresh pages cost ~15% of such a backward's CPU
// time (perf stat, 2-core AMX VM); the packs faulted in again whenever glibc trimmed its heap. Grow-only up to
// kWorkspaceCap bytes; a call that needs more, or finds it in use by another thread's backward, allocates its own.
// Never destroyed (no allocator calls at exit); attention_workspace(release=True) frees it.
constexpr int64_t kWorkspaceCap = int64_t{256} << 20;
std::mutex workspace_mutex;
at::Tensor& kept_workspace() {
  static at::Tensor* buffer = new at::Tensor();
  return *buffer;
}

// At least `bytes` bytes: the kept buffer (locked by `lease` until the caller's scope ends) or a new one.
at::Tensor workspace(int64_t bytes, std::unique_lock<std::mutex>& lease) {
  const auto options = at::TensorOptions().dtype(at::kByte);
  if (bytes <= kWorkspaceCap) {
    std::unique_lock<std::mutex> lock(workspace_mutex, std::try_to_lock);
    if (lock.owns_lock()) {
      at::Tensor& kept = kept_workspace();
      if (!kept.defined() || kept.numel() < bytes) {
        kept = at::Tensor();  // free the smaller one first
        kept = at::empty({bytes}, options);
      }
      lease = std::move(lock);
      return kept;
    }
  }
  return at::empty({bytes}, options);
}

// Bytes the kept workspace holds, after freeing it when `release`.
int64_t attention_workspace(bool release) {
  std::lock_guard<std::mutex> lock(workspace_mutex);
  at::Tensor& kept = kept_workspace();
  if (release) kept = at::Tensor();
  return kept.defined() ? kept.numel() : 0;
}

// Consecutive 64-byte-aligned pieces of one buffer: first the sizes (add), then the pointers (take, same order).
class Pieces {
 public:
  template <class T>
  int64_t add(int64_t n) {
    const int64_t at = total_;
    total_ += (n * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
    return at;
  }
  int64_t total() const { return total_; }
  template <class T>
  static T* take(uint8_t* base, int64_t offset) {
    return reinterpret_cast<T*>(base + offset);
  }

 private:
  int64_t total_ = 0;
};

// Runs task(index, scratch) for index in [0, n) over the threads, each thread taking the next index (the tasks of
// causal attention differ in size); every task writes outputs of its own, so the order does not matter.
// With oneDNN's products (onednn) each worker releases the micro-kernel's hardware state (AMX tile configuration)
// when done, as torch's flash attention does.
template <class Task>
void run_tasks(int64_t n, int64_t scratch_floats, bool onednn, const Task& task) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(scratch_floats));
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t x = next.fetch_add(1); x < n; x = next.fetch_add(1)) task(x, scratch.data());
    }
    if (onednn) release_tile_products();
  });
}

std::tuple<at::Tensor, at::Tensor> attention_flash_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                           const at::Tensor& v_in,
                                                           const std::optional<at::Tensor>& mask_in,
                                                           const std::optional<at::Tensor>& row_lo_in,
                                                           double dropout_p, bool is_causal, double scale,
                                                           const at::Tensor& seed) {
  check_qkv(q_in, k_in, v_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  flash::Args a = base_args(q, k, v, scale, is_causal);
  set_dropout(a, dropout_p, seed);
  const at::Tensor mask = set_mask(a, mask_in);
  const at::Tensor row_lo = set_row_lo(a, row_lo_in);
  at::Tensor out = at::empty({a.b, a.hq, a.s, a.dv}, q.options());
  at::Tensor lse = at::empty({a.b, a.hq, a.s}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  at::Tensor k_d = at::empty({packed_size(k, kBN)}, k.options()), v_r = at::empty({packed_size(v, kBN)}, v.options());
  const flash::Tasks& tasks = flash_tasks();
  pack(k, kBN, tasks.pack_cols, bits_mut(k_d));
  pack(v, kBN, tasks.pack_rows, bits_mut(v_r));
  a.q = bits(q);
  a.k_d = bits(k_d);
  a.v_r = bits(v_r);
  a.out = bits_mut(out);
  a.lse = lse.data_ptr<float>();
  a.product = tile_product(tasks);
  const int64_t ntm = (a.s + kBM - 1) / kBM, heads = a.b * a.hq;
  // Last query tiles first: under a causal mask they have the most keys.
  run_tasks(heads * ntm, flash::scratch_floats(a), a.product != nullptr, [&](int64_t x, float* scratch) {
    const int64_t it = ntm - 1 - x / heads, bh = x % heads;
    tasks.forward(a, bh / a.hq, bh % a.hq, it, scratch);
  });
  return {out, lse};
}

// rowsum(grad * out) per row, in fp32, into dp (one float per row).
void row_delta(const flash::Tasks& tasks, const at::Tensor& grad, const at::Tensor& out, float* dp) {
  const int64_t rows = out.numel() / out.size(-1), dv = out.size(-1);
  const uint16_t *g = bits(grad), *o = bits(out);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) { tasks.row_delta(g, o, dv, begin, end, dp); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_flash_backward(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const std::optional<at::Tensor>& mask_in,
    const std::optional<at::Tensor>& row_lo_in, double dropout_p, bool is_causal, double scale,
    const at::Tensor& seed) {
  check_qkv(q_in, k_in, v_in);
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
  flash::Args a = base_args(q, k, v, scale, is_causal);
  TORCH_CHECK_VALUE(grad_in.sizes() == out_in.sizes() && out_in.dim() == 4 && out_in.size(0) == a.b &&
                        out_in.size(1) == a.hq && out_in.size(2) == a.s && out_in.size(3) == a.dv &&
                        lse_in.numel() == a.b * a.hq * a.s && lse_in.scalar_type() == at::kFloat,
                    "ipex_train::attention_flash_backward: grad_out, out and lse do not match query and value");
  set_dropout(a, dropout_p, seed);
  const at::Tensor mask = set_mask(a, mask_in);
  const at::Tensor row_lo = set_row_lo(a, row_lo_in);
  const at::Tensor grad = grad_in.to(at::kBFloat16).contiguous(), out = out_in.to(at::kBFloat16).contiguous();
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
             dv = at::empty(v.sizes(), v.options());
  if (q.numel() == 0 || k.numel() == 0) return {dq.zero_(), dk.zero_(), dv.zero_()};
  const int64_t ntm = (a.s + kBM - 1) / kBM, ntn = (a.t + kBN - 1) / kBN;
  a.chunk_tiles = chunk_tiles(ntn, a.b * a.hk);
  const int64_t chunks = (ntn + a.chunk_tiles - 1) / a.chunk_tiles;
  Pieces pieces;
  const int64_t shares_at = pieces.add<float>(chunks * a.b * a.hq * ntm * a.d * kBM);
  const int64_t delta_at = pieces.add<float>(out.numel() / a.dv);
  const int64_t k_t_at = pieces.add<uint16_t>(packed_size(k, kBN));
  const int64_t q_d_at = pieces.add<uint16_t>(packed_size(q, kBM));
  const int64_t q_r_at = pieces.add<uint16_t>(packed_size(q, kBM));
  const int64_t g_d_at = pieces.add<uint16_t>(packed_size(grad, kBM));
  const int64_t g_r_at = pieces.add<uint16_t>(packed_size(grad, kBM));
  std::unique_lock<std::mutex> lease;
  const at::Tensor work = workspace(pieces.total(), lease);
  uint8_t* base = work.data_ptr<uint8_t>();
  float* delta = Pieces::take<float>(base, delta_at);
  const flash::Tasks& tasks = flash_tasks();
  row_delta(tasks, grad, out, delta);
  pack_transposed(k, kBN, Pieces::take<uint16_t>(base, k_t_at));
  pack(q, kBM, tasks.pack_cols, Pieces::take<uint16_t>(base, q_d_at));
  pack(q, kBM, tasks.pack_rows, Pieces::take<uint16_t>(base, q_r_at));
  pack(grad, kBM, tasks.pack_cols, Pieces::take<uint16_t>(base, g_d_at));
  pack(grad, kBM, tasks.pack_rows, Pieces::take<uint16_t>(base, g_r_at));
  // Not zero-filled: each chunk's first product into a query tile stores, and dq_written says which were written.
  at::Tensor dq_written = at::zeros({chunks * a.b * a.hq * ntm}, q.options().dtype(at::kByte));
  a.q = bits(q);
  a.k = bits(k);
  a.v = bits(v);
  a.k_t = Pieces::take<uint16_t>(base, k_t_at);
  a.q_d = Pieces::take<uint16_t>(base, q_d_at);
  a.q_r = Pieces::take<uint16_t>(base, q_r_at);
  a.g_d = Pieces::take<uint16_t>(base, g_d_at);
  a.g_r = Pieces::take<uint16_t>(base, g_r_at);
  a.lse = const_cast<float*>(lse.const_data_ptr<float>());  // read only in backward
  a.delta = delta;
  a.dq_part = Pieces::take<float>(base, shares_at);
  a.dq_written = dq_written.data_ptr<uint8_t>();
  a.dk_out = bits_mut(dk);
  a.dv_out = bits_mut(dv);
  a.product = tile_product(tasks);
  const int64_t kv_heads = a.b * a.hk;
  // First chunks first: under a causal mask the most queries reach them.
  run_tasks(kv_heads * chunks, flash::scratch_floats(a), a.product != nullptr, [&](int64_t x, float* scratch) {
    const int64_t chunk = x / kv_heads, bh = x % kv_heads;
    tasks.backward_kv(a, bh / a.hk, bh % a.hk, chunk, scratch);
  });
  uint16_t* dq_out = bits_mut(dq);
  const int64_t query_tiles = a.b * a.hq * ntm;
  at::parallel_for(0, query_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(flash::scratch_floats(a)));
    for (int64_t x = begin; x < end; ++x) tasks.reduce_dq(a, chunks, x, dq_out, scratch.data());
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY_FRAGMENT(ipex_train, m) {
  m.def(
      "attention_flash_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor? doc_start, "
      "float dropout_p, bool is_causal, float scale, Tensor seed) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_flash_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
      "Tensor? attn_mask, Tensor? doc_start, float dropout_p, bool is_causal, float scale, Tensor seed) "
      "-> (Tensor, Tensor, Tensor)");
  m.def("attention_workspace(bool release=False) -> int", &ipex_train::attention_workspace);
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("attention_flash_forward", &ipex_train::attention_flash_forward);
  m.impl("attention_flash_backward", &ipex_train::attention_flash_backward);
}
