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
#include <cmath>
#include <stdexcept>
#include <type_traits>
#include <vector>

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

// ----------------------------------------------------------------------------- AccumAdamW

template <typename T, bool K1, bool FLUSH, bool HW, int N>
DLION_ALWAYS_INLINE void adamw_block(T* x, const T* y, const T* g, float* a, float* m, float* v,
                              int count, const AdamWArgs& s) {
  // N = kB for full blocks (fixed trip count: vectorizes), 0 for the tail (count elements).
  const int len = N ? N : count;
  alignas(32) float xv[kB];
  alignas(32) float gv[kB];
  load<HW>(y, xv, len);  // x is read from y (x itself, or the fused mixing's source)
  load<HW>(g, gv, len);
  for (int j = 0; j < len; ++j) {
    const float gj = gv[j];
    float xj = xv[j] * s.decay;
    float aj = 0.0f;
    if (!K1) {
      aj = a[j] + gj * s.inv_k;
      a[j] = FLUSH ? 0.0f : aj;
    }
    const float mj = m[j], vj = v[j];
    const float mt = mj + s.omb1 * gj;
    const float vt = vj + s.omb2 * (gj * gj);
    xj = xj - s.step_size * (mt / (std::sqrt(vt) / s.bc2_sqrt + s.eps));
    xv[j] = xj;
    if (FLUSH) {
      const float src = K1 ? gj : aj;
      m[j] = s.b1 * (mj + s.omb1 * src);
      v[j] = s.b2 * (vj + s.omb2 * (src * src));
    }
  }
  store<HW>(x, xv, len);
}

template <typename T, bool K1, bool FLUSH, bool HW>
DLION_ALWAYS_INLINE void adamw_range(T* x, const T* y, const T* g, float* a, float* m, float* v,
                              int64_t begin, int64_t end, const AdamWArgs& s) {
  int64_t i = begin;
  for (; i + kB <= end; i += kB)
    adamw_block<T, K1, FLUSH, HW, kB>(x + i, y + i, g + i, K1 ? a : a + i, m + i, v + i, kB, s);
  if (i < end)
    adamw_block<T, K1, FLUSH, HW, 0>(x + i, y + i, g + i, K1 ? a : a + i, m + i, v + i,
                                     static_cast<int>(end - i), s);
}

template <typename T, bool K1, bool FLUSH>
void adamw_base(T* x, const T* y, const T* g, float* a, float* m, float* v, int64_t b,
                int64_t e, const AdamWArgs& s) {
  adamw_range<T, K1, FLUSH, false>(x, y, g, a, m, v, b, e, s);
}
#ifdef DLION_HAVE_AVX2_CLONE
template <typename T, bool K1, bool FLUSH>
DLION_AVX2 void adamw_avx2(T* x, const T* y, const T* g, float* a, float* m, float* v,
                                  int64_t b, int64_t e, const AdamWArgs& s) {
  adamw_range<T, K1, FLUSH, true>(x, y, g, a, m, v, b, e, s);
}
#endif

// ----------------------------------------------------------------------------- AccumLion

template <typename T, bool K1, bool FLUSH, bool HW, int N>
DLION_ALWAYS_INLINE void lion_block(T* x, const T* y, const T* g, float* a, float* m, int count,
                             const LionArgs& s) {
  const int len = N ? N : count;
  alignas(32) float xv[kB];
  alignas(32) float gv[kB];
  load<HW>(y, xv, len);  // x is read from y (x itself, or the fused mixing's source)
  load<HW>(g, gv, len);
  for (int j = 0; j < len; ++j) {
    const float gj = gv[j];
    const float mj = m[j];
    const float c = s.b1 * mj + s.omb1 * gj;
    const float sign = (c > 0.0f ? 1.0f : 0.0f) - (c < 0.0f ? 1.0f : 0.0f);
    xv[j] = xv[j] - s.lr * (sign + s.wd * xv[j]);
    float aj = 0.0f;
    if (!K1) {
      aj = a[j] + gj * s.inv_k;
      a[j] = FLUSH ? 0.0f : aj;
    }
    if (FLUSH) m[j] = s.b2 * mj + s.omb2 * (K1 ? gj : aj);
  }
  store<HW>(x, xv, len);
}

template <typename T, bool K1, bool FLUSH, bool HW>
DLION_ALWAYS_INLINE void lion_range(T* x, const T* y, const T* g, float* a, float* m, int64_t begin,
                             int64_t end, const LionArgs& s) {
  int64_t i = begin;
  for (; i + kB <= end; i += kB)
    lion_block<T, K1, FLUSH, HW, kB>(x + i, y + i, g + i, K1 ? a : a + i, m + i, kB, s);
  if (i < end)
    lion_block<T, K1, FLUSH, HW, 0>(x + i, y + i, g + i, K1 ? a : a + i, m + i,
                                    static_cast<int>(end - i), s);
}

template <typename T, bool K1, bool FLUSH>
void lion_base(T* x, const T* y, const T* g, float* a, float* m, float*, int64_t b, int64_t e,
               const LionArgs& s) {
  lion_range<T, K1, FLUSH, false>(x, y, g, a, m, b, e, s);
}
#ifdef DLION_HAVE_AVX2_CLONE
template <typename T, bool K1, bool FLUSH>
DLION_AVX2 void lion_avx2(T* x, const T* y, const T* g, float* a, float* m, float*,
                                 int64_t b, int64_t e, const LionArgs& s) {
  lion_range<T, K1, FLUSH, true>(x, y, g, a, m, b, e, s);
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

#ifdef DLION_HAVE_AVX2_CLONE
#define DLION_ACCUM_PICK(fn, ...) (cpu_has_avx2() ? &fn##_avx2<__VA_ARGS__> : &fn##_base<__VA_ARGS__>)
#else
#define DLION_ACCUM_PICK(fn, ...) (&fn##_base<__VA_ARGS__>)
#endif

template <typename T>
void adamw_typed(const int64_t* table, int64_t n, const AdamWArgs& s, int threads) {
  RangeFn<T, AdamWArgs> fn;
  if (s.k1)
    fn = s.flush ? DLION_ACCUM_PICK(adamw, T, true, true) : DLION_ACCUM_PICK(adamw, T, true, false);
  else
    fn = s.flush ? DLION_ACCUM_PICK(adamw, T, false, true)
                 : DLION_ACCUM_PICK(adamw, T, false, false);
  run<T, AdamWArgs>(table, n, fn, s, threads);
}

template <typename T>
void lion_typed(const int64_t* table, int64_t n, const LionArgs& s, int threads) {
  RangeFn<T, LionArgs> fn;
  if (s.k1)
    fn = s.flush ? DLION_ACCUM_PICK(lion, T, true, true) : DLION_ACCUM_PICK(lion, T, true, false);
  else
    fn = s.flush ? DLION_ACCUM_PICK(lion, T, false, true) : DLION_ACCUM_PICK(lion, T, false, false);
  run<T, LionArgs>(table, n, fn, s, threads);
}

}  // namespace

void cpu_accum_adamw(const int64_t* table, int64_t n_tensors, DType dtype, const AdamWArgs& args,
                     int threads) {
  switch (dtype) {
    case DType::kFloat32:
      return adamw_typed<float>(table, n_tensors, args, threads);
    case DType::kBFloat16:
      return adamw_typed<bf16>(table, n_tensors, args, threads);
    case DType::kFloat16:
      return adamw_typed<fp16>(table, n_tensors, args, threads);
  }
  throw std::invalid_argument("dlion_kernels: unknown parameter dtype code");
}

void cpu_accum_lion(const int64_t* table, int64_t n_tensors, DType dtype, const LionArgs& args,
                    int threads) {
  switch (dtype) {
    case DType::kFloat32:
      return lion_typed<float>(table, n_tensors, args, threads);
    case DType::kBFloat16:
      return lion_typed<bf16>(table, n_tensors, args, threads);
    case DType::kFloat16:
      return lion_typed<fp16>(table, n_tensors, args, threads);
  }
  throw std::invalid_argument("dlion_kernels: unknown parameter dtype code");
}

}  // namespace dlion
