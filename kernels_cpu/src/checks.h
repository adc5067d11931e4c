// Argument checks and storage-layout detection of the step ops: one parameter group in, one Slot per parameter out
// (its layout and the tensors the loops will walk), raising naming the argument at the first problem.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "kernel_abi.h"

namespace ipex_train {

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
  StateCodec codec[3] = {StateCodec::kPlain, StateCodec::kPlain, StateCodec::kPlain};  // from the state dtypes
  uint64_t key = 0;  // Chunk::key: the stochastic-rounding key of this parameter in this call
};

// Bytes of a packed int8 state tensor for a parameter of `numel` elements: one fp32 scale per kQ8Block elements,
// then one code per element (ipex_train/state_codec.h).
inline int64_t q8_blocks(int64_t numel) { return (numel + kQ8Block - 1) / kQ8Block; }
inline int64_t q8_bytes(int64_t numel) { return 4 * q8_blocks(numel) + numel; }

struct StateArg {
  const char* name;
  at::TensorList tensors;
};

std::string where(const char* arg, size_t i);
void check_cpu_dense(const char* op, const at::Tensor& t, const std::string& name);
void check_same_shape(const char* op, const at::Tensor& t, const std::string& name, const at::Tensor& param,
                      const std::string& pname);
// Both tensors visit their elements in the same order when walked linearly through memory.
bool same_memory_order(const at::Tensor& a, const at::Tensor& b);

// Checks one parameter group and returns its slots. A group of at least `stream_min` elements gets
// Slot::stream16 on the parameters that were not copied.
// `state_key` seeds the stochastic rounding of bf16 state (each parameter gets its own key from it).
std::vector<Slot> prepare(const char* op, at::TensorList params, const c10::List<std::optional<at::Tensor>>& aux,
                          at::TensorList grads, const std::vector<StateArg>& states, int64_t stream_min,
                          int64_t state_key = 0);
// Copies the results of copied slots back into the caller's tensors.
void write_back(std::vector<Slot>& slots);

void check_steps_len(const char* op, at::TensorList params, at::TensorList steps);
// The (already incremented) step count of parameter i.
double step_of(const char* op, at::TensorList steps, size_t i);

}  // namespace ipex_train
