// AccumAdamW and AccumLion on the CPU (semantics and operation order: kernels/accum.py).
// Compiled like cpu_kernels.cpp (-O3 -ffp-contract=off: one rounding per operation, no FMA) plus
// -fno-math-errno so that sqrt vectorizes (sqrtps is IEEE-exact; only errno is given up).
// Work is cut into 32-element blocks with fixed-length loops that vectorize; each block loop is
// compiled for the baseline ISA and for AVX2 + F16C and picked at run time (DLION_CPU_NO_AVX2=1
// keeps the baseline), with bit-identical results. Tasks of 64K elements go to the thread pool.
// x is read from the table's y row (x itself, or a source apart from every written tensor: the
// decentralized wrapper's fused mixing, accum.py) and written to x.
#include "cpu/accum_kernels.h"

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "accum_step.h"
#include "cpu/convert.h"
#include "cpu/thread_pool.h"

namespace dlion {
namespace {

using accum::AdamWArgs;
using accum::LionArgs;

constexpr int kB = 32;                  // elements per block (fixed-length inner loops)
constexpr int64_t kTaskElems = 1 << 16;  // elements per thread-pool task

// count elements of p (count == kB: a full block, the vectorized path) to fp32 and back.
template <bool HW, typename T>
DLION_ALWAYS_INLINE void load(const T* p, float* out, int count) {
#ifdef DLION_HAVE_AVX2_CLONE
  if constexpr (HW && std::is_same_v<T, fp16>) {
    if (count == kB) return fp16_load_block<kB>(p, out);
  }
#endif
  for (int j = 0; j < count; ++j) out[j] = to_f32(p[j]);
}
template <bool HW, typename T>
DLION_ALWAYS_INLINE void store(T* p, const float* in, int count) {
#ifdef DLION_HAVE_AVX2_CLONE
  if constexpr (HW && std::is_same_v<T, fp16>) {
    if (count == kB) return fp16_store_block<kB>(p, in);
  }
#endif
  for (int j = 0; j < count; ++j) p[j] = from_f32<T>(in[j]);
}

// The optimizers' element step (accum::AdamW, accum::Lion) is shared with the CUDA kernels:
// csrc/accum_step.h (always inlined into the AVX2 block loops).
using accum::AdamW;
using accum::Lion;

// ----------------------------------------------------------------------------- blocks

template <typename Op, typename T, bool K1, bool FLUSH, bool HW, int N>
DLION_ALWAYS_INLINE void block(T* x, const T* y, const T* g, float* a, float* m, float* v,
                               int count, const typename Op::Args& s) {
  // N = kB for full blocks (fixed trip count: vectorizes), 0 for the tail (count elements).
  const int len = N ? N : count;
  alignas(32) float xv[kB];
  alignas(32) float gv[kB];
  load<HW>(y, xv, len);  // x is read from y (x itself, or the fused mixing's source)
  load<HW>(g, gv, len);
  for (int j = 0; j < len; ++j)
    xv[j] = Op::template element<K1, FLUSH>(xv[j], gv[j], a, m, v, j, s);
  store<HW>(x, xv, len);
}

template <typename Op, typename T, bool K1, bool FLUSH, bool HW>
DLION_ALWAYS_INLINE void range(T* x, const T* y, const T* g, float* a, float* m, float* v,
                               int64_t begin, int64_t end, const typename Op::Args& s) {
  // a is null when K == 1, v for AccumLion: never offset those
  auto at = [](float* p, int64_t i, bool used) { return used ? p + i : p; };
  int64_t i = begin;
  for (; i + kB <= end; i += kB)
    block<Op, T, K1, FLUSH, HW, kB>(x + i, y + i, g + i, at(a, i, !K1), m + i,
                                    at(v, i, Op::kSecondMoment), kB, s);
  if (i < end)
    block<Op, T, K1, FLUSH, HW, 0>(x + i, y + i, g + i, at(a, i, !K1), m + i,
                                   at(v, i, Op::kSecondMoment), static_cast<int>(end - i), s);
}

template <typename Op, typename T, bool K1, bool FLUSH>
void range_base(T* x, const T* y, const T* g, float* a, float* m, float* v, int64_t b,
                int64_t e, const typename Op::Args& s) {
  range<Op, T, K1, FLUSH, false>(x, y, g, a, m, v, b, e, s);
}
#ifdef DLION_HAVE_AVX2_CLONE
template <typename Op, typename T, bool K1, bool FLUSH>
DLION_AVX2 void range_avx2(T* x, const T* y, const T* g, float* a, float* m, float* v, int64_t b,
                           int64_t e, const typename Op::Args& s) {
  range<Op, T, K1, FLUSH, true>(x, y, g, a, m, v, b, e, s);
}
#endif

// ----------------------------------------------------------------------------- driver

struct Task {
  int64_t tensor, begin, end;
};

template <typename T, typename Args>
using RangeFn = void (*)(T*, const T*, const T*, float*, float*, float*, int64_t, int64_t,
                         const Args&);

template <typename T, typename Args>
void run(const int64_t* table, int64_t n_tensors, RangeFn<T, Args> fn, const Args& args,
         int threads) {
  using namespace accum;
  std::vector<Task> tasks;
  int64_t total = 0;
  const int64_t N = n_tensors;
  for (int64_t t = 0; t < N; ++t) {
    const int64_t numel = table[kNumel * N + t];
    total += numel;
    for (int64_t b = 0; b < numel; b += kTaskElems)
      tasks.push_back({t, b, std::min(numel, b + kTaskElems)});
  }
  // At least 32K elements per thread: small calls stay on the calling thread.
  const int useful = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(std::max(threads, 1), total / (kTaskElems / 2) + 1)));
  parallel_for(static_cast<int64_t>(tasks.size()), useful, [&](int64_t i) {
    const Task& task = tasks[i];
    const int64_t t = task.tensor;
    fn(reinterpret_cast<T*>(table[kX * N + t]), reinterpret_cast<const T*>(table[kY * N + t]),
       reinterpret_cast<const T*>(table[kG * N + t]),
       reinterpret_cast<float*>(table[kA * N + t]), reinterpret_cast<float*>(table[kM * N + t]),
       reinterpret_cast<float*>(table[kV * N + t]), task.begin, task.end, args);
  });
}

template <typename Op, typename T, bool K1, bool FLUSH>
RangeFn<T, typename Op::Args> pick() {
#ifdef DLION_HAVE_AVX2_CLONE
  if (cpu_has_avx2()) return &range_avx2<Op, T, K1, FLUSH>;
#endif
  return &range_base<Op, T, K1, FLUSH>;
}

template <typename Op, typename T>
void typed(const int64_t* table, int64_t n, const typename Op::Args& s, int threads) {
  RangeFn<T, typename Op::Args> fn;
  if (s.k1)
    fn = s.flush ? pick<Op, T, true, true>() : pick<Op, T, true, false>();
  else
    fn = s.flush ? pick<Op, T, false, true>() : pick<Op, T, false, false>();
  run<T, typename Op::Args>(table, n, fn, s, threads);
}

template <typename Op>
void dispatch(const int64_t* table, int64_t n, DType dtype, const typename Op::Args& s,
              int threads) {
  switch (dtype) {
    case DType::kFloat32:
      return typed<Op, float>(table, n, s, threads);
    case DType::kBFloat16:
      return typed<Op, bf16>(table, n, s, threads);
    case DType::kFloat16:
      return typed<Op, fp16>(table, n, s, threads);
  }
  throw std::invalid_argument("dlion_kernels: unknown parameter dtype code");
}

}  // namespace

void cpu_accum_adamw(const int64_t* table, int64_t n_tensors, DType dtype, const AdamWArgs& args,
                     int threads) {
  dispatch<AdamW>(table, n_tensors, dtype, args, threads);
}

void cpu_accum_lion(const int64_t* table, int64_t n_tensors, DType dtype, const LionArgs& args,
                    int threads) {
  dispatch<Lion>(table, n_tensors, dtype, args, threads);
}

}  // namespace dlion
