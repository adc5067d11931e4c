// Kernel variant (ISA) selection: which KernelTable the ops run, chosen once per process (best for this CPU, or
// set_kernel_variant / IPEX_TRAIN_KERNEL), and which variants this CPU could run.
#pragma once

#include <string>
#include <vector>

#include "kernel_abi.h"

namespace ipex_train {

const KernelTable& kernels();  // the table in use; the ops read it once per call
std::string kernel_variant();
void set_kernel_variant(std::string name);
// Until the next successful set_kernel_variant, every kernel call (and kernel_variant()) raises ValueError(message):
// how a variant request that cannot be honoured (a bad IPEX_TRAIN_KERNEL) is reported at first use, not at import.
void set_kernel_variant_error(std::string message);
// The variants this CPU can run, best first. Reads the features only: the table in use is never touched, so a step
// running on another thread keeps its variant.
std::vector<std::string> supported_kernel_variants();
std::string cpu_feature_string();

}  // namespace ipex_train
