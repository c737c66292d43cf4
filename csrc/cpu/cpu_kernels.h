// The three stages on the CPU (semantics: dlion_kernels/kernels/reference.py, formats:
// dlion_kernels/kernels/layout.py).
// Pointers are raw host addresses; `table` is the tensor table of common.h.
#pragma once

#include <cstdint>
#include <string>

#include "common.h"

namespace dlion {

// c = b1*m + omb1*g (fp32, one rounding each); packed vote(c) into `votes`. m is read only.
// Table rows: a = gradient (null = zeros), b = fp32 momentum.
void cpu_local_step(const int64_t* table, int64_t n_tensors, DType g_dtype, uint32_t* votes,
                    float b1, float omb1, bool ternary, int threads);

// Tally n packed vote vectors (rows of `stacked`, row_words int32 words apart, `blocks` blocks
// each) into the packed aggregate `out`. `tie` is layout.tie_pattern(step) as 32 bits.
void cpu_tally(const uint32_t* stacked, int64_t row_words, int64_t n, int64_t blocks,
               uint32_t* out, bool average, bool ternary, uint32_t tie, int threads);

// x = x - lr * (D + wd * x) in fp32, D decoded from the packed aggregate, stored as p_dtype;
// m = b2*m + omb2*g in fp32. Table rows: a = parameter, b = fp32 momentum, c = gradient (null =
// zeros) of dtype g_dtype, which is p_dtype or fp32.
void cpu_apply(const int64_t* table, int64_t n_tensors, DType p_dtype, DType g_dtype,
               const uint32_t* aggregate, float lr, float wd, float b2, float omb2, int64_t n,
               bool average, bool ternary, int threads);

// The variant of the CPU kernels this process runs: "avx2+f16c" or "baseline" (SSE2 on x86-64).
std::string cpu_isa();

// Whether any element of the tensors of a table (row a) is inf or NaN.
bool cpu_nonfinite(const int64_t* table, int64_t n_tensors, DType g_dtype, int threads);

}  // namespace dlion
