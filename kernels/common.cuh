// Device helpers shared by the InstanceNorm kernels: streaming vector access,
// the mean/M2 statistics of a slice and their warp, block and cluster reductions.
#pragma once

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

namespace instance_norm {

constexpr int kWarpSize = 32;
// Hopper's largest cluster (16 CTAs needs cudaFuncAttributeNonPortableClusterSizeAllowed).
constexpr int kMaxClusterSize = 16;

// Every element is read once and written once: streaming (evict-first) 16-byte
// accesses keep the slice data from displacing reusable lines in L1 and L2.
__device__ __forceinline__ float4 load_streaming(const float4* p) { return __ldcs(p); }
__device__ __forceinline__ void store_streaming(float4* p, float4 v) { __stcs(p, v); }

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
// Returns after barrier_arrive(): other CTAs may still be reading this CTA's
// shared memory, so the caller must call cooperative_groups::this_cluster()
// .barrier_wait() before it exits (work placed between the two hides the wait).
template <int THREADS>
struct ClusterStatsReduce {
  using Reduce = cub::BlockReduce<SliceStats, THREADS>;
  struct TempStorage {
    typename Reduce::TempStorage reduce;
    SliceStats cta_total;
  };

  __device__ static SliceStats allreduce_arrive(SliceStats thread_stats, TempStorage& storage) {
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    const SliceStats total = Reduce(storage.reduce).Reduce(thread_stats, CombineStats());
    if (threadIdx.x == 0) storage.cta_total = total;
    cluster.sync();  // release this CTA's total, acquire the others'
    const unsigned lane = threadIdx.x % kWarpSize;
    SliceStats rank_total{0.f, 0.f, 0.f};
    if (lane < cluster.num_blocks()) rank_total = *cluster.map_shared_rank(&storage.cta_total, lane);
    const SliceStats result = warp_allreduce(rank_total);
    cluster.barrier_arrive();
    return result;
  }
};
#endif

}  // namespace instance_norm
