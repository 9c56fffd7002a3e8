// InstanceNorm forward on contiguous (num_slices, spatial) fp32 data: the
// cluster-resident single-read kernel, the generic kernel, and the one place
// that chooses between them.
#include "common.cuh"
#include "instance_norm.h"

#include <map>
#include <mutex>
#include <tuple>

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

// Cluster-resident path (sm_90+): a cluster of ceil(spatial / (THREADS *
// VALUES_PER_THREAD)) CTAs owns one slice; CTA rank r holds the contiguous chunk
// [r, r + 1) * THREADS * VALUES_PER_THREAD of it in registers (16-byte loads,
// coalesced across the CTA). Each thread takes a two-pass mean and M2 of its own
// values; these are merged across the block with cub and across the cluster
// through distributed shared memory (one cluster barrier), then every thread
// normalizes its registers and writes them: HBM is read once and written once.
// Requires spatial % 4 == 0, 16-byte aligned x and y, and spatial at most
// kMaxClusterSize * THREADS * VALUES_PER_THREAD (the launcher checks).
template <int THREADS, int VALUES_PER_THREAD, int CTAS_PER_SM>
__global__ void __launch_bounds__(THREADS, CTAS_PER_SM)
    forward_cluster_kernel(const float* __restrict__ x, float* __restrict__ y, int spatial, float eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(VALUES_PER_THREAD % 4 == 0, "values are held as float4");
  constexpr int kVecs = VALUES_PER_THREAD / 4;
  using Reduce = ClusterStatsReduce<THREADS>;
  __shared__ typename Reduce::TempStorage storage;

  const cg::cluster_group cluster = cg::this_cluster();
  const int64_t slice_offset = static_cast<int64_t>(blockIdx.x / cluster.num_blocks()) * spatial;
  const float shift = __ldg(x + slice_offset);
  const float4* slice_x = reinterpret_cast<const float4*>(x + slice_offset);
  float4* slice_y = reinterpret_cast<float4*>(y + slice_offset);

  // This thread's vectors are first + i * THREADS for i < valid.
  const int num_vecs = spatial / 4;
  const int first = static_cast<int>(cluster.block_rank()) * (THREADS * kVecs) + threadIdx.x;
  const int valid = min(kVecs, max(0, (num_vecs - first + THREADS - 1) / THREADS));

  float4 d[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    d[i] = i < valid ? load_streaming(slice_x + first + i * THREADS) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    if (i < valid) {
      d[i] = make_float4(d[i].x - shift, d[i].y - shift, d[i].z - shift, d[i].w - shift);
      sum += (d[i].x + d[i].y) + (d[i].z + d[i].w);
    }
  }
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

  stats = Reduce::allreduce_arrive(stats, storage);
  const float mean = stats.mean;
  const float rstd = rsqrtf(stats.m2 / static_cast<float>(spatial) + eps);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    if (i < valid) {
      store_streaming(slice_y + first + i * THREADS,
                      make_float4((d[i].x - mean) * rstd, (d[i].y - mean) * rstd,
                                  (d[i].z - mean) * rstd, (d[i].w - mean) * rstd));
    }
  }
  cluster.barrier_wait();  // no CTA leaves while another may still read its shared memory
#endif
}

using ClusterKernel = void (*)(const float*, float*, int, float);

struct ClusterVariant {
  ForwardPath path;
  int threads;
  int cta_capacity;  // fp32 values one CTA holds
  ClusterKernel kernel;
};

// Ordered by preference: kAuto takes the first that fits the slice and the GPU.
constexpr ClusterVariant kClusterVariants[] = {
    {ForwardPath::kCluster256x64, 256, 256 * 64, forward_cluster_kernel<256, 64, 2>},
    {ForwardPath::kCluster512x32, 512, 512 * 32, forward_cluster_kernel<512, 32, 2>},
    {ForwardPath::kCluster512x64, 512, 512 * 64, forward_cluster_kernel<512, 64, 1>},
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
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// Whether clusters of `cluster_size` CTAs of this variant can be resident on the
// current device (not on pre-Hopper GPUs, nor where a GPC is too small, e.g. some
// MIG partitions). Cached per (device, variant, size): the query costs microseconds.
bool cluster_fits(const ClusterVariant& v, int cluster_size) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, bool> cache;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const auto key = std::make_tuple(device, static_cast<int>(v.path), cluster_size);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;

  bool fits = false;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess && major >= 9 &&
      (cluster_size <= 8 ||
       cudaFuncSetAttribute(v.kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess)) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_launch_config(v, cluster_size, cluster_size, nullptr, &attribute);
    int max_clusters = 0;
    fits = cudaOccupancyMaxActiveClusters(&max_clusters, v.kernel, &config) == cudaSuccess && max_clusters > 0;
  }
  cudaGetLastError();  // a failed query must not be reported by the next launch check
  cache.emplace(key, fits);
  return fits;
}

bool cluster_variant_supported(const ClusterVariant& v, int64_t num_slices, int64_t spatial, bool aligned) {
  const int cluster_size = cluster_size_for(v, spatial);
  return aligned && cluster_size <= kMaxClusterSize && num_slices * cluster_size <= INT32_MAX &&
         cluster_fits(v, cluster_size);
}

cudaError_t launch_cluster(const ClusterVariant& v, const float* x, float* y, int64_t num_slices, int64_t spatial,
                           float eps, cudaStream_t stream) {
  const int cluster_size = cluster_size_for(v, spatial);
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config =
      cluster_launch_config(v, static_cast<unsigned>(num_slices * cluster_size), cluster_size, stream, &attribute);
  return cudaLaunchKernelEx(&config, v.kernel, x, y, static_cast<int>(spatial), eps);
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
