// The products of the tiled attention's tiles (attention_flash.h, Args::product): oneDNN's batch-reduce GEMM
// micro-kernel through torch's cpublas where it runs exactly (checked once per process) and the AVX-512 BF16 tiles
// are in use, else the tiles' own loops. torch.ops.ipex_train.attention_products(choice) reads or sets the choice.
#pragma once

#include "attention_flash.h"

namespace ipex_train {

// The product the tiles of `tasks` run for a call: oneDNN's with the AVX-512 BF16 tiles when chosen, else null.
flash::Product tile_product(const flash::Tasks& tasks);
// Releases the micro-kernel's per-thread hardware state (the AMX tile configuration); each worker that ran oneDNN's
// products calls it when done, as torch's flash attention does.
void release_tile_products();

}  // namespace ipex_train
