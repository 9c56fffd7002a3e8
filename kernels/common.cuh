// Device helpers shared by the InstanceNorm kernels: streaming stores, cp.async
// staging, the mean/M2 statistics of a slice and their warp, block and cluster
// reductions.
#pragma once

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace instance_norm {

constexpr int kWarpSize = 32;
// Hopper's largest cluster (16 CTAs needs cudaFuncAttributeNonPortableClusterSizeAllowed).
constexpr int kMaxClusterSize = 16;

// Storage types (float, __half, __nv_bfloat16): how many values one 16-byte vector
// holds, and their conversion to and from the float32 all arithmetic is done in.
template <typename T>
struct Storage;

template <>
struct Storage<float> {
  static constexpr int kPerVector = 4;
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

// 16-bit types: the vector is four words of two values each.
template <typename T, typename T2, float2 (*kToFloat2)(T2), T2 (*kFromFloats)(float, float)>
struct Storage16 {
  static constexpr int kPerVector = 8;
  __device__ static void unpack(const uint4& raw, float* out) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      T2 pair;
      memcpy(&pair, &words[k], sizeof(pair));
      const float2 f = kToFloat2(pair);
      out[2 * k] = f.x, out[2 * k + 1] = f.y;
    }
  }
  __device__ static uint4 pack(const float* in) {
    unsigned words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const T2 pair = kFromFloats(in[2 * k], in[2 * k + 1]);
      memcpy(&words[k], &pair, sizeof(pair));
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
};

__device__ __forceinline__ float2 half2_to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ __half2 floats_to_half2(float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ float2 bfloat162_to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ __nv_bfloat162 floats_to_bfloat162(float a, float b) {
  return __floats2bfloat162_rn(a, b);
}

template <>
struct Storage<__half> : Storage16<__half, __half2, half2_to_float2, floats_to_half2> {
  __device__ static float to_float(__half v) { return __half2float(v); }
  __device__ static __half from_float(float v) { return __low2half(__float2half2_rn(v)); }
};

template <>
struct Storage<__nv_bfloat16> : Storage16<__nv_bfloat16, __nv_bfloat162, bfloat162_to_float2, floats_to_bfloat162> {
  __device__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// Every output element is written once: streaming (evict-first) 16-byte stores
// keep it from displacing reusable lines in L2.
__device__ __forceinline__ void store_streaming(uint4* p, uint4 v) { __stcs(p, v); }

// Per-thread asynchronous 16-byte copy global -> shared (sm_80+), cached in L2
// only; completes for the issuing thread at cp_async_wait_all().
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

// All 32 lanes of the warp end with the combination of all lanes' statistics.
__device__ __forceinline__ SliceStats warp_allreduce(SliceStats s) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    const SliceStats other{__shfl_xor_sync(0xffffffffu, s.count, offset),
                           __shfl_xor_sync(0xffffffffu, s.mean, offset),
                           __shfl_xor_sync(0xffffffffu, s.m2, offset)};
    s = combine(s, other);
  }
  return s;
}

// Block-wide reduction of SliceStats whose result every thread of the block gets.
// Uses cub::BlockReduce; `result` then carries thread 0's total to the others.
// Contains __syncthreads: every thread of the block must call it.
template <int THREADS>
struct BlockStatsReduce {
  using Reduce = cub::BlockReduce<SliceStats, THREADS>;
  struct TempStorage {
    typename Reduce::TempStorage reduce;
    SliceStats result;
  };

  __device__ static SliceStats allreduce(SliceStats thread_stats, TempStorage& storage) {
    const SliceStats total = Reduce(storage.reduce).Reduce(thread_stats, CombineStats());
    if (threadIdx.x == 0) storage.result = total;
    __syncthreads();
    const SliceStats result = storage.result;
    __syncthreads();  // storage may be reused by the caller's next reduction
    return result;
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Cluster-wide reduction through distributed shared memory (Hopper, sm_90+).
// Each CTA reduces its threads with cub::BlockReduce and publishes the total in
// its own shared memory; after a cluster barrier every warp of every CTA reads all
// ranks' totals (lane r reads rank r) and combines them with the same butterfly,
// so all threads of the cluster get bit-identical statistics.
// One cluster barrier per call: the totals are double-buffered by `parity`, and a
// buffer is rewritten two calls later, after the next call's barrier, which no CTA
// passes before every CTA has finished this call's reads. Before exiting, a CTA
// must go through one more cluster barrier (cluster.sync()) so that no CTA is still
// reading its shared memory.
template <int THREADS>
struct ClusterStatsReduce {
  using Reduce = cub::BlockReduce<SliceStats, THREADS>;
  struct TempStorage {
    typename Reduce::TempStorage reduce;
    SliceStats cta_total[2];
  };

  __device__ static SliceStats allreduce(SliceStats thread_stats, TempStorage& storage, int parity) {
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    const SliceStats total = Reduce(storage.reduce).Reduce(thread_stats, CombineStats());
    if (threadIdx.x == 0) storage.cta_total[parity] = total;
    cluster.sync();  // release this CTA's total, acquire the others'; also frees storage.reduce for reuse
    const unsigned lane = threadIdx.x % kWarpSize;
    SliceStats rank_total{0.f, 0.f, 0.f};
    if (lane < cluster.num_blocks()) rank_total = *cluster.map_shared_rank(&storage.cta_total[parity], lane);
    return warp_allreduce(rank_total);
  }
};
#endif

}  // namespace instance_norm
