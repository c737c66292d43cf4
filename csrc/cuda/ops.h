// Host launchers of the CUDA kernels (ops.cu), callable from plain C++ (bindings.cpp).
// Pointers are device addresses passed as integers; `stream` is a cudaStream_t as an integer
// (torch.cuda.current_stream().cuda_stream); `device` is the CUDA device index. Every launcher
// checks cudaGetLastError() after its launch and throws std::runtime_error with the CUDA error.
#pragma once

#include <cstdint>
#include <string>

#include "common.h"

namespace dlion {

// Elements per CTA chunk: the table's chunk row counts chunks of this size.
int64_t cuda_chunk_elems();

// "" if the CUDA runtime sees at least one device, else the reason (driver too old, no device).
std::string cuda_runtime_problem();

// Kernel stages v2: local_step reads m, apply writes x and m (and does nothing when the int32
// at `skip` is non-zero; skip = 0: no flag).
void cuda_local_step(int64_t table, int64_t n_tensors, int64_t n_chunks, DType g_dtype,
                     int64_t votes, float b1, float omb1, bool ternary, int device,
                     int64_t stream);

// `step`: 0, or the device address of an int64 step counter: the binary tie pattern is then
// taken from its parity on the device (tie_pattern of layout.py) instead of `tie`.
void cuda_tally(int64_t stacked, int64_t row_words, int64_t n, int64_t blocks, int64_t out,
                bool average, bool ternary, uint32_t tie, int64_t step, int device,
                int64_t stream);

void cuda_apply(int64_t table, int64_t n_tensors, int64_t n_chunks, DType p_dtype, DType g_dtype,
                int64_t aggregate, float lr, float wd, float b2, float omb2, int64_t n,
                bool average, bool ternary, int64_t skip, int device, int64_t stream);

}  // namespace dlion
