// fp32 <-> bf16 / fp16 on the CPU, bit-exact with torch (round to nearest even, NaN-safe), in
// branch-free integer and fp32 code that compilers vectorize. fp16 follows FP16 (Maratyszcza),
// which is what c10::Half uses.
#pragma once

#include <cstdint>
#include <cstring>

// Always inlined: GCC does not inline a plain inline function into a target("avx2") caller (the
// multi-versioned block loops of accum_kernels.cpp), which left a call per element there.
#if defined(__GNUC__) || defined(__clang__)
#define DLION_CONVERT_INLINE inline __attribute__((always_inline))
#else
#define DLION_CONVERT_INLINE inline
#endif

namespace dlion {

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

DLION_CONVERT_INLINE float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
DLION_CONVERT_INLINE uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

DLION_CONVERT_INLINE float to_f32(float v) { return v; }
DLION_CONVERT_INLINE float to_f32(bf16 v) {
  return bits_to_f32(static_cast<uint32_t>(v.bits) << 16);
}
DLION_CONVERT_INLINE float to_f32(fp16 v) {
  const uint32_t w = static_cast<uint32_t>(v.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bits_to_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t mag = two_w < (1u << 27) ? f32_to_bits(denormalized) : f32_to_bits(normalized);
  return bits_to_f32(sign | mag);
}

template <typename T>
inline T from_f32(float f);

template <>
DLION_CONVERT_INLINE float from_f32<float>(float f) {
  return f;
}

template <>
DLION_CONVERT_INLINE bf16 from_f32<bf16>(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return bf16{static_cast<uint16_t>(nan ? 0x7FC0u : rounded)};
}

template <>
DLION_CONVERT_INLINE fp16 from_f32<fp16>(float f) {
  const uint32_t w = f32_to_bits(f);
  float base = (bits_to_f32(f32_to_bits(f) & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return fp16{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

}  // namespace dlion
