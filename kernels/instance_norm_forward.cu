// InstanceNorm forward on contiguous (num_slices, spatial) fp32 data: the
// cluster-resident single-read kernel, the generic kernel, and the one place
// that chooses between them.
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

// Generic path: one CTA per slice (grid-stride over slices), any spatial size,
// alignment and GPU. Pass 1 runs Welford's update over each thread's strided
// elements, then a block reduction; pass 2 reads the slice again and writes it.
// Values are shifted by the slice's first element before any statistics, so a
// constant slice gives exactly 0 (d = 0, mean = 0) whatever its magnitude.
constexpr int kGenericThreads = 512;

template <int THREADS>
__global__ void __launch_bounds__(THREADS)
    forward_generic_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t num_slices,
                           int64_t spatial, float eps) {
  __shared__ typename BlockStatsReduce<THREADS>::TempStorage storage;
  for (int64_t slice = blockIdx.x; slice < num_slices; slice += gridDim.x) {
    const float* slice_x = x + slice * spatial;
    float* slice_y = y + slice * spatial;
    const float shift = slice_x[0];
    SliceStats stats{0.f, 0.f, 0.f};
    for (int64_t i = threadIdx.x; i < spatial; i += THREADS) {
      const float d = slice_x[i] - shift;
      stats.count += 1.f;
      const float delta = d - stats.mean;
      stats.mean += delta / stats.count;
      stats.m2 += delta * (d - stats.mean);
    }
    stats = BlockStatsReduce<THREADS>::allreduce(stats, storage);
    const float rstd = rsqrtf(stats.m2 / static_cast<float>(spatial) + eps);
    for (int64_t i = threadIdx.x; i < spatial; i += THREADS) {
      slice_y[i] = ((slice_x[i] - shift) - stats.mean) * rstd;
    }
  }
}

// cp.async-copies this thread's vectors i < valid (column_x[i * THREADS]) into its
// shared-memory column (staged_column + i * THREADS * 16 bytes), then commits.
template <int THREADS, int... I>
__device__ __forceinline__ void stage_column(unsigned staged_column, const float4* column_x, int valid,
                                             std::integer_sequence<int, I...>) {
  ((I < valid ? cp_async_16<I * THREADS * 16>(staged_column, column_x) : void()), ...);
  cp_async_commit();
}

// Cluster-resident path (sm_90+), persistent. The grid holds as many clusters of
// ceil(spatial / (THREADS * VALUES_PER_THREAD)) CTAs as can be resident at once,
// and cluster k normalizes slices k, k + num_clusters, ... (one cluster per slice
// is limited by the GPU's cluster launch rate: docs/perf-notes.md).
// For each slice, CTA rank r owns the contiguous chunk
// [r, r + 1) * THREADS * VALUES_PER_THREAD; thread t owns its vectors
// first + i * THREADS (16-byte accesses, coalesced across the CTA).
// Per slice: wait for this thread's staged vectors, move them from shared memory
// to registers, start staging the next slice into the same shared memory with
// cp.async (so its HBM read overlaps everything below), take a two-pass mean and
// M2 of the registers, merge them across the block (cub) and the cluster (DSMEM,
// one cluster barrier), normalize the registers and write them. HBM is read once
// and written once. Shift: statistics are taken of x - x[slice][0], so a constant
// slice gives exactly 0 whatever its magnitude.
// Needs THREADS * VALUES_PER_THREAD * 4 bytes of dynamic shared memory, spatial % 4
// == 0, 16-byte aligned x and y, and spatial at most kMaxClusterSize * THREADS *
// VALUES_PER_THREAD (the launcher checks).
template <int THREADS, int VALUES_PER_THREAD>
__global__ void __launch_bounds__(THREADS, 1)
    forward_cluster_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t num_slices, int spatial,
                           float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(VALUES_PER_THREAD % 4 == 0, "values are held as float4");
  constexpr int kVecs = VALUES_PER_THREAD / 4;
  constexpr int kCtaCapacity = THREADS * VALUES_PER_THREAD;
  using Reduce = ClusterStatsReduce<THREADS>;
  __shared__ typename Reduce::TempStorage storage;
  extern __shared__ float4 staged[];  // [kVecs][THREADS]: each thread owns its column

  const cg::cluster_group cluster = cg::this_cluster();
  const int cluster_size = static_cast<int>(cluster.num_blocks());
  const int64_t num_clusters = gridDim.x / cluster_size;

  // This thread's vectors of a slice are first + i * THREADS for i < valid.
  const int num_vecs = spatial / 4;
  const int first = static_cast<int>(cluster.block_rank()) * (kCtaCapacity / 4) + threadIdx.x;
  const int valid = min(kVecs, max(0, (num_vecs - first + THREADS - 1) / THREADS));
  const unsigned staged_column = static_cast<unsigned>(__cvta_generic_to_shared(staged + threadIdx.x));
  const auto stage = [&](int64_t slice) {
    stage_column<THREADS>(staged_column, reinterpret_cast<const float4*>(x + slice * spatial) + first, valid,
                          std::make_integer_sequence<int, kVecs>());
  };

  int64_t slice = blockIdx.x / cluster_size;
  float shift = slice < num_slices ? __ldg(x + slice * spatial) : 0.f;
  if (slice < num_slices) stage(slice);
  for (int parity = 0; slice < num_slices; slice += num_clusters, parity ^= 1) {
    const int64_t next = slice + num_clusters;
    const float next_shift = next < num_slices ? __ldg(x + next * spatial) : 0.f;

    float4 d[kVecs];
    cp_async_wait_all();
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      d[i] = i < valid ? staged[i * THREADS + threadIdx.x] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
        d[i] = make_float4(d[i].x - shift, d[i].y - shift, d[i].z - shift, d[i].w - shift);
        sum += (d[i].x + d[i].y) + (d[i].z + d[i].w);
      }
    }
    // The sum used every staged value this thread read, so they are all in
    // registers now and its shared-memory column can take the next slice.
    if (next < num_slices) stage(next);

    SliceStats stats{4.f * valid, 0.f, 0.f};
    if (valid > 0) {
      stats.mean = sum / stats.count;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (i < valid) {
          const float a = d[i].x - stats.mean, b = d[i].y - stats.mean;
          const float c = d[i].z - stats.mean, e = d[i].w - stats.mean;
          stats.m2 += (a * a + b * b) + (c * c + e * e);
        }
      }
    }
    stats = Reduce::allreduce(stats, storage, parity);
    const float mean = stats.mean;
    const float rstd = rsqrtf(stats.m2 / static_cast<float>(spatial) + eps);
    float4* slice_y = reinterpret_cast<float4*>(y + slice * spatial);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
        store_streaming(slice_y + first + i * THREADS,
                        make_float4((d[i].x - mean) * rstd, (d[i].y - mean) * rstd, (d[i].z - mean) * rstd,
                                    (d[i].w - mean) * rstd));
      }
    }
    shift = next_shift;
  }
  cluster.sync();  // no CTA leaves while another may still read its shared memory
#endif
}

using ClusterKernel = void (*)(const float*, float*, int64_t, int, float);

struct ClusterVariant {
  ForwardPath path;
  int threads;
  int cta_capacity;  // fp32 values one CTA holds (in registers, and staged in shared memory)
  int shared_bytes;  // dynamic shared memory per CTA
  ClusterKernel kernel;
};

template <int THREADS, int VALUES>
constexpr ClusterVariant cluster_variant(ForwardPath path) {
  return {path, THREADS, THREADS * VALUES, THREADS * VALUES * 4, forward_cluster_kernel<THREADS, VALUES>};
}

// 512 threads x 64 fp32: 128 KB in registers plus 128 KB staged per CTA, one CTA
// per SM; a 512 x 512 slice takes a cluster of 8 (docs/perf-notes.md compares shapes).
constexpr ClusterVariant kClusterVariants[] = {
    cluster_variant<512, 64>(ForwardPath::kCluster),
};

const ClusterVariant* find_cluster_variant(ForwardPath path) {
  for (const ClusterVariant& v : kClusterVariants) {
    if (v.path == path) return &v;
  }
  return nullptr;
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
// MIG partitions). Cached per (device, variant, size): the query costs microseconds.
int max_active_clusters(const ClusterVariant& v, int cluster_size) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, int> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const auto key = std::make_tuple(device, static_cast<int>(v.path), cluster_size);
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

bool cluster_variant_supported(const ClusterVariant& v, int64_t num_slices, int64_t spatial, bool aligned) {
  const int cluster_size = cluster_size_for(v, spatial);
  return aligned && cluster_size <= kMaxClusterSize && max_active_clusters(v, cluster_size) > 0;
}

cudaError_t launch_cluster(const ClusterVariant& v, const float* x, float* y, int64_t num_slices, int64_t spatial,
                           float eps, cudaStream_t stream) {
  const int cluster_size = cluster_size_for(v, spatial);
  const int64_t num_clusters = std::min<int64_t>(num_slices, max_active_clusters(v, cluster_size));
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_launch_config(v, static_cast<unsigned>(num_clusters * cluster_size), cluster_size, stream, &attribute);
  return cudaLaunchKernelEx(&config, v.kernel, x, y, num_slices, static_cast<int>(spatial), eps);
}

cudaError_t launch_generic(const float* x, float* y, int64_t num_slices, int64_t spatial, float eps,
                           cudaStream_t stream) {
  const unsigned num_ctas = static_cast<unsigned>(num_slices < INT32_MAX ? num_slices : INT32_MAX);
  forward_generic_kernel<kGenericThreads><<<num_ctas, kGenericThreads, 0, stream>>>(x, y, num_slices, spatial, eps);
  return cudaGetLastError();
}

}  // namespace

ForwardPath choose_forward_path(int64_t num_slices, int64_t spatial, bool aligned) {
  for (const ClusterVariant& v : kClusterVariants) {
    if (cluster_variant_supported(v, num_slices, spatial, aligned)) return v.path;
  }
  return ForwardPath::kGeneric;
}

bool forward_path_supported(ForwardPath path, int64_t num_slices, int64_t spatial, bool aligned) {
  if (path == ForwardPath::kAuto || path == ForwardPath::kGeneric) return true;
  const ClusterVariant* v = find_cluster_variant(path);
  return v != nullptr && cluster_variant_supported(*v, num_slices, spatial, aligned);
}

cudaError_t forward_f32(const float* x, float* y, int64_t num_slices, int64_t spatial, float eps, ForwardPath path,
                        cudaStream_t stream) {
  if (num_slices <= 0 || spatial <= 0) return cudaSuccess;
  const bool aligned = spatial % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(y) % 16 == 0;
  if (path == ForwardPath::kAuto) path = choose_forward_path(num_slices, spatial, aligned);
  if (!forward_path_supported(path, num_slices, spatial, aligned)) return cudaErrorInvalidValue;
  if (path == ForwardPath::kGeneric) return launch_generic(x, y, num_slices, spatial, eps, stream);
  return launch_cluster(*find_cluster_variant(path), x, y, num_slices, spatial, eps, stream);
}

}  // namespace instance_norm
