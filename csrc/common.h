// Shared by the CPU and CUDA code: the tensor table, the dtype codes, the counting limits.
//
// The tensor table (built by dlion_kernels/kernels/native.py, an int64 tensor, structure of arrays):
//   row 0  a      pointer to the first array (local_step: gradient, 0 = None; apply: param)
//   row 1  b      pointer to the second array (local_step, apply: fp32 momentum; apply: 0 = none)
//   row 2  numel  elements of the tensor (> 0)
//   row 3  block  block offset of the tensor in the packed vectors (layout.py)
//   row 4  chunk  first CUDA chunk of the tensor (prefix sum of ceil(numel / chunk elements))
//   row 5  c      pointer to the third array (apply: gradient, 0 = None; else unused)
// (row c comes last so that the rows of the first layout kept their numbers.)
// Entry t of row r is table[r * T + t] for T tensors.
#pragma once

#include <cstdint>

namespace dlion {

enum TableRow : int {
  kRowA = 0,
  kRowB = 1,
  kRowNumel = 2,
  kRowBlock = 3,
  kRowChunk = 4,
  kRowC = 5
};
constexpr int kTableRows = 6;

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int kBlock = 32;        // elements per packed int32 word
constexpr int kMaxCountPlanes = 16;  // counters of up to 16 bit planes: n <= 32767 (ternary)
constexpr int64_t kMaxVoters = 32767;  // n limit of every backend (layout.py MAX_VOTERS)

// Bits needed to hold the value v >= 0 (Python's int.bit_length()).
inline int bit_length(int64_t v) {
  int p = 0;
  while (v > 0) {
    ++p;
    v >>= 1;
  }
  return p;
}

}  // namespace dlion
