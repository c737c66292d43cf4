// The C entry points of the emulated CUDA build (ctypes; python_tests/kernels/
// test_cuda_emulated.py): the launchers of csrc/cuda/ops.cu and csrc/cuda/accum_kernels.cu,
// compiled for the host with cuda_emu.h, on host memory; the emulation's own checks (self-test
// kernels that must work, and kernels that must fault); and the bf16/fp16 conversions, compared
// with torch's by the test.
//
// Every entry point returns 0, or 1 (std::runtime_error, e.g. a faulted launch) or 2
// (std::invalid_argument) with the message in `err`.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "common.h"
#include "cuda/accum_ops.h"
#include "cuda/ops.h"

namespace {

template <typename F>
int guarded(char* err, std::size_t errlen, F&& f) {
  int code = 0;
  std::string what;
  try {
    f();
  } catch (const std::invalid_argument& e) {
    code = 2, what = e.what();
  } catch (const std::exception& e) {
    code = 1, what = e.what();
  }
  if (code != 0 && errlen > 0) {
    std::strncpy(err, what.c_str(), errlen - 1);
    err[errlen - 1] = '\0';
  }
  return code;
}

dlion::DType dtype(int code) { return static_cast<dlion::DType>(code); }

// ----------------------------------------------------------------------------- self tests

constexpr unsigned kFull = 0xFFFFFFFFu;

// Warp calls: out holds 7 int32 per thread.
__global__ void warp_calls_kernel(int* out) {
  const int t = threadIdx.x, lane = t % 32;
  const int v = 1000 * static_cast<int>(blockIdx.x) + t;
  int* o = out + 7 * (static_cast<int>(blockIdx.x) * blockDim.x + t);
  o[0] = __shfl_xor_sync(kFull, v, 1);
  o[1] = __shfl_xor_sync(kFull, v, 18);
  o[2] = __shfl_sync(kFull, v, 7);
  o[3] = __shfl_down_sync(kFull, v, 3);
  o[4] = __shfl_up_sync(kFull, v, 5);
  o[5] = static_cast<int>(__ballot_sync(kFull, lane % 3 == 0 || t == 40));
  __syncwarp();
  o[6] = __all_sync(kFull, v >= 0) + 2 * __any_sync(kFull, lane == 31);
}

// A block barrier: out[b * blockDim + t] = in of thread blockDim - 1 - t, through shared memory.
__global__ void reverse_kernel(const int* in, int* out) {
  __shared__ int s[1024];
  const int n = blockDim.x, b = blockIdx.x, t = threadIdx.x;
  s[t] = in[b * n + t];
  __syncthreads();
  const int r = s[n - 1 - t];
  __syncthreads();  // s is rewritten below
  s[t] = r * 2;
  __syncthreads();
  out[b * n + t] = s[t] / 2;
}

__global__ void divergent_syncthreads_kernel(int* out) {
  if (threadIdx.x < 100) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void exited_lanes_kernel(int* out) {
  if (threadIdx.x % 32 < 16) return;
  out[threadIdx.x] = __shfl_xor_sync(kFull, static_cast<int>(threadIdx.x), 1);
}

__global__ void partial_mask_kernel(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0x0000FFFFu, static_cast<int>(threadIdx.x), 1);
}

__global__ void misaligned_vector_kernel(const float* in, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(in + 1 + 4 * threadIdx.x);
  out[threadIdx.x] = v.x;
}

__global__ void different_barriers_kernel(int* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = __shfl_xor_sync(kFull, 1, 1);
  } else {
    __syncthreads();
  }
}

__global__ void mixed_warp_calls_kernel(int* out) {
  if (threadIdx.x % 2) {
    out[threadIdx.x] = __shfl_xor_sync(kFull, 1, 1);
  } else {
    out[threadIdx.x] = static_cast<int>(__ballot_sync(kFull, 1));
  }
}

}  // namespace

extern "C" {

// 0: warp calls (grid 2 x 64 threads, out 7 * 128 ints); 1: shared-memory reverse (grid 3 x 256,
// in and out 768 ints); 2-7: kernels that must fault (out 256 ints, `in` 1040 floats for 5).
int emu_selftest(int which, void* in, void* out, char* err, std::size_t errlen) {
  return guarded(err, errlen, [&] {
    int* o = static_cast<int*>(out);
    switch (which) {
      case 0: warp_calls_kernel ^ emu::Config(2, 64) ^ emu::Args(o); break;
      case 1:
        reverse_kernel ^ emu::Config(3, 256) ^ emu::Args(static_cast<const int*>(in), o);
        break;
      case 2: divergent_syncthreads_kernel ^ emu::Config(1, 256) ^ emu::Args(o); break;
      case 3: exited_lanes_kernel ^ emu::Config(1, 64) ^ emu::Args(o); break;
      case 4: partial_mask_kernel ^ emu::Config(1, 32) ^ emu::Args(o); break;
      case 5:
        misaligned_vector_kernel ^ emu::Config(1, 256) ^
            emu::Args(static_cast<const float*>(in), reinterpret_cast<float*>(o));
        break;
      case 6: different_barriers_kernel ^ emu::Config(1, 64) ^ emu::Args(o); break;
      case 7: mixed_warp_calls_kernel ^ emu::Config(1, 32) ^ emu::Args(o); break;
      default: throw std::invalid_argument("no such self test");
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
  });
}

void emu_set_max_grid(unsigned g) { emu::Executor::get().set_max_grid(g); }
void emu_set_os_threads(int on) { emu::Executor::get().set_os_threads(on != 0); }

void emu_f32_to_bf16(const float* in, std::uint16_t* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(in[i]).bits;
}
void emu_f32_to_f16(const float* in, std::uint16_t* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = __float2half_rn(in[i]).bits;
}
void emu_f16_to_f32(const std::uint16_t* in, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = __half2float(__half{in[i]});
}
void emu_bf16_to_f32(const std::uint16_t* in, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = __bfloat162float(__nv_bfloat16{in[i]});
}

// ----------------------------------------------------------------------------- the launchers

std::int64_t emu_cuda_chunk_elems() { return dlion::cuda_chunk_elems(); }
std::int64_t emu_cuda_accum_chunk_elems() { return dlion::cuda_accum_chunk_elems(); }

int emu_cuda_runtime_problem(char* out, std::size_t len) {
  const std::string p = dlion::cuda_runtime_problem();
  std::strncpy(out, p.c_str(), len - 1);
  out[len - 1] = '\0';
  return p.empty() ? 0 : 1;
}

int emu_cuda_local_step(std::int64_t table, std::int64_t n_tensors, std::int64_t n_chunks,
                        int g_dtype, std::int64_t votes, float b1, float omb1, int ternary,
                        int device, std::int64_t stream, char* err, std::size_t errlen) {
  return guarded(err, errlen, [&] {
    dlion::cuda_local_step(table, n_tensors, n_chunks, dtype(g_dtype), votes, b1, omb1,
                           ternary != 0, device, stream);
  });
}

int emu_cuda_tally(std::int64_t stacked, std::int64_t row_words, std::int64_t n,
                   std::int64_t blocks, std::int64_t out, int average, int ternary,
                   std::uint32_t tie, std::int64_t step, int device, std::int64_t stream,
                   char* err, std::size_t errlen) {
  return guarded(err, errlen, [&] {
    dlion::cuda_tally(stacked, row_words, n, blocks, out, average != 0, ternary != 0, tie, step,
                      device, stream);
  });
}

int emu_cuda_apply(std::int64_t table, std::int64_t n_tensors, std::int64_t n_chunks, int p_dtype,
                   int g_dtype, std::int64_t aggregate, float lr, float wd, float b2, float omb2,
                   std::int64_t n, int average, int ternary, std::int64_t skip, int device,
                   std::int64_t stream, char* err, std::size_t errlen) {
  return guarded(err, errlen, [&] {
    dlion::cuda_apply(table, n_tensors, n_chunks, dtype(p_dtype), dtype(g_dtype), aggregate, lr,
                      wd, b2, omb2, n, average != 0, ternary != 0, skip, device, stream);
  });
}

// s: decay, inv_k, b1, omb1, b2, omb2, step_size, bc2_sqrt, eps (kernels/accum.py ADAMW_SCALARS).
int emu_cuda_accum_adamw(std::int64_t table, std::int64_t n_tensors, std::int64_t n_chunks,
                         int dt, const float* s, int k1, int flush, int device,
                         std::int64_t stream, char* err, std::size_t errlen) {
  return guarded(err, errlen, [&] {
    const dlion::accum::AdamWArgs a{s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8],
                                    k1 != 0, flush != 0};
    dlion::cuda_accum_adamw(table, n_tensors, n_chunks, dtype(dt), a, device, stream);
  });
}

// s: lr, wd, inv_k, b1, omb1, b2, omb2 (kernels/accum.py LION_SCALARS).
int emu_cuda_accum_lion(std::int64_t table, std::int64_t n_tensors, std::int64_t n_chunks, int dt,
                        const float* s, int k1, int flush, int device, std::int64_t stream,
                        char* err, std::size_t errlen) {
  return guarded(err, errlen, [&] {
    const dlion::accum::LionArgs a{s[0], s[1], s[2], s[3], s[4], s[5], s[6], k1 != 0, flush != 0};
    dlion::cuda_accum_lion(table, n_tensors, n_chunks, dtype(dt), a, device, stream);
  });
}

}  // extern "C"
