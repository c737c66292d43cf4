// A CPU emulation of the CUDA builtins that csrc/cuda uses, for tests only: the .cu sources are
// compiled as host C++ (g++, python_tests/kernels/test_cuda_emulated.py) with this directory first
// on the include path, so that <cuda_runtime.h>, <cuda_bf16.h> and <cuda_fp16.h> land here.
//
// Execution model: one host thread of execution per CUDA thread, blocks one after another in a
// shuffled order (a kernel must not depend on block order). Warp calls (__shfl_*_sync,
// __ballot_sync, __syncwarp) meet at a barrier of the warp's 32 lanes; __syncthreads at a barrier
// of the block. The threads of a block are fibers (ucontext) of the launching thread, switched at
// the barriers: fast and deterministic. emu::Executor::get().set_os_threads(true) makes them OS
// threads of a pool instead, truly concurrent (shared memory races can show), but slow where the
// CPU is shared. What the hardware would leave undefined is a fault that
// fails the launch (cudaGetLastError then returns cudaErrorLaunchFailure with the reason):
// a partial mask, lanes of one warp at different warp calls, a thread that exits while others wait
// for it at a barrier, threads of one block waiting at different barriers (deadlock), and a vector
// (float4, uint2, ...) access at an address not aligned to its size.
//
// Arithmetic is the host's IEEE fp32 with one rounding per operation: build with
// -ffp-contract=off (no fused multiply-add unless the code asks for fmaf) and -fno-strict-aliasing
// (the kernels type-pun through reinterpret_cast, which nvcc allows). bf16 and fp16 are this
// file's own types with round-to-nearest-even conversions, as the CUDA headers do.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <math.h>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// Blocks run one at a time, so one static array per __shared__ declaration is the block's.
#define __shared__ static
#define __grid_constant__

// ----------------------------------------------------------------------------- vector types

namespace emu {
[[noreturn]] inline void fault(const std::string& what);
inline void check_aligned(const void* p, std::size_t bytes, const char* type) {
  std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p);
  asm volatile("" : "+r"(a));  // the compiler may not assume the type's alignment here
  if (a % bytes != 0) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "misaligned %s access at %p (needs %zu-byte alignment)", type,
                  p, bytes);
    fault(buf);
  }
}
}  // namespace emu

// A vector type (aligned to its size, as CUDA's) whose copies, i.e. the kernels' vector loads and
// stores through reinterpret_cast, check that the memory is aligned as the hardware requires.
#define EMU_VEC2(NAME, T)                                                    \
  struct alignas(2 * sizeof(T)) NAME {                                       \
    T x, y;                                                                  \
    NAME() = default;                                                        \
    constexpr NAME(T a, T b) : x(a), y(b) {}                                 \
    NAME(const NAME& o) : x(o.x), y(o.y) {                                   \
      emu::check_aligned(&o, sizeof(NAME), #NAME);                           \
    }                                                                        \
    NAME& operator=(const NAME& o) {                                         \
      emu::check_aligned(this, sizeof(NAME), #NAME);                         \
      x = o.x, y = o.y;                                                      \
      return *this;                                                          \
    }                                                                        \
  };                                                                         \
  inline NAME make_##NAME(T a, T b) { return NAME(a, b); }
#define EMU_VEC4(NAME, T)                                                    \
  struct alignas(4 * sizeof(T)) NAME {                                       \
    T x, y, z, w;                                                            \
    NAME() = default;                                                        \
    constexpr NAME(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}           \
    NAME(const NAME& o) : x(o.x), y(o.y), z(o.z), w(o.w) {                   \
      emu::check_aligned(&o, sizeof(NAME), #NAME);                           \
    }                                                                        \
    NAME& operator=(const NAME& o) {                                         \
      emu::check_aligned(this, sizeof(NAME), #NAME);                         \
      x = o.x, y = o.y, z = o.z, w = o.w;                                    \
      return *this;                                                          \
    }                                                                        \
  };                                                                         \
  inline NAME make_##NAME(T a, T b, T c, T d) { return NAME(a, b, c, d); }

EMU_VEC2(float2, float)
EMU_VEC4(float4, float)
EMU_VEC2(int2, int)
EMU_VEC4(int4, int)
EMU_VEC2(uint2, unsigned)
EMU_VEC4(uint4, unsigned)
EMU_VEC2(longlong2, long long)
EMU_VEC2(double2, double)

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

// The built-in variables of the CUDA thread that this host thread is running.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ----------------------------------------------------------------------------- bf16 and fp16

struct __nv_bfloat16 {
  std::uint16_t bits;
};
struct __half {
  std::uint16_t bits;
};
using __nv_bfloat16_raw = __nv_bfloat16;
using __half_raw = __half;

namespace emu {
inline std::uint32_t f2u(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round-to-nearest-even; NaN becomes the canonical 0x7FFF as in cuda_bf16.hpp.
inline std::uint16_t f32_to_bf16_rn(float f) {
  const std::uint32_t u = f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// Round-to-nearest-even with subnormals and overflow to infinity; NaN -> 0x7FFF (cuda_fp16.hpp).
inline std::uint16_t f32_to_f16_rn(float f) {
  const std::uint32_t u = f2u(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7FFFu;
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  std::uint32_t h, rem, half_ulp;
  if (a >= 0x38800000u) {  // normal half: rebias the exponent, drop 13 mantissa bits
    h = ((a >> 23) - 112u) << 10 | ((a >> 13) & 0x3FFu);
    rem = a & 0x1FFFu;
    half_ulp = 0x1000u;
  } else if (a <= 0x33000000u) {  // <= 2^-25: rounds to zero (2^-25 is a tie, to even 0)
    return static_cast<std::uint16_t>(sign);
  } else {  // subnormal half: units of 2^-24
    const std::uint32_t mant = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - (a >> 23);
    h = mant >> shift;
    rem = mant & ((1u << shift) - 1u);
    half_ulp = 1u << (shift - 1u);
  }
  if (rem > half_ulp || (rem == half_ulp && (h & 1u))) ++h;  // a carry rolls into the exponent
  return static_cast<std::uint16_t>(sign | h);
}
inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1Fu) return u2f(sign | 0x7F800000u | (m << 13));
  if (e != 0) return u2f(sign | ((e + 112u) << 23) | (m << 13));
  const float v = std::ldexp(static_cast<float>(m), -24);  // subnormal or zero: exact
  return sign ? -v : v;
}
}  // namespace emu

inline float __bfloat162float(__nv_bfloat16 v) { return emu::u2f(std::uint32_t{v.bits} << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) { return {emu::f32_to_bf16_rn(v)}; }
inline __nv_bfloat16 __float2bfloat16(float v) { return __float2bfloat16_rn(v); }
inline float __half2float(__half v) { return emu::f16_to_f32(v.bits); }
inline __half __float2half_rn(float v) { return {emu::f32_to_f16_rn(v)}; }
inline __half __float2half(float v) { return __float2half_rn(v); }

// Pairs: .x is the low half of the 32-bit word. Copies check 4-byte alignment (a 32-bit access).
#define EMU_PAIR(NAME, T)                                                    \
  struct alignas(4) NAME {                                                   \
    T x, y;                                                                  \
    NAME() = default;                                                        \
    constexpr NAME(T a, T b) : x(a), y(b) {}                                 \
    NAME(const NAME& o) : x(o.x), y(o.y) {                                   \
      emu::check_aligned(&o, sizeof(NAME), #NAME);                           \
    }                                                                        \
    NAME& operator=(const NAME& o) {                                         \
      emu::check_aligned(this, sizeof(NAME), #NAME);                         \
      x = o.x, y = o.y;                                                      \
      return *this;                                                          \
    }                                                                        \
  };
EMU_PAIR(__nv_bfloat162, __nv_bfloat16)
EMU_PAIR(__half2, __half)

inline float2 __bfloat1622float2(const __nv_bfloat162 v) {
  return float2(__bfloat162float(v.x), __bfloat162float(v.y));
}
inline float2 __half22float2(const __half2 v) {
  return float2(__half2float(v.x), __half2float(v.y));
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
}
inline __half2 __floats2half2_rn(float a, float b) {
  return __half2(__float2half_rn(a), __float2half_rn(b));
}
inline __nv_bfloat162 __float22bfloat162_rn(const float2 v) {
  return __floats2bfloat162_rn(v.x, v.y);
}
inline __half2 __float22half2_rn(const float2 v) { return __floats2half2_rn(v.x, v.y); }

// ----------------------------------------------------------------------------- arithmetic

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __int2float_rn(int v) { return static_cast<float>(v); }
inline float __uint2float_rn(unsigned v) { return static_cast<float>(v); }
inline int __float2int_rn(float v) { return static_cast<int>(std::nearbyint(v)); }
inline int __float2int_rz(float v) { return static_cast<int>(v); }
inline float __saturatef(float v) { return v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }
inline unsigned __brev(unsigned v) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((v >> i) & 1u) << (31 - i);
  return r;
}
// CUDA's min/max are overloaded for every arithmetic type in the global namespace.
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
// sqrtf: <math.h> (IEEE, correctly rounded, as CUDA's sqrtf with -prec-sqrt=true).

// Read-only loads through the texture path: a plain load here.
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// ----------------------------------------------------------------------------- atomics

template <typename T>
inline T atomicAdd(T* p, T v) {
  if constexpr (std::is_floating_point_v<T>) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8);
    using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    U old = __atomic_load_n(reinterpret_cast<U*>(p), __ATOMIC_SEQ_CST), next;
    do {
      T f, g;
      std::memcpy(&f, &old, sizeof f);
      g = f + v;
      std::memcpy(&next, &g, sizeof g);
    } while (!__atomic_compare_exchange_n(reinterpret_cast<U*>(p), &old, next, false,
                                          __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    T f;
    std::memcpy(&f, &old, sizeof f);
    return f;
  } else {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  }
}
template <typename T>
inline T atomicSub(T* p, T v) {
  return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
inline T atomicOr(T* p, T v) {
  return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
inline T atomicAnd(T* p, T v) {
  return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
inline T atomicExch(T* p, T v) {
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
template <typename T>
inline T atomicCAS(T* p, T compare, T v) {
  __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
template <typename T>
inline T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v &&
         !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ----------------------------------------------------------------------------- the executor

namespace emu {

struct Abort {};  // unwinds a CUDA thread once the launch has faulted

enum class WarpOp : int { kNone = 0, kShfl, kBallot, kSync };

// Switching between fibers. x86-64: saves the callee-saved registers on the current stack, stores
// its stack pointer in *from and continues on `to` (no system call, unlike swapcontext, which
// sets the signal mask at every switch). Elsewhere: ucontext.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
#define EMU_FAST_SWITCH 1
extern "C" void emu_fiber_switch(void** from, void* to);
asm(R"(
  .text
  .weak emu_fiber_switch
  .hidden emu_fiber_switch
  .type emu_fiber_switch, @function
emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_fiber_switch, .-emu_fiber_switch
)");
#endif

class Executor {
 public:
  static Executor& get() {
    static Executor e;
    return e;
  }

  // Runs `body` as every thread of every block of the grid; "" or the first fault.
  std::string run(dim3 grid, dim3 block, const std::function<void()>& body) {
    std::lock_guard<std::mutex> one_launch(launch_mu_);
    std::unique_lock<std::mutex> lk(mu_);
    const unsigned threads = block.x * block.y * block.z;
    if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.y > 65535 || grid.z > 65535)
      return "invalid configuration (block of " + std::to_string(threads) + " threads)";
    if (max_grid_ > 0 && grid.x > max_grid_) grid.x = max_grid_;
    while (os_threads_ && workers_.size() < threads) {
      const unsigned id = static_cast<unsigned>(workers_.size());
      workers_.emplace_back([this, id] { work(id); });
    }
    // Blocks in a shuffled order, the same for a given grid.
    std::vector<std::uint64_t> order(std::uint64_t{grid.x} * grid.y * grid.z);
    std::iota(order.begin(), order.end(), std::uint64_t{0});
    std::shuffle(order.begin(), order.end(), std::mt19937_64(order.size()));
    body_ = &body;
    grid_ = grid;
    block_ = block;
    threads_ = threads;
    error_.clear();
    warps_.assign((threads + 31) / 32, Warp{});
    for (std::size_t w = 0; w < warps_.size(); ++w)
      warps_[w].size = std::min<unsigned>(32, threads - 32 * static_cast<unsigned>(w));
    for (const std::uint64_t b : order) {
      block_idx_ = {static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                    static_cast<unsigned>(b / (std::uint64_t{grid.x} * grid.y))};
      for (Warp& w : warps_) w.arrived = w.exited = 0, w.op = WarpOp::kNone;
      block_arrived_ = block_exited_ = waiting_ = 0;
      running_ = threads;
      if (os_threads_) {
        ++job_;
        start_cv_.notify_all();
        done_cv_.wait(lk, [this] { return running_ == 0; });
      } else {
        lk.unlock();
        run_fibers();
        lk.lock();
      }
      if (!error_.empty()) break;
    }
    body_ = nullptr;
    return error_;
  }

  // Clamps gridDim.x of later launches (0: off), for kernels that loop over a grid stride.
  void set_max_grid(unsigned g) {
    std::lock_guard<std::mutex> lk(mu_);
    max_grid_ = g;
  }

  // true: each CUDA thread of a block is an OS thread of a pool (real concurrency); false
  // (default): a fiber of the launching thread, switched at barriers only (fast, deterministic).
  void set_os_threads(bool on) {
    std::lock_guard<std::mutex> lk(launch_mu_);
    os_threads_ = on;
  }

  [[noreturn]] void fault(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu_);
    fail(what);
    throw Abort{};
  }

  // The barrier of this thread's warp, for a warp call of kind `op`.
  void warp_barrier(WarpOp op) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!error_.empty()) throw Abort{};
    const unsigned t = linear_tid(), wi = t / 32;
    Warp& w = warps_[wi];
    if (w.arrived == 0) {
      w.op = op;
    } else if (w.op != op) {
      fail("lanes of warp " + std::to_string(wi) + " meet at different warp calls");
      throw Abort{};
    }
    ++w.arrived;
    ++waiting_;
    if (w.arrived == w.size) {
      w.arrived = 0;
      ++w.generation;
      waiting_ -= w.size;
      warp_cvs_[wi].notify_all();
      return;
    }
    fail_if_stuck();
    const std::uint64_t gen = w.generation;
    wait(lk, warp_cvs_[wi], [&] { return w.generation != gen || !error_.empty(); });
    if (w.generation == gen) throw Abort{};
  }

  void block_barrier() {
    std::unique_lock<std::mutex> lk(mu_);
    if (!error_.empty()) throw Abort{};
    ++block_arrived_;
    ++waiting_;
    if (block_arrived_ == threads_) {
      block_arrived_ = 0;
      ++block_generation_;
      waiting_ -= threads_;
      block_cv_.notify_all();
      return;
    }
    fail_if_stuck();
    const std::uint64_t gen = block_generation_;
    wait(lk, block_cv_, [&] { return block_generation_ != gen || !error_.empty(); });
    if (block_generation_ == gen) throw Abort{};
  }

  // The exchange slots of this thread's warp for a warp call with this parity (double-buffered:
  // a lane cannot write slot set p again before every lane has passed the next warp call, which
  // each lane reaches only after reading set p).
  std::uint64_t* slots(int parity) { return warps_[linear_tid() / 32].slots[parity]; }

  static unsigned linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  }

  // The parity of the running CUDA thread's next buffered warp call.
  static int& parity() { return *parity_ptr(); }

  ~Executor() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      quit_ = true;
      start_cv_.notify_all();
    }
    for (std::thread& t : workers_) t.join();
  }

 private:
  struct Warp {
    unsigned size = 32, arrived = 0, exited = 0;
    std::uint64_t generation = 0;
    WarpOp op = WarpOp::kNone;
    std::uint64_t slots[2][32] = {};
  };
  struct Fiber {
#ifdef EMU_FAST_SWITCH
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
    std::vector<char> stack;
    int parity = 0;
    bool done = false;
  };
  static constexpr std::size_t kFiberStack = 256 * 1024;

  static int*& parity_ptr() {
    static thread_local int own = 0;
    static thread_local int* p = &own;
    return p;
  }

  // Blocks the running CUDA thread until `ready` (mu_ held on entry and exit).
  template <typename Ready>
  void wait(std::unique_lock<std::mutex>& lk, std::condition_variable& cv, Ready ready) {
    if (os_threads_) {
      cv.wait(lk, ready);
      return;
    }
    while (!ready()) {  // back to the scheduler; it resumes every unfinished fiber in turn
      Fiber& f = fibers_[linear_tid()];
      lk.unlock();
      to_scheduler(f);
      lk.lock();
    }
  }

  void fail(const std::string& what) {  // mu_ held
    if (error_.empty()) {
      error_ = what + " (block " + std::to_string(block_idx_.x) + "," +
               std::to_string(block_idx_.y) + "," + std::to_string(block_idx_.z) + ")";
    }
    for (std::size_t w = 0; w < warps_.size(); ++w) warp_cvs_[w].notify_all();
    block_cv_.notify_all();
  }

  // Why no waiting thread can ever be released, or "": threads wait for threads that have
  // exited, or every live thread waits and no barrier is complete (different barriers).
  std::string stuck() const {  // mu_ held
    for (std::size_t i = 0; i < warps_.size(); ++i) {
      const Warp& w = warps_[i];
      if (w.arrived > 0 && w.exited > 0 && w.arrived + w.exited == w.size)
        return "lanes of warp " + std::to_string(i) +
               " exited while the others wait at a warp call with a full mask";
    }
    if (block_arrived_ > 0 && block_exited_ > 0 && block_arrived_ + block_exited_ == threads_)
      return "threads exited while the others wait at __syncthreads";
    if (waiting_ > 0 && waiting_ + block_exited_ == threads_)
      return "deadlock: every thread waits and no barrier can complete (threads at different "
             "barriers)";
    return "";
  }

  void fail_if_stuck() {  // mu_ held, called by a waiting CUDA thread
    const std::string why = stuck();
    if (!why.empty()) {
      fail(why);
      throw Abort{};
    }
  }

  void enter(unsigned id) {  // the built-in variables of CUDA thread `id` of the current block
    threadIdx = {id % block_.x, id / block_.x % block_.y, id / (block_.x * block_.y)};
    blockIdx = block_idx_;
    blockDim = block_;
    gridDim = grid_;
  }

  void body_and_exit(unsigned id) {  // mu_ not held
    try {
      (*body_)();
    } catch (const Abort&) {
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> g(mu_);
      fail(std::string("exception in a CUDA thread: ") + e.what());
    }
    std::lock_guard<std::mutex> g(mu_);
    ++warps_[id / 32].exited;
    ++block_exited_;
    const std::string why = stuck();
    if (!why.empty()) fail(why);
    --running_;
  }

  void work(unsigned id) {  // an OS thread of the pool
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      start_cv_.wait(lk, [&] { return quit_ || job_ != seen; });
      if (quit_) return;
      seen = job_;
      if (id >= threads_) continue;
      enter(id);
      parity() = 0;
      lk.unlock();
      body_and_exit(id);
      lk.lock();
      if (running_ == 0) done_cv_.notify_all();
    }
  }

#ifdef EMU_FAST_SWITCH
  void to_scheduler(Fiber& f) { emu_fiber_switch(&f.sp, scheduler_sp_); }
  void to_fiber(Fiber& f) { emu_fiber_switch(&scheduler_sp_, f.sp); }
  static void fiber_main() {  // entered by the first switch; never returns
    Executor& ex = get();
    Fiber& f = ex.fibers_[ex.current_];
    ex.body_and_exit(ex.current_);
    f.done = true;
    ex.to_scheduler(f);
    std::abort();  // a finished fiber is never resumed
  }
  void start(Fiber& f) {
    // The first switch pops six registers and returns into fiber_main with the stack as after
    // a call (rsp + 8 a multiple of 16), its own return address null (ends backtraces).
    const auto top = reinterpret_cast<std::uintptr_t>(f.stack.data() + f.stack.size()) &
                     ~std::uintptr_t{15};
    void** sp = reinterpret_cast<void**>(top - 8);
    *sp = nullptr;
    *--sp = reinterpret_cast<void*>(&Executor::fiber_main);
    for (int r = 0; r < 6; ++r) *--sp = nullptr;
    f.sp = sp;
  }
#else
  void to_scheduler(Fiber& f) { swapcontext(&f.context, &scheduler_); }
  void to_fiber(Fiber& f) { swapcontext(&scheduler_, &f.context); }
  static void fiber_main() {
    Executor& ex = get();
    ex.body_and_exit(ex.current_);
    ex.fibers_[ex.current_].done = true;
  }  // returns to uc_link, the scheduler
  void start(Fiber& f) {
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = &scheduler_;
    makecontext(&f.context, &Executor::fiber_main, 0);
  }
#endif

  void run_fibers() {  // one block, mu_ not held
    if (fibers_.size() < threads_) fibers_.resize(threads_);
    for (unsigned i = 0; i < threads_; ++i) {
      Fiber& f = fibers_[i];
      if (f.stack.empty()) f.stack.resize(kFiberStack);
      start(f);
      f.parity = 0;
      f.done = false;
    }
    int* const own_parity = parity_ptr();
    for (unsigned live = threads_; live > 0;) {
      for (unsigned i = 0; i < threads_; ++i) {
        Fiber& f = fibers_[i];
        if (f.done) continue;
        current_ = i;
        enter(i);
        parity_ptr() = &f.parity;
        to_fiber(f);
        if (f.done) --live;
      }
    }
    parity_ptr() = own_parity;
  }

  std::mutex launch_mu_, mu_;
  std::condition_variable start_cv_, done_cv_, block_cv_;
  std::condition_variable warp_cvs_[32];
  std::vector<std::thread> workers_;
  std::vector<Fiber> fibers_;
#ifdef EMU_FAST_SWITCH
  void* scheduler_sp_ = nullptr;
#else
  ucontext_t scheduler_;
#endif
  unsigned current_ = 0;
  bool os_threads_ = false;
  std::vector<Warp> warps_;
  const std::function<void()>* body_ = nullptr;
  dim3 grid_, block_;
  uint3 block_idx_{};
  unsigned threads_ = 0, running_ = 0, block_arrived_ = 0, block_exited_ = 0, waiting_ = 0;
  unsigned max_grid_ = 0;
  std::uint64_t job_ = 0, block_generation_ = 0;
  bool quit_ = false;
  std::string error_;
};

[[noreturn]] inline void fault(const std::string& what) { Executor::get().fault(what); }

inline void require_full_mask(unsigned mask, const char* what) {
  if (mask != 0xFFFFFFFFu)
    fault(std::string(what) + ": the emulation supports the full mask 0xFFFFFFFF only");
  if ((blockDim.x * blockDim.y * blockDim.z) % 32 != 0)
    fault(std::string(what) + " with a full mask in a block that is not whole warps");
}

// One warp-wide exchange: every lane publishes `value`, then reads lane src(lane)'s.
template <typename T, typename Src>
inline T exchange(unsigned mask, T value, int width, Src src, const char* what) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of a 1-8 byte value");
  require_full_mask(mask, what);
  if (width != 32) fault(std::string(what) + ": the emulation supports width 32 only");
  Executor& ex = Executor::get();
  int& parity = Executor::parity();
  std::uint64_t* slots = ex.slots(parity);
  const int lane = static_cast<int>(Executor::linear_tid() % 32);
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  slots[lane] = bits;
  ex.warp_barrier(WarpOp::kShfl);
  const int from = src(lane);
  T out;
  std::memcpy(&out, &slots[from >= 0 && from < 32 ? from : lane], sizeof(T));
  parity ^= 1;
  return out;
}

// ----------------------------------------------------------------------------- launches

struct Config {
  dim3 grid, block;
  Config(dim3 g, dim3 b, std::size_t shared = 0, const void* stream = nullptr)
      : grid(g), block(b) {
    (void)shared;
    (void)stream;
  }
};

template <typename... A>
struct ArgPack {
  std::tuple<A...> values;
};
template <typename... A>
ArgPack<std::decay_t<A>...> Args(A&&... a) {
  return {std::tuple<std::decay_t<A>...>(std::forward<A>(a)...)};
}

template <typename... P>
struct Bound {
  void (*kernel)(P...);
  Config config;
};

// The launches as rewritten by the test: `k<<<g, b, s, st>>>(args)` becomes
// `k ^ ::emu::Config(g, b, s, st) ^ ::emu::Args(args)`.
template <typename... P>
Bound<P...> operator^(void (*kernel)(P...), const Config& c) {
  return {kernel, c};
}

inline void record_launch_error(const std::string& what);  // below, with the runtime API

template <typename... P, typename... A>
void operator^(const Bound<P...>& b, const ArgPack<A...>& a) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong argument count");
  const std::function<void()> body = [&] {
    std::apply([&](const auto&... v) { b.kernel(static_cast<P>(v)...); }, a.values);
  };
  const std::string err = Executor::get().run(b.config.grid, b.config.block, body);
  if (!err.empty()) record_launch_error(err);
}

}  // namespace emu

// ----------------------------------------------------------------------------- warp calls

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return emu::exchange(mask, var, width, [=](int lane) { return lane ^ lane_mask; },
                       "__shfl_xor_sync");
}
template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return emu::exchange(mask, var, width, [=](int) { return src_lane & 31; }, "__shfl_sync");
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return emu::exchange(mask, var, width,
                       [=](int lane) { return lane + static_cast<int>(delta) < 32 ?
                                              lane + static_cast<int>(delta) : lane; },
                       "__shfl_down_sync");
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return emu::exchange(mask, var, width,
                       [=](int lane) { return lane >= static_cast<int>(delta) ?
                                              lane - static_cast<int>(delta) : lane; },
                       "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  emu::require_full_mask(mask, "__ballot_sync");
  emu::Executor& ex = emu::Executor::get();
  int& parity = emu::Executor::parity();
  std::uint64_t* slots = ex.slots(parity);
  const unsigned lane = emu::Executor::linear_tid() % 32;
  slots[lane] = predicate != 0;
  ex.warp_barrier(emu::WarpOp::kBallot);
  unsigned out = 0;
  for (unsigned l = 0; l < 32; ++l) out |= static_cast<unsigned>(slots[l] != 0) << l;
  parity ^= 1;
  return out;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  return __ballot_sync(mask, predicate) == 0xFFFFFFFFu;
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) {
  emu::require_full_mask(mask, "__syncwarp");
  emu::Executor::get().warp_barrier(emu::WarpOp::kSync);
}
inline unsigned __activemask() { return 0xFFFFFFFFu; }
inline void __syncthreads() { emu::Executor::get().block_barrier(); }

// ----------------------------------------------------------------------------- runtime API

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorLaunchFailure = 719,
};
struct CUstream_st;
using cudaStream_t = CUstream_st*;

namespace emu {
// The host thread's last launch error and its reason (cudaGetLastError returns and clears it).
inline thread_local cudaError_t last_error = cudaSuccess;
inline thread_local std::string last_reason;
inline void record_launch_error(const std::string& what) {
  if (last_error == cudaSuccess) {
    last_error = cudaErrorLaunchFailure;
    last_reason = what;
  }
}
}  // namespace emu

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::last_error;
  emu::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaPeekAtLastError() { return emu::last_error; }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  static thread_local std::string text;
  text = e == cudaErrorLaunchFailure ? "unspecified launch failure (emulated: " +
                                           emu::last_reason + ")"
                                     : cudaGetErrorName(e);
  return text.c_str();
}
// One emulated device, index 0.
inline cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
