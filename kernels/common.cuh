// Helpers shared by the InstanceNorm kernels: storage-type traits, streaming
// stores, cp.async staging, the mean/M2 statistics of a slice and their warp,
// block and cluster reductions; on the host, dtype dispatch and cluster launches.
#pragma once

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
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

// Calls f(i, v) for each raw 16-byte vector raw[i], i < valid, with v its values
// as float. The resident kernels keep the raw vectors in registers (4 registers
// per vector whatever the dtype) and unpack them at each use through this.
template <typename T, int N, typename F>
__device__ __forceinline__ void for_each_unpacked(const uint4 (&raw)[N], int valid, F f) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i < valid) {
      float v[Storage<T>::kPerVector];
      Storage<T>::unpack(raw[i], v);
      f(i, v);
    }
  }
}

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

// cp.async-copies this thread's 16-byte vectors i < valid (column[i * THREADS])
// into its shared-memory column (staged_column + i * THREADS * 16 bytes), then
// commits: the staging of the cluster paths' next slice.
template <int THREADS, int... I>
__device__ __forceinline__ void stage_column(unsigned staged_column, const uint4* column, int valid,
                                             std::integer_sequence<int, I...>) {
  ((I < valid ? cp_async_16<I * THREADS * 16>(staged_column, column) : void()), ...);
  cp_async_commit();
}

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

// Sums of two values per slice (the backward's sum(dy) and sum(dy * xhat)). Float
// addition is commutative bit for bit, so the butterflies below stay symmetric.
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

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Cluster-wide reduction through distributed shared memory (Hopper, sm_90+), used
// by forward (SliceStats) and backward (sums) alike.
// Each CTA reduces its threads with cub::BlockReduce and publishes the total in
// its own shared memory; after a cluster barrier every warp of every CTA reads all
// ranks' totals (lane r reads rank r) and combines them with the same butterfly,
// so all threads of the cluster get bit-identical results.
// One cluster barrier per call: the totals are double-buffered by `parity`, and a
// buffer is rewritten two calls later, after the next call's barrier, which no CTA
// passes before every CTA has finished this call's reads. Before exiting, a CTA
// must go through one more cluster barrier (cluster.sync()) so that no CTA is still
// reading its shared memory.
template <typename V, int THREADS, typename Op>
struct ClusterAllReduce {
  using Reduce = cub::BlockReduce<V, THREADS>;
  struct TempStorage {
    typename Reduce::TempStorage reduce;
    V cta_total[2];
  };

  __device__ static V allreduce(V thread_value, TempStorage& storage, int parity) {
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    const V total = Reduce(storage.reduce).Reduce(thread_value, Op());
    if (threadIdx.x == 0) storage.cta_total[parity] = total;
    cluster.sync();  // release this CTA's total, acquire the others'; also frees storage.reduce for reuse
    const unsigned lane = threadIdx.x % kWarpSize;
    V rank_total{};
    if (lane < cluster.num_blocks()) rank_total = *cluster.map_shared_rank(&storage.cta_total[parity], lane);
    return warp_allreduce(rank_total, Op());
  }
};

template <int THREADS>
using ClusterStatsReduce = ClusterAllReduce<SliceStats, THREADS, CombineStats>;
#endif

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

// A grid-stride kernel's CTA count: enough to cover `work` items of `per_cta` each,
// capped at a launch-legal count that still fills any GPU many times over.
inline unsigned grid_for(int64_t work, int64_t per_cta) {
  const int64_t ctas = (work + per_cta - 1) / per_cta;
  return static_cast<unsigned>(ctas < (1 << 20) ? ctas : (1 << 20));
}

inline int element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Values of `dtype` per 16-byte vector: 4 fp32 or 8 fp16/bf16.
inline int values_per_vector(DType dtype) { return 16 / element_bytes(dtype); }

// Whether p is 16-byte aligned; nullptr counts as aligned (support queries made
// before the output exists; the caching allocator's blocks are aligned).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Launch configuration of `num_ctas` CTAs of `threads` threads in clusters of
// `cluster_size` along x, with `shared_bytes` of dynamic shared memory.
// `attribute` must outlive the launch call.
inline cudaLaunchConfig_t cluster_launch_config(unsigned num_ctas, int threads, int shared_bytes, int cluster_size,
                                                cudaStream_t stream, cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = cluster_size;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// How many clusters of `cluster_size` CTAs of `kernel` (threads, dynamic shared
// bytes) can be resident at once on the current device: 0 on pre-Hopper GPUs, or
// where a GPC is too small (some MIG partitions). Sets the kernel's non-portable
// cluster size and shared-memory attributes the launch needs. Cached per (device,
// kernel, cluster size): the query costs microseconds.
inline int max_active_clusters(const void* kernel, int threads, int shared_bytes, int cluster_size) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const auto key = std::make_tuple(device, kernel, cluster_size);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;

  int max_clusters = 0;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9 &&
      (cluster_size <= 8 ||
       cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes) == cudaSuccess) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config =
        cluster_launch_config(cluster_size, threads, shared_bytes, cluster_size, nullptr, &attribute);
    if (cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config) != cudaSuccess) max_clusters = 0;
  }
  cudaGetLastError();  // a failed query must not be reported by the next launch check
  cache.emplace(key, max_clusters);
  return max_clusters;
}

// One configuration of a persistent cluster kernel (forward or backward) for one
// storage dtype: THREADS per CTA, cta_capacity values of a slice per CTA,
// shared_bytes of dynamic shared memory. A slice of `spatial` values takes a
// cluster of ceil(spatial / cta_capacity) CTAs; the grid holds as many clusters as
// can be resident, each looping over slices.
template <typename Problem>
struct ClusterVariant {
  DType dtype;
  int threads;
  int cta_capacity;
  int shared_bytes;
  void (*kernel)(const Problem);

  int cluster_size(int64_t spatial) const { return static_cast<int>((spatial + cta_capacity - 1) / cta_capacity); }
  int active_clusters(int size) const {
    return max_active_clusters(reinterpret_cast<const void*>(kernel), threads, shared_bytes, size);
  }
  // Whether slices of `spatial` values fit a cluster the current device can run.
  bool fits(int64_t spatial) const {
    const int size = cluster_size(spatial);
    return size <= kMaxClusterSize && active_clusters(size) > 0;
  }
  cudaError_t launch(const Problem& p, cudaStream_t stream) const {
    const int size = cluster_size(p.spatial);
    const int64_t num_clusters = std::min<int64_t>(p.num_slices(), active_clusters(size));
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config =
        cluster_launch_config(static_cast<unsigned>(num_clusters * size), threads, shared_bytes, size, stream, &attribute);
    return cudaLaunchKernelEx(&config, kernel, p);
  }
};

// The variant of `dtype` in a table with one entry per DType.
template <typename Problem, size_t N>
const ClusterVariant<Problem>& variant_for(const ClusterVariant<Problem> (&variants)[N], DType dtype) {
  for (const ClusterVariant<Problem>& v : variants) {
    if (v.dtype == dtype) return v;
  }
  return variants[0];  // unreachable: every DType has a variant
}

}  // namespace instance_norm
