// AccumAdamW and AccumLion on CUDA (semantics and operation order: kernels/accum.py). One launch
// covers every tensor of the accum table (csrc/accum_common.h): one CTA per chunk of kChunk
// elements of one tensor, found by binary search in the table's chunk row; threads stride by
// kThreads inside the chunk (coalesced). Built with --fmad=false and IEEE division and sqrt (no
// fast math): one rounding per operation, as the reference. x is read from the table's y row (x
// itself, or a source apart from every written tensor: the fused mixing, accum.py), written to x.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/accum_ops.h"

namespace dlion {
namespace {

using accum::AdamWArgs;
using accum::LionArgs;

constexpr int kThreads = 256;
constexpr int kPerThread = 16;
constexpr int64_t kChunk = int64_t{kThreads} * kPerThread;  // 4096 elements per CTA

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float ld(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(__half* p, float v) { *p = __float2half_rn(v); }

// The tensor of chunk c: the last t with table[kChunk row][t] <= c.
__device__ __forceinline__ int find_tensor(const int64_t* table, int n, int64_t c) {
  const int64_t* first = table + accum::kChunk * n;
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T, bool K1, bool FLUSH>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const int64_t* __restrict__ table, int n, AdamWArgs s) {
  const int64_t c = blockIdx.x;
  const int t = find_tensor(table, n, c);
  T* x = reinterpret_cast<T*>(table[accum::kX * n + t]);
  const T* y = reinterpret_cast<const T*>(table[accum::kY * n + t]);  // x is read from y
  const T* g = reinterpret_cast<const T*>(table[accum::kG * n + t]);
  float* a = reinterpret_cast<float*>(table[accum::kA * n + t]);
  float* m = reinterpret_cast<float*>(table[accum::kM * n + t]);
  float* v = reinterpret_cast<float*>(table[accum::kV * n + t]);
  const int64_t numel = table[accum::kNumel * n + t];
  const int64_t begin = (c - table[accum::kChunk * n + t]) * kChunk;
  const int64_t end = min(numel, begin + kChunk);
#pragma unroll 4
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float gj = ld(g + i);
    float xj = ld(y + i) * s.decay;
    float aj = 0.0f;
    if (!K1) {
      aj = a[i] + gj * s.inv_k;
      a[i] = FLUSH ? 0.0f : aj;
    }
    const float mj = m[i], vj = v[i];
    const float mt = mj + s.omb1 * gj;
    const float vt = vj + s.omb2 * (gj * gj);
    xj = xj - s.step_size * (mt / (sqrtf(vt) / s.bc2_sqrt + s.eps));
    st(x + i, xj);
    if (FLUSH) {
      const float src = K1 ? gj : aj;
      m[i] = s.b1 * (mj + s.omb1 * src);
      v[i] = s.b2 * (vj + s.omb2 * (src * src));
    }
  }
}

template <typename T, bool K1, bool FLUSH>
__global__ void __launch_bounds__(kThreads)
    lion_kernel(const int64_t* __restrict__ table, int n, LionArgs s) {
  const int64_t c = blockIdx.x;
  const int t = find_tensor(table, n, c);
  T* x = reinterpret_cast<T*>(table[accum::kX * n + t]);
  const T* y = reinterpret_cast<const T*>(table[accum::kY * n + t]);  // x is read from y
  const T* g = reinterpret_cast<const T*>(table[accum::kG * n + t]);
  float* a = reinterpret_cast<float*>(table[accum::kA * n + t]);
  float* m = reinterpret_cast<float*>(table[accum::kM * n + t]);
  const int64_t numel = table[accum::kNumel * n + t];
  const int64_t begin = (c - table[accum::kChunk * n + t]) * kChunk;
  const int64_t end = min(numel, begin + kChunk);
#pragma unroll 4
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float gj = ld(g + i);
    const float mj = m[i];
    const float cj = s.b1 * mj + s.omb1 * gj;
    const float sign = (cj > 0.0f ? 1.0f : 0.0f) - (cj < 0.0f ? 1.0f : 0.0f);
    const float xj = ld(y + i);
    st(x + i, xj - s.lr * (sign + s.wd * xj));
    float aj = 0.0f;
    if (!K1) {
      aj = a[i] + gj * s.inv_k;
      a[i] = FLUSH ? 0.0f : aj;
    }
    if (FLUSH) m[i] = s.b2 * mj + s.omb2 * (K1 ? gj : aj);
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("dlion_kernels: ") + what + ": " +
                             cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
}

struct Device {
  explicit Device(int device) {
    check(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device) check(cudaSetDevice(device), "cudaSetDevice");
    else previous = -1;
  }
  ~Device() {
    if (previous >= 0) cudaSetDevice(previous);
  }
  int previous = -1;
};

template <typename T>
void adamw_typed(const int64_t* table, int n, int64_t chunks, const AdamWArgs& s,
                 cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(chunks));
  if (s.k1) {
    if (s.flush) adamw_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(table, n, s);
    else adamw_kernel<T, true, false><<<grid, kThreads, 0, stream>>>(table, n, s);
  } else {
    if (s.flush) adamw_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(table, n, s);
    else adamw_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(table, n, s);
  }
}

template <typename T>
void lion_typed(const int64_t* table, int n, int64_t chunks, const LionArgs& s,
                cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(chunks));
  if (s.k1) {
    if (s.flush) lion_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(table, n, s);
    else lion_kernel<T, true, false><<<grid, kThreads, 0, stream>>>(table, n, s);
  } else {
    if (s.flush) lion_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(table, n, s);
    else lion_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(table, n, s);
  }
}

void check_sizes(int64_t n_tensors, int64_t n_chunks) {
  if (n_tensors > 0x7FFFFFFF || n_chunks > 0x7FFFFFFF)
    throw std::invalid_argument("dlion_kernels: accum step: too many tensors or elements");
}

}  // namespace

int64_t cuda_accum_chunk_elems() { return kChunk; }

void cuda_accum_adamw(int64_t table, int64_t n_tensors, int64_t n_chunks, DType dtype,
                      const AdamWArgs& args, int device, int64_t stream) {
  check_sizes(n_tensors, n_chunks);
  if (n_chunks == 0) return;
  Device guard(device);
  const auto* t = reinterpret_cast<const int64_t*>(static_cast<uintptr_t>(table));
  auto s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
  const int n = static_cast<int>(n_tensors);
  switch (dtype) {
    case DType::kFloat32: adamw_typed<float>(t, n, n_chunks, args, s); break;
    case DType::kBFloat16: adamw_typed<__nv_bfloat16>(t, n, n_chunks, args, s); break;
    case DType::kFloat16: adamw_typed<__half>(t, n, n_chunks, args, s); break;
    default: throw std::invalid_argument("dlion_kernels: unknown parameter dtype code");
  }
  check(cudaGetLastError(), "accum_adamw launch");
}

void cuda_accum_lion(int64_t table, int64_t n_tensors, int64_t n_chunks, DType dtype,
                     const LionArgs& args, int device, int64_t stream) {
  check_sizes(n_tensors, n_chunks);
  if (n_chunks == 0) return;
  Device guard(device);
  const auto* t = reinterpret_cast<const int64_t*>(static_cast<uintptr_t>(table));
  auto s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
  const int n = static_cast<int>(n_tensors);
  switch (dtype) {
    case DType::kFloat32: lion_typed<float>(t, n, n_chunks, args, s); break;
    case DType::kBFloat16: lion_typed<__nv_bfloat16>(t, n, n_chunks, args, s); break;
    case DType::kFloat16: lion_typed<__half>(t, n, n_chunks, args, s); break;
    default: throw std::invalid_argument("dlion_kernels: unknown parameter dtype code");
  }
  check(cudaGetLastError(), "accum_lion launch");
}

}  // namespace dlion
