// Device code of the three stages. Semantics: dlion_kernels/kernels/reference.py; packed
// formats: dlion_kernels/kernels/layout.py. The launchers are in ops.cu, the one file that
// includes this header
// (nvcc 13 instantiates a __global__ template only in the translation unit that launches it).
//
// local_step and apply walk a list of tensors in one launch: the grid is one CTA per chunk of
// kChunk elements of one tensor; a CTA finds its tensor by binary search in the table's chunk row
// (common.h). Inside a chunk, pass u of kPasses covers kThreads * kVec contiguous elements, each
// thread kVec consecutive ones (one 16-byte fp32 / 8-byte bf16/fp16 access; a misaligned array
// is realigned across the warp, load_shifted), each warp 128 elements = 4 packed words. fp32
// math, one rounding per operation (__fmul_rn etc.).
//
// Both stages are bound by how many bytes each SM keeps in flight, not by arithmetic: a CTA
// issues every load of its chunk first (apply: x, the aggregate words, m and g together), keeps
// the data as stored (bf16/fp16 packed two to a register: twice the bytes per register, so more
// CTAs fit), and only then converts, computes and stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "common.h"

namespace dlion {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int kPasses = 4;
constexpr int64_t kChunk = int64_t{kThreads} * kVec * kPasses;  // 4096 elements per CTA
constexpr int kTallyThreads = 256;
// The average apply decodes up to this many bit planes from words prefetched by the warp and a
// table of D in shared memory; more planes (n >= 256 binary, n >= 128 ternary) decode per thread.
constexpr int kLutPlanes = 8;

enum Decode : int { kVoteBinary = 0, kVoteTernary = 1, kAverageBinary = 2, kAverageTernary = 3 };

namespace detail {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// ----------------------------------------------------------------------------- loads, stores

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

// kVec consecutive elements as fp32, p aligned to kVec * sizeof(T).
__device__ __forceinline__ void load_vec(const float* p, float (&v)[kVec]) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}
__device__ __forceinline__ void load_vec(const __nv_bfloat16* p, float (&v)[kVec]) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
  v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
}
__device__ __forceinline__ void load_vec(const __half* p, float (&v)[kVec]) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&t.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&t.y));
  v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
}

__device__ __forceinline__ void store_vec(float* p, const float (&v)[kVec]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float (&v)[kVec]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]);  // .x (low half) = v[0]
  const __nv_bfloat162 hi = __floats2bfloat162_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                            *reinterpret_cast<const uint32_t*>(&hi));
}
__device__ __forceinline__ void store_vec(__half* p, const float (&v)[kVec]) {
  const __half2 lo = __floats2half2_rn(v[0], v[1]);
  const __half2 hi = __floats2half2_rn(v[2], v[3]);
  *reinterpret_cast<uint2*>(p) = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                                            *reinterpret_cast<const uint32_t*>(&hi));
}

// kVec elements as stored: fp32 in a float4, bf16/fp16 packed two to a 32-bit word (uint2).
// The loads of a chunk land here; conversion to fp32 waits until the arithmetic needs it.
template <typename T>
struct Raw {
  uint2 v;
};
template <>
struct Raw<float> {
  float4 v;
};

__device__ __forceinline__ void load_raw(const float* p, Raw<float>& r) {
  r.v = *reinterpret_cast<const float4*>(p);
}
template <typename T>
__device__ __forceinline__ void load_raw(const T* p, Raw<T>& r) {
  r.v = *reinterpret_cast<const uint2*>(p);
}

__device__ __forceinline__ void unpack(const Raw<float>& r, float (&v)[kVec]) {
  v[0] = r.v.x, v[1] = r.v.y, v[2] = r.v.z, v[3] = r.v.w;
}
__device__ __forceinline__ void unpack(const Raw<__nv_bfloat16>& r, float (&v)[kVec]) {
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.v.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.v.y));
  v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
}
__device__ __forceinline__ void unpack(const Raw<__half>& r, float (&v)[kVec]) {
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&r.v.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&r.v.y));
  v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
}

// Values that came from T (the misaligned and tail loads) back into Raw<T>: exact.
__device__ __forceinline__ void pack(const float (&v)[kVec], Raw<float>& r) {
  r.v = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void pack(const float (&v)[kVec], Raw<__nv_bfloat16>& r) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(v[2], v[3]);
  r.v = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                   *reinterpret_cast<const uint32_t*>(&hi));
}
__device__ __forceinline__ void pack(const float (&v)[kVec], Raw<__half>& r) {
  const __half2 lo = __floats2half2_rn(v[0], v[1]);
  const __half2 hi = __floats2half2_rn(v[2], v[3]);
  r.v = make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                   *reinterpret_cast<const uint32_t*>(&hi));
}

template <typename T>
__device__ __forceinline__ void zero(Raw<T>& r) {
  const float z[kVec] = {0.0f, 0.0f, 0.0f, 0.0f};
  pack(z, r);
}

// ----------------------------------------------------------------------------- the table

// The tensor that owns `chunk`: the last t with chunk_start[t] <= chunk.
__device__ __forceinline__ int find_tensor(const int64_t* __restrict__ starts, int n_tensors,
                                           int64_t chunk) {
  int lo = 0, hi = n_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(starts + mid) <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct Entry {
  const void* a;
  void* b;
  int64_t numel, block, base;  // base: first element of this CTA's chunk
  int t;                       // the tensor's column in the table
};

__device__ __forceinline__ Entry load_entry(const int64_t* __restrict__ table, int n_tensors) {
  const int64_t chunk = blockIdx.x;
  const int t = find_tensor(table + kRowChunk * n_tensors, n_tensors, chunk);
  Entry e;
  e.a = reinterpret_cast<const void*>(__ldg(table + kRowA * n_tensors + t));
  e.b = reinterpret_cast<void*>(__ldg(table + kRowB * n_tensors + t));
  e.numel = __ldg(table + kRowNumel * n_tensors + t);
  e.block = __ldg(table + kRowBlock * n_tensors + t);
  e.base = (chunk - __ldg(table + kRowChunk * n_tensors + t)) * kChunk;
  e.t = t;
  return e;
}

// First element of this thread's kVec elements in pass u.
__device__ __forceinline__ int64_t element_index(int64_t base, int u) {
  return base + int64_t{u} * (kThreads * kVec) + int64_t{threadIdx.x} * kVec;
}

// OR of the kVec-bit nibbles of the 8 lanes that share a packed word, placed at their bit
// position; lanes 0, 8, 16, 24 end with the word of their group.
__device__ __forceinline__ uint32_t gather_word(uint32_t nibble) {
  uint32_t w = nibble << ((threadIdx.x & 7) * kVec);
  w |= __shfl_xor_sync(kFullMask, w, 1);
  w |= __shfl_xor_sync(kFullMask, w, 2);
  w |= __shfl_xor_sync(kFullMask, w, 4);
  return w;
}

}  // namespace detail

using namespace detail;  // NOLINT: helpers of the kernels below

// ----------------------------------------------------------------------------- local_step

// Elements p is off a kVec-element vector boundary (0: aligned). Each array decides for itself,
// so one misaligned array does not take the others off the vector path.
template <typename T>
__device__ __forceinline__ int misalignment(const T* p) {
  return static_cast<int>((reinterpret_cast<uintptr_t>(p) / sizeof(T)) % kVec);
}

// v[j] = w[k + j] of the window w = a ++ b, k = 1..3 (a run-time shift, constant indices).
__device__ __forceinline__ void window(const float (&a)[kVec], const float (&b)[kVec], int k,
                                       float (&v)[kVec]) {
  static_assert(kVec == 4, "window() is written for 4-element groups");
  v[0] = k == 1 ? a[1] : k == 2 ? a[2] : a[3];
  v[1] = k == 1 ? a[2] : k == 2 ? a[3] : b[0];
  v[2] = k == 1 ? a[3] : k == 2 ? b[0] : b[1];
  v[3] = k == 1 ? b[0] : k == 2 ? b[1] : b[2];
}

// A misaligned array (a view at an odd offset: bf16 tensors in a flat buffer, DDP bucket views)
// still moves in vectors, realigned across the warp. Pass u of a warp covers 128 contiguous
// elements, lane l the group [i, i + 4) with i = w + 4 l; with p off by `mis` elements the
// aligned vectors start at s = i + 4 - mis. Lane l loads and stores the aligned vector V_l =
// [s, s + 4): its own last mis elements and lane l + 1's first 4 - mis, moved by one shuffle.
// Lane 0 also loads V_-1 for its head; on stores, lane 0's first 4 - mis and lane 31's last mis
// elements go one by one. A vector is read only if it holds an element of the tensor (an aligned
// 16-byte unit with a byte of the allocation lies inside it) and written only if all four are.
// Every lane of the warp must call these together (mis is the CTA's tensor's, so it is uniform).
template <typename T>
__device__ __forceinline__ void load_shifted(const T* p, int64_t i, int64_t numel, int mis,
                                             float (&v)[kVec]) {
  const int lane = threadIdx.x & 31;
  const int64_t s = i + kVec - mis;
  float cur[kVec], prev[kVec];
  if (s < numel) {
    load_vec(p + s, cur);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) cur[j] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) prev[j] = __shfl_up_sync(kFullMask, cur[j], 1);
  if (lane == 0) {
    if (i - mis < numel) {
      load_vec(p + (i - mis), prev);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) prev[j] = 0.0f;
    }
  }
  window(prev, cur, mis, v);
#pragma unroll
  for (int j = 0; j < kVec; ++j)
    if (i + j >= numel) v[j] = 0.0f;
}

template <typename T>
__device__ __forceinline__ void store_shifted(T* p, int64_t i, int64_t numel, int mis,
                                              const float (&v)[kVec]) {
  const int lane = threadIdx.x & 31;
  const int64_t s = i + kVec - mis;
  float next[kVec], out[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) next[j] = __shfl_down_sync(kFullMask, v[j], 1);
  window(v, next, kVec - mis, out);  // V_l; on lane 31 only out[0 .. mis) are its own
  if (lane != 31 && s + kVec <= numel) {
    store_vec(p + s, out);
  } else {
    const int own = lane == 31 ? mis : kVec;
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (j < own && s + j < numel) p[s + j] = from_float<T>(out[j]);
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (j < kVec - mis && i + j < numel) p[i + j] = from_float<T>(v[j]);
  }
}

// Loads kVec consecutive elements at element i of p (as fp32), zeros past `numel`; `mis`:
// misalignment(p) (0: a full group is one vector access).
template <typename T>
__device__ __forceinline__ void load_group(const T* p, int64_t i, int64_t numel, int mis,
                                           float (&v)[kVec]) {
  if (mis != 0) return load_shifted(p, i, numel, mis, v);
  if (i + kVec <= numel) {
    load_vec(p + i, v);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = i + j < numel ? to_float(p[i + j]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ void store_group(T* p, int64_t i, int64_t numel, int mis,
                                            const float (&v)[kVec]) {
  if (mis != 0) return store_shifted(p, i, numel, mis, v);
  if (i + kVec <= numel) {
    store_vec(p + i, v);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      if (i + j < numel) p[i + j] = from_float<T>(v[j]);
  }
}

// load_group into the stored form: one vector access when aligned and whole.
template <typename T>
__device__ __forceinline__ void load_group_raw(const T* p, int64_t i, int64_t numel, int mis,
                                               Raw<T>& r) {
  if (mis == 0 && i + kVec <= numel) return load_raw(p + i, r);
  float v[kVec];
  load_group(p, i, numel, mis, v);
  pack(v, r);
}

// G: float | __nv_bfloat16 | __half (gradient; null = zeros); momentum is fp32 and only read
// (apply writes it, kernel stages v2).
template <typename G, bool TERNARY>
__global__ void __launch_bounds__(kThreads)
    local_step_kernel(const int64_t* __restrict__ table, int n_tensors,
                      uint32_t* __restrict__ votes, float b1, float omb1) {
  const Entry e = load_entry(table, n_tensors);
  const G* __restrict__ g = static_cast<const G*>(e.a);
  const float* __restrict__ m = static_cast<const float*>(e.b);
  const int mis_m = misalignment(m), mis_g = g != nullptr ? misalignment(g) : 0;

  // Loads of all passes first: kPasses * (16 + 4 * sizeof(G)) bytes in flight per thread, kept
  // as stored (bf16/fp16 gradients packed) until the arithmetic.
  Raw<G> gr[kPasses];
  Raw<float> mr[kPasses];
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const int64_t i = element_index(e.base, u);
    load_group_raw(m, i, e.numel, mis_m, mr[u]);
    if (g != nullptr) {
      load_group_raw(g, i, e.numel, mis_g, gr[u]);
    } else {
      zero(gr[u]);
    }
  }

#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const int64_t i = element_index(e.base, u);
    float gv[kVec], mv[kVec];
    unpack(gr[u], gv);
    unpack(mr[u], mv);
    uint32_t pos = 0, neg = 0;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float c = __fadd_rn(__fmul_rn(b1, mv[j]), __fmul_rn(omb1, gv[j]));
      pos |= static_cast<uint32_t>(c > 0.0f) << j;
      if constexpr (TERNARY) neg |= static_cast<uint32_t>(c < 0.0f) << j;
    }
    const int64_t left = e.numel - i;  // elements of this thread's kVec inside the tensor
    const uint32_t valid = left >= kVec ? 0xFu : (left > 0 ? (1u << left) - 1u : 0u);
    pos = gather_word(pos & valid);
    if constexpr (TERNARY) neg = gather_word(neg & valid);
    if ((threadIdx.x & 7) == 0 && i < e.numel) {
      const int64_t word = e.block + i / kBlock;
      if constexpr (TERNARY) {
        votes[2 * word] = pos;
        votes[2 * word + 1] = neg;
      } else {
        votes[word] = pos;
      }
    }
  }
}

// ----------------------------------------------------------------------------- apply

// D of element j (0..3 of this thread's group) from the words of its block: vote kinds.
template <int KIND>
__device__ __forceinline__ void decode_vote(uint32_t w0, uint32_t w1, int shift,
                                            float (&d)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    if constexpr (KIND == kVoteBinary) {
      d[j] = ((w0 >> (shift + j)) & 1u) ? 1.0f : -1.0f;
    } else {
      d[j] = __int2float_rn(static_cast<int>((w0 >> (shift + j)) & 1u) -
                            static_cast<int>((w1 >> (shift + j)) & 1u));
    }
  }
}

// D = (2q - n) / n (average/binary) or (q - n) / n (average/ternary) for a count q, rounded once.
template <int KIND>
__device__ __forceinline__ float average_d(int q, int n, float nf) {
  const int num = KIND == kAverageBinary ? 2 * q - n : q - n;
  return __fdiv_rn(__int2float_rn(num), nf);
}

// P: float | __nv_bfloat16 | __half (parameter); G: P or float (gradient; null = zeros); KIND:
// Decode. x = x - lr * (D + wd * x) and m = b2*m + omb2*g, unless *skip != 0 (then nothing).
// A null momentum (table row b = 0): x only, neither m nor g is touched.
//
// Every load of the chunk is issued before any arithmetic: x, the aggregate words, m and g,
// kPasses * kVec * (sizeof(P) + 4 + sizeof(G)) bytes in flight per thread. The average kinds
// with at most kLutPlanes planes do not load their words per thread: a warp's pass covers 4
// whole blocks, whose 4 * planes words are contiguous, so lane l loads word l of them (one
// coalesced access) and each lane takes the words of its block by shuffles; D(q) for every
// q < 2^planes is a table in shared memory, computed once per CTA (one division per entry
// instead of one per element).
template <typename P, typename G, int KIND>
__global__ void __launch_bounds__(kThreads)
    apply_kernel(const int64_t* __restrict__ table, int n_tensors,
                 const uint32_t* __restrict__ aggregate, int planes, float lr, float wd, int n,
                 float nf, float b2, float omb2, const int32_t* __restrict__ skip) {
  constexpr bool kAverage = KIND == kAverageBinary || KIND == kAverageTernary;
  __shared__ float lut[kAverage ? (1 << kLutPlanes) : 1];
  // The flag of a step dropped after the exchange, read on the device (no host sync). It is
  // tested once the chunk's loads are issued, so that its latency is not paid before them
  // (reading is harmless; nothing is written when it is set).
  const int32_t skipped = skip != nullptr ? __ldg(skip) : 0;
  const bool lut_decode = kAverage && planes <= kLutPlanes;
  const Entry e = load_entry(table, n_tensors);
  P* __restrict__ x = static_cast<P*>(const_cast<void*>(e.a));
  float* __restrict__ m = static_cast<float*>(e.b);
  const G* __restrict__ g = reinterpret_cast<const G*>(
      __ldg(table + kRowC * n_tensors + e.t));
  const int mis_x = misalignment(x), mis_m = misalignment(m);
  const int mis_g = g != nullptr ? misalignment(g) : 0;
  const int lane = threadIdx.x & 31;

  Raw<P> xr[kPasses];
  Raw<float> mr[kPasses];
  Raw<G> gr[kPasses];
  uint32_t w0[kPasses], w1[kPasses];
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const int64_t i = element_index(e.base, u);
    load_group_raw(x, i, e.numel, mis_x, xr[u]);
    if (m != nullptr) {  // the same for the whole CTA: one tensor per chunk
      load_group_raw(m, i, e.numel, mis_m, mr[u]);
      if (g != nullptr) {
        load_group_raw(g, i, e.numel, mis_g, gr[u]);
      } else {
        zero(gr[u]);
      }
    }
    w0[u] = w1[u] = 0;
    if constexpr (!kAverage) {
      if (i < e.numel) {
        const int64_t word = (e.block + i / kBlock) * planes;
        w0[u] = __ldg(aggregate + word);
        if constexpr (KIND == kVoteTernary) w1[u] = __ldg(aggregate + word + 1);
      }
    } else if (lut_decode) {
      const int64_t first = i - 4 * lane;  // the warp's first element in this pass
      const int64_t blocks = (e.numel - first + kBlock - 1) / kBlock;  // of its 4, in the tensor
      if (lane < 4 * planes && lane < blocks * planes)
        w0[u] = __ldg(aggregate + (e.block + first / kBlock) * planes + lane);
    }
  }
  if constexpr (kAverage) {
    if (lut_decode) {  // D of every count, while the loads are in flight
      for (int q = threadIdx.x; q < (1 << planes); q += kThreads)
        lut[q] = average_d<KIND>(q, n, nf);
      __syncthreads();
    }
  }
  if (skipped != 0) return;  // the same for the whole grid

#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const int64_t i = element_index(e.base, u);
    const int shift = static_cast<int>(i % kBlock);
    float d[kVec];
    if constexpr (!kAverage) {
      decode_vote<KIND>(w0[u], w1[u], shift, d);
    } else if (lut_decode) {
      int q[kVec] = {0, 0, 0, 0};
      const int src = (lane >> 3) * planes;  // lane holding plane 0 of this lane's block
      for (int p = 0; p < planes; ++p) {
        const uint32_t w = __shfl_sync(kFullMask, w0[u], src + p);
#pragma unroll
        for (int j = 0; j < kVec; ++j) q[j] |= static_cast<int>((w >> (shift + j)) & 1u) << p;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) d[j] = lut[q[j]];
    } else {
      int q[kVec] = {0, 0, 0, 0};
      if (i < e.numel) {
        const uint32_t* words = aggregate + (e.block + i / kBlock) * planes;
        for (int p = 0; p < planes; ++p) {
          const uint32_t w = __ldg(words + p);
#pragma unroll
          for (int j = 0; j < kVec; ++j) q[j] |= static_cast<int>((w >> (shift + j)) & 1u) << p;
        }
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) d[j] = average_d<KIND>(q[j], n, nf);
    }
    float xv[kVec];
    unpack(xr[u], xv);
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      xv[j] = __fsub_rn(xv[j], __fmul_rn(lr, __fadd_rn(d[j], __fmul_rn(wd, xv[j]))));
    store_group(x, i, e.numel, mis_x, xv);
  }

  if (m == nullptr) return;
#pragma unroll
  for (int u = 0; u < kPasses; ++u) {
    const int64_t i = element_index(e.base, u);
    float mv[kVec], gv[kVec];
    unpack(mr[u], mv);
    unpack(gr[u], gv);
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      mv[j] = __fadd_rn(__fmul_rn(b2, mv[j]), __fmul_rn(omb2, gv[j]));
    store_group(m, i, e.numel, mis_m, mv);
  }
}

// ----------------------------------------------------------------------------- tally

template <int PLANES>
__device__ __forceinline__ void add_bits(uint32_t (&cnt)[PLANES], uint32_t x) {
  uint32_t carry = x;
#pragma unroll
  for (int p = 0; p < PLANES; ++p) {
    const uint32_t next = cnt[p] & carry;
    cnt[p] ^= carry;
    carry = next;
  }
}

// Bits where the bit-sliced count is > k (gt) and == k (eq).
template <int PLANES>
__device__ __forceinline__ void compare_const(const uint32_t (&cnt)[PLANES], int k, uint32_t& gt,
                                              uint32_t& eq) {
  gt = 0;
  eq = ~0u;
#pragma unroll
  for (int p = PLANES - 1; p >= 0; --p) {
    if ((k >> p) & 1) {
      eq &= cnt[p];
    } else {
      gt |= eq & cnt[p];
      eq &= ~cnt[p];
    }
  }
}

// Carry-save adder: (high, low) = the two bits of a + b + c.
__device__ __forceinline__ void csa(uint32_t& high, uint32_t& low, uint32_t a, uint32_t b,
                                    uint32_t c) {
  const uint32_t u = a ^ b;
  high = (a & b) | (u & c);
  low = u ^ c;
}

// Adds 8 bit vectors with a Harley-Seal tree of carry-save adders (7 CSAs, then one ripple of
// the eights from plane 3) instead of 8 ripples through all planes. PLANES >= 4.
template <int PLANES>
__device__ __forceinline__ void add_8_bits(uint32_t (&cnt)[PLANES], const uint32_t (&a)[8]) {
  uint32_t twos_a, twos_b, fours_a, fours_b, eights;
  csa(twos_a, cnt[0], cnt[0], a[0], a[1]);
  csa(twos_b, cnt[0], cnt[0], a[2], a[3]);
  csa(fours_a, cnt[1], cnt[1], twos_a, twos_b);
  csa(twos_a, cnt[0], cnt[0], a[4], a[5]);
  csa(twos_b, cnt[0], cnt[0], a[6], a[7]);
  csa(fours_b, cnt[1], cnt[1], twos_a, twos_b);
  csa(eights, cnt[2], cnt[2], fours_a, fours_b);
  uint32_t carry = eights;
#pragma unroll
  for (int p = 3; p < PLANES; ++p) {
    const uint32_t next = cnt[p] & carry;
    cnt[p] ^= carry;
    carry = next;
  }
}

// One thread per block (column of `stacked`), PLANES bit-sliced counters per thread. `tie`: the
// bits that win a binary tie with even n, or taken from the device counter `step` when given.
// Ternary counts q = #plus + #(not minus) = #plus - #minus + n over the 2n bit vectors. The CTA walks
// tiles of kTallyThreads consecutive blocks (the loop bounds are the same for all its threads, so
// __syncthreads is safe in it). Average mode writes out_planes words per block: they go through
// shared memory so that consecutive threads store consecutive words (coalesced), instead of each
// thread storing out_planes words out_planes apart.
template <int PLANES, bool TERNARY>
__global__ void __launch_bounds__(kTallyThreads)
    tally_kernel(const uint32_t* __restrict__ stacked, int64_t row_words, int n, int64_t blocks,
                 uint32_t* __restrict__ out, bool average, int out_planes, uint32_t tie,
                 const int64_t* __restrict__ step) {
  constexpr int kGroupRows = TERNARY ? 4 : 8;  // rows per 8 bit vectors
  // The step counter on the device (a step captured in a CUDA graph): its parity picks the tie
  // pattern (layout.py tie_pattern: even 0x55555555, odd 0xAAAAAAAA).
  if constexpr (!TERNARY) {
    if (step != nullptr) tie = (__ldg(step) & 1) ? 0xAAAAAAAAu : 0x55555555u;
  }
  __shared__ uint32_t staged[kTallyThreads * PLANES];
  const int64_t stride = int64_t{gridDim.x} * kTallyThreads;
  for (int64_t b0 = int64_t{blockIdx.x} * kTallyThreads; b0 < blocks; b0 += stride) {
    const int64_t b = b0 + threadIdx.x;
    const bool active = b < blocks;
    uint32_t cnt[PLANES];
#pragma unroll
    for (int p = 0; p < PLANES; ++p) cnt[p] = 0;
    if (active) {
      const uint32_t* col = stacked + (TERNARY ? 2 * b : b);
      int i = 0;
      if constexpr (PLANES >= 4) {
        for (; i + kGroupRows <= n; i += kGroupRows) {
          uint32_t a[8];
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            if constexpr (TERNARY) {
              const uint32_t w = __ldg(col + (i + k / 2) * row_words + (k % 2));
              a[k] = (k % 2) ? ~w : w;
            } else {
              a[k] = __ldg(col + (i + k) * row_words);
            }
          }
          add_8_bits(cnt, a);
        }
      }
#pragma unroll 4
      for (; i < n; ++i) {
        const uint32_t* row = col + i * row_words;
        if constexpr (TERNARY) {
          const uint32_t plus = __ldg(row), minus = __ldg(row + 1);
          add_bits(cnt, plus);
          add_bits(cnt, ~minus);
        } else {
          add_bits(cnt, __ldg(row));
        }
      }
    }
    if (average) {
#pragma unroll
      for (int p = 0; p < PLANES; ++p)
        if (p < out_planes) staged[threadIdx.x * out_planes + p] = cnt[p];
      __syncthreads();
      const int64_t tile = blocks - b0 < kTallyThreads ? blocks - b0 : kTallyThreads;
      const int words = static_cast<int>(tile) * out_planes;
      for (int k = threadIdx.x; k < words; k += kTallyThreads) out[b0 * out_planes + k] = staged[k];
      __syncthreads();  // the next tile overwrites `staged`
    } else if (!active) {
      continue;
    } else if constexpr (TERNARY) {  // pos: q > n, neg: q < n
      uint32_t gt, eq;
      compare_const(cnt, n, gt, eq);
      out[2 * b] = gt;
      out[2 * b + 1] = ~(gt | eq);
    } else {  // +1 where 2k > n; a tie (2k == n, n even) takes the tie pattern
      uint32_t gt, eq;
      compare_const(cnt, n / 2, gt, eq);
      out[b] = gt | (eq & ((n % 2 == 0) ? tie : 0u));
    }
  }
}

}  // namespace cuda
}  // namespace dlion
