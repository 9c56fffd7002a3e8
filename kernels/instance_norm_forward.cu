// InstanceNorm forward on contiguous (num_slices, spatial) data of float32,
// float16 or bfloat16: the cluster-resident single-read kernel, the generic
// kernel, and the one place that chooses between them.
#include "common.cuh"
#include "instance_norm.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace instance_norm {
namespace {

namespace cg = cooperative_groups;

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

// Per-channel affine of slice `slice`: y = (x - mean) * rstd * weight + bias.
__device__ __forceinline__ float2 slice_affine(const ForwardProblem& p, int64_t slice) {
  const int64_t channel = slice % p.num_channels;
  return make_float2(p.weight != nullptr ? __ldg(p.weight + channel) : 1.f,
                     p.bias != nullptr ? __ldg(p.bias + channel) : 0.f);
}

// Generic path: one CTA per slice (grid-stride over slices), any spatial size,
// alignment and GPU. The first sweep runs Welford's update over each thread's strided
// elements, then a block reduction; a second sweep reads the slice again and
// writes it.
// Values are shifted by the slice's first element before any statistics, so a
// constant slice gives exactly 0 (d = 0, mean = 0) whatever its magnitude.
constexpr int kGenericThreads = 512;

template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS) forward_generic_kernel(const ForwardProblem p) {
  using S = Storage<T>;
  __shared__ typename BlockStatsReduce<THREADS>::TempStorage storage;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  for (int64_t slice = blockIdx.x; slice < p.num_slices; slice += gridDim.x) {
    const T* slice_x = x + slice * p.spatial;
    T* slice_y = y + slice * p.spatial;
    const float shift = S::to_float(__ldg(slice_x));
    const float2 affine = slice_affine(p, slice);
    SliceStats stats{0.f, 0.f, 0.f};
    for (int64_t i = threadIdx.x; i < p.spatial; i += THREADS) {
      const float d = S::to_float(__ldg(slice_x + i)) - shift;
      stats.count += 1.f;
      const float delta = d - stats.mean;
      stats.mean += delta / stats.count;
      stats.m2 += delta * (d - stats.mean);
    }
    stats = BlockStatsReduce<THREADS>::allreduce(stats, storage);
    const float scale = rsqrtf(stats.m2 / static_cast<float>(p.spatial) + p.eps) * affine.x;
    for (int64_t i = threadIdx.x; i < p.spatial; i += THREADS) {
      slice_y[i] = S::from_float(((S::to_float(__ldg(slice_x + i)) - shift) - stats.mean) * scale + affine.y);
    }
  }
}

// cp.async-copies this thread's vectors i < valid (column_x[i * THREADS]) into its
// shared-memory column (staged_column + i * THREADS * 16 bytes), then commits.
template <int THREADS, int... I>
__device__ __forceinline__ void stage_column(unsigned staged_column, const uint4* column_x, int valid,
                                             std::integer_sequence<int, I...>) {
  ((I < valid ? cp_async_16<I * THREADS * 16>(staged_column, column_x) : void()), ...);
  cp_async_commit();
}

// Cluster-resident path (sm_90+), persistent. The grid holds as many clusters of
// ceil(spatial / (THREADS * VALUES_PER_THREAD)) CTAs as can be resident at once,
// and cluster k normalizes slices k, k + num_clusters, ... (one cluster per slice
// is limited by the GPU's cluster launch rate: docs/perf-notes.md).
// For each slice, CTA rank r owns the contiguous chunk
// [r, r + 1) * THREADS * VALUES_PER_THREAD; thread t owns its 16-byte vectors
// first + i * THREADS (coalesced across the CTA).
// Per slice: wait for this thread's staged vectors, move them from shared memory
// to float registers, start staging the next slice into the same shared memory
// with cp.async (so its HBM read overlaps everything below), take the mean and then
// the centered M2 of the registers, merge them across the block (cub) and the cluster
// (DSMEM, one cluster barrier), normalize the registers and write them. HBM is
// read once and written once. Shift: statistics are taken of x - x[slice][0], so
// a constant slice gives exactly 0 (before bias) whatever its magnitude.
// Needs THREADS * VALUES_PER_THREAD * sizeof(T) bytes of dynamic shared memory,
// spatial % Storage<T>::kPerVector == 0, 16-byte aligned x and y, and spatial at
// most kMaxClusterSize * THREADS * VALUES_PER_THREAD (the launcher checks).
template <typename T, int THREADS, int VALUES_PER_THREAD>
__global__ void __launch_bounds__(THREADS, 1) forward_cluster_kernel(const ForwardProblem p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  static_assert(VALUES_PER_THREAD % kPer == 0, "values are held as whole 16-byte vectors");
  constexpr int kVecs = VALUES_PER_THREAD / kPer;
  constexpr int kCtaVecs = THREADS * kVecs;
  using Reduce = ClusterStatsReduce<THREADS>;
  __shared__ typename Reduce::TempStorage storage;
  extern __shared__ uint4 staged[];  // [kVecs][THREADS]: each thread owns its column

  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int spatial = static_cast<int>(p.spatial);
  const cg::cluster_group cluster = cg::this_cluster();
  const int cluster_size = static_cast<int>(cluster.num_blocks());
  const int64_t num_clusters = gridDim.x / cluster_size;

  // This thread's vectors of a slice are first + i * THREADS for i < valid.
  const int num_vecs = spatial / kPer;
  const int first = static_cast<int>(cluster.block_rank()) * kCtaVecs + threadIdx.x;
  const int valid = min(kVecs, max(0, (num_vecs - first + THREADS - 1) / THREADS));
  const unsigned staged_column = static_cast<unsigned>(__cvta_generic_to_shared(staged + threadIdx.x));
  const auto stage = [&](int64_t slice) {
    stage_column<THREADS>(staged_column, reinterpret_cast<const uint4*>(x + slice * spatial) + first, valid,
                          std::make_integer_sequence<int, kVecs>());
  };

  int64_t slice = blockIdx.x / cluster_size;
  float shift = slice < p.num_slices ? S::to_float(x[slice * spatial]) : 0.f;
  if (slice < p.num_slices) stage(slice);
  for (int parity = 0; slice < p.num_slices; slice += num_clusters, parity ^= 1) {
    const int64_t next = slice + num_clusters;
    const float next_shift = next < p.num_slices ? S::to_float(x[next * spatial]) : 0.f;
    const float2 affine = slice_affine(p, slice);

    float d[kVecs][kPer];
    cp_async_wait_all();
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
        S::unpack(staged[i * THREADS + threadIdx.x], d[i]);
      } else {
#pragma unroll
        for (int k = 0; k < kPer; ++k) d[i][k] = 0.f;
      }
    }
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          d[i][k] -= shift;
          sum += d[i][k];
        }
      }
    }
    // The sum used every staged value this thread read, so they are all in
    // registers now and its shared-memory column can take the next slice.
    if (next < p.num_slices) stage(next);

    SliceStats stats{static_cast<float>(kPer * valid), 0.f, 0.f};
    if (valid > 0) {
      stats.mean = sum / stats.count;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (i < valid) {
#pragma unroll
          for (int k = 0; k < kPer; ++k) {
            const float deviation = d[i][k] - stats.mean;
            stats.m2 += deviation * deviation;
          }
        }
      }
    }
    stats = Reduce::allreduce(stats, storage, parity);
    const float mean = stats.mean;
    const float scale = rsqrtf(stats.m2 / static_cast<float>(spatial) + p.eps) * affine.x;
    uint4* slice_y = reinterpret_cast<uint4*>(y + slice * spatial);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
        float out[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) out[k] = (d[i][k] - mean) * scale + affine.y;
        store_streaming(slice_y + first + i * THREADS, S::pack(out));
      }
    }
    shift = next_shift;
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
#endif
}

using ClusterKernel = void (*)(const ForwardProblem);

struct ClusterVariant {
  DType dtype;
  int threads;
  int cta_capacity;  // values one CTA holds (in float registers, and staged in shared memory)
  int shared_bytes;  // dynamic shared memory per CTA
  ClusterKernel kernel;
};

template <typename T, int THREADS, int VALUES>
constexpr ClusterVariant cluster_variant(DType dtype) {
  return {dtype, THREADS, THREADS * VALUES, THREADS * VALUES * static_cast<int>(sizeof(T)),
          forward_cluster_kernel<T, THREADS, VALUES>};
}

// 512 threads x 64 values: 128 KB of float registers plus the staged next slice
// per CTA, one CTA per SM; a 512 x 512 slice takes a cluster of 8
// (docs/perf-notes.md compares shapes).
constexpr ClusterVariant kClusterVariants[] = {
    cluster_variant<float, 512, 64>(DType::kFloat32),
    cluster_variant<__half, 512, 64>(DType::kFloat16),
    cluster_variant<__nv_bfloat16, 512, 64>(DType::kBFloat16),
};

const ClusterVariant& cluster_variant_for(DType dtype) {
  for (const ClusterVariant& v : kClusterVariants) {
    if (v.dtype == dtype) return v;
  }
  return kClusterVariants[0];  // unreachable: every DType has a variant
}

int element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

bool vector_aligned(const ForwardProblem& p) {
  const int per_vector = 16 / element_bytes(p.dtype);
  return p.spatial % per_vector == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.y) % 16 == 0;
}

int cluster_size_for(const ClusterVariant& v, int64_t spatial) {
  return static_cast<int>((spatial + v.cta_capacity - 1) / v.cta_capacity);
}

cudaLaunchConfig_t cluster_launch_config(const ClusterVariant& v, unsigned num_ctas, int cluster_size,
                                         cudaStream_t stream, cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = cluster_size;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(num_ctas);
  config.blockDim = dim3(v.threads);
  config.dynamicSmemBytes = v.shared_bytes;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// How many clusters of `cluster_size` CTAs of this variant can be resident at once
// on the current device: 0 on pre-Hopper GPUs, or where a GPC is too small (some
// MIG partitions). Cached per (device, dtype, size): the query costs microseconds.
int max_active_clusters(const ClusterVariant& v, int cluster_size) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, int> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const auto key = std::make_tuple(device, static_cast<int>(v.dtype), cluster_size);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;

  int max_clusters = 0;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9 &&
      (cluster_size <= 8 ||
       cudaFuncSetAttribute(v.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) &&
      cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, v.shared_bytes) == cudaSuccess) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_launch_config(v, cluster_size, cluster_size, nullptr, &attribute);
    if (cudaOccupancyMaxActiveClusters(&max_clusters, v.kernel, &config) != cudaSuccess) max_clusters = 0;
  }
  cudaGetLastError();  // a failed query must not be reported by the next launch check
  cache.emplace(key, max_clusters);
  return max_clusters;
}

bool cluster_supported(const ForwardProblem& p) {
  const ClusterVariant& v = cluster_variant_for(p.dtype);
  const int cluster_size = cluster_size_for(v, p.spatial);
  return vector_aligned(p) && cluster_size <= kMaxClusterSize && max_active_clusters(v, cluster_size) > 0;
}

cudaError_t launch_cluster(const ForwardProblem& p, cudaStream_t stream) {
  const ClusterVariant& v = cluster_variant_for(p.dtype);
  const int cluster_size = cluster_size_for(v, p.spatial);
  const int64_t num_clusters = std::min<int64_t>(p.num_slices, max_active_clusters(v, cluster_size));
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_launch_config(v, static_cast<unsigned>(num_clusters * cluster_size), cluster_size, stream, &attribute);
  return cudaLaunchKernelEx(&config, v.kernel, p);
}

cudaError_t launch_generic(const ForwardProblem& p, cudaStream_t stream) {
  const unsigned num_ctas = static_cast<unsigned>(std::min<int64_t>(p.num_slices, INT32_MAX));
  return dispatch_dtype(p.dtype, [&](auto tag) {
    forward_generic_kernel<decltype(tag), kGenericThreads><<<num_ctas, kGenericThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace

ForwardPath choose_forward_path(const ForwardProblem& problem) {
  return cluster_supported(problem) ? ForwardPath::kCluster : ForwardPath::kGeneric;
}

bool forward_path_supported(ForwardPath path, const ForwardProblem& problem) {
  switch (path) {
    case ForwardPath::kAuto:
    case ForwardPath::kGeneric: return true;
    case ForwardPath::kCluster: return cluster_supported(problem);
  }
  return false;
}

cudaError_t forward(const ForwardProblem& problem, ForwardPath path, cudaStream_t stream) {
  if (problem.num_slices <= 0 || problem.spatial <= 0) return cudaSuccess;
  if (problem.y == nullptr || !forward_path_supported(path, problem)) return cudaErrorInvalidValue;
  if (path == ForwardPath::kAuto) path = choose_forward_path(problem);
  if (path == ForwardPath::kGeneric) return launch_generic(problem, stream);
  return launch_cluster(problem, stream);
}

}  // namespace instance_norm
