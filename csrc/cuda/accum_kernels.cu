// AccumAdamW and AccumLion on CUDA (semantics and operation order: kernels/accum.py). One launch
// covers every tensor of the accum table (csrc/accum_common.h): one CTA per chunk of kChunk
// elements of one tensor, found by binary search in the table's chunk row; threads stride by
// kThreads inside the chunk (coalesced), all loads first (accum_kernel). Built with --fmad=false
// and IEEE division and sqrt (no fast math): one rounding per operation, as the reference. x is
// read from the table's y row (x itself, or a source apart from every written tensor: the fused
// mixing, accum.py), written to x.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "accum_step.h"
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

// One tensor's elements in this CTA's chunk, with the table's rows at that tensor.
template <typename T>
struct Slice {
  T* x;
  const T* y;  // x is read from y (x itself, or the fused mixing's source)
  const T* g;
  float *a, *m, *v;  // v: 0 for AccumLion
  int64_t begin, end;
};

template <typename T>
__device__ __forceinline__ Slice<T> load_slice(const int64_t* table, int n) {
  const int64_t c = blockIdx.x;
  const int t = find_tensor(table, n, c);
  const int64_t* col = table + t;  // row r of this tensor: col[r * n]
  Slice<T> e;
  e.x = reinterpret_cast<T*>(col[accum::kX * n]);
  e.y = reinterpret_cast<const T*>(col[accum::kY * n]);
  e.g = reinterpret_cast<const T*>(col[accum::kG * n]);
  e.a = reinterpret_cast<float*>(col[accum::kA * n]);
  e.m = reinterpret_cast<float*>(col[accum::kM * n]);
  e.v = reinterpret_cast<float*>(col[accum::kV * n]);
  e.begin = (c - col[accum::kChunk * n]) * kChunk;
  e.end = min(col[accum::kNumel * n], e.begin + kChunk);
  return e;
}

// The optimizers' element step (accum::AdamW, accum::Lion), shared with the CPU kernels:
// csrc/accum_step.h.
using accum::AdamW;
using accum::Lion;

// Every load of the thread's kPerThread elements (strided by kThreads: coalesced) is issued before
// any arithmetic or store, so that a CTA keeps its whole chunk in flight: stores to a, m and v
// may alias later loads as far as the compiler knows, so a loop that loads, computes and stores
// one element at a time waits a memory latency per element. The element step then works on the
// registers (i = 0 of one-element arrays) and the results are stored.
template <typename Op, typename T, bool K1, bool FLUSH>
__global__ void __launch_bounds__(kThreads)
    accum_kernel(const int64_t* __restrict__ table, int n, typename Op::Args s) {
  const Slice<T> e = load_slice<T>(table, n);
  float xv[kPerThread], gv[kPerThread], av[kPerThread], mv[kPerThread], vv[kPerThread];
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = e.begin + threadIdx.x + int64_t{k} * kThreads;
    xv[k] = gv[k] = av[k] = mv[k] = vv[k] = 0.0f;
    if (i < e.end) {
      xv[k] = ld(e.y + i);
      gv[k] = ld(e.g + i);
      if (!K1) av[k] = e.a[i];
      mv[k] = e.m[i];
      if (Op::kSecondMoment) vv[k] = e.v[i];
    }
  }
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = e.begin + threadIdx.x + int64_t{k} * kThreads;
    if (i < e.end) {
      st(e.x + i, Op::template element<K1, FLUSH>(xv[k], gv[k], av + k, mv + k, vv + k, 0, s));
      if (!K1) e.a[i] = av[k];
      if (FLUSH) {
        e.m[i] = mv[k];
        if (Op::kSecondMoment) e.v[i] = vv[k];
      }
    }
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

template <typename Op, typename T>
void launch(const int64_t* table, int n, int64_t chunks, const typename Op::Args& s,
            cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(chunks));
  if (s.k1) {
    if (s.flush) accum_kernel<Op, T, true, true><<<grid, kThreads, 0, stream>>>(table, n, s);
    else accum_kernel<Op, T, true, false><<<grid, kThreads, 0, stream>>>(table, n, s);
  } else {
    if (s.flush) accum_kernel<Op, T, false, true><<<grid, kThreads, 0, stream>>>(table, n, s);
    else accum_kernel<Op, T, false, false><<<grid, kThreads, 0, stream>>>(table, n, s);
  }
}

void check_sizes(int64_t n_tensors, int64_t n_chunks) {
  if (n_tensors > 0x7FFFFFFF || n_chunks > 0x7FFFFFFF)
    throw std::invalid_argument("dlion_kernels: accum step: too many tensors or elements");
}

template <typename Op>
void run(const char* what, int64_t table, int64_t n_tensors, int64_t n_chunks, DType dtype,
         const typename Op::Args& args, int device, int64_t stream) {
  check_sizes(n_tensors, n_chunks);
  if (n_chunks == 0) return;
  Device guard(device);
  const auto* t = reinterpret_cast<const int64_t*>(static_cast<uintptr_t>(table));
  auto s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream));
  const int n = static_cast<int>(n_tensors);
  switch (dtype) {
    case DType::kFloat32: launch<Op, float>(t, n, n_chunks, args, s); break;
    case DType::kBFloat16: launch<Op, __nv_bfloat16>(t, n, n_chunks, args, s); break;
    case DType::kFloat16: launch<Op, __half>(t, n, n_chunks, args, s); break;
    default: throw std::invalid_argument("dlion_kernels: unknown parameter dtype code");
  }
  check(cudaGetLastError(), what);
}

}  // namespace

int64_t cuda_accum_chunk_elems() { return kChunk; }

void cuda_accum_adamw(int64_t table, int64_t n_tensors, int64_t n_chunks, DType dtype,
                      const AdamWArgs& args, int device, int64_t stream) {
  run<AdamW>("accum_adamw launch", table, n_tensors, n_chunks, dtype, args, device, stream);
}

void cuda_accum_lion(int64_t table, int64_t n_tensors, int64_t n_chunks, DType dtype,
                     const LionArgs& args, int device, int64_t stream) {
  run<Lion>("accum_lion launch", table, n_tensors, n_chunks, dtype, args, device, stream);
}

}  // namespace dlion
