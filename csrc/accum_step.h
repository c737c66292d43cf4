// The per-element AccumAdamW / AccumLion step, one copy for the CPU kernels
// (cpu/accum_kernels.cpp, also compiled for AVX2) and the CUDA kernels (cuda/accum_kernels.cu,
// also compiled as host C++ by the CUDA emulation test). Semantics and operation order:
// dlion_kernels/kernels/accum.py; one rounding per operation (no FMA: -ffp-contract=off on the
// host, --fmad=false on the device).
#pragma once

#include <cmath>

#include "accum_common.h"

// Host and device under nvcc. On the host always inlined: GCC does not inline a plain inline
// function into a target("avx2") caller, which left a call per element in the AVX2 block loops.
#if defined(__CUDACC__)
#define DLION_HOST_DEVICE __host__ __device__ __forceinline__
#elif defined(__GNUC__) || defined(__clang__)
#define DLION_HOST_DEVICE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define DLION_HOST_DEVICE __forceinline
#else
#define DLION_HOST_DEVICE inline
#endif

namespace dlion {
namespace accum {

// IEEE-exact square root on either side (sqrtf on the device: no fast math).
DLION_HOST_DEVICE float step_sqrt(float v) {
#if defined(__CUDA_ARCH__)
  return sqrtf(v);
#else
  return std::sqrt(v);
#endif
}

// The accumulator: a += g / K, reset on flush steps; untouched (a may be null) when K == 1.
template <bool K1, bool FLUSH, typename I>
DLION_HOST_DEVICE float accumulate(float* a, I i, float gj, float inv_k) {
  if (K1) return 0.0f;
  const float aj = a[i] + gj * inv_k;
  a[i] = FLUSH ? 0.0f : aj;
  return aj;
}

// Element i: the new x from x (as read from the table's y row) and g; a[i], m[i], v[i] updated in
// place (on flush steps).
struct AdamW {
  using Args = AdamWArgs;
  static constexpr bool kSecondMoment = true;
  template <bool K1, bool FLUSH, typename I>
  DLION_HOST_DEVICE static float element(float xj, float gj, float* a, float* m, float* v, I i,
                                         const Args& s) {
    xj = xj * s.decay;
    const float aj = accumulate<K1, FLUSH>(a, i, gj, s.inv_k);
    const float mj = m[i], vj = v[i];
    const float mt = mj + s.omb1 * gj;
    const float vt = vj + s.omb2 * (gj * gj);
    xj = xj - s.step_size * (mt / (step_sqrt(vt) / s.bc2_sqrt + s.eps));
    if (FLUSH) {
      const float src = K1 ? gj : aj;
      m[i] = s.b1 * (mj + s.omb1 * src);
      v[i] = s.b2 * (vj + s.omb2 * (src * src));
    }
    return xj;
  }
};

struct Lion {
  using Args = LionArgs;
  static constexpr bool kSecondMoment = false;  // the table's v row is null
  template <bool K1, bool FLUSH, typename I>
  DLION_HOST_DEVICE static float element(float xj, float gj, float* a, float* m, float*, I i,
                                         const Args& s) {
    const float mj = m[i];
    const float c = s.b1 * mj + s.omb1 * gj;
    const float sign = (c > 0.0f ? 1.0f : 0.0f) - (c < 0.0f ? 1.0f : 0.0f);
    xj = xj - s.lr * (sign + s.wd * xj);
    const float aj = accumulate<K1, FLUSH>(a, i, gj, s.inv_k);
    if (FLUSH) m[i] = s.b2 * mj + s.omb2 * (K1 ? gj : aj);
    return xj;
  }
};

}  // namespace accum
}  // namespace dlion
