// The torch-facing side of kernels_cpu: op schemas, argument checks, storage-layout detection, splitting each
// parameter group into chunks run on torch's thread pool, and the choice of ISA variant. The per-element math
// is in include/ipex_train/updates/*.h and the loops in loops.h; this file never touches an element.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <sstream>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "kernel_abi.h"

namespace ipex_train {
namespace {

constexpr int64_t kChunk = 1 << 15;        // elements per work item: big enough to stream, small enough to balance
constexpr int64_t kParallelMin = 1 << 16;  // a group smaller than this runs on the calling thread
// A group of at least this many elements writes the master layouts' 16-bit params with streaming stores
// (Chunk::stream16): its step moves 64 MB or more, so those lines would be gone from the caches by the forward pass
// that reads them anyway. Smaller groups keep plain stores, which leave the params in cache for that forward.
constexpr int64_t kStreamMin = 1 << 22;

// ---------------------------------------------------------------------------------------------------------------
// Kernel variant (ISA) selection

struct Variant {
  const char* name;
  const KernelTable* table;
  std::vector<std::string> needs;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"avx512", &kAvx512Kernels, {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}},
      {"avx2", &kAvx2Kernels, {"avx2", "fma", "f16c"}},
      {"scalar", &kScalarKernels, {}},
  };
  return v;
}

std::string missing_features(const Variant& v) {
  std::string missing;
  for (const auto& f : v.needs)
    if (!has_feature(f)) missing += (missing.empty() ? "" : ", ") + f;
  return missing;
}

const KernelTable* best_table() {
  for (const auto& v : variants())
    if (v.table->name != nullptr && missing_features(v).empty()) return v.table;
  return &kScalarKernels;
}

std::atomic<const KernelTable*> g_table{nullptr};

const KernelTable& kernels() {
  const KernelTable* t = g_table.load();
  if (t == nullptr) {
    t = best_table();
    g_table.store(t);
  }
  return *t;
}

std::string kernel_variant() { return kernels().name; }

void set_kernel_variant(std::string name) {
  if (name == "auto") {
    g_table.store(best_table());
    return;
  }
  std::string known = "auto";
  for (const auto& v : variants()) {
    known += std::string(", ") + v.name;
    if (name != v.name) continue;
    TORCH_CHECK(v.table->name != nullptr, "kernel variant '", name, "' is not built for this architecture");
    const std::string missing = missing_features(v);
    TORCH_CHECK(missing.empty(), "kernel variant '", name, "' needs CPU features this machine lacks: ", missing);
    g_table.store(v.table);
    return;
  }
  TORCH_CHECK_VALUE(false, "unknown kernel variant '", name, "'; expected one of: ", known);
}

std::string cpu_feature_string() {
  std::string s;
  for (const auto& f : cpu_features()) s += (s.empty() ? "" : ",") + f.first + "=" + (f.second ? "1" : "0");
  return s;
}

// ---------------------------------------------------------------------------------------------------------------
// Argument checking and layout detection

// One parameter with its tensors, as the loops will see them.
struct Slot {
  Layout layout;
  at::Tensor param, aux, grad;
  at::Tensor state[3];
  // Set when some tensor of this parameter had a memory order the others do not share: the loops then run on
  // contiguous copies, written back into these originals afterwards.
  bool copied = false;
  at::Tensor param_out, aux_out, state_out[3];
  bool stream16 = false;  // Chunk::stream16 for this parameter's chunks
};

struct StateArg {
  const char* name;
  at::TensorList tensors;
};

std::string where(const char* arg, size_t i) { return std::string(arg) + "[" + std::to_string(i) + "]"; }

void check_cpu_dense(const char* op, const at::Tensor& t, const std::string& name) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", name, " is a ", t.layout(),
                    " tensor; this fused kernel takes dense (strided) tensors only");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " is on ", t.device(),
                    "; kernels_cpu takes CPU tensors only");
}

void check_same_shape(const char* op, const at::Tensor& t, const std::string& name, const at::Tensor& param,
                      const std::string& pname) {
  TORCH_CHECK_VALUE(t.sizes() == param.sizes(), op, ": ", name, " has shape ", t.sizes(), " but ", pname,
                    " has shape ", param.sizes());
}

// Both tensors visit their elements in the same order when walked linearly through memory.
bool same_memory_order(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_non_overlapping_and_dense() || !b.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  return true;
}

Layout layout_of(const char* op, size_t i, const at::Tensor& p, const at::Tensor& aux) {
  const auto pt = p.scalar_type();
  if (!aux.defined()) {
    if (pt == at::kFloat) return Layout::kF32;
    if (pt == at::kDouble) return Layout::kF64;
    TORCH_CHECK_TYPE(false, op, ": ", where("params", i), " has dtype ", pt, "; without ", where("aux", i),
                     " the kernel takes float32 or float64 params (a bfloat16 param needs an int16 residual or a "
                     "float32 master in aux, a float16 param a float32 master)");
  }
  const auto at = aux.scalar_type();
  if (at == at::kShort && pt == at::kBFloat16) return Layout::kSplitBF16;
  if (at == at::kFloat && pt == at::kBFloat16) return Layout::kBF16Master;
  if (at == at::kFloat && pt == at::kHalf) return Layout::kF16Master;
  TORCH_CHECK_TYPE(false, op, ": ", where("params", i), " (", pt, ") with ", where("aux", i), " (", at,
                   ") is not a storage layout; expected a bfloat16 param with an int16 residual (split), or a "
                   "bfloat16/float16 param with a float32 master");
}

at::ScalarType grad_dtype(Layout l) {
  switch (l) {
    case Layout::kF32: return at::kFloat;
    case Layout::kF64: return at::kDouble;
    case Layout::kSplitBF16:
    case Layout::kBF16Master: return at::kBFloat16;
    case Layout::kF16Master: return at::kHalf;
  }
  return at::kFloat;
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kF32: return "float32";
    case Layout::kF64: return "float64";
    case Layout::kSplitBF16: return "split bfloat16";
    case Layout::kBF16Master: return "bfloat16 with float32 master";
    case Layout::kF16Master: return "float16 with float32 master";
  }
  return "?";
}

// Checks one parameter group and returns its slots; raises naming the argument at the first problem.
std::vector<Slot> prepare(const char* op, at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux,
                          at::TensorList grads, const std::vector<StateArg>& states) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n, op, ": got ", n, " params but ", grads.size(), " grads");
  // An empty aux list means no parameter has one (torch.compile cannot functionalize None inside a mutable list).
  TORCH_CHECK_VALUE(aux.size() == n || aux.size() == 0, op, ": got ", n, " params but ", aux.size(),
                    " aux entries (pass one per param, None for a parameter without a residual or master, or an "
                    "empty list when none has one)");
  for (const auto& s : states)
    TORCH_CHECK_VALUE(s.tensors.size() == n, op, ": got ", n, " params but ", s.tensors.size(), " ", s.name);
  TORCH_CHECK_VALUE(states.size() <= 3, op, ": at most 3 state tensors per parameter");

  std::vector<Slot> slots(n);
  for (size_t i = 0; i < n; ++i) {
    Slot& s = slots[i];
    const std::string pname = where("params", i);
    check_cpu_dense(op, params[i], pname);
    const std::optional<at::Tensor> a = aux.size() == 0 ? std::nullopt : aux.get(i);
    const at::Tensor aux_t = a.has_value() ? *a : at::Tensor();
    if (aux_t.defined()) {
      check_cpu_dense(op, aux_t, where("aux", i));
      check_same_shape(op, aux_t, where("aux", i), params[i], pname);
    }
    s.layout = layout_of(op, i, params[i], aux_t);
    const at::Tensor& g = grads[i];
    TORCH_CHECK_VALUE(!g.defined() || !g.is_sparse(), op, ": ", where("grads", i),
                      " is sparse; the fused kernels take dense grads only");
    check_cpu_dense(op, g, where("grads", i));
    TORCH_CHECK_TYPE(g.scalar_type() == grad_dtype(s.layout), op, ": ", where("grads", i), " has dtype ",
                     g.scalar_type(), " but ", pname, " is stored as ", layout_name(s.layout), " and needs ",
                     grad_dtype(s.layout), " grads");
    check_same_shape(op, g, where("grads", i), params[i], pname);
    const auto state_dtype = s.layout == Layout::kF64 ? at::kDouble : at::kFloat;
    for (size_t k = 0; k < states.size(); ++k) {
      const at::Tensor& t = states[k].tensors[i];
      const std::string sname = where(states[k].name, i);
      check_cpu_dense(op, t, sname);
      TORCH_CHECK_TYPE(t.scalar_type() == state_dtype, op, ": ", sname, " has dtype ", t.scalar_type(),
                       "; optimizer state for a ", layout_name(s.layout), " parameter is ", state_dtype);
      check_same_shape(op, t, sname, params[i], pname);
    }

    bool aligned = params[i].is_non_overlapping_and_dense() && same_memory_order(params[i], g);
    if (aux_t.defined()) aligned = aligned && same_memory_order(params[i], aux_t);
    for (const auto& st : states) aligned = aligned && same_memory_order(params[i], st.tensors[i]);

    if (aligned) {
      s.param = params[i];
      s.aux = aux_t;
      s.grad = g;
      for (size_t k = 0; k < states.size(); ++k) s.state[k] = states[k].tensors[i];
    } else {
      s.copied = true;
      s.param_out = params[i];
      s.aux_out = aux_t;
      s.param = params[i].contiguous();
      s.aux = aux_t.defined() ? aux_t.contiguous() : aux_t;
      s.grad = g.contiguous();
      for (size_t k = 0; k < states.size(); ++k) {
        s.state_out[k] = states[k].tensors[i];
        s.state[k] = states[k].tensors[i].contiguous();
      }
    }
  }
  int64_t group = 0;
  for (const Slot& s : slots) group += s.param.numel();
  // A copied parameter is read back from its copy right after the step, so that copy stays in cache.
  for (Slot& s : slots) s.stream16 = group >= kStreamMin && !s.copied;
  return slots;
}

void write_back(std::vector<Slot>& slots) {
  auto back = [](at::Tensor& dst, const at::Tensor& src) {
    if (dst.defined() && !dst.is_same(src)) dst.copy_(src);
  };
  for (Slot& s : slots) {
    if (!s.copied) continue;
    back(s.param_out, s.param);
    back(s.aux_out, s.aux);
    for (int k = 0; k < 3; ++k) back(s.state_out[k], s.state[k]);
  }
}

void* offset(const at::Tensor& t, int64_t elems) {
  return t.defined() ? static_cast<char*>(t.data_ptr()) + elems * t.element_size() : nullptr;
}

Chunk chunk_of(const Slot& s, int64_t begin, int64_t n) {
  return {offset(s.param, begin), offset(s.aux, begin), offset(s.grad, begin),
          {offset(s.state[0], begin), offset(s.state[1], begin), offset(s.state[2], begin)}, n, s.stream16};
}

struct Job {
  int64_t slot, begin, n;
};

// The chunks of slots [first, last), with their element count in *total.
std::vector<Job> jobs_of(const std::vector<Slot>& slots, size_t first, size_t last, int64_t* total) {
  std::vector<Job> jobs;
  *total = 0;
  for (size_t i = first; i < last; ++i) {
    const int64_t numel = slots[i].param.numel();
    *total += numel;
    for (int64_t b = 0; b < numel; b += kChunk) jobs.push_back({int64_t(i), b, std::min(kChunk, numel - b)});
  }
  return jobs;
}

std::vector<Job> jobs_of(const std::vector<Slot>& slots, int64_t* total) { return jobs_of(slots, 0, slots.size(), total); }

// Runs fn(slot, chunk, job index) over every chunk of the group on torch's thread pool. Each thread takes the next
// chunk in list order when it finishes one, instead of a fixed share of the list: a core slowed down by another
// process (or a slower core type) then simply does fewer chunks, where a fixed split left the other threads waiting
// for it (5-25% of a step on this project's shared 2-core VM). Results never depend on which thread ran a chunk.
template <class Fn>
void for_each_chunk(const std::vector<Slot>& slots, const std::vector<Job>& jobs, int64_t total, const Fn& fn) {
  const int64_t n_jobs = int64_t(jobs.size());
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    for (int64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < n_jobs;) {
      const Job& job = jobs[j];
      fn(job.slot, chunk_of(slots[job.slot], job.begin, job.n), j);
    }
  };
  if (total < kParallelMin || n_jobs < 2) return work(0, 1);
  // One index per thread; inside another parallel region torch runs the body once, serially, which does every job.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n_jobs), 1, work);
}

double step_of(const char* op, at::TensorList steps, size_t i) {
  const at::Tensor& t = steps[i];
  TORCH_CHECK_VALUE(t.defined() && t.numel() == 1 && t.device().is_cpu(), op, ": ", where("state_steps", i),
                    " must be a one-element CPU tensor holding the step count (already incremented)");
  const double step = t.item<double>();
  TORCH_CHECK_VALUE(step >= 1, op, ": ", where("state_steps", i), " is ", step,
                    "; increment the step before calling the kernel");
  return step;
}

void check_steps_len(const char* op, at::TensorList params, at::TensorList steps) {
  TORCH_CHECK_VALUE(steps.size() == params.size(), op, ": got ", params.size(), " params but ", steps.size(),
                    " state_steps");
}

// ---------------------------------------------------------------------------------------------------------------
// Ops

void sgd_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
              at::TensorList momentum_buffers, c10::List<bool> fresh_buffers, double lr, double momentum,
              double dampening, double weight_decay, bool nesterov, bool maximize) {
  const char* op = "ipex_train::sgd_step";
  const bool use_momentum = momentum != 0;
  TORCH_CHECK_VALUE(!nesterov || (use_momentum && dampening == 0), op,
                    ": nesterov needs momentum > 0 and dampening == 0");
  std::vector<StateArg> states;
  if (use_momentum) {
    states.push_back({"momentum_buffers", momentum_buffers});
    TORCH_CHECK_VALUE(fresh_buffers.size() == params.size(), op, ": got ", params.size(), " params but ",
                      fresh_buffers.size(), " fresh_buffers flags");
  }
  auto slots = prepare(op, params, aux, grads, states);
  std::vector<updates::SgdCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const bool fresh = use_momentum && fresh_buffers.get(i);
    coef[i] = updates::sgd_coef(lr, momentum, dampening, weight_decay, maximize, fresh);
  }
  int64_t total;
  const auto jobs = jobs_of(slots, &total);
  const KernelTable& k = kernels();
  for_each_chunk(slots, jobs, total, [&](int64_t i, const Chunk& c, int64_t) {
    k.sgd(slots[i].layout, c, coef[i], use_momentum, nesterov);
  });
  write_back(slots);
}

void adam_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
               at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs,
               at::TensorList state_steps, double lr, double beta1, double beta2, double weight_decay, double eps,
               bool amsgrad, bool maximize, bool decoupled_weight_decay) {
  const char* op = "ipex_train::adam_step";
  std::vector<StateArg> states = {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}};
  if (amsgrad) states.push_back({"max_exp_avg_sqs", max_exp_avg_sqs});
  check_steps_len(op, params, state_steps);
  auto slots = prepare(op, params, aux, grads, states);
  std::vector<updates::AdamCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    coef[i] = updates::adam_coef(lr, beta1, beta2, weight_decay, eps, maximize, decoupled_weight_decay,
                                 step_of(op, state_steps, i));
  int64_t total;
  const auto jobs = jobs_of(slots, &total);
  const KernelTable& k = kernels();
  for_each_chunk(slots, jobs, total,
                 [&](int64_t i, const Chunk& c, int64_t) { k.adam(slots[i].layout, c, coef[i], amsgrad); });
  write_back(slots);
}

void adagrad_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
                  at::TensorList state_sums, at::TensorList state_steps, double lr, double lr_decay,
                  double weight_decay, double eps, bool maximize) {
  const char* op = "ipex_train::adagrad_step";
  check_steps_len(op, params, state_steps);
  auto slots = prepare(op, params, aux, grads, {{"state_sums", state_sums}});
  std::vector<updates::AdagradCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    coef[i] = updates::adagrad_coef(lr, lr_decay, weight_decay, eps, maximize, step_of(op, state_steps, i));
  int64_t total;
  const auto jobs = jobs_of(slots, &total);
  const KernelTable& k = kernels();
  for_each_chunk(slots, jobs, total,
                 [&](int64_t i, const Chunk& c, int64_t) { k.adagrad(slots[i].layout, c, coef[i]); });
  write_back(slots);
}

// Lamb and Lars: a first pass that returns two sums of squares per chunk, then, once each parameter's norms are
// known (ready(slot, norm_a, norm_b)), a second pass that updates it. Parameters go in batches of at least
// kTwoPassBatch elements (a large one alone), and a batch's second pass follows its first at once, walking the chunks
// backwards: it starts on the data the first pass touched last, which is still in the last-level cache. Norms are
// added in chunk order, so they do not depend on the thread count.
constexpr int64_t kTwoPassBatch = 1 << 20;

template <class First, class Ready, class Second>
void two_passes(const std::vector<Slot>& slots, const First& first, const Ready& ready, const Second& second) {
  for (size_t begin = 0, end; begin < slots.size(); begin = end) {
    int64_t n = 0;
    for (end = begin; end < slots.size() && n < kTwoPassBatch; ++end) n += slots[end].param.numel();
    int64_t total;
    const auto jobs = jobs_of(slots, begin, end, &total);
    std::vector<double> partial(2 * jobs.size());
    for_each_chunk(slots, jobs, total, [&](int64_t i, const Chunk& c, int64_t j) {
      first(i, c, &partial[2 * j], &partial[2 * j + 1]);
    });
    std::vector<std::pair<double, double>> sq(end - begin, {0.0, 0.0});
    for (size_t j = 0; j < jobs.size(); ++j) {
      sq[jobs[j].slot - begin].first += partial[2 * j];
      sq[jobs[j].slot - begin].second += partial[2 * j + 1];
    }
    for (size_t i = begin; i < end; ++i) ready(i, std::sqrt(sq[i - begin].first), std::sqrt(sq[i - begin].second));
    const std::vector<Job> backwards(jobs.rbegin(), jobs.rend());
    for_each_chunk(slots, backwards, total, [&](int64_t i, const Chunk& c, int64_t) { second(i, c); });
  }
}

void lamb_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
               at::TensorList exp_avgs, at::TensorList exp_avg_sqs, at::TensorList state_steps, double lr,
               double beta1, double beta2, double weight_decay, double eps, bool bias_correction) {
  const char* op = "ipex_train::lamb_step";
  check_steps_len(op, params, state_steps);
  auto slots = prepare(op, params, aux, grads, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}});
  std::vector<updates::LambCoef<double>> coef(slots.size());
  for (size_t i = 0; i < slots.size(); ++i)
    coef[i] = updates::lamb_coef(beta1, beta2, eps, weight_decay, bias_correction, step_of(op, state_steps, i));
  const KernelTable& k = kernels();
  two_passes(
      slots,
      [&](int64_t i, const Chunk& c, double* w_sq, double* u_sq) { k.lamb_moments(slots[i].layout, c, coef[i], w_sq, u_sq); },
      [&](size_t i, double w_norm, double u_norm) { coef[i].lr_trust = lr * updates::lamb_trust_ratio(w_norm, u_norm); },
      [&](int64_t i, const Chunk& c) { k.lamb_apply(slots[i].layout, c, coef[i]); });
  write_back(slots);
}

void lars_step(at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux, at::TensorList grads,
               at::TensorList momentum_buffers, double lr, double momentum, double weight_decay, double eeta,
               double epsilon) {
  const char* op = "ipex_train::lars_step";
  auto slots = prepare(op, params, aux, grads, {{"momentum_buffers", momentum_buffers}});
  const KernelTable& k = kernels();
  std::vector<updates::LarsCoef<double>> coef(slots.size());
  two_passes(
      slots, [&](int64_t i, const Chunk& c, double* w_sq, double* g_sq) { k.lars_norms(slots[i].layout, c, w_sq, g_sq); },
      [&](size_t i, double w_norm, double g_norm) {
        coef[i] = {momentum, weight_decay, lr * updates::lars_local_lr(w_norm, g_norm, eeta, weight_decay, epsilon)};
      },
      [&](int64_t i, const Chunk& c) { k.lars_apply(slots[i].layout, c, coef[i]); });
  write_back(slots);
}

// Runs fn(begin, n) over [0, numel) in chunks on torch's thread pool.
template <class Fn>
void parallel_chunks(int64_t numel, const Fn& fn) {
  at::parallel_for(0, numel, numel < kParallelMin ? numel + 1 : kChunk, [&](int64_t b, int64_t e) { fn(b, e - b); });
}

std::tuple<at::Tensor, at::Tensor> split_bf16(const at::Tensor& src_in) {
  const char* op = "ipex_train::split_bf16";
  check_cpu_dense(op, src_in, "src");
  TORCH_CHECK_TYPE(src_in.scalar_type() == at::kFloat, op, ": src has dtype ", src_in.scalar_type(),
                   "; expected float32");
  const at::Tensor src = src_in.is_non_overlapping_and_dense() ? src_in : src_in.contiguous();
  at::Tensor top = at::empty_like(src, src.options().dtype(at::kBFloat16));
  at::Tensor res = at::empty_like(src, src.options().dtype(at::kShort));
  TORCH_INTERNAL_ASSERT(same_memory_order(src, top) && same_memory_order(src, res));
  const float* s = src.const_data_ptr<float>();
  auto* t = static_cast<uint16_t*>(top.data_ptr());
  auto* r = static_cast<int16_t*>(res.data_ptr());
  const KernelTable& k = kernels();
  parallel_chunks(src.numel(), [&](int64_t b, int64_t n) { k.split_bf16(s + b, t + b, r + b, n); });
  return {top, res};
}

at::Tensor combine_bf16(const at::Tensor& top_in, const at::Tensor& res_in) {
  const char* op = "ipex_train::combine_bf16";
  check_cpu_dense(op, top_in, "top");
  check_cpu_dense(op, res_in, "residual");
  TORCH_CHECK_TYPE(top_in.scalar_type() == at::kBFloat16, op, ": top has dtype ", top_in.scalar_type(),
                   "; expected bfloat16");
  TORCH_CHECK_TYPE(res_in.scalar_type() == at::kShort, op, ": residual has dtype ", res_in.scalar_type(),
                   "; expected int16");
  check_same_shape(op, res_in, "residual", top_in, "top");
  at::Tensor top = top_in.is_non_overlapping_and_dense() ? top_in : top_in.contiguous();
  at::Tensor res = same_memory_order(top, res_in) ? res_in : res_in.contiguous();
  if (!same_memory_order(top, res)) top = top.contiguous();
  at::Tensor out = at::empty_like(top, top.options().dtype(at::kFloat));
  const auto* t = static_cast<const uint16_t*>(top.const_data_ptr());
  const auto* r = static_cast<const int16_t*>(res.const_data_ptr());
  float* o = out.data_ptr<float>();
  const KernelTable& k = kernels();
  parallel_chunks(out.numel(), [&](int64_t b, int64_t n) { k.combine_bf16(t + b, r + b, o + b, n); });
  return out;
}

// Sparse grads dispatch to the SparseCPU key, before the CPU kernel's own checks could name the argument.
void reject_sparse(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto args = torch::jit::last(*stack, schema.arguments().size());
  for (size_t a = 0; a < schema.arguments().size(); ++a) {
    if (!args[a].isTensorList()) continue;
    const auto list = args[a].toTensorList();
    for (size_t i = 0; i < list.size(); ++i)
      TORCH_CHECK_VALUE(!at::Tensor(list[i]).is_sparse(), schema.name(), ": ", where(schema.arguments()[a].name().c_str(), i),
                        " is sparse; the fused kernels take dense tensors only (ipex_train.optimize runs sparse "
                        "grads through the optimizer's own step)");
  }
  TORCH_CHECK_VALUE(false, schema.name(), ": sparse tensors are not supported");
}

}  // namespace
}  // namespace ipex_train

TORCH_LIBRARY(ipex_train, m) {
  m.def(
      "sgd_step(Tensor(a!)[] params, Tensor(b!)?[] aux, Tensor[] grads, Tensor(c!)[] momentum_buffers, "
      "bool[] fresh_buffers, float lr, float momentum, float dampening, float weight_decay, bool nesterov, "
      "bool maximize) -> ()");
  m.def(
      "adam_step(Tensor(a!)[] params, Tensor(b!)?[] aux, Tensor[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] max_exp_avg_sqs, Tensor[] state_steps, float lr, float beta1, "
      "float beta2, float weight_decay, float eps, bool amsgrad, bool maximize, bool decoupled_weight_decay) -> ()");
  m.def(
      "adagrad_step(Tensor(a!)[] params, Tensor(b!)?[] aux, Tensor[] grads, Tensor(c!)[] state_sums, "
      "Tensor[] state_steps, float lr, float lr_decay, float weight_decay, float eps, bool maximize) -> ()");
  m.def(
      "lamb_step(Tensor(a!)[] params, Tensor(b!)?[] aux, Tensor[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor[] state_steps, float lr, float beta1, float beta2, float weight_decay, "
      "float eps, bool bias_correction) -> ()");
  m.def(
      "lars_step(Tensor(a!)[] params, Tensor(b!)?[] aux, Tensor[] grads, Tensor(c!)[] momentum_buffers, "
      "float lr, float momentum, float weight_decay, float eeta, float epsilon) -> ()");
  m.def("split_bf16(Tensor src) -> (Tensor top, Tensor residual)");
  m.def("combine_bf16(Tensor top, Tensor residual) -> Tensor");
  m.def("kernel_variant() -> str", &ipex_train::kernel_variant);
  m.def("set_kernel_variant(str name) -> ()", &ipex_train::set_kernel_variant);
  m.def("cpu_features() -> str", &ipex_train::cpu_feature_string);
}

TORCH_LIBRARY_IMPL(ipex_train, CPU, m) {
  m.impl("sgd_step", &ipex_train::sgd_step);
  m.impl("adam_step", &ipex_train::adam_step);
  m.impl("adagrad_step", &ipex_train::adagrad_step);
  m.impl("lamb_step", &ipex_train::lamb_step);
  m.impl("lars_step", &ipex_train::lars_step);
  m.impl("split_bf16", &ipex_train::split_bf16);
  m.impl("combine_bf16", &ipex_train::combine_bf16);
}

TORCH_LIBRARY_IMPL(ipex_train, SparseCPU, m) {
  for (const char* name : {"sgd_step", "adam_step", "adagrad_step", "lamb_step", "lars_step"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&ipex_train::reject_sparse>());
}
