// Host launchers: argument checks, dtype / mode dispatch, one launch per stage, error checks.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common.h"
#include "cuda/kernels.cuh"
#include "cuda/ops.h"

namespace dlion {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a sticky-free error so the next call starts clean
    throw std::runtime_error(std::string("dlion_kernels: ") + what + ": " +
                             cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
}

void check_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

// Makes `device` current for the launch and restores the previous device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
    } else {
      previous_ = -1;
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

void check_grid(int64_t n_chunks, const char* what) {
  if (n_chunks > 0x7FFFFFFF)
    throw std::invalid_argument(std::string("dlion_kernels: ") + what + ": too many elements");
}

void check_n(int64_t n) {
  if (n < 1 || n > kMaxVoters)
    throw std::invalid_argument("dlion_kernels: n (the number of vote vectors) must be in "
                                "[1, 32767], got " + std::to_string(n));
}

template <typename G>
void launch_local_step(dim3 grid, cudaStream_t s, const int64_t* table, int n_tensors,
                       uint32_t* votes, float b1, float omb1, bool ternary) {
  if (ternary) {
    cuda::local_step_kernel<G, true>
        <<<grid, cuda::kThreads, 0, s>>>(table, n_tensors, votes, b1, omb1);
  } else {
    cuda::local_step_kernel<G, false>
        <<<grid, cuda::kThreads, 0, s>>>(table, n_tensors, votes, b1, omb1);
  }
}

struct ApplyArgs {
  float lr, wd, b2, omb2;
  int64_t n;
  bool average, ternary;
  const int32_t* skip;
};

template <typename P, typename G>
void launch_apply(dim3 grid, cudaStream_t s, const int64_t* table, int n_tensors,
                  const uint32_t* agg, const ApplyArgs& a) {
  const int ni = static_cast<int>(a.n);
  const float nf = static_cast<float>(a.n);
#define DLION_APPLY_LAUNCH(KIND, PLANES)                                                    \
  cuda::apply_kernel<P, G, KIND><<<grid, cuda::kThreads, 0, s>>>(                           \
      table, n_tensors, agg, PLANES, a.lr, a.wd, ni, nf, a.b2, a.omb2, a.skip)
  if (!a.average) {
    if (a.ternary) {
      DLION_APPLY_LAUNCH(cuda::kVoteTernary, 2);
    } else {
      DLION_APPLY_LAUNCH(cuda::kVoteBinary, 1);
    }
    return;
  }
  const int planes = bit_length(a.ternary ? 2 * a.n : a.n);
  if (a.ternary) {
    DLION_APPLY_LAUNCH(cuda::kAverageTernary, planes);
  } else {
    DLION_APPLY_LAUNCH(cuda::kAverageBinary, planes);
  }
#undef DLION_APPLY_LAUNCH
}

// Gradients of the parameters' dtype or fp32 (e.g. fp32 node means with bf16 parameters).
template <typename P>
void launch_apply_grad(DType p_dtype, DType g_dtype, dim3 grid, cudaStream_t s,
                       const int64_t* table, int n_tensors, const uint32_t* agg,
                       const ApplyArgs& a) {
  if (g_dtype == p_dtype) return launch_apply<P, P>(grid, s, table, n_tensors, agg, a);
  if (g_dtype == DType::kFloat32) return launch_apply<P, float>(grid, s, table, n_tensors, agg, a);
  throw std::invalid_argument("dlion_kernels: apply: gradients must have the parameters' dtype "
                              "or float32");
}

template <bool TERNARY>
void launch_tally(int count_planes, dim3 grid, cudaStream_t s, const uint32_t* stacked,
                  int64_t row_words, int n, int64_t blocks, uint32_t* out, bool average,
                  int out_planes, uint32_t tie, const int64_t* step) {
#define DLION_TALLY_CASE(P)                                                   \
  case P:                                                                     \
    cuda::tally_kernel<P, TERNARY><<<grid, cuda::kTallyThreads, 0, s>>>(      \
        stacked, row_words, n, blocks, out, average, out_planes, tie, step);  \
    return;
  switch (count_planes) {
    DLION_TALLY_CASE(1)
    DLION_TALLY_CASE(2)
    DLION_TALLY_CASE(3)
    DLION_TALLY_CASE(4)
    DLION_TALLY_CASE(5)
    DLION_TALLY_CASE(6)
    DLION_TALLY_CASE(7)
    DLION_TALLY_CASE(8)
    default:
      cuda::tally_kernel<kMaxCountPlanes, TERNARY><<<grid, cuda::kTallyThreads, 0, s>>>(
          stacked, row_words, n, blocks, out, average, out_planes, tie, step);
  }
#undef DLION_TALLY_CASE
}

}  // namespace

int64_t cuda_chunk_elems() { return cuda::kChunk; }

std::string cuda_runtime_problem() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
  }
  if (count == 0) return "the CUDA runtime sees no device";
  return "";
}

void cuda_local_step(int64_t table, int64_t n_tensors, int64_t n_chunks, DType g_dtype,
                     int64_t votes, float b1, float omb1, bool ternary, int device,
                     int64_t stream) {
  if (n_chunks <= 0 || n_tensors <= 0) return;
  check_grid(n_chunks, "local_step");
  DeviceGuard guard(device);
  const dim3 grid(static_cast<unsigned>(n_chunks));
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const auto* t = reinterpret_cast<const int64_t*>(table);
  auto* v = reinterpret_cast<uint32_t*>(votes);
  const int T = static_cast<int>(n_tensors);
  switch (g_dtype) {
    case DType::kFloat32:
      launch_local_step<float>(grid, s, t, T, v, b1, omb1, ternary);
      break;
    case DType::kBFloat16:
      launch_local_step<__nv_bfloat16>(grid, s, t, T, v, b1, omb1, ternary);
      break;
    case DType::kFloat16:
      launch_local_step<__half>(grid, s, t, T, v, b1, omb1, ternary);
      break;
    default:
      throw std::invalid_argument("dlion_kernels: local_step: unknown gradient dtype code");
  }
  check_launch("local_step kernel launch failed");
}

void cuda_tally(int64_t stacked, int64_t row_words, int64_t n, int64_t blocks, int64_t out,
                bool average, bool ternary, uint32_t tie, int64_t step, int device,
                int64_t stream) {
  check_n(n);
  if (blocks <= 0) return;
  DeviceGuard guard(device);
  const int count_planes = bit_length(ternary ? 2 * n : n);
  const int out_planes = average ? count_planes : (ternary ? 2 : 1);
  const int64_t ctas = (blocks + cuda::kTallyThreads - 1) / cuda::kTallyThreads;
  const dim3 grid(static_cast<unsigned>(ctas < 0x7FFFFFFF ? ctas : 0x7FFFFFFF));
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const auto* in = reinterpret_cast<const uint32_t*>(stacked);
  auto* o = reinterpret_cast<uint32_t*>(out);
  const int ni = static_cast<int>(n);
  const auto* step_ptr = reinterpret_cast<const int64_t*>(step);
  if (ternary) {
    launch_tally<true>(count_planes, grid, s, in, row_words, ni, blocks, o, average, out_planes,
                       tie, step_ptr);
  } else {
    launch_tally<false>(count_planes, grid, s, in, row_words, ni, blocks, o, average, out_planes,
                        tie, step_ptr);
  }
  check_launch("tally kernel launch failed");
}

void cuda_apply(int64_t table, int64_t n_tensors, int64_t n_chunks, DType p_dtype, DType g_dtype,
                int64_t aggregate, float lr, float wd, float b2, float omb2, int64_t n,
                bool average, bool ternary, int64_t skip, int device, int64_t stream) {
  check_n(n);
  if (n_chunks <= 0 || n_tensors <= 0) return;
  check_grid(n_chunks, "apply");
  DeviceGuard guard(device);
  const dim3 grid(static_cast<unsigned>(n_chunks));
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const auto* t = reinterpret_cast<const int64_t*>(table);
  const auto* agg = reinterpret_cast<const uint32_t*>(aggregate);
  const int T = static_cast<int>(n_tensors);
  const ApplyArgs a{lr, wd, b2, omb2, n, average, ternary,
                    reinterpret_cast<const int32_t*>(skip)};
  switch (p_dtype) {
    case DType::kFloat32:
      launch_apply_grad<float>(p_dtype, g_dtype, grid, s, t, T, agg, a);
      break;
    case DType::kBFloat16:
      launch_apply_grad<__nv_bfloat16>(p_dtype, g_dtype, grid, s, t, T, agg, a);
      break;
    case DType::kFloat16:
      launch_apply_grad<__half>(p_dtype, g_dtype, grid, s, t, T, agg, a);
      break;
    default:
      throw std::invalid_argument("dlion_kernels: apply: unknown parameter dtype code");
  }
  check_launch("apply kernel launch failed");
}

}  // namespace dlion
