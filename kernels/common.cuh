// Helpers shared by the InstanceNorm kernels: storage-type traits, streaming
// stores, cp.async staging, the mean/M2 statistics of a slice and their warp and
// block reductions, the resident paths' teams (cluster or cooperative launch); on
// the host, dtype dispatch, occupancy queries, the resident paths' plans and the
// launch of a plan's kernel.
#pragma once

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cuda/atomic>
#include <cuda/std/type_traits>
#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "instance_norm.h"

namespace instance_norm {

constexpr int kWarpSize = 32;
// Hopper's largest cluster (16 CTAs needs cudaFuncAttributeNonPortableClusterSizeAllowed).
constexpr int kMaxClusterSize = 16;

// torch.relu: negative values to 0, NaN kept; on sm_80+ one max.NaN (PTX ISA, max),
// where fmaxf would turn NaN into 0.
__device__ __forceinline__ float relu(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float out;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(out) : "f"(v));
  return out;
#else
  return v < 0.f ? 0.f : v;
#endif
}

// Storage types (float, __half, __nv_bfloat16): how many values one 16-byte vector
// holds, and their conversion to and from the float32 all arithmetic is done in.
template <typename T>
struct Storage;

template <>
struct Storage<float> {
  static constexpr int kPerVector = 4;
  static constexpr bool kHasPermuteUnpack = false;  // float32 is not unpacked
  __device__ static float to_float(float v) { return v; }
  __device__ static float from_float(float v) { return v; }
  __device__ static void unpack(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x), out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z), out[3] = __uint_as_float(raw.w);
  }
  __device__ static uint4 pack(const float* in) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                      __float_as_uint(in[3]));
  }
};

// 16-bit types: the vector is four words of two values each. A type may give a
// second unpacking of the same values by other instructions (kToFloat2ByPermute):
// the compiler does not merge a loop that unpacks one way with a later one that
// unpacks the other way, where it would otherwise keep the unpacked floats live
// from the first loop to the second. pack_relu(in) is pack of the values' relu
// (kFromFloatsRelu converts the relu of two values).
template <typename T, typename T2, float2 (*kToFloat2)(T2), T2 (*kFromFloats)(float, float),
          T2 (*kFromFloatsRelu)(float, float), float2 (*kToFloat2ByPermute)(T2) = nullptr>
struct Storage16 {
  static constexpr int kPerVector = 8;
  static constexpr bool kHasPermuteUnpack = kToFloat2ByPermute != nullptr;
  __device__ static void unpack(const uint4& raw, float* out) { unpack_with<kToFloat2>(raw, out); }
  __device__ static void unpack_by_permute(const uint4& raw, float* out) {
    unpack_with<kToFloat2ByPermute>(raw, out);
  }
  template <float2 (*kConvert)(T2)>
  __device__ static void unpack_with(const uint4& raw, float* out) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      T2 pair;
      memcpy(&pair, &words[k], sizeof(pair));
      const float2 f = kConvert(pair);
      out[2 * k] = f.x, out[2 * k + 1] = f.y;
    }
  }
  __device__ static uint4 pack(const float* in) { return pack_with<kFromFloats>(in); }
  __device__ static uint4 pack_relu(const float* in) { return pack_with<kFromFloatsRelu>(in); }
  template <T2 (*kConvert)(float, float)>
  __device__ static uint4 pack_with(const float* in) {
    unsigned words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const T2 pair = kConvert(in[2 * k], in[2 * k + 1]);
      memcpy(&words[k], &pair, sizeof(pair));
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
};

// The relu of two floats, converted to a 16-bit pair (a to the low half): on sm_80+
// one cvt, whose .relu clamps negative results to 0 and keeps NaN (PTX ISA, cvt),
// so a 16-bit store's ReLU costs no instruction of its own.
template <typename T2, T2 (*kFromFloats)(float, float)>
__device__ __forceinline__ T2 floats_to_pair_relu(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned word;
  if constexpr (cuda::std::is_same_v<T2, __half2>) {
    asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(b), "f"(a));
  } else {
    asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(b), "f"(a));
  }
  T2 pair;
  memcpy(&pair, &word, sizeof(pair));
  return pair;
#else
  return kFromFloats(relu(a), relu(b));
#endif
}

__device__ __forceinline__ float2 half2_to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ __half2 floats_to_half2(float a, float b) { return __floats2half2_rn(a, b); }
// A bfloat16 is the top half of a float32: one shift (low value) and one mask (high
// value) per word, where __bfloat1622float2 takes a byte permute and two shifts.
__device__ __forceinline__ float2 bfloat162_to_float2(__nv_bfloat162 v) {
  unsigned word;
  memcpy(&word, &v, sizeof(word));
  return make_float2(__uint_as_float(word << 16), __uint_as_float(word & 0xffff0000u));
}
// The same values by two byte permutes (a value's two bytes above two zero bytes).
__device__ __forceinline__ float2 bfloat162_to_float2_by_permute(__nv_bfloat162 v) {
  unsigned word;
  memcpy(&word, &v, sizeof(word));
  return make_float2(__uint_as_float(__byte_perm(word, 0u, 0x1044)), __uint_as_float(__byte_perm(word, 0u, 0x3244)));
}
__device__ __forceinline__ __nv_bfloat162 floats_to_bfloat162(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}

template <>
struct Storage<__half> : Storage16<__half, __half2, half2_to_float2, floats_to_half2,
                                   floats_to_pair_relu<__half2, floats_to_half2>> {
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __low2half(__float2half2_rn(v)); }
};

template <>
struct Storage<__nv_bfloat16>
    : Storage16<__nv_bfloat16, __nv_bfloat162, bfloat162_to_float2, floats_to_bfloat162,
                floats_to_pair_relu<__nv_bfloat162, floats_to_bfloat162>, bfloat162_to_float2_by_permute> {
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// Calls f(i, v) for each raw 16-byte vector raw[i], i < valid, with v its values
// as float. The resident kernels keep the raw vectors in registers (4 registers
// per vector whatever the dtype) and unpack them at each use through this; f may
// rewrite raw[i] (through its own reference to the array) once v is unpacked.
// `valid` is an int, or cuda::std::integral_constant<int, N> where every vector is
// valid (then no test or branch per vector is compiled; with_valid_count picks).
// BY_PERMUTE unpacks through Storage<T>::unpack_by_permute (where kHasPermuteUnpack).
template <typename T, bool BY_PERMUTE = false, int N, typename Count, typename F>
__device__ __forceinline__ void for_each_unpacked(const uint4 (&raw)[N], Count valid, F f) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i < valid) {
      float v[Storage<T>::kPerVector];
      if constexpr (BY_PERMUTE) {
        Storage<T>::unpack_by_permute(raw[i], v);
      } else {
        Storage<T>::unpack(raw[i], v);
      }
      f(i, v);
    }
  }
}

// Calls f(cuda::std::integral_constant<int, N>()) when valid == N, else f(valid):
// a loop over a thread's N vectors compiled both without and with a test per vector.
template <int N, typename F>
__device__ __forceinline__ auto with_valid_count(int valid, F f) {
  return valid == N ? f(cuda::std::integral_constant<int, N>()) : f(valid);
}

// Whether p is 16-byte aligned; nullptr counts as aligned (support queries made
// before the output exists; the caching allocator's blocks are aligned).
__host__ __device__ inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The ceiling of a / b (a >= 0, b > 0), and a rounded up to a multiple of b, in the
// wider type of the two: for the host's sizes and grids (a kernel's own bounds keep
// their min/max form, whose machine code the timings were taken with).
template <typename A, typename B>
__host__ __device__ constexpr auto ceil_div(A a, B b) -> decltype(a + b) {
  return (a + b - 1) / b;
}
template <typename A, typename B>
__host__ __device__ constexpr auto round_up(A a, B b) -> decltype(a + b) {
  return ceil_div(a, b) * b;
}

// How many of a thread's `most` strided items exist: items first + i * STRIDE, for i
// below the result, lie below `count` (0 where first >= count), in the integer type of
// count and first. The resident forward writes the same expression out (see there).
template <int STRIDE, typename I>
__device__ __forceinline__ I valid_count(I count, I first, int most) {
  return min(I{most}, max(I{0}, (count - first + STRIDE - 1) / STRIDE));
}

// An L2 eviction policy that keeps lines (evict_last), for a first read whose
// second should find them in L2.
__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// store_streaming to base + OFFSET bytes, OFFSET an immediate.
template <int OFFSET>
__device__ __forceinline__ void store_streaming_at(void* base, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0+%5], {%1, %2, %3, %4};" ::"l"(base), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w),
               "n"(OFFSET)
               : "memory");
}

// Every output element is written once: streaming (evict-first) 16-byte stores
// keep it from displacing reusable lines in L2.
__device__ __forceinline__ void store_streaming(uint4* p, uint4 v) { __stcs(p, v); }

// Per-thread asynchronous 16-byte copy global -> shared (sm_80+), cached in L2
// only; completes for the issuing thread at cp_async_wait_all() or at a
// cp_async_wait_group() that its commit group passes.
// Copies global_base + OFFSET bytes to shared-memory address shared_base + OFFSET
// bytes. OFFSET is an immediate in both addresses, so a loop over offsets keeps two
// base registers instead of a pair of addresses per copy (which spills).
template <int OFFSET>
__device__ __forceinline__ void cp_async_16(unsigned shared_base, const void* global_base) {
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;" ::"r"(shared_base), "l"(global_base), "n"(OFFSET)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Waits until at most N of this thread's most recently committed cp.async groups
// are pending (the groups before them complete).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// cp_async_16 with an L2 eviction policy (e.g. l2_evict_last_policy()).
template <int OFFSET>
__device__ __forceinline__ void cp_async_16_hint(unsigned shared_base, const void* global_base, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0+%3], [%1+%3], 16, %2;" ::"r"(shared_base),
               "l"(global_base), "l"(policy), "n"(OFFSET)
               : "memory");
}

// cp.async-copies this thread's 16-byte vectors i < valid (column[i * THREADS])
// into its shared-memory column (staged_column + i * THREADS * 16 bytes), then
// commits (an empty group when valid <= 0): the staging of the resident paths' next
// slice, and the backward's dy ring. KEEP_IN_L2 asks L2 to keep the lines
// (evict_last) for a second read.
template <int THREADS, bool KEEP_IN_L2 = false, int... I>
__device__ __forceinline__ void stage_column(unsigned staged_column, const uint4* column, int valid,
                                             std::integer_sequence<int, I...>) {
  if constexpr (KEEP_IN_L2) {
    const uint64_t policy = l2_evict_last_policy();
    ((I < valid ? cp_async_16_hint<I * THREADS * 16>(staged_column, column, policy) : void()), ...);
  } else {
    ((I < valid ? cp_async_16<I * THREADS * 16>(staged_column, column) : void()), ...);
  }
  cp_async_commit();
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Bulk copy (sm_90+, the TMA engine) of `bytes` (a multiple of 16; both addresses
// 16-byte aligned) from global memory to this CTA's shared memory at shared
// address `destination`, completing as transaction bytes on the mbarrier at shared
// address `barrier` (after mbarrier_arrive_expect_tx of the same bytes).
__device__ __forceinline__ void bulk_copy_to_shared(unsigned destination, const void* source, unsigned bytes,
                                                    unsigned barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   destination),
               "l"(source), "r"(bytes), "r"(barrier)
               : "memory");
}

// Spins until the phase of `barrier` with parity `parity` (0 or 1) has completed
// (sm_90+ mbarrier try_wait.parity, acquire at CTA scope).
__device__ __forceinline__ void wait_mbarrier_phase(uint64_t* barrier, unsigned parity) {
  while (!cuda::ptx::mbarrier_try_wait_parity(barrier, parity)) {
  }
}
#endif

// `address` made to depend on every vector of `raw`, so that a cp.async to it
// issues only after the shared-memory loads into `raw` have returned their data
// (a register dependency the hardware's scoreboard enforces): a thread can then
// restage a shared-memory column it has just read without waiting for any use of
// the values. `zero` must be 0 at run time but unknown to the compiler (computed
// from a kernel parameter), or the dependency would be folded away.
template <int N>
__device__ __forceinline__ unsigned after_reading(unsigned address, const uint4 (&raw)[N], unsigned zero) {
  unsigned any = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) any |= raw[i].x;
  return address + (any & zero);
}

// n / d for 32-bit n < 2^31 and 0 < d < 2^31 by a multiply-high and a shift
// (Granlund & Montgomery 1994; the same magic numbers as PyTorch's IntDivider), so
// elementwise kernels can split an index per element without a hardware divide.
struct FastDivider {
  unsigned divisor;
  unsigned multiplier;
  unsigned shift;

  __host__ explicit FastDivider(unsigned d) : divisor(d), multiplier(0), shift(0) {
    while (shift < 32 && (1ull << shift) < d) ++shift;
    multiplier = static_cast<unsigned>(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ unsigned div(unsigned n) const { return (__umulhi(n, multiplier) + n) >> shift; }
};

// x -> fma(x, scale, offset): the map a SliceShift becomes with a center folded into
// its offset (SliceShift::centered).
struct LinearMap {
  float scale;
  float offset;
  __device__ float apply(float x) const { return __fmaf_rn(x, scale, offset); }
};

// Every path takes the statistics of d = (x - shift) * k, shift = the slice's first
// value, k = a power of two: 1 unless |shift| >= 2^32, then 2^-exponent(shift), so
// values near 1e30 (fp32 or bf16) become values near 1 whose squares cannot overflow
// (PyTorch's own kernels give NaN there). d = fma(x, k, -shift * k) is k times the
// rounded x - shift (scaling by a power of two is exact): with k = 1 it is x - shift
// bit for bit, and it is exactly 0 where x == shift, so a constant slice gives 0.
struct SliceShift {
  float scale;   // k
  float offset;  // -shift * k (exact), from which shift and 1 / k are recovered exactly

  __device__ static SliceShift of(float shift) {
    const int exponent = static_cast<int>((__float_as_uint(shift) >> 23) & 0xffu) - 127;
    const bool large = exponent >= 32 && exponent < 128;  // 128: Inf or NaN, left to propagate
    const float scale = large ? __uint_as_float(static_cast<unsigned>(127 - exponent) << 23) : 1.f;
    return {scale, -shift * scale};
  }
  // d of a value x of the slice.
  __device__ float apply(float x) const { return __fmaf_rn(x, scale, offset); }
  // x -> d - center (center in d's units) as one FMA: fma(x, k, offset - center),
  // whose offset is rounded once, by at most half a float32 ulp of shift * k + center.
  __device__ LinearMap centered(float center) const { return {scale, offset - center}; }
  // rstd of d from its M2 over `count` values: 1 / sqrt(var_d + eps * k^2), so that
  // (d - mean_d) * rstd_d = (x - mean) / sqrt(var + eps).
  __device__ float rstd_of_d(float m2, float count, float eps) const {
    return rsqrtf(m2 / count + eps * scale * scale);
  }
  __device__ float value() const { return -offset / scale; }
  // The mean of x - shift, the slice's mean and its rstd, in x's units, from mean_d
  // and rstd_d (divisions and products by k are exact).
  __device__ float relative_mean(float mean_d) const { return mean_d / scale; }
  __device__ float mean(float mean_d) const { return value() + mean_d / scale; }
  __device__ float rstd(float rstd_d) const { return rstd_d * scale; }
};

// The channels-last kernels' statistics sweep, one vector of N channels: adds each
// channel's d = shift[k].apply(values[k]) to sum_d[k] and d^2 to sum_d2[k].
template <int N>
__device__ __forceinline__ void add_shifted_sums(const SliceShift (&shift)[N], const float (&values)[N],
                                                 float (&sum_d)[N], float (&sum_d2)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float d = shift[k].apply(values[k]);
    sum_d[k] += d;
    sum_d2[k] = __fmaf_rn(d, d, sum_d2[k]);
  }
}

// Statistics of a set of values: how many, their mean, and M2 = sum of squared
// deviations from that mean (the biased variance is m2 / count).
struct SliceStats {
  float count;
  float mean;
  float m2;
};

// Chan, Golub & LeVeque (1979), "Updating formulae and a pairwise algorithm for
// computing sample variances": merge two disjoint sets' (count, mean, M2).
// Written symmetric in (a, b), with rounding pinned by __fmul_rn/__fadd_rn so the
// compiler cannot contract it asymmetrically into an FMA: combine(a, b) and
// combine(b, a) give the same bits, so an xor-butterfly leaves every lane, and a
// rank-ordered cluster reduction every CTA, with bit-identical statistics.
__device__ __forceinline__ SliceStats combine(const SliceStats& a, const SliceStats& b) {
  if (a.count == 0.f) return b;
  if (b.count == 0.f) return a;
  const float count = a.count + b.count;
  const float mean = __fadd_rn(__fmul_rn(a.count, a.mean), __fmul_rn(b.count, b.mean)) / count;
  const float delta = b.mean - a.mean;
  const float m2 = (a.m2 + b.m2) + __fmul_rn(delta, delta) * (__fmul_rn(a.count, b.count) / count);
  return {count, mean, m2};
}

struct CombineStats {
  __device__ __forceinline__ SliceStats operator()(const SliceStats& a, const SliceStats& b) const {
    return combine(a, b);
  }
};

struct Sum {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Sums of two values per slice (the backward's sum(dy) and sum(dy * xhat), the block
// path's sums of d and d^2). Float addition is commutative bit for bit, so the
// butterflies below stay symmetric.
struct SumFloat2 {
  __device__ __forceinline__ float2 operator()(const float2& a, const float2& b) const {
    return make_float2(a.x + b.x, a.y + b.y);
  }
};

// __shfl_xor_sync of a struct of 32-bit words.
template <typename V>
__device__ __forceinline__ V shfl_xor(const V& value, int offset) {
  static_assert(sizeof(V) % 4 == 0, "shuffled as 32-bit words");
  constexpr int kWords = sizeof(V) / 4;
  unsigned words[kWords];
  memcpy(words, &value, sizeof(V));
#pragma unroll
  for (int k = 0; k < kWords; ++k) words[k] = __shfl_xor_sync(0xffffffffu, words[k], offset);
  V out;
  memcpy(&out, words, sizeof(V));
  return out;
}

// Every lane of each aligned group of `group_lanes` lanes (a power of two <= 32)
// ends with the combination (by the commutative Op) of the group's values: an xor
// butterfly, so with a symmetric Op every lane of a group gets the same bits.
template <typename V, typename Op>
__device__ __forceinline__ V group_allreduce(V value, int group_lanes, Op op) {
#pragma unroll
  for (int offset = group_lanes / 2; offset > 0; offset >>= 1) value = op(value, shfl_xor(value, offset));
  return value;
}

// group_allreduce over the whole warp.
template <typename V, typename Op>
__device__ __forceinline__ V warp_allreduce(V value, Op op) {
  return group_allreduce(value, kWarpSize, op);
}

// Items shared out to groups of `group_lanes` lanes (a power of two <= 32, aligned
// in the warp) of a grid of THREADS-thread CTAs, so that many small items (e.g.
// 70,000 slices of 16 values) take a few lanes each rather than a warp or a CTA.
// Calls f(item, in_range, group_lane) with a trip count uniform across the warp, so
// every lane reaches the groups' shuffles; past the last item f runs with in_range =
// false and must add nothing.
template <int THREADS, typename F>
__device__ __forceinline__ void for_each_group_item(int64_t num_items, int group_lanes, F f) {
  constexpr int kWarps = THREADS / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t groups_per_warp = kWarpSize / group_lanes;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * groups_per_warp;
  for (int64_t first = warp * groups_per_warp; first < num_items; first += step) {
    const int64_t item = first + lane / group_lanes;
    f(item, item < num_items, lane % group_lanes);
  }
}

// Block-wide reduction (cub::BlockReduce) whose result every thread of the block
// gets; `result` carries thread 0's total to the others. Contains __syncthreads:
// every thread of the block must call it.
template <typename V, int THREADS, typename Op>
struct BlockAllReduce {
  using Reduce = cub::BlockReduce<V, THREADS>;
  struct TempStorage {
    typename Reduce::TempStorage reduce;
    V result;
  };

  __device__ static V allreduce(V thread_value, TempStorage& storage) {
    const V total = Reduce(storage.reduce).Reduce(thread_value, Op());
    if (threadIdx.x == 0) storage.result = total;
    __syncthreads();
    const V result = storage.result;
    __syncthreads();  // storage may be reused by the caller's next reduction
    return result;
  }
};

template <int THREADS>
using BlockStatsReduce = BlockAllReduce<SliceStats, THREADS, CombineStats>;

// The weight and bias of channel `channel` as stored, P their type (the kernel's
// compile-time knowledge of p.parameter_dtype); 1 and 0 where absent. Kernels that
// load the pair early keep it so and convert it (Storage<P>::to_float) where they use
// it: a 16-bit conversion right after the load would wait for the load there.
template <typename P>
struct StoredPair {
  P weight, bias;
};

template <typename P>
__device__ __forceinline__ StoredPair<P> channel_parameters(const ForwardProblem& p, int64_t channel) {
  return {p.weight != nullptr ? __ldg(static_cast<const P*>(p.weight) + channel) : Storage<P>::from_float(1.f),
          p.bias != nullptr ? __ldg(static_cast<const P*>(p.bias) + channel) : Storage<P>::from_float(0.f)};
}

// log2 of the bytes of one weight or bias value of a forward problem on T values:
// float32 (2) or T's 16 bits (1), per ForwardProblem::parameter_dtype.
template <typename T>
__device__ __forceinline__ int parameter_bytes_log2(const ForwardProblem& p) {
  return cuda::std::is_same_v<T, float> || p.parameter_dtype == DType::kFloat32 ? 2 : 1;
}

// The weight and bias of channel `channel` of a forward problem on 16-bit T values,
// as loaded: 32-bit words holding float32 values, or T's 16 bits in the low half
// where ForwardProblem::parameter_dtype is T (an absent one's word is meaningless).
// The 16-bit warp kernels of 8 values a lane and the vector kernels load them with
// the slice's values and convert them (affine_of) after their reductions, and the
// channels-last tile kernel converts them after both loads: a 16-bit conversion right
// after its load makes the warp wait for that load before it issues the next
// (docs/perf-notes.md #186f, #187, #189e).
struct LoadedAffine {
  uint32_t weight, bias;
};

template <typename T>
__device__ __forceinline__ LoadedAffine load_channel_affine(const ForwardProblem& p, int64_t channel) {
  static_assert(sizeof(T) == 2, "16-bit values (fp32 kernels load with channel_affine)");
  LoadedAffine loaded{};
  if (p.weight == nullptr && p.bias == nullptr) return loaded;
  // Both loads in one block, without a branch between them for an absent one (which
  // loads the other's value, replaced in affine_of): ptxas put other loads' consumers
  // between two branches, and the second load waited there.
  const bool float32 = p.parameter_dtype == DType::kFloat32;
  // One address for either type: two made the 16-bit warp kernels of 32 values a
  // lane spill (docs/perf-notes.md #157).
  const int64_t offset = channel << parameter_bytes_log2<T>(p);
  const char* weight = static_cast<const char*>(p.weight != nullptr ? p.weight : p.bias) + offset;
  const char* bias = static_cast<const char*>(p.bias != nullptr ? p.bias : p.weight) + offset;
  const auto word = [&](const char* address) -> uint32_t {
    return float32 ? __ldg(reinterpret_cast<const unsigned*>(address))
                   : __ldg(reinterpret_cast<const unsigned short*>(address));
  };
  loaded.weight = word(weight);
  loaded.bias = word(bias);
  return loaded;
}

// The (weight, bias) as float of a load_channel_affine<T> result (weight 1 and bias 0
// where absent).
template <typename T>
__device__ __forceinline__ float2 affine_of(const ForwardProblem& p, LoadedAffine loaded) {
  const auto value = [&](const void* values, uint32_t word, float none) {
    if (values == nullptr) return none;
    if (p.parameter_dtype == DType::kFloat32) return __uint_as_float(word);
    const unsigned short bits = static_cast<unsigned short>(word);
    T v;
    memcpy(&v, &bits, sizeof(v));
    return Storage<T>::to_float(v);
  };
  return make_float2(value(p.weight, loaded.weight, 1.f), value(p.bias, loaded.bias, 0.f));
}

// Per-channel affine of channel `channel` of a forward problem on T values: y = (x -
// mean) * rstd * weight + bias (weight 1 and bias 0 where absent). The parameters are
// float32 or T (ForwardProblem::parameter_dtype), so a float32 kernel tests nothing and
// a 16-bit one only which of the two.
template <typename T>
__device__ __forceinline__ float2 channel_affine(const ForwardProblem& p, int64_t channel) {
  if constexpr (cuda::std::is_same_v<T, float>) {
    const StoredPair<float> pair = channel_parameters<float>(p, channel);
    return make_float2(pair.weight, pair.bias);
  } else {
    const bool float32 = p.parameter_dtype == DType::kFloat32;
    // One address for either type: two made the 16-bit warp kernels of 32 values a
    // lane spill (docs/perf-notes.md #157).
    const int64_t offset = channel << parameter_bytes_log2<T>(p);
    const auto value = [&](const void* values, float none) {
      if (values == nullptr) return none;
      const char* address = static_cast<const char*>(values) + offset;
      return float32 ? __ldg(reinterpret_cast<const float*>(address))
                     : Storage<T>::to_float(__ldg(reinterpret_cast<const T*>(address)));
    };
    return make_float2(value(p.weight, 1.f), value(p.bias, 0.f));
  }
}

template <typename T>
__device__ __forceinline__ float2 slice_affine(const ForwardProblem& p, int64_t slice) {
  return channel_affine<T>(p, slice % p.num_channels);
}

template <typename T>
__device__ __forceinline__ LoadedAffine load_slice_affine(const ForwardProblem& p, int64_t slice) {
  return load_channel_affine<T>(p, slice % p.num_channels);
}

// ---- Fused epilogues (Epilogue in instance_norm.h) ----

// act(v) for a compile-time Activation A, the formulas of Activation (PyTorch's
// torch.nn.functional), in float32 with the accurate library functions (expf,
// erff, tanhf).
template <Activation A>
__device__ __forceinline__ float activate(float v, float negative_slope) {
  if constexpr (A == Activation::kRelu) return relu(v);
  if constexpr (A == Activation::kLeakyRelu) return v > 0.f ? v : v * negative_slope;
  if constexpr (A == Activation::kSilu) return v / (1.f + expf(-v));
  if constexpr (A == Activation::kGelu) return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  if constexpr (A == Activation::kGeluTanh) {
    return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
  }
  return v;
}

// d act / dv at v, as PyTorch's backward formulas take it (relu and leaky_relu: 1 for
// v > 0, else 0 or negative_slope; gelu: Phi(v) + v phi(v); gelu tanh: the
// derivative of its tanh form, as aten's GeluBackward computes it).
template <Activation A>
__device__ __forceinline__ float activation_derivative(float v, float negative_slope) {
  if constexpr (A == Activation::kRelu) return v > 0.f ? 1.f : 0.f;
  if constexpr (A == Activation::kLeakyRelu) return v > 0.f ? 1.f : negative_slope;
  if constexpr (A == Activation::kSilu) {
    const float sigmoid = 1.f / (1.f + expf(-v));
    return sigmoid * (1.f + v * (1.f - sigmoid));
  }
  if constexpr (A == Activation::kGelu) {
    const float cdf = 0.5f * (1.f + erff(v * 0.70710678118654752f));
    return cdf + v * 0.39894228040143268f * expf(-0.5f * v * v);
  }
  if constexpr (A == Activation::kGeluTanh) {
    constexpr float kBeta = 0.79788456080286536f, kKappa = 0.044715f;
    const float tanh_inner = tanhf(kBeta * (v + kKappa * v * v * v));
    return 0.5f * (1.f + tanh_inner) + 0.5f * v * (1.f - tanh_inner * tanh_inner) * kBeta * (1.f + 3.f * kKappa * v * v);
  }
  return 1.f;
}

// f(std::integral_constant<Activation, a>()) for the run-time activation a != kNone:
// the loop over a thread's values goes inside f, compiled once per activation, so
// each loop holds one activation's code (a switch per value made the 16-bit
// kernels spill).
template <typename F>
__device__ __forceinline__ void with_activation(Activation a, F f) {
  using cuda::std::integral_constant;
  switch (a) {
    case Activation::kRelu: f(integral_constant<Activation, Activation::kRelu>()); break;
    case Activation::kLeakyRelu: f(integral_constant<Activation, Activation::kLeakyRelu>()); break;
    case Activation::kSilu: f(integral_constant<Activation, Activation::kSilu>()); break;
    case Activation::kGelu: f(integral_constant<Activation, Activation::kGelu>()); break;
    case Activation::kGeluTanh: f(integral_constant<Activation, Activation::kGeluTanh>()); break;
    default: break;
  }
}

// Adds the residual's N values at the element `out` of y (N = one 16-byte vector, or
// 1). The residual has y's shape and layout, so its element sits at the same offset
// from its base; a vector store address is 16-byte aligned, and so then is the
// residual's (both bases are).
template <typename T, int N>
__device__ __forceinline__ void add_residual(const void* residual, const void* y, const T* out, float (&v)[N]) {
  const T* r = static_cast<const T*>(residual) + (out - static_cast<const T*>(y));
  if constexpr (N == Storage<T>::kPerVector && N > 1) {
    float rv[N];
    Storage<T>::unpack(__ldg(reinterpret_cast<const uint4*>(r)), rv);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] += rv[k];
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] += Storage<T>::to_float(__ldg(r + k));
  }
}

// The epilogue of N values a thread stores at `out`, an element of y: adds the
// residual's values at the same element (add_residual), then the activation, chosen
// at run time per call. Without an epilogue nothing is read.
template <typename T, int N>
__device__ __forceinline__ void apply_epilogue(const Epilogue& e, const void* y, const T* out, float (&v)[N]) {
  if (!e.active()) return;
  if (e.residual != nullptr) add_residual<T, N>(e.residual, y, out, v);
  with_activation(e.activation, [&](auto a) {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = activate<decltype(a)::value>(v[k], e.negative_slope);
  });
}

// Epilogues as functors for a store loop written once: epilogue(y, out, v) on the
// values of the vector a thread stores at `out`, then epilogue.pack<T>(v) gives the
// vector's bits. A kernel templated on one of the types below runs its store loop
// through Type::with(e, loop), which calls loop(epilogue) for the call's epilogue e:
//   NoEpilogue: nothing (the plain kernels);
//   DynamicEpilogue: apply_epilogue, the activation chosen per vector at run time;
//   ActivationEpilogue<A>: StaticEpilogue<A, with or without the residual>, one
//     activation compiled in, so the loop holds no branch between its stores and no
//     other activation's registers; a 16-bit vector's ReLU is left to its pack
//     (Storage16::pack_relu, no instruction of its own). A = kNone: the residual alone.
struct NoEpilogue {
  template <typename T, int N>
  __device__ __forceinline__ void operator()(const void*, const T*, float (&)[N]) const {}
  template <typename T>
  __device__ __forceinline__ uint4 pack(const float* v) const { return Storage<T>::pack(v); }
  template <typename F>
  __device__ __forceinline__ static void with(const Epilogue&, F loop) { loop(NoEpilogue{}); }
};

struct DynamicEpilogue {
  const Epilogue& e;
  template <typename T, int N>
  __device__ __forceinline__ void operator()(const void* y, const T* out, float (&v)[N]) const {
    apply_epilogue<T, N>(e, y, out, v);
  }
  template <typename T>
  __device__ __forceinline__ uint4 pack(const float* v) const { return Storage<T>::pack(v); }
  template <typename F>
  __device__ __forceinline__ static void with(const Epilogue& e, F loop) { loop(DynamicEpilogue{e}); }
};

template <Activation A, bool RESIDUAL>
struct StaticEpilogue {
  template <typename T>
  static constexpr bool kReluInPack = A == Activation::kRelu && Storage<T>::kPerVector == 8;

  float negative_slope;
  const void* residual;
  template <typename T, int N>
  __device__ __forceinline__ void operator()(const void* y, const T* out, float (&v)[N]) const {
    static_assert(N == Storage<T>::kPerVector, "a whole vector, which pack() then packs");
    if constexpr (RESIDUAL) add_residual<T, N>(residual, y, out, v);
    if constexpr (!kReluInPack<T>) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = activate<A>(v[k], negative_slope);
    }
  }
  template <typename T>
  __device__ __forceinline__ uint4 pack(const float* v) const {
    if constexpr (kReluInPack<T>) {
      return Storage<T>::pack_relu(v);
    } else {
      return Storage<T>::pack(v);
    }
  }
};

template <Activation A>
struct ActivationEpilogue {
  template <typename F>
  __device__ __forceinline__ static void with(const Epilogue& e, F loop) {
    if (e.residual != nullptr) {
      loop(StaticEpilogue<A, true>{e.negative_slope, e.residual});
    } else if constexpr (A != Activation::kNone) {
      loop(StaticEpilogue<A, false>{e.negative_slope, nullptr});
    }
  }
};

// One value's epilogue (scalar stores).
template <typename T>
__device__ __forceinline__ float epilogue_value(const Epilogue& e, const void* y, const T* out, float value) {
  float v[1] = {value};
  apply_epilogue<T, 1>(e, y, out, v);
  return v[0];
}

// ---- reflection pad (ReflectionPad in kernels/instance_norm.h) ----

// The source index of index i (counted from the dim's first unpadded value, so
// negative in the pad before it) of a dim of n values, reflected as PyTorch's
// ReflectionPad does: without repeating the edge value. For -(n - 1) <= i <= 2 (n -
// 1), i.e. pads shorter than the dim (as PyTorch requires): -i before the dim, 2 (n -
// 1) - i after it, as n - 1 - |n - 1 - |i|| (two absolute values, no compares).
__device__ __forceinline__ int reflect(int i, int n) { return (n - 1) - abs((n - 1) - abs(i)); }

// How `count` values of T at an address aligned to sizeof(T) lie over 16-byte
// blocks: `head` values of their first block come before them, `lead` of them
// before the first whole block, then `blocks` whole blocks, then `rest` values.
// value(j), j < lead + rest: the index of the j-th value outside the whole blocks.
struct BlockSpan {
  int head, lead, blocks, rest;
  template <typename T>
  __device__ static BlockSpan of(const T* values, int count) {
    constexpr int kPer = 16 / sizeof(T);
    const int head = static_cast<int>(reinterpret_cast<uintptr_t>(values) % 16 / sizeof(T));
    const int lead = min(count, (kPer - head) % kPer);
    const int blocks = (count - lead) / kPer;
    return {head, lead, blocks, count - lead - blocks * kPer};
  }
  template <typename T>
  __device__ int value(int j) const {
    return j < lead ? j : j + blocks * static_cast<int>(16 / sizeof(T));
  }
};

// A position (row, column) in rows of `width` values, moved on by `stride` values at
// a time: one division to start, none per move.
struct RowCursor {
  int row, column;
  int stride_rows, stride_columns, width;
  __device__ RowCursor(int first, int stride, int width)
      : row(first / width), column(first % width), stride_rows(stride / width), stride_columns(stride % width),
        width(width) {}
  __device__ void advance() {
    row += stride_rows, column += stride_columns;
    if (column >= width) column -= width, ++row;
  }
};

// Copies `count` values of T from `source` (global memory, aligned to sizeof(T)) to
// shared memory `staged` (16-byte aligned), keeping their offset within 16-byte
// blocks: value i lands at staged[head + i], head = source's offset in its 16-byte
// block, in values (returned). The 16-byte blocks wholly inside the range go by
// cp.async (in flight until the caller's cp_async_wait_all), the values before the
// first and after the last by scalar loads; nothing outside the range is read. The
// caller syncs the CTA before reading. staged needs count * sizeof(T) + 16 bytes.
template <typename T, int THREADS>
__device__ __forceinline__ int stage_values(T* staged, const T* source, int count) {
  const BlockSpan span = BlockSpan::of(source, count);
  const unsigned first_block = static_cast<unsigned>(__cvta_generic_to_shared(staged + span.head + span.lead));
  const uint4* aligned = reinterpret_cast<const uint4*>(source + span.lead);
  for (int b = threadIdx.x; b < span.blocks; b += THREADS) cp_async_16<0>(first_block + 16u * b, aligned + b);
  for (int j = threadIdx.x; j < span.lead + span.rest; j += THREADS) {
    const int i = span.value<T>(j);
    staged[span.head + i] = source[i];
  }
  return span.head;
}

// Folds the pads of one slice's padded gradient, staged in shared memory (dy:
// pad's padded_height x padded_width values of T), into the values they reflect,
// as ReflectionPad's backward does: each padded row's pad columns onto the
// columns they reflect, then the pad rows (whose interior columns now hold their
// corners too) onto the rows they reflect; a thread per row, then per column, adding
// in T as PyTorch's pad backward does. The interior (rows top .. top + height - 1,
// columns left .. left + width - 1) then holds each value's whole gradient. Pad
// values are read, never written, so the threads' additions do not race; every
// thread of the CTA calls it (it syncs the CTA after each of its two sweeps).
template <typename T, int THREADS>
__device__ __forceinline__ void fold_reflection_pad(T* dy, const ReflectionPad& pad) {
  using S = Storage<T>;
  const int width = pad.padded_width();
  const auto add = [](T& to, T from) { to = S::from_float(S::to_float(to) + S::to_float(from)); };
  for (int row = threadIdx.x; row < pad.padded_height(); row += THREADS) {
    T* const columns = dy + row * width + pad.left;  // columns[c]: column c, c < 0 in the left pad
    for (int j = 1; j <= pad.left; ++j) add(columns[j], columns[-j]);
    for (int j = 1; j <= pad.right; ++j) add(columns[pad.width - 1 - j], columns[pad.width - 1 + j]);
  }
  __syncthreads();
  for (int column = threadIdx.x; column < pad.width; column += THREADS) {
    T* const rows = dy + pad.top * width + pad.left + column;  // rows[r * width]: row r
    for (int i = 1; i <= pad.top; ++i) add(rows[i * width], rows[-i * width]);
    for (int i = 1; i <= pad.bottom; ++i) add(rows[(pad.height - 1 - i) * width], rows[(pad.height - 1 + i) * width]);
  }
  __syncthreads();
}

// The kPerVector values of the slice from (row, column) on (in the slice's rows) of
// the padded gradient dy (of one slice, staged in shared memory, its pads folded:
// fold_reflection_pad), read from their positions in the padded slice, as one vector
// of T: scalar loads (a padded row's values are not 16-byte aligned).
template <typename T>
__device__ __forceinline__ uint4 padded_own_vector(const T* dy, const ReflectionPad& pad, int row, int column) {
  T values[Storage<T>::kPerVector];
  const T* const own = dy + (row + pad.top) * pad.padded_width() + column + pad.left;
  if (column + Storage<T>::kPerVector <= pad.width) {  // within one row
#pragma unroll
    for (int k = 0; k < Storage<T>::kPerVector; ++k) values[k] = own[k];
  } else {
#pragma unroll
    for (int k = 0; k < Storage<T>::kPerVector; ++k) {
      values[k] = dy[(row + pad.top) * pad.padded_width() + column + pad.left];
      if (++column == pad.width) column = 0, ++row;
    }
  }
  uint4 raw;
  memcpy(&raw, values, sizeof(raw));
  return raw;
}

// The slice's mean and rstd (in x's units), to the forward's optional outputs;
// called by one thread per slice.
__device__ __forceinline__ void save_slice_stats(const ForwardProblem& p, int64_t slice, float mean, float rstd) {
  if (p.mean != nullptr) p.mean[slice] = mean;
  if (p.rstd != nullptr) p.rstd[slice] = rstd;
}

// ---- teams: the CTAs that hold one slice between them on the resident paths ----
//
// A team's CTAs each reduce their threads' values (cub::BlockReduce) and exchange
// the CTA totals; the totals are combined in rank order (lane l takes ranks l,
// l + 32, ... in turn, then an xor butterfly), so every thread of the team gets
// bit-identical results. One team barrier per allreduce: the totals are
// double-buffered by the round's parity, and a buffer is rewritten two rounds
// later, after the next round's barrier, which no CTA passes before every CTA has
// read this round's totals.
//   ClusterTeam (sm_90+): a thread-block cluster; totals in each CTA's shared
//     memory, read through DSMEM after a cluster barrier by every warp.
//   CooperativeTeam (sm_80+ with room for the kernel's shared memory: about 128
//     KB per CTA in the forward; the backward's kernels need sm_90 and 224 KB):
//     `size` consecutive CTAs of a cooperative launch (all
//     CTAs co-resident, so a team never waits for a CTA that cannot start); totals
//     in global memory, the barrier an arrival counter per team (release / acquire
//     at device scope); warp 0 combines and shares the result through shared memory.
// Team API: rank() in [0, size()), index() in [0, count()) (which team), count()
// (teams in the grid), allreduce<Op>(value, storage, round) with round = 0, 1, ...
// counted by every CTA alike, finish() before the CTA exits.

// Which team holds a slice on a resident path.
enum class TeamKind { kCluster, kCooperative };

template <typename V, int THREADS>
struct TeamStorage {
  typename cub::BlockReduce<V, THREADS>::TempStorage reduce;
  V cta_total[2];
  V result;
};

// Combines `size` CTA totals, total(r) for rank r, in the fixed order above;
// size <= MAX_SIZE (a team of at most a warp's lanes takes no loop).
template <typename Op, int MAX_SIZE, typename V, typename TotalOf>
__device__ __forceinline__ V combine_team_totals(int size, TotalOf total_of) {
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  V value{};
  if (lane < size) value = total_of(lane);
  if constexpr (MAX_SIZE > kWarpSize) {
    for (int rank = lane + kWarpSize; rank < size; rank += kWarpSize) value = Op()(value, total_of(rank));
  }
  return warp_allreduce(value, Op());
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
struct ClusterTeam {
  // Every thread stages its next-slice columns before the allreduce (a split like
  // the cooperative team's measured slower on clusters: docs/perf-notes.md #35).
  __device__ static constexpr bool stages_after_allreduce() { return false; }
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();

  __device__ int rank() const { return static_cast<int>(cluster.block_rank()); }
  __device__ int size() const { return static_cast<int>(cluster.num_blocks()); }
  __device__ int64_t index() const { return blockIdx.x / size(); }
  __device__ int64_t count() const { return gridDim.x / size(); }

  template <typename Op, typename V, int THREADS>
  __device__ V allreduce(V value, TeamStorage<V, THREADS>& storage, int round) const {
    const int parity = round & 1;
    const V total = cub::BlockReduce<V, THREADS>(storage.reduce).Reduce(value, Op());
    if (threadIdx.x == 0) storage.cta_total[parity] = total;
    cluster.sync();  // release this CTA's total, acquire the others'; also frees storage.reduce for reuse
    static_assert(kMaxClusterSize <= kWarpSize, "one rank per lane");
    return combine_team_totals<Op, kMaxClusterSize, V>(
        size(), [&](int rank) { return *cluster.map_shared_rank(&storage.cta_total[parity], rank); });
  }
  // No CTA leaves while another may still read its shared memory.
  __device__ void finish() const { cluster.sync(); }
};
#endif

// CTAs in the team that holds a slice of `spatial` values, `cta_capacity` per CTA;
// the one formula the launchers (sizing grids and workspaces) and the cooperative
// kernels (ranks, counters) share.
__host__ __device__ constexpr int team_size_for(int64_t spatial, int cta_capacity) {
  return static_cast<int>((spatial + cta_capacity - 1) / cta_capacity);
}

// Bytes of a cooperative launch's workspace before the totals: one arrival counter
// per team, rounded up to 16 bytes.
__host__ __device__ inline size_t team_counter_bytes(int64_t teams) {
  return static_cast<size_t>((teams * sizeof(unsigned) + 15) / 16 * 16);
}

// A cooperative team's exchange through global memory, step by step (CooperativeTeam
// and the pipelined path): one thread publishes its CTA's total and arrives on the
// team's counter (release at device scope); one thread waits until the counter holds
// a round's arrivals (acquire); then its warp combines the totals, read from L2.
template <typename V>
__device__ __forceinline__ void publish_team_total(V* totals, int rank, const V& total, unsigned* counter) {
  totals[rank] = total;
  cuda::atomic_ref<unsigned, cuda::thread_scope_device>(*counter).fetch_add(1u, cuda::std::memory_order_release);
}

__device__ __forceinline__ void wait_team_arrivals(unsigned* counter, unsigned all_arrived) {
  cuda::atomic_ref<unsigned, cuda::thread_scope_device> arrivals(*counter);
  while (arrivals.load(cuda::std::memory_order_acquire) < all_arrived) {
  }
}

// Every lane of the calling warp gets totals[0, size) combined in rank order
// (combine_team_totals), each read from L2 (ld.global.cg): L1 is not coherent with the
// other SMs' writes. After wait_team_arrivals and a __syncwarp.
template <typename Op, typename V>
__device__ __forceinline__ V combine_published_totals(const V* totals, int size) {
  static_assert(sizeof(V) % 4 == 0, "totals are read as 32-bit words");
  return combine_team_totals<Op, INT_MAX, V>(size, [&](int rank) {
    constexpr int kWords = sizeof(V) / 4;
    const unsigned* words = reinterpret_cast<const unsigned*>(totals + rank);
    unsigned loaded[kWords];
#pragma unroll
    for (int k = 0; k < kWords; ++k) loaded[k] = __ldcg(words + k);
    V out;
    memcpy(&out, loaded, sizeof(V));
    return out;
  });
}

struct CooperativeTeam {
  // Warp 0 holds the thread that releases the team's arrival (thread 0); a release
  // waits for that thread's memory operations in flight, so warp 0 stages its
  // columns of the next slice after the allreduce (docs/perf-notes.md #36).
  __device__ static bool stages_after_allreduce() { return threadIdx.x < kWarpSize; }
  int size_;
  int rank_;
  int64_t index_;
  int64_t count_;
  unsigned* arrivals_;  // this team's counter: size_ arrivals per round, from 0
  char* totals_;        // every team's [2][size_] CTA totals, after the counters

  // workspace: team_counter_bytes(count) zeroed bytes of counters, then
  // count * 2 * size CTA totals (the launcher sizes and zeroes it).
  __device__ CooperativeTeam(void* workspace, int size)
      : size_(size),
        rank_(static_cast<int>(blockIdx.x % size)),
        index_(blockIdx.x / size),
        count_(gridDim.x / size),
        arrivals_(static_cast<unsigned*>(workspace) + blockIdx.x / size),
        totals_(static_cast<char*>(workspace) + team_counter_bytes(gridDim.x / size)) {}

  __device__ int rank() const { return rank_; }
  __device__ int size() const { return size_; }
  __device__ int64_t index() const { return index_; }
  __device__ int64_t count() const { return count_; }

  template <typename Op, typename V, int THREADS>
  __device__ V allreduce(V value, TeamStorage<V, THREADS>& storage, int round) const {
    // Thread 0 rewrites storage.result next round only after cub's barrier inside
    // Reduce, which every thread passes after reading this round's result; a
    // one-warp CTA would have no such barrier.
    static_assert(THREADS > kWarpSize, "storage.result reuse relies on cub's CTA barrier");
    V* totals = reinterpret_cast<V*>(totals_) + (index_ * 2 + (round & 1)) * size_;
    const V total = cub::BlockReduce<V, THREADS>(storage.reduce).Reduce(value, Op());
    if (threadIdx.x < kWarpSize) {
      if (threadIdx.x == 0) {
        publish_team_total(totals, rank_, total, arrivals_);
        wait_team_arrivals(arrivals_, static_cast<unsigned>(size_) * static_cast<unsigned>(round + 1));
      }
      __syncwarp();  // the warp after lane 0's acquire
      const V result = combine_published_totals<Op>(totals, size_);
      if (threadIdx.x == 0) storage.result = result;
    }
    __syncthreads();  // storage.result to every thread; also frees storage.reduce for reuse
    return storage.result;
  }
  __device__ void finish() const {}
};

// Calls body(team) with this CTA's team of kind TEAM: its cluster, or the `size`
// consecutive CTAs of the cooperative launch (workspace: their counters and
// totals). Cluster teams exist on sm_90+ only; built for older GPUs the cluster
// kernel is empty, and the launcher never runs it there.
template <TeamKind TEAM, typename Body>
__device__ __forceinline__ void with_team(void* workspace, int size, Body body) {
  if constexpr (TEAM == TeamKind::kCooperative) {
    body(CooperativeTeam(workspace, size));
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    body(ClusterTeam());
#endif
  }
}

// ---- host helpers ----

// Calls f(T{}) with T the storage type of `dtype`.
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F f) {
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(__half{});
    case DType::kBFloat16: return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Calls f(cuda::std::integral_constant<Activation, a>()) for the run-time activation
// a (kNone included): one kernel per activation.
template <typename F>
cudaError_t dispatch_activation(Activation a, F f) {
  using cuda::std::integral_constant;
  switch (a) {
    case Activation::kNone: return f(integral_constant<Activation, Activation::kNone>());
    case Activation::kRelu: return f(integral_constant<Activation, Activation::kRelu>());
    case Activation::kLeakyRelu: return f(integral_constant<Activation, Activation::kLeakyRelu>());
    case Activation::kSilu: return f(integral_constant<Activation, Activation::kSilu>());
    case Activation::kGelu: return f(integral_constant<Activation, Activation::kGelu>());
    case Activation::kGeluTanh: return f(integral_constant<Activation, Activation::kGeluTanh>());
  }
  return cudaErrorInvalidValue;
}

// The smallest power of two >= work, at most a warp: lanes per item of
// for_each_group_item.
inline int lanes_for(int64_t work) {
  int lanes = 1;
  while (lanes < kWarpSize && lanes < work) lanes *= 2;
  return lanes;
}

// A grid-stride kernel's CTA count: enough to cover `work` items of `per_cta` each,
// capped at a launch-legal count that still fills any GPU many times over.
inline unsigned grid_for(int64_t work, int64_t per_cta) {
  const int64_t ctas = ceil_div(work, per_cta);
  return static_cast<unsigned>(ctas < (1 << 20) ? ctas : (1 << 20));
}

inline int element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Values of `dtype` per 16-byte vector: 4 fp32 or 8 fp16/bf16.
inline int values_per_vector(DType dtype) { return 16 / element_bytes(dtype); }

// Whether a forward problem's slices are whole 16-byte vectors at 16-byte aligned x
// and y (the resident and pipelined paths' loads and stores).
inline bool vector_aligned(const ForwardProblem& p) {
  return p.spatial % values_per_vector(p.dtype) == 0 && aligned16(p.x) && aligned16(p.y);
}

// Launch configuration of `num_ctas` CTAs of `threads` threads with
// `shared_bytes` of dynamic shared memory and one launch attribute, which must
// outlive the launch call.
inline cudaLaunchConfig_t attributed_launch_config(unsigned num_ctas, int threads, int shared_bytes,
                                                   cudaStream_t stream, cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// Launch configuration of `num_ctas` CTAs of `threads` threads in clusters of
// `cluster_size` along x, with `shared_bytes` of dynamic shared memory.
// `attribute` must outlive the launch call.
inline cudaLaunchConfig_t cluster_launch_config(unsigned num_ctas, int threads, int shared_bytes, int cluster_size,
                                                cudaStream_t stream, cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = cluster_size;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  return attributed_launch_config(num_ctas, threads, shared_bytes, stream, attribute);
}

// The same for a cooperative launch (all CTAs co-resident).
inline cudaLaunchConfig_t cooperative_launch_config(unsigned num_ctas, int threads, int shared_bytes,
                                                    cudaStream_t stream, cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeCooperative;
  attribute->val.cooperative = 1;
  return attributed_launch_config(num_ctas, threads, shared_bytes, stream, attribute);
}

// query(device) for the current device, cached per (device, kernel, tag): the
// occupancy queries below cost microseconds (kernel nullptr: a query of the device
// alone). 0 without a current device. A failed
// query must not be reported by the next launch check, so errors are cleared.
template <typename Query>
int cached_occupancy(const void* kernel, int tag, Query query) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const auto key = std::make_tuple(device, kernel, tag);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const int value = query(device);
  cudaGetLastError();
  cache.emplace(key, value);
  return value;
}

// The emulated device's limits (emulate_device in instance_norm.h), if any: one
// object shared by every translation unit of the extension (an inline function's
// static).
struct EmulationState {
  bool active = false;
  EmulatedDevice device{};
};
inline EmulationState& emulation() {
  static EmulationState state;
  return state;
}

// Shared memory the CUDA runtime reserves per CTA on sm_80 and later (CUDA C++
// Programming Guide, "Shared Memory" of compute capability 8.x).
constexpr int kReservedSharedPerCta = 1024;

// `per_sm` CTAs of `kernel` (threads, dynamic shared bytes), the current device's
// answer, capped at what the emulated device would hold; `per_sm` itself when no
// device is emulated.
inline int emulated_ctas_per_sm(const void* kernel, int threads, int shared_bytes, int per_sm) {
  const EmulationState& emulated = emulation();
  cudaFuncAttributes attributes;
  if (!emulated.active || per_sm == 0) return per_sm;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) return 0;
  const int cta_shared = shared_bytes + static_cast<int>(attributes.sharedSizeBytes);
  if (cta_shared > emulated.device.shared_per_cta) return 0;
  return std::min({per_sm, emulated.device.shared_per_sm / (cta_shared + kReservedSharedPerCta),
                   emulated.device.threads_per_sm / threads});
}

// Raises `kernel`'s dynamic shared-memory limit to the most `device` allows beside
// its static shared memory, as a launch with more than 48 KB needs; false where a
// query fails or `shared_bytes` is above that limit. The limit is the most, not
// `shared_bytes`, so a kernel launched with several sizes keeps room for the largest.
inline bool raise_dynamic_shared_limit(const void* kernel, int device, int shared_bytes) {
  int optin = 0;
  cudaFuncAttributes attributes;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
      cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    return false;
  }
  const int dynamic_limit = optin - static_cast<int>(attributes.sharedSizeBytes);
  return shared_bytes <= dynamic_limit &&
         cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic_limit) == cudaSuccess;
}

// How many CTAs of `kernel` (threads, dynamic shared bytes) one SM of the current
// device holds at once; 0 where a CTA cannot have that much shared memory. Raises
// the kernel's dynamic shared-memory limit to the most the device allows beside its
// static shared memory, as a launch with more than 48 KB needs. Cached per (device,
// kernel, shared_bytes): `threads` must be fixed by the kernel (its launch bounds),
// as it is for the block path's kernels, one query per slice size.
inline int ctas_per_sm(const void* kernel, int threads, int shared_bytes) {
  return cached_occupancy(kernel, shared_bytes, [&](int device) {
    int per_sm = 0;
    if (!raise_dynamic_shared_limit(kernel, device, shared_bytes) ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes) != cudaSuccess) {
      per_sm = 0;
    }
    return emulated_ctas_per_sm(kernel, threads, shared_bytes, per_sm);
  });
}

// `device`'s SM count (0 where the query fails).
inline int sm_count(int device) {
  int sms = 0;
  return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess ? sms : 0;
}

// The current device's SM count (0 where a query fails; its error is cleared so a
// later cudaGetLastError() reports only the launch). Cached as the occupancy queries
// are (no kernel): the block path's plan asks on every call.
inline int current_sm_count() {
  return cached_occupancy(nullptr, 0, [](int device) { return sm_count(device); });
}

// Whether `device` is sm_90 or newer (clusters, bulk copies); the emulated device's
// capability where one is emulated.
inline bool is_sm90_or_newer(int device) {
  int major = 0;
  if (emulation().active) return emulation().device.major >= 9;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9;
}

// How many clusters of `cluster_size` CTAs of `kernel` (threads, dynamic shared
// bytes) can be resident at once on the current device: 0 on pre-Hopper GPUs, or
// where a GPC is too small (some MIG partitions). Sets the kernel's non-portable
// cluster size and shared-memory attributes the launch needs. Cached per (kernel,
// cluster size, shared bytes): a negative tag, apart from ctas_per_sm's.
inline int max_active_clusters(const void* kernel, int threads, int shared_bytes, int cluster_size) {
  static_assert(kMaxClusterSize < 32, "the cache tag packs the cluster size into 5 bits");
  return cached_occupancy(kernel, -(shared_bytes * 32 + cluster_size), [&](int device) {
    int max_clusters = 0;
    if (is_sm90_or_newer(device) &&
        (cluster_size <= 8 ||
         cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) &&
        raise_dynamic_shared_limit(kernel, device, shared_bytes)) {
      cudaLaunchAttribute attribute;
      const cudaLaunchConfig_t config =
          cluster_launch_config(cluster_size, threads, shared_bytes, cluster_size, nullptr, &attribute);
      if (cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config) != cudaSuccess) max_clusters = 0;
    }
    return max_clusters;
  });
}

// How many CTAs of `kernel` (threads, dynamic shared bytes) can be resident at
// once on the whole current device, the most a cooperative launch may have: 0 where
// the device cannot launch cooperatively, or is older than sm_90 for a kernel that
// needs_sm90. Sets the kernel's shared-memory attribute the launch needs. Cached.
inline int max_resident_ctas(const void* kernel, int threads, int shared_bytes, bool needs_sm90) {
  return cached_occupancy(kernel, 0, [&](int device) {
    int per_sm = 0, cooperative = 0;
    const int sms = sm_count(device);
    if ((needs_sm90 && !is_sm90_or_newer(device)) ||
        cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device) != cudaSuccess || !cooperative ||
        sms == 0 ||
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, shared_bytes) != cudaSuccess) {
      per_sm = 0;
    }
    return emulated_ctas_per_sm(kernel, threads, shared_bytes, per_sm) * sms;
  });
}

// One configuration of a persistent resident kernel (forward or backward) for one
// storage dtype, compiled for both team kinds: `threads` per CTA, cta_capacity
// values of a slice per CTA, shared_bytes of dynamic shared memory, total_bytes
// the size of the CTA total a cooperative team exchanges. A slice of `spatial`
// values takes a team of ceil(spatial / cta_capacity) CTAs; the grid holds as many
// teams as can be resident, each looping over slices. needs_sm90: the kernels are
// empty before sm_90 (bulk copies), so neither team kind fits there.
template <typename Problem>
struct ResidentVariant {
  DType dtype;
  int threads;
  int cta_capacity;
  int shared_bytes;
  int total_bytes;
  void (*cluster_kernel)(const Problem);
  void (*cooperative_kernel)(const Problem);
  bool needs_sm90;

  int team_size(int64_t spatial) const { return team_size_for(spatial, cta_capacity); }

  // Cluster teams (sm_90+).
  int active_clusters(int size) const {
    return max_active_clusters(reinterpret_cast<const void*>(cluster_kernel), threads, shared_bytes, size);
  }
  bool cluster_fits(int64_t spatial) const {
    const int size = team_size(spatial);
    return size <= kMaxClusterSize && active_clusters(size) > 0;
  }
  // Sets plan's teams and launch for the cluster path, where cluster_fits(p.spatial):
  // as many clusters as are resident at once, at most one per slice.
  template <typename Plan>
  void plan_cluster(const Problem& p, Plan& plan) const {
    plan.team_size = team_size(p.spatial);
    plan.teams = std::min<int64_t>(p.num_slices(), active_clusters(plan.team_size));
    const unsigned grid = static_cast<unsigned>(plan.teams * plan.team_size);
    plan.launch = {LaunchKind::kCluster, cluster_kernel, grid, threads, shared_bytes, plan.team_size, 0};
  }

  // Cooperative teams (any GPU with cooperative launch).
  int resident_ctas() const {
    return max_resident_ctas(reinterpret_cast<const void*>(cooperative_kernel), threads, shared_bytes, needs_sm90);
  }
  bool cooperative_fits(int64_t spatial) const { return team_size(spatial) <= resident_ctas(); }
  // Sets plan's teams, launch and workspace for the cooperative path, where
  // cooperative_fits(p.spatial): as many teams as are resident at once, at most one
  // per slice; the workspace holds their arrival counters, then two rounds of CTA
  // totals per team.
  template <typename Plan>
  void plan_cooperative(const Problem& p, Plan& plan) const {
    plan.team_size = team_size(p.spatial);
    plan.teams = std::max<int64_t>(1, std::min<int64_t>(p.num_slices(), resident_ctas() / plan.team_size));
    const size_t counters = team_counter_bytes(plan.teams);
    plan.workspace_bytes = counters + static_cast<size_t>(plan.teams * 2 * plan.team_size * total_bytes);
    const unsigned grid = static_cast<unsigned>(plan.teams * plan.team_size);
    plan.launch = {LaunchKind::kCooperative, cooperative_kernel, grid, threads, shared_bytes, 0, counters};
  }
};

// The variant of `dtype` in a table with one entry per DType.
template <typename Problem, size_t N>
const ResidentVariant<Problem>& variant_for(const ResidentVariant<Problem> (&variants)[N], DType dtype) {
  for (const ResidentVariant<Problem>& v : variants) {
    if (v.dtype == dtype) return v;
  }
  return variants[0];  // unreachable: every DType has a variant
}

// Launches a plan's kernel on `stream` (after zeroing the counters a cooperative
// launch needs in p.workspace); returns the first CUDA error.
template <typename Problem>
cudaError_t launch_kernel(const KernelLaunch<Problem>& launch, const Problem& p, cudaStream_t stream) {
  if (launch.kernel == nullptr) return cudaErrorInvalidValue;
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config;
  switch (launch.kind) {
    case LaunchKind::kPlain:
      launch.kernel<<<launch.grid, launch.threads, launch.shared_bytes, stream>>>(p);
      return cudaGetLastError();
    case LaunchKind::kCluster:
      config = cluster_launch_config(launch.grid, launch.threads, launch.shared_bytes, launch.cluster_size, stream,
                                     &attribute);
      break;
    case LaunchKind::kCooperative: {
      if (p.workspace == nullptr) return cudaErrorInvalidValue;
      const cudaError_t error = cudaMemsetAsync(p.workspace, 0, launch.zeroed_bytes, stream);
      if (error != cudaSuccess) return error;
      config = cooperative_launch_config(launch.grid, launch.threads, launch.shared_bytes, stream, &attribute);
      break;
    }
  }
  return cudaLaunchKernelEx(&config, launch.kernel, p);
}

// The counts plans_made() reports: one object shared by every translation unit of
// the extension (an inline function's static), as emulation().
struct PlanCounters {
  std::atomic<int64_t> forward{0};
  std::atomic<int64_t> backward{0};
};
inline PlanCounters& plan_counters() {
  static PlanCounters counters;
  return counters;
}

}  // namespace instance_norm
