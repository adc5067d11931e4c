// The tiles of ipex_train's tiled attention in plain C++ (any CPU): the products as scalar loops, slow; used where
// the CPU has no bf16 dot products (ipex_train.attention then prefers other kernels) and by the tests.
#define FLASH_TABLE kGenericTasks
#include "attention_flash_tiles.h"
