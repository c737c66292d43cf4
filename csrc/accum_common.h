// The accum table, shared by the CPU and CUDA AccumAdamW / AccumLion kernels (built by
// dlion_kernels/kernels/accum_native.py; an int64 tensor, structure of arrays, T tensors):
//   row 0  x      parameter (fp32 / bf16 / fp16, the call's dtype)
//   row 1  g      gradient (same dtype as x)
//   row 2  a      fp32 accumulator (unused, may be 0, when K = 1)
//   row 3  m      fp32 first moment
//   row 4  v      fp32 second moment (AccumAdamW; 0 for AccumLion)
//   row 5  numel  elements (> 0)
//   row 6  chunk  first CUDA chunk of the tensor (prefix sum of ceil(numel / chunk elements))
//   row 7  y      where x is read from (same dtype and size): x itself (the in-place step) or a
//                 source apart from every written tensor, e.g. the decentralized wrapper's
//                 received gossip buffer, which fuses the mixing copy x = y into the step
// Entry t of row r is table[r * T + t]. Semantics: dlion_kernels/kernels/accum.py.
#pragma once

#include <cstdint>

namespace dlion {
namespace accum {

enum Row : int { kX = 0, kG = 1, kA = 2, kM = 3, kV = 4, kNumel = 5, kChunk = 6, kY = 7 };
constexpr int kRows = 8;

// The scalars of one call, rounded to fp32 once by the bindings (accum.py: adamw_scalars).
struct AdamWArgs {
  float decay, inv_k, b1, omb1, b2, omb2, step_size, bc2_sqrt, eps;
  bool k1, flush;  // K == 1 (the accumulator is not touched); t mod K == 0
};
struct LionArgs {
  float lr, wd, inv_k, b1, omb1, b2, omb2;
  bool k1, flush;
};

}  // namespace accum
}  // namespace dlion
