// AccumAdamW and AccumLion on the CPU: one multi-threaded pass over every tensor of a table
// (csrc/accum_common.h). Semantics: dlion_kernels/kernels/accum.py.
#pragma once

#include <cstdint>

#include "accum_common.h"
#include "common.h"

namespace dlion {

void cpu_accum_adamw(const int64_t* table, int64_t n_tensors, DType dtype,
                     const accum::AdamWArgs& args, int threads);
void cpu_accum_lion(const int64_t* table, int64_t n_tensors, DType dtype,
                    const accum::LionArgs& args, int threads);

}  // namespace dlion
