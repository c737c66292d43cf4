// CPU kernels of the stages. Compiled with -O3 -ffp-contract=off (no FMA contraction): each fp32
// operation rounds once, in the order of reference.py. Work is cut into 32-element blocks so that
// the element loops are fixed-length and vectorize. Every block loop is written once, as an
// always-inline body, and compiled twice: for the baseline ISA (SSE2 on x86-64) and for AVX2 +
// F16C, picked at run time. Only the vector width and the fp16 conversion instructions change
// (F16C rounds to nearest even like the software conversion), so results are bit-identical.
// The loops prefetch their streams a little ahead: without it a bf16 apply ran 3x slower from
// DRAM than from cache on the machine this was tuned on (bench/NOTES.md).
#include "cpu/cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "cpu/convert.h"
#include "cpu/thread_pool.h"

namespace dlion {

#ifdef DLION_HAVE_AVX2_CLONE
bool cpu_has_avx2() {
  static const bool has = [] {
    const char* off = std::getenv("DLION_CPU_NO_AVX2");
    if (off != nullptr && off[0] != '\0' && off[0] != '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("f16c") != 0;
  }();
  return has;
}
#endif

namespace {

constexpr int64_t kTaskBlocks = 2048;      // 64K elements per task for local_step / apply
constexpr int64_t kTallyTaskBlocks = 1024;  // blocks per tally task
constexpr int kTallyTile = 256;             // blocks whose counters live on the stack at once
constexpr int kMaxStaticPlanes = 8;         // apply/average: plane counts unrolled at compile time

// kBit.v[j] = 1 << j: a table, so that per-lane bit tests vectorize without variable shifts.
struct BitTable {
  alignas(64) uint32_t v[kBlock];
  constexpr BitTable() : v() {
    for (int j = 0; j < kBlock; ++j) v[j] = 1u << j;
  }
};
constexpr BitTable kBit{};

struct Task {
  int64_t tensor, begin, end;  // block range [begin, end) of one tensor
};

// Blocks of every tensor of the table, cut into tasks of at most kTaskBlocks blocks.
std::vector<Task> make_tasks(const int64_t* table, int64_t n_tensors, int64_t* total_blocks) {
  std::vector<Task> tasks;
  *total_blocks = 0;
  for (int64_t t = 0; t < n_tensors; ++t) {
    const int64_t numel = table[kRowNumel * n_tensors + t];
    const int64_t nb = (numel + kBlock - 1) / kBlock;
    *total_blocks += nb;
    for (int64_t b = 0; b < nb; b += kTaskBlocks)
      tasks.push_back({t, b, std::min(nb, b + kTaskBlocks)});
  }
  return tasks;
}

// Threads worth using for `blocks` blocks of work: small calls stay on the calling thread.
int threads_for(int64_t blocks, int threads) {
  const int64_t useful = blocks / 1024 + 1;  // at least 32K elements per thread
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, useful)));
}

// Bits of the 32 values that are > 0 (pos) and < 0 (neg); NaN is neither.
template <bool TERNARY>
inline void pack_signs(const float* c, uint32_t* pos, uint32_t* neg) {
  uint32_t p = 0, q = 0;
#if defined(__SSE2__)
  const __m128 zero = _mm_setzero_ps();
  for (int k = 0; k < 8; ++k) {
    const __m128 v = _mm_loadu_ps(c + 4 * k);
    p |= static_cast<uint32_t>(_mm_movemask_ps(_mm_cmpgt_ps(v, zero))) << (4 * k);
    if (TERNARY) q |= static_cast<uint32_t>(_mm_movemask_ps(_mm_cmplt_ps(v, zero))) << (4 * k);
  }
#else
  for (int j = 0; j < kBlock; ++j) {
    p |= static_cast<uint32_t>(c[j] > 0.0f) << j;
    if (TERNARY) q |= static_cast<uint32_t>(c[j] < 0.0f) << j;
  }
#endif
  *pos = p;
  *neg = q;
}

// ----------------------------------------------------------------------------- ISA variants


// Whether full blocks of T convert through load_block/store_block (fp16 with F16C) rather than
// element by element inside the arithmetic loop.
template <bool HW, typename T>
constexpr bool kBlockConvert = HW && std::is_same_v<T, fp16>;

// A full block of 32 elements to fp32 and back. HW: the AVX2 + F16C variant, whose fp16
// conversions are single instructions (the software ones do not vectorize).
template <bool HW, typename T>
DLION_ALWAYS_INLINE void load_block(const T* p, float* out) {
#ifdef DLION_HAVE_AVX2_CLONE
  if constexpr (HW && std::is_same_v<T, fp16>) {
    fp16_load_block<kBlock>(p, out);
    return;
  }
#endif
  for (int j = 0; j < kBlock; ++j) out[j] = to_f32(p[j]);
}
template <bool HW, typename T>
DLION_ALWAYS_INLINE void store_block(T* p, const float* in) {
#ifdef DLION_HAVE_AVX2_CLONE
  if constexpr (HW && std::is_same_v<T, fp16>) {
    fp16_store_block<kBlock>(p, in);
    return;
  }
#endif
  for (int j = 0; j < kBlock; ++j) p[j] = from_f32<T>(in[j]);
}

// Prefetch the block kPrefetchBytes ahead of `block` in a stream of T (RW: 0 read, 1 write).
constexpr int kPrefetchBytes = 2048;
template <int RW, typename T>
DLION_ALWAYS_INLINE void prefetch_ahead(const T* block) {
#if defined(__GNUC__) || defined(__clang__)
  const char* p = reinterpret_cast<const char*>(block) + kPrefetchBytes;
  for (int off = 0; off < kBlock * static_cast<int>(sizeof(T)); off += 64)
    __builtin_prefetch(p + off, RW, 3);
#endif
}

// ----------------------------------------------------------------------------- local_step

// c = b1*m + omb1*g and its packed vote; m is only read (apply writes it).
template <typename G, bool HAS_G, bool TERNARY, bool HW>
DLION_ALWAYS_INLINE void local_step_body(const G* g, const float* m, int64_t numel,
                                         uint32_t* words, int64_t b_begin, int64_t b_end,
                                         float b1, float omb1) {
  alignas(32) float c[kBlock];
  alignas(32) float gv[kBlock];
  for (int64_t b = b_begin; b < b_end; ++b) {
    const int64_t i0 = b * kBlock;
    const G* gb = HAS_G ? g + i0 : nullptr;
    const float* mb = m + i0;
    if (numel - i0 >= kBlock) {
      if (HAS_G) prefetch_ahead<0>(gb);
      prefetch_ahead<0>(mb);
      if constexpr (HAS_G && kBlockConvert<HW, G>) {
        load_block<HW>(gb, gv);
        for (int j = 0; j < kBlock; ++j) c[j] = b1 * mb[j] + omb1 * gv[j];
      } else {  // one fused loop: fewer instructions where conversions vectorize anyway
        for (int j = 0; j < kBlock; ++j) {
          const float gj = HAS_G ? to_f32(gb[j]) : 0.0f;
          c[j] = b1 * mb[j] + omb1 * gj;
        }
      }
    } else {  // the tensor's last, partial block: the bits past its end are 0
      const int count = static_cast<int>(numel - i0);
      for (int j = 0; j < kBlock; ++j) c[j] = 0.0f;
      for (int j = 0; j < count; ++j) {
        const float gj = HAS_G ? to_f32(gb[j]) : 0.0f;
        c[j] = b1 * mb[j] + omb1 * gj;
      }
    }
    uint32_t pos, neg;
    pack_signs<TERNARY>(c, &pos, &neg);
    if (TERNARY) {
      words[2 * b] = pos;
      words[2 * b + 1] = neg;
    } else {
      words[b] = pos;
    }
  }
}

template <typename G, bool HAS_G, bool TERNARY>
void local_step_base(const G* g, const float* m, int64_t numel, uint32_t* words, int64_t b_begin,
                     int64_t b_end, float b1, float omb1) {
  local_step_body<G, HAS_G, TERNARY, false>(g, m, numel, words, b_begin, b_end, b1, omb1);
}
#ifdef DLION_HAVE_AVX2_CLONE
template <typename G, bool HAS_G, bool TERNARY>
DLION_AVX2 void local_step_avx2(const G* g, const float* m, int64_t numel, uint32_t* words,
                                int64_t b_begin, int64_t b_end, float b1, float omb1) {
  local_step_body<G, HAS_G, TERNARY, true>(g, m, numel, words, b_begin, b_end, b1, omb1);
}
#endif

// DLION_PICK(name, template args): the block function name_avx2<...> when the CPU has AVX2 and
// F16C, else name_base<...>.
#ifdef DLION_HAVE_AVX2_CLONE
template <typename Fn>
Fn pick(Fn base, Fn avx2) {
  return cpu_has_avx2() ? avx2 : base;
}
#define DLION_PICK(fn, ...) pick(&fn##_base<__VA_ARGS__>, &fn##_avx2<__VA_ARGS__>)
#else
#define DLION_PICK(fn, ...) (&fn##_base<__VA_ARGS__>)
#endif

template <typename G, bool TERNARY>
void local_step_typed(const int64_t* table, int64_t n_tensors, uint32_t* votes, float b1,
                      float omb1, int threads) {
  int64_t total_blocks = 0;
  const std::vector<Task> tasks = make_tasks(table, n_tensors, &total_blocks);
  constexpr int planes = TERNARY ? 2 : 1;
  const auto with_g = DLION_PICK(local_step, G, true, TERNARY);
  const auto without_g = DLION_PICK(local_step, G, false, TERNARY);
  parallel_for(static_cast<int64_t>(tasks.size()), threads_for(total_blocks, threads),
               [&](int64_t i) {
                 const Task& task = tasks[i];
                 const int64_t t = task.tensor, T = n_tensors;
                 const G* g = reinterpret_cast<const G*>(table[kRowA * T + t]);
                 const float* m = reinterpret_cast<const float*>(table[kRowB * T + t]);
                 const int64_t numel = table[kRowNumel * T + t];
                 uint32_t* words = votes + planes * table[kRowBlock * T + t];
                 (g != nullptr ? with_g : without_g)(g, m, numel, words, task.begin, task.end, b1,
                                                     omb1);
               });
}

template <typename G>
void local_step_dtype(const int64_t* table, int64_t n_tensors, uint32_t* votes, float b1,
                      float omb1, bool ternary, int threads) {
  if (ternary) {
    local_step_typed<G, true>(table, n_tensors, votes, b1, omb1, threads);
  } else {
    local_step_typed<G, false>(table, n_tensors, votes, b1, omb1, threads);
  }
}

// ----------------------------------------------------------------------------- tally

// Adds the bit vector x to the bit-sliced counters cnt[0..P) of one word column.
template <int P>
inline void add_bits(uint32_t (*cnt)[kTallyTile], int b, uint32_t x) {
  uint32_t carry = x;
  for (int p = 0; p < P; ++p) {
    const uint32_t next = cnt[p][b] & carry;
    cnt[p][b] ^= carry;
    carry = next;
  }
}

// Compares the bit-sliced counters of column b with the constant k: bits where count > k (gt)
// and where count == k (eq).
template <int P>
inline void compare_const(uint32_t (*cnt)[kTallyTile], int b, int64_t k, uint32_t* gt,
                          uint32_t* eq) {
  uint32_t g = 0, e = ~0u;
  for (int p = P - 1; p >= 0; --p) {
    const uint32_t c = cnt[p][b];
    if ((k >> p) & 1) {
      e &= c;
    } else {
      g |= e & c;
      e &= ~c;
    }
  }
  *gt = g;
  *eq = e;
}

// Carry-save adder: (high, low) = the two bits of a + b + c.
inline void csa(uint32_t& high, uint32_t& low, uint32_t a, uint32_t b, uint32_t c) {
  const uint32_t u = a ^ b;
  high = (a & b) | (u & c);
  low = u ^ c;
}

// Adds 8 bit vectors to the counters of column b with a Harley-Seal tree of carry-save adders
// (7 CSAs and one carry ripple from plane 3, instead of 8 ripples through all planes). P >= 4.
template <int P>
inline void add_8_bits(uint32_t (*cnt)[kTallyTile], int b, const uint32_t (&a)[8]) {
  uint32_t ones = cnt[0][b], twos = cnt[1][b], fours = cnt[2][b];
  uint32_t twos_a, twos_b, fours_a, fours_b, eights;
  csa(twos_a, ones, ones, a[0], a[1]);
  csa(twos_b, ones, ones, a[2], a[3]);
  csa(fours_a, twos, twos, twos_a, twos_b);
  csa(twos_a, ones, ones, a[4], a[5]);
  csa(twos_b, ones, ones, a[6], a[7]);
  csa(fours_b, twos, twos, twos_a, twos_b);
  csa(eights, fours, fours, fours_a, fours_b);
  cnt[0][b] = ones;
  cnt[1][b] = twos;
  cnt[2][b] = fours;
  uint32_t carry = eights;
  for (int p = 3; p < P; ++p) {
    const uint32_t next = cnt[p][b] & carry;
    cnt[p][b] ^= carry;
    carry = next;
  }
}

template <int P, bool TERNARY>
void tally_blocks(const uint32_t* stacked, int64_t row_words, int64_t n, int64_t b_begin,
                  int64_t b_end, uint32_t* out, bool average, int out_planes, uint32_t tie) {
  uint32_t cnt[P][kTallyTile];
  // Ternary counts q = #plus + #(not minus) = #plus - #minus + n over 2n bit vectors.
  constexpr int64_t kGroupRows = TERNARY ? 4 : 8;  // rows per 8 bit vectors
  for (int64_t b0 = b_begin; b0 < b_end; b0 += kTallyTile) {
    const int nb = static_cast<int>(std::min<int64_t>(kTallyTile, b_end - b0));
    for (int p = 0; p < P; ++p)
      for (int b = 0; b < kTallyTile; ++b) cnt[p][b] = 0;
    int64_t i = 0;
    if (P >= 4) {
      for (; i + kGroupRows <= n; i += kGroupRows) {
        const uint32_t* r = stacked + i * row_words + (TERNARY ? 2 * b0 : b0);
        for (int b = 0; b < nb; ++b) {
          uint32_t a[8];
          for (int k = 0; k < 8; ++k) {
            if (TERNARY) {
              const uint32_t w = r[(k / 2) * row_words + 2 * b + (k % 2)];
              a[k] = (k % 2) ? ~w : w;
            } else {
              a[k] = r[k * row_words + b];
            }
          }
          add_8_bits<P>(cnt, b, a);
        }
      }
    }
    for (; i < n; ++i) {
      const uint32_t* row = stacked + i * row_words;
      if (TERNARY) {
        const uint32_t* r = row + 2 * b0;
        for (int b = 0; b < nb; ++b) {
          add_bits<P>(cnt, b, r[2 * b]);
          add_bits<P>(cnt, b, ~r[2 * b + 1]);
        }
      } else {
        const uint32_t* r = row + b0;
        for (int b = 0; b < nb; ++b) add_bits<P>(cnt, b, r[b]);
      }
    }
    if (average) {
      for (int b = 0; b < nb; ++b)
        for (int p = 0; p < out_planes; ++p) out[(b0 + b) * out_planes + p] = cnt[p][b];
    } else if (TERNARY) {  // pos: q > n, neg: q < n
      for (int b = 0; b < nb; ++b) {
        uint32_t gt, eq;
        compare_const<P>(cnt, b, n, &gt, &eq);
        out[2 * (b0 + b)] = gt;
        out[2 * (b0 + b) + 1] = ~(gt | eq);
      }
    } else {  // +1 where 2k > n; a tie (2k == n, n even) takes the tie pattern
      const uint32_t tie_mask = (n % 2 == 0) ? tie : 0u;
      for (int b = 0; b < nb; ++b) {
        uint32_t gt, eq;
        compare_const<P>(cnt, b, n / 2, &gt, &eq);
        out[b0 + b] = gt | (eq & tie_mask);
      }
    }
  }
}

template <int P, bool TERNARY>
void tally_typed(const uint32_t* stacked, int64_t row_words, int64_t n, int64_t blocks,
                 uint32_t* out, bool average, int out_planes, uint32_t tie, int threads) {
  const int64_t n_tasks = (blocks + kTallyTaskBlocks - 1) / kTallyTaskBlocks;
  const int use = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(threads, blocks * n / 4096 + 1)));
  parallel_for(n_tasks, use, [&](int64_t task) {
    const int64_t begin = task * kTallyTaskBlocks;
    const int64_t end = std::min(blocks, begin + kTallyTaskBlocks);
    tally_blocks<P, TERNARY>(stacked, row_words, n, begin, end, out, average, out_planes, tie);
  });
}

template <bool TERNARY>
void tally_planes(int planes, const uint32_t* stacked, int64_t row_words, int64_t n,
                  int64_t blocks, uint32_t* out, bool average, int out_planes, uint32_t tie,
                  int threads) {
#define DLION_TALLY_CASE(P)                                                                   \
  case P:                                                                                     \
    return tally_typed<P, TERNARY>(stacked, row_words, n, blocks, out, average, out_planes, \
                                   tie, threads);
  switch (planes) {
    DLION_TALLY_CASE(1)
    DLION_TALLY_CASE(2)
    DLION_TALLY_CASE(3)
    DLION_TALLY_CASE(4)
    DLION_TALLY_CASE(5)
    DLION_TALLY_CASE(6)
    DLION_TALLY_CASE(7)
    DLION_TALLY_CASE(8)
    default:
      return tally_typed<kMaxCountPlanes, TERNARY>(stacked, row_words, n, blocks, out, average,
                                                   out_planes, tie, threads);
  }
#undef DLION_TALLY_CASE
}

// ----------------------------------------------------------------------------- apply

enum Decode : int { kVoteBinary = 0, kVoteTernary = 1, kAverageBinary = 2, kAverageTernary = 3 };

// The arguments of apply that every block loop needs.
struct ApplyArgs {
  float lr, wd, b2, omb2, nf;
  int n, planes;
};

// Apply on the blocks [b_begin, b_end) of one tensor: x from the aggregate, then m from g (m and
// g are independent of x, so both streams share one pass over the blocks). Average mode: q (the
// count, plane p = bit p) is rebuilt from the top plane down with fixed-length 32-lane integer
// loops, and D = float(a*q - n) / float(n) by a vectorized IEEE division (exactly reference.py's
// `num.to(f32) / f32(n)`). PL > 0 is the number of planes known at compile time (fully unrolled,
// q stays in registers); PL == 0 reads it from `a.planes`. g == nullptr: a None gradient (zeros).
// m == nullptr: no momentum (x only; g is not read), e.g. hierarchy's params outside the shard.
template <typename P, typename G, int KIND, int PL, bool HW>
DLION_ALWAYS_INLINE void apply_body(P* x, const G* g, float* m, int64_t numel,
                                    const uint32_t* words, int64_t b_begin, int64_t b_end,
                                    const ApplyArgs& a) {
  const int planes = PL > 0 ? PL : a.planes;
  const float lr = a.lr, wd = a.wd, b2 = a.b2, omb2 = a.omb2;
  alignas(32) float d[kBlock];
  alignas(32) float xv[kBlock];
  for (int64_t b = b_begin; b < b_end; ++b) {
    if (KIND == kVoteBinary) {
      const uint32_t w = words[b];
      for (int j = 0; j < kBlock; ++j) d[j] = (w & kBit.v[j]) ? 1.0f : -1.0f;
    } else if (KIND == kVoteTernary) {
      const uint32_t pos = words[2 * b], neg = words[2 * b + 1];
      for (int j = 0; j < kBlock; ++j)
        d[j] = static_cast<float>(((pos & kBit.v[j]) ? 1 : 0) - ((neg & kBit.v[j]) ? 1 : 0));
    } else {
      alignas(32) int32_t q[kBlock];
      for (int j = 0; j < kBlock; ++j) q[j] = 0;
      const uint32_t* wb = words + b * planes;
      for (int p = planes - 1; p >= 0; --p) {
        const uint32_t w = wb[p];
        for (int j = 0; j < kBlock; ++j) q[j] = q[j] + q[j] + ((w & kBit.v[j]) ? 1 : 0);
      }
      for (int j = 0; j < kBlock; ++j) {
        const int32_t num = KIND == kAverageBinary ? 2 * q[j] - a.n : q[j] - a.n;
        d[j] = static_cast<float>(num) / a.nf;
      }
    }
    const int64_t i0 = b * kBlock;
    P* xb = x + i0;
    float* mb = m != nullptr ? m + i0 : nullptr;
    const G* gb = g != nullptr && m != nullptr ? g + i0 : nullptr;
    const int count = static_cast<int>(std::min<int64_t>(kBlock, numel - i0));
    if (count == kBlock) {
      prefetch_ahead<1>(xb);
      if (mb != nullptr) prefetch_ahead<1>(mb);
      if constexpr (kBlockConvert<HW, P>) {
        load_block<HW>(xb, xv);
        for (int j = 0; j < kBlock; ++j) xv[j] = xv[j] - lr * (d[j] + wd * xv[j]);
        store_block<HW>(xb, xv);
      } else {  // one fused loop: fewer instructions where conversions vectorize anyway
        for (int j = 0; j < kBlock; ++j) {
          const float xf = to_f32(xb[j]);
          xb[j] = from_f32<P>(xf - lr * (d[j] + wd * xf));
        }
      }
      if (mb == nullptr) {
        // no momentum
      } else if (gb != nullptr) {
        prefetch_ahead<0>(gb);
        if constexpr (kBlockConvert<HW, G>) {
          load_block<HW>(gb, xv);  // xv is free again: the gradient as fp32
          for (int j = 0; j < kBlock; ++j) mb[j] = b2 * mb[j] + omb2 * xv[j];
        } else {
          for (int j = 0; j < kBlock; ++j) mb[j] = b2 * mb[j] + omb2 * to_f32(gb[j]);
        }
      } else {
        for (int j = 0; j < kBlock; ++j) mb[j] = b2 * mb[j] + omb2 * 0.0f;
      }
    } else {
      for (int j = 0; j < count; ++j) {
        const float xf = to_f32(xb[j]);
        xb[j] = from_f32<P>(xf - lr * (d[j] + wd * xf));
        if (mb == nullptr) continue;
        const float gj = gb != nullptr ? to_f32(gb[j]) : 0.0f;
        mb[j] = b2 * mb[j] + omb2 * gj;
      }
    }
  }
}

template <typename P, typename G, int KIND, int PL>
void apply_base(P* x, const G* g, float* m, int64_t numel, const uint32_t* words, int64_t b_begin,
                int64_t b_end, const ApplyArgs& a) {
  apply_body<P, G, KIND, PL, false>(x, g, m, numel, words, b_begin, b_end, a);
}
#ifdef DLION_HAVE_AVX2_CLONE
template <typename P, typename G, int KIND, int PL>
DLION_AVX2 void apply_avx2(P* x, const G* g, float* m, int64_t numel, const uint32_t* words,
                           int64_t b_begin, int64_t b_end, const ApplyArgs& a) {
  apply_body<P, G, KIND, PL, true>(x, g, m, numel, words, b_begin, b_end, a);
}
#endif

template <typename P, typename G, int KIND, int PL>
void apply_typed(const int64_t* table, int64_t n_tensors, const uint32_t* aggregate,
                 const ApplyArgs& a, int threads) {
  const auto blocks = DLION_PICK(apply, P, G, KIND, PL);
  int64_t total_blocks = 0;
  const std::vector<Task> tasks = make_tasks(table, n_tensors, &total_blocks);
  parallel_for(static_cast<int64_t>(tasks.size()), threads_for(total_blocks, threads),
               [&](int64_t i) {
                 const Task& task = tasks[i];
                 const int64_t t = task.tensor, T = n_tensors;
                 P* x = reinterpret_cast<P*>(table[kRowA * T + t]);
                 float* m = reinterpret_cast<float*>(table[kRowB * T + t]);
                 const G* g = reinterpret_cast<const G*>(table[kRowC * T + t]);
                 const int64_t numel = table[kRowNumel * T + t];
                 const uint32_t* words = aggregate + a.planes * table[kRowBlock * T + t];
                 blocks(x, g, m, numel, words, task.begin, task.end, a);
               });
}

template <typename P, typename G, int KIND>
void apply_average(const int64_t* table, int64_t n_tensors, const uint32_t* aggregate,
                   const ApplyArgs& a, int threads) {
#define DLION_APPLY_CASE(PL) \
  case PL:                   \
    return apply_typed<P, G, KIND, PL>(table, n_tensors, aggregate, a, threads);
  static_assert(kMaxStaticPlanes == 8, "update the cases below");
  switch (a.planes) {
    DLION_APPLY_CASE(1)
    DLION_APPLY_CASE(2)
    DLION_APPLY_CASE(3)
    DLION_APPLY_CASE(4)
    DLION_APPLY_CASE(5)
    DLION_APPLY_CASE(6)
    DLION_APPLY_CASE(7)
    DLION_APPLY_CASE(8)
    default:
      return apply_typed<P, G, KIND, 0>(table, n_tensors, aggregate, a, threads);
  }
#undef DLION_APPLY_CASE
}

template <typename P, typename G>
void apply_dtype(const int64_t* table, int64_t n_tensors, const uint32_t* aggregate,
                 ApplyArgs a, bool average, bool ternary, int threads) {
  if (!average) {
    a.planes = ternary ? 2 : 1;
    if (ternary) return apply_typed<P, G, kVoteTernary, 2>(table, n_tensors, aggregate, a, threads);
    return apply_typed<P, G, kVoteBinary, 1>(table, n_tensors, aggregate, a, threads);
  }
  a.planes = bit_length(ternary ? 2 * int64_t{a.n} : int64_t{a.n});
  if (ternary) return apply_average<P, G, kAverageTernary>(table, n_tensors, aggregate, a, threads);
  return apply_average<P, G, kAverageBinary>(table, n_tensors, aggregate, a, threads);
}

// Gradients of the parameters' dtype or fp32 (e.g. fp32 node means with bf16 parameters).
template <typename P>
void apply_grad_dtype(const int64_t* table, int64_t n_tensors, DType p_dtype, DType g_dtype,
                      const uint32_t* aggregate, const ApplyArgs& a, bool average, bool ternary,
                      int threads) {
  if (g_dtype == p_dtype)
    return apply_dtype<P, P>(table, n_tensors, aggregate, a, average, ternary, threads);
  if (g_dtype == DType::kFloat32)
    return apply_dtype<P, float>(table, n_tensors, aggregate, a, average, ternary, threads);
  throw std::invalid_argument("dlion_kernels: apply: gradients must have the parameters' dtype "
                              "or float32");
}

// ----------------------------------------------------------------------------- nonfinite

// x * 0 is NaN exactly when x is inf or NaN, and 0 otherwise, so 32 lane sums of g * 0 stay 0
// until a non-finite element reaches them: fixed-length independent lanes, which vectorize.
template <typename G, bool HW>
DLION_ALWAYS_INLINE bool nonfinite_body(const G* g, int64_t numel, int64_t b_begin,
                                        int64_t b_end) {
  alignas(32) float acc[kBlock] = {};
  alignas(32) float gv[kBlock];
  for (int64_t b = b_begin; b < b_end; ++b) {
    const G* gb = g + b * kBlock;
    const int64_t count = std::min<int64_t>(kBlock, numel - b * kBlock);
    if (count == kBlock) {
      prefetch_ahead<0>(gb);
      if constexpr (kBlockConvert<HW, G>) {
        load_block<HW>(gb, gv);
        for (int j = 0; j < kBlock; ++j) acc[j] += gv[j] * 0.0f;
      } else {
        for (int j = 0; j < kBlock; ++j) acc[j] += to_f32(gb[j]) * 0.0f;
      }
    } else {
      for (int j = 0; j < count; ++j) acc[j] += to_f32(gb[j]) * 0.0f;
    }
  }
  bool any = false;
  for (int j = 0; j < kBlock; ++j) any |= acc[j] != acc[j];
  return any;
}

template <typename G>
bool nonfinite_base(const G* g, int64_t numel, int64_t b_begin, int64_t b_end) {
  return nonfinite_body<G, false>(g, numel, b_begin, b_end);
}
#ifdef DLION_HAVE_AVX2_CLONE
template <typename G>
DLION_AVX2 bool nonfinite_avx2(const G* g, int64_t numel, int64_t b_begin, int64_t b_end) {
  return nonfinite_body<G, true>(g, numel, b_begin, b_end);
}
#endif

template <typename G>
bool nonfinite_typed(const int64_t* table, int64_t n_tensors, int threads) {
  int64_t total_blocks = 0;
  const std::vector<Task> tasks = make_tasks(table, n_tensors, &total_blocks);
  const auto blocks = DLION_PICK(nonfinite, G);
  std::atomic<bool> found{false};
  parallel_for(static_cast<int64_t>(tasks.size()), threads_for(total_blocks, threads),
               [&](int64_t i) {
                 if (found.load(std::memory_order_relaxed)) return;
                 const Task& task = tasks[i];
                 const int64_t t = task.tensor, T = n_tensors;
                 const G* g = reinterpret_cast<const G*>(table[kRowA * T + t]);
                 if (blocks(g, table[kRowNumel * T + t], task.begin, task.end))
                   found.store(true, std::memory_order_relaxed);
               });
  return found.load();
}

void check_n(int64_t n) {
  if (n < 1 || n > kMaxVoters)
    throw std::invalid_argument("dlion_kernels: n (the number of vote vectors) must be in "
                                "[1, 32767], got " + std::to_string(n));
}

}  // namespace

void cpu_local_step(const int64_t* table, int64_t n_tensors, DType g_dtype, uint32_t* votes,
                    float b1, float omb1, bool ternary, int threads) {
  switch (g_dtype) {
    case DType::kFloat32:
      return local_step_dtype<float>(table, n_tensors, votes, b1, omb1, ternary, threads);
    case DType::kBFloat16:
      return local_step_dtype<bf16>(table, n_tensors, votes, b1, omb1, ternary, threads);
    case DType::kFloat16:
      return local_step_dtype<fp16>(table, n_tensors, votes, b1, omb1, ternary, threads);
  }
  throw std::invalid_argument("dlion_kernels: unknown gradient dtype code");
}

void cpu_tally(const uint32_t* stacked, int64_t row_words, int64_t n, int64_t blocks,
               uint32_t* out, bool average, bool ternary, uint32_t tie, int threads) {
  check_n(n);
  const int count_planes = bit_length(ternary ? 2 * n : n);
  const int out_planes = average ? count_planes : (ternary ? 2 : 1);
  if (ternary) {
    tally_planes<true>(count_planes, stacked, row_words, n, blocks, out, average, out_planes, tie,
                       threads);
  } else {
    tally_planes<false>(count_planes, stacked, row_words, n, blocks, out, average, out_planes, tie,
                        threads);
  }
}

void cpu_apply(const int64_t* table, int64_t n_tensors, DType p_dtype, DType g_dtype,
               const uint32_t* aggregate, float lr, float wd, float b2, float omb2, int64_t n,
               bool average, bool ternary, int threads) {
  check_n(n);
  const ApplyArgs a{lr, wd, b2, omb2, static_cast<float>(n), static_cast<int>(n), 0};
  switch (p_dtype) {
    case DType::kFloat32:
      return apply_grad_dtype<float>(table, n_tensors, p_dtype, g_dtype, aggregate, a, average,
                                     ternary, threads);
    case DType::kBFloat16:
      return apply_grad_dtype<bf16>(table, n_tensors, p_dtype, g_dtype, aggregate, a, average,
                                    ternary, threads);
    case DType::kFloat16:
      return apply_grad_dtype<fp16>(table, n_tensors, p_dtype, g_dtype, aggregate, a, average,
                                    ternary, threads);
  }
  throw std::invalid_argument("dlion_kernels: unknown parameter dtype code");
}

std::string cpu_isa() {
#ifdef DLION_HAVE_AVX2_CLONE
  if (cpu_has_avx2()) return "avx2+f16c";
#endif
  return "baseline";
}

bool cpu_nonfinite(const int64_t* table, int64_t n_tensors, DType g_dtype, int threads) {
  switch (g_dtype) {
    case DType::kFloat32:
      return nonfinite_typed<float>(table, n_tensors, threads);
    case DType::kBFloat16:
      return nonfinite_typed<bf16>(table, n_tensors, threads);
    case DType::kFloat16:
      return nonfinite_typed<fp16>(table, n_tensors, threads);
  }
  throw std::invalid_argument("dlion_kernels: unknown gradient dtype code");
}

}  // namespace dlion
