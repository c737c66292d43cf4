// Host launchers of the CUDA AccumAdamW / AccumLion kernels (accum_kernels.cu). `table` is a
// device address of the accum table (csrc/accum_common.h), `stream` a cudaStream_t as an integer.
#pragma once

#include <cstdint>

#include "accum_common.h"
#include "common.h"

namespace dlion {

int64_t cuda_accum_chunk_elems();

void cuda_accum_adamw(int64_t table, int64_t n_tensors, int64_t n_chunks, DType dtype,
                      const accum::AdamWArgs& args, int device, int64_t stream);
void cuda_accum_lion(int64_t table, int64_t n_tensors, int64_t n_chunks, DType dtype,
                     const accum::LionArgs& args, int device, int64_t stream);

}  // namespace dlion
