// Chunk scheduling of the step ops: a parameter group becomes a list of chunks (Jobs) run on torch's thread pool,
// in one pass or, for Lamb and Lars, two passes with the per-parameter norms in between.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <utility>
#include <vector>

#include "checks.h"

namespace ipex_train {

constexpr int64_t kChunk = 1 << 15;        // elements per work item: big enough to stream, small enough to balance
static_assert(kChunk % kQ8Block == 0, "chunks must start on an int8 state block");
constexpr int64_t kParallelMin = 1 << 16;  // a group smaller than this runs on the calling thread
// A group of at least this many elements writes the master layouts' 16-bit params with streaming stores
// (Chunk::stream16): its step moves 64 MB or more, so those lines would be gone from the caches by the forward pass
// that reads them anyway. Smaller groups keep plain stores, which leave the params in cache for that forward.
constexpr int64_t kStreamMin = 1 << 22;

inline void* offset(const at::Tensor& t, int64_t elems) {
  return t.defined() ? static_cast<char*>(t.data_ptr()) + elems * t.element_size() : nullptr;
}

inline Chunk chunk_of(const Slot& s, int64_t begin, int64_t n) {
  Chunk c{offset(s.param, begin), offset(s.aux, begin), offset(s.grad, begin),
          {offset(s.state[0], begin), offset(s.state[1], begin), offset(s.state[2], begin)}, n, s.stream16};
  for (int k = 0; k < 3; ++k) {
    c.codec[k] = s.codec[k];
    if (!s.state[k].defined() || (s.codec[k] != StateCodec::kQ8Signed && s.codec[k] != StateCodec::kQ8Unsigned))
      continue;
    // Packed int8 state: the block scales, then the codes (kChunk is a whole number of blocks).
    float* scales = static_cast<float*>(s.state[k].data_ptr());
    c.scales[k] = scales + begin / kQ8Block;
    c.state[k] = reinterpret_cast<char*>(scales + q8_blocks(s.param.numel())) + begin;
  }
  c.key = s.key;
  c.first = begin;
  return c;
}

struct Job {
  int64_t slot, begin, n;
};

// The chunks of slots [first, last), with their element count in *total.
inline std::vector<Job> jobs_of(const std::vector<Slot>& slots, size_t first, size_t last, int64_t* total) {
  std::vector<Job> jobs;
  *total = 0;
  for (size_t i = first; i < last; ++i) {
    const int64_t numel = slots[i].param.numel();
    *total += numel;
    for (int64_t b = 0; b < numel; b += kChunk) jobs.push_back({int64_t(i), b, std::min(kChunk, numel - b)});
  }
  return jobs;
}

inline std::vector<Job> jobs_of(const std::vector<Slot>& slots, int64_t* total) { return jobs_of(slots, 0, slots.size(), total); }

// Runs fn(slot, chunk, job index) over every chunk of the group on torch's thread pool. Each thread takes the next
// chunk in list order when it finishes one, instead of a fixed share of the list: a core slowed down by another
// process (or a slower core type) then simply does fewer chunks, where a fixed split left the other threads waiting
// for it (measured: benchmarks/reports/kernels_cpu.md). Results never depend on which thread ran a chunk.
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

// Runs fn(begin, n) over [0, numel) in chunks on torch's thread pool.
template <class Fn>
void parallel_chunks(int64_t numel, const Fn& fn) {
  at::parallel_for(0, numel, numel < kParallelMin ? numel + 1 : kChunk, [&](int64_t b, int64_t e) { fn(b, e - b); });
}

}  // namespace ipex_train
