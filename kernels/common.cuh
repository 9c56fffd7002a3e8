// Device helpers shared by the InstanceNorm kernels: streaming stores, cp.async
// staging, the mean/M2 statistics of a slice and their warp, block and cluster
// reductions.
#pragma once

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cuda_runtime.h>

#include <cstdint>

namespace instance_norm {

constexpr int kWarpSize = 32;
// Hopper's largest cluster (16 CTAs needs cudaFuncAttributeNonPortableClusterSizeAllowed).
constexpr int kMaxClusterSize = 16;

// Every output element is written once: streaming (evict-first) 16-byte stores
// keep it from displacing reusable lines in L2.
__device__ __forceinline__ void store_streaming(float4* p, float4 v) { __stcs(p, v); }

// Per-thread asynchronous 16-byte copy global -> shared (sm_80+), cached in L2
// only; completes for the issuing thread at cp_async_wait_all().
// Copies global_base + OFFSET bytes to shared-memory address shared_base + OFFSET
// bytes. OFFSET is an immediate in both addresses, so a loop over offsets keeps two
// base registers instead of a pair of addresses per copy (which spills).
template <int OFFSET>
__device__ __forceinline__ void cp_async_16(unsigned shared_base, const float4* global_base) {
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
// must pass one more cluster barrier (cluster.sync()) so that no CTA is still
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
