// fp32 <-> bf16 / fp16 on the CPU, bit-exact with torch (round to nearest even, NaN-safe), in
// branch-free integer and fp32 code that compilers vectorize. fp16 follows FP16 (Maratyszcza),
// which is what c10::Half uses.
//
// Also the ISA variants shared by the CPU kernels (cpu_kernels.cpp, accum_kernels.cpp): block
// loops are compiled for the baseline ISA and, with DLION_AVX2, for AVX2 + F16C, picked at run
// time by cpu_has_avx2(); fp16 blocks then convert with F16C (round to nearest even, like the
// software conversion: bit-identical results).
#pragma once

#include <cstdint>
#include <cstring>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define DLION_HAVE_AVX2_CLONE 1
#include <immintrin.h>
#define DLION_AVX2 __attribute__((target("avx2,f16c")))
#endif

// Always inlined, conversions included: GCC does not inline a plain inline function into a
// target("avx2") caller, which left a call per element in the AVX2 block loops.
#if defined(__GNUC__) || defined(__clang__)
#define DLION_ALWAYS_INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define DLION_ALWAYS_INLINE __forceinline
#else
#define DLION_ALWAYS_INLINE inline
#endif

namespace dlion {

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

DLION_ALWAYS_INLINE float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
DLION_ALWAYS_INLINE uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

DLION_ALWAYS_INLINE float to_f32(float v) { return v; }
DLION_ALWAYS_INLINE float to_f32(bf16 v) {
  return bits_to_f32(static_cast<uint32_t>(v.bits) << 16);
}
DLION_ALWAYS_INLINE float to_f32(fp16 v) {
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
DLION_ALWAYS_INLINE float from_f32<float>(float f) {
  return f;
}

template <>
DLION_ALWAYS_INLINE bf16 from_f32<bf16>(float f) {
  const uint32_t u = f32_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return bf16{static_cast<uint16_t>(nan ? 0x7FC0u : rounded)};
}

template <>
DLION_ALWAYS_INLINE fp16 from_f32<fp16>(float f) {
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

// ----------------------------------------------------------------------------- ISA variants

#ifdef DLION_HAVE_AVX2_CLONE
// Whether this CPU runs the AVX2 + F16C variants (cpu_kernels.cpp; DLION_CPU_NO_AVX2=1 keeps the
// baseline code, for tests and benchmarks of that path).
bool cpu_has_avx2();

// N fp16 (a multiple of 8) to fp32 and back with F16C.
template <int N>
DLION_AVX2 inline void fp16_load_block(const fp16* p, float* out) {
  static_assert(N % 8 == 0, "whole 8-element vectors");
  for (int k = 0; k < N; k += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k));
    _mm256_storeu_ps(out + k, _mm256_cvtph_ps(h));
  }
}
template <int N>
DLION_AVX2 inline void fp16_store_block(fp16* p, const float* in) {
  static_assert(N % 8 == 0, "whole 8-element vectors");
  for (int k = 0; k < N; k += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + k), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + k), h);
  }
}
#endif

}  // namespace dlion
