// InstanceNorm forward on contiguous (num_slices, spatial) data of float32,
// float16 or bfloat16: the warp- and CTA-per-slice and resident (cluster or
// cooperative team) kernels, and the one place that chooses a path (the split
// path and the eval-mode sweep are in instance_norm_split.cu).
#include "common.cuh"
#include "instance_norm.h"
#include "split.h"

#include <algorithm>
#include <utility>

namespace instance_norm {
// load_inline compiles all .cu sources as one translation unit: each file keeps
// its internals in its own namespace.
namespace forward_detail {

// Per-channel affine of slice `slice`: y = (x - mean) * rstd * weight + bias.
__device__ __forceinline__ float2 slice_affine(const ForwardProblem& p, int64_t slice) {
  const int64_t channel = slice % p.num_channels;
  return make_float2(p.weight != nullptr ? __ldg(p.weight + channel) : 1.f,
                     p.bias != nullptr ? __ldg(p.bias + channel) : 0.f);
}

// The slice's mean and rstd (in x's units), to the optional outputs; called by one
// thread per slice.
__device__ __forceinline__ void save_slice_stats(const ForwardProblem& p, int64_t slice, float mean, float rstd) {
  if (p.mean != nullptr) p.mean[slice] = mean;
  if (p.rstd != nullptr) p.rstd[slice] = rstd;
}

// Row paths, for slices that fit one warp (kWarp) or one CTA (kBlock): a group of
// GROUP threads (a warp, or the whole CTA) per slice, grid-stride over slices, any
// alignment and GPU. Thread t of the group holds elements t + GROUP k (k < VALUES) in
// registers, so the slice is read once and each load instruction of a warp reads
// consecutive elements; many groups are resident per SM, so many slices are in
// flight at once. The mean and then the centered M2 are summed over the group (an
// xor butterfly, or cub::BlockReduce, both in a fixed order). Statistics of the
// shifted, scaled values (SliceShift), as on the other paths.
// CTA sizes: 512 threads (16 warp groups) for the warp path, 1024 (one group) for
// the block path; both at most 64 registers per thread, so two 512-thread or one
// 1024-thread CTA per SM hold up to 2 x 16,384 fp32 values in flight per SM.
constexpr int kWarpPathThreads = 512;
constexpr int kBlockPathThreads = 1024;

template <int GROUP>
__host__ __device__ constexpr int row_cta_threads() {
  return GROUP == kWarpSize ? kWarpPathThreads : GROUP;
}

// Sum of v over the group, returned to every thread of it.
template <int GROUP>
__device__ __forceinline__ float group_sum(float v, typename BlockAllReduce<float, GROUP, Sum>::TempStorage& storage) {
  if constexpr (GROUP == kWarpSize) {
    return warp_allreduce(v, Sum());
  } else {
    return BlockAllReduce<float, GROUP, Sum>::allreduce(v, storage);
  }
}

template <typename T, int GROUP, int VALUES>
__global__ void __launch_bounds__(row_cta_threads<GROUP>(), 65536 / 64 / row_cta_threads<GROUP>())
    forward_rows_kernel(const ForwardProblem p) {
  static_assert(GROUP == kWarpSize || GROUP == kBlockPathThreads, "a warp or the whole CTA per slice");
  using S = Storage<T>;
  constexpr int kGroups = row_cta_threads<GROUP>() / GROUP;
  __shared__ typename BlockAllReduce<float, GROUP, Sum>::TempStorage storage;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int rank = threadIdx.x % GROUP;
  const int spatial = static_cast<int>(p.spatial);
  const int64_t num_slices = p.num_slices();
  for (int64_t slice = static_cast<int64_t>(blockIdx.x) * kGroups + threadIdx.x / GROUP; slice < num_slices;
       slice += static_cast<int64_t>(gridDim.x) * kGroups) {
    const T* slice_x = x + slice * spatial;
    const SliceShift shift = SliceShift::of(S::to_float(__ldg(slice_x)));
    float d[VALUES];
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < VALUES; ++k) {
      const int i = rank + k * GROUP;
      d[k] = i < spatial ? shift.apply(S::to_float(__ldg(slice_x + i))) : 0.f;
      sum += d[k];
    }
    const float mean = group_sum<GROUP>(sum, storage) / static_cast<float>(spatial);
    float m2 = 0.f;
#pragma unroll
    for (int k = 0; k < VALUES; ++k) {
      const float deviation = rank + k * GROUP < spatial ? d[k] - mean : 0.f;
      m2 += deviation * deviation;
    }
    const float rstd = shift.rstd_of_d(group_sum<GROUP>(m2, storage), static_cast<float>(spatial), p.eps);
    if (rank == 0) save_slice_stats(p, slice, shift.mean(mean), shift.rstd(rstd));
    const float2 affine = slice_affine(p, slice);
    const float scale = rstd * affine.x;
    T* slice_y = y + slice * spatial;
#pragma unroll
    for (int k = 0; k < VALUES; ++k) {
      const int i = rank + k * GROUP;
      if (i < spatial) slice_y[i] = S::from_float((d[k] - mean) * scale + affine.y);
    }
  }
}

// Resident paths, persistent: kCluster (a thread-block cluster per slice, sm_90+)
// and kCooperative (a team of CTAs of a cooperative launch, any size up to the
// resident CTAs; common.cuh, teams). The grid holds as many teams of
// ceil(spatial / (THREADS * VALUES_PER_THREAD)) CTAs as can be resident at once,
// and team k normalizes slices k, k + teams, ... (one team per slice is limited by
// the GPU's launch rate: docs/perf-notes.md).
// For each slice, CTA rank r owns the contiguous chunk
// [r, r + 1) * THREADS * VALUES_PER_THREAD; thread t owns its 16-byte vectors
// first + i * THREADS (coalesced across the CTA).
// Per slice: wait for this thread's staged vectors, move them from shared memory
// to registers, at once start staging the next slice into the same shared memory
// with cp.async (so its HBM read overlaps everything below; after_reading orders
// the restage after the reads without waiting for the sum), take the mean and then
// the centered M2 of the registers, merge them across the block (cub) and the team
// (one team barrier), normalize the registers and write them. HBM is
// read once and written once. Statistics are of the shifted, scaled values
// (SliceShift), so a constant slice gives exactly 0 (before bias) and values near
// 1e30 do not overflow.
// Needs THREADS * VALUES_PER_THREAD * sizeof(T) bytes of dynamic shared memory,
// spatial % Storage<T>::kPerVector == 0, 16-byte aligned x and y, and a team size
// the device can run: a cluster of at most kMaxClusterSize CTAs, or at most the
// resident CTAs for a cooperative team (the launcher checks).
template <typename T, int THREADS, int VALUES_PER_THREAD, typename Team>
__device__ __forceinline__ void forward_resident(const ForwardProblem& p, const Team& team) {
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  static_assert(VALUES_PER_THREAD % kPer == 0, "values are held as whole 16-byte vectors");
  constexpr int kVecs = VALUES_PER_THREAD / kPer;
  constexpr int kCtaVecs = THREADS * kVecs;
  __shared__ TeamStorage<SliceStats, THREADS> storage;
  extern __shared__ uint4 staged[];  // [kVecs][THREADS]: each thread owns its column

  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int spatial = static_cast<int>(p.spatial);
  const int64_t num_teams = team.count();
  const int64_t num_slices = p.num_slices();

  // This thread's vectors of a slice are first + i * THREADS for i < valid.
  const int num_vecs = spatial / kPer;
  const int first = team.rank() * kCtaVecs + threadIdx.x;
  const int valid = min(kVecs, max(0, (num_vecs - first + THREADS - 1) / THREADS));
  const unsigned staged_column = static_cast<unsigned>(__cvta_generic_to_shared(staged + threadIdx.x));
  const auto stage = [&](unsigned column, int64_t slice) {
    stage_column<THREADS>(column, reinterpret_cast<const uint4*>(x + slice * spatial) + first, valid,
                          std::make_integer_sequence<int, kVecs>());
  };
  const unsigned zero = static_cast<unsigned>(spatial) >> 31;  // spatial < 2^31: 0, unknown to the compiler

  int64_t slice = team.index();
  float first_value = slice < num_slices ? S::to_float(x[slice * spatial]) : 0.f;
  if (slice < num_slices) stage(staged_column, slice);
  for (int round = 0; slice < num_slices; slice += num_teams, ++round) {
    const int64_t next = slice + num_teams;
    const float next_first_value = next < num_slices ? S::to_float(x[next * spatial]) : 0.f;
    const SliceShift shift = SliceShift::of(first_value);

    // The raw 16-byte vectors stay in registers (4 registers per vector whatever the
    // dtype, so a 16-bit CTA holds twice the values of a float32 one); 16-bit values
    // are converted to float at each of the three uses.
    uint4 raw[kVecs];
    cp_async_wait_all();
#pragma unroll
    for (int i = 0; i < kVecs; ++i) raw[i] = i < valid ? staged[i * THREADS + threadIdx.x] : make_uint4(0, 0, 0, 0);
    // The next slice's HBM read starts as soon as this thread's column is in
    // registers, and overlaps everything below.
    const bool stages_late = Team::stages_after_allreduce();
    if (next < num_slices && !stages_late) stage(after_reading(staged_column, raw, zero), next);
    // Three loops over the registers: the sum of d, M2 about the thread's mean, and
    // y = d * scale + (bias - mean * scale), d = (x - shift) * k (SliceShift). The
    // shift is a value of the slice, so mean_d * scale is of the order of
    // (mean - x0) / std, and folding it into the bias rounds only that. float32
    // registers hold d from the first loop on (the same 32 bits); 16-bit ones hold x,
    // and each loop computes d anew, the M2 loop as one FMA with the thread's mean
    // folded into the shift (rounding the offset by at most half a float32 ulp of
    // the thread's mean of x * k: M2 changes by count * that^2, far below 16-bit
    // resolution).
    // Every vector of a column is valid but in the last CTA of a team whose slice
    // does not fill it, so each loop is compiled both without and with a test per
    // vector (with_valid_count). Without the tests the compiler merges the unpacking
    // of one loop with a later loop's, keeping 128 unpacked floats live (200-500 B
    // of spills): so the statistics loops go test-free only where that cannot
    // happen: float32 (nothing is unpacked again) and bfloat16 (its sum loop
    // unpacks by byte permutes, the others by shift and mask).
    constexpr bool kHoldsD = sizeof(T) == sizeof(float);
    const auto thread_stats = [&](auto count) {
      float sum = 0.f;
      for_each_unpacked<T, S::kHasPermuteUnpack>(raw, count, [&](int i, const float(&v)[kPer]) {
        float d[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) sum += d[k] = shift.apply(v[k]);
        if constexpr (kHoldsD) raw[i] = S::pack(d);
      });
      SliceStats stats{static_cast<float>(kPer * count), 0.f, 0.f};
      if (count > 0) {
        stats.mean = sum / stats.count;
        const LinearMap centered = kHoldsD ? LinearMap{1.f, -stats.mean} : shift.centered(stats.mean);
        for_each_unpacked<T>(raw, count, [&](int, const float(&v)[kPer]) {
#pragma unroll
          for (int k = 0; k < kPer; ++k) {
            const float deviation = centered.apply(v[k]);
            stats.m2 += deviation * deviation;
          }
        });
      }
      return stats;
    };
    SliceStats stats;
    if constexpr (kHoldsD || S::kHasPermuteUnpack) {
      stats = with_valid_count<kVecs>(valid, thread_stats);
    } else {
      stats = thread_stats(valid);
    }
    stats = team.template allreduce<CombineStats>(stats, storage, round);
    if (next < num_slices && stages_late) stage(staged_column, next);
    const float mean = stats.mean;
    const float rstd = shift.rstd_of_d(stats.m2, static_cast<float>(spatial), p.eps);
    const float2 affine = slice_affine(p, slice);  // here, not held through the passes
    const float scale = rstd * affine.x;
    const float offset = affine.y - mean * scale;
    uint4* slice_y = reinterpret_cast<uint4*>(y + slice * spatial);
    with_valid_count<kVecs>(valid, [&](auto count) {
      for_each_unpacked<T>(raw, count, [&](int i, const float(&v)[kPer]) {
        float out[kPer];
#pragma unroll
        for (int k = 0; k < kPer; ++k) out[k] = __fmaf_rn(kHoldsD ? v[k] : shift.apply(v[k]), scale, offset);
        store_streaming(slice_y + first + i * THREADS, S::pack(out));
      });
    });
    // After the stores, where the values' registers are free (saving earlier spills).
    if (threadIdx.x == 0 && team.rank() == 0) save_slice_stats(p, slice, shift.mean(mean), shift.rstd(rstd));
    first_value = next_first_value;
  }
  team.finish();
}

template <typename T, int THREADS, int VALUES_PER_THREAD, TeamKind TEAM>
__global__ void __launch_bounds__(THREADS, 1) forward_resident_kernel(const ForwardProblem p) {
  with_team<TEAM>(p.workspace, team_size_for(p.spatial, THREADS * VALUES_PER_THREAD),
                  [&](const auto& team) { forward_resident<T, THREADS, VALUES_PER_THREAD>(p, team); });
}

template <typename T, int THREADS, int VALUES>
constexpr ResidentVariant<ForwardProblem> resident_variant(DType dtype) {
  return {dtype,
          THREADS,
          THREADS * VALUES,
          THREADS * VALUES * static_cast<int>(sizeof(T)),
          static_cast<int>(sizeof(SliceStats)),
          forward_resident_kernel<T, THREADS, VALUES, TeamKind::kCluster>,
          forward_resident_kernel<T, THREADS, VALUES, TeamKind::kCooperative>,
          false};
}

// 512 threads x 16 vectors: 128 KB of registers plus 128 KB of the staged next
// slice per CTA, one CTA per SM. A 512 x 512 slice takes a cluster of 8 in fp32 (64
// values per thread) and of 4 in fp16/bf16 (128 values per thread)
// (docs/perf-notes.md compares shapes).
constexpr ResidentVariant<ForwardProblem> kResidentVariants[] = {
    resident_variant<float, 512, 64>(DType::kFloat32),
    resident_variant<__half, 512, 128>(DType::kFloat16),
    resident_variant<__nv_bfloat16, 512, 128>(DType::kBFloat16),
};

bool vector_aligned(const ForwardProblem& p) {
  return p.spatial % values_per_vector(p.dtype) == 0 && aligned16(p.x) && aligned16(p.y);
}

bool resident_supported(TeamKind team, const ForwardProblem& p) {
  const ResidentVariant<ForwardProblem>& variant = variant_for(kResidentVariants, p.dtype);
  return p.layout == Layout::kContiguous && vector_aligned(p) &&
         (team == TeamKind::kCluster ? variant.cluster_fits(p.spatial) : variant.cooperative_fits(p.spatial));
}

template <typename T, int GROUP, int VALUES>
cudaError_t launch_rows(const ForwardProblem& p, cudaStream_t stream) {
  constexpr int kThreads = row_cta_threads<GROUP>();
  forward_rows_kernel<T, GROUP, VALUES><<<grid_for(p.num_slices(), kThreads / GROUP), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The smallest variant that holds the slice: a warp of 32 x {2, 8, 32} values, or a
// CTA of 1024 x {4, 8, 16}.
cudaError_t launch_warp(const ForwardProblem& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.spatial <= 2 * kWarpSize) return launch_rows<T, kWarpSize, 2>(p, stream);
    if (p.spatial <= 8 * kWarpSize) return launch_rows<T, kWarpSize, 8>(p, stream);
    return launch_rows<T, kWarpSize, 32>(p, stream);
  });
}

cudaError_t launch_block(const ForwardProblem& p, cudaStream_t stream) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.spatial <= 4 * kBlockPathThreads) return launch_rows<T, kBlockPathThreads, 4>(p, stream);
    if (p.spatial <= 8 * kBlockPathThreads) return launch_rows<T, kBlockPathThreads, 8>(p, stream);
    return launch_rows<T, kBlockPathThreads, 16>(p, stream);
  });
}

}  // namespace forward_detail

static_assert(kWarpMaxSpatial == 32 * kWarpSize, "the warp path's largest variant holds 32 values per lane");
static_assert(kBlockMaxSpatial == 16 * forward_detail::kBlockPathThreads,
              "the block path's largest variant holds 16 values per thread");

// Slices that fit a warp or a CTA take the row paths, which keep many slices in
// flight per SM; larger ones the cluster path where it runs, else cooperative teams
// where the slice fits the resident CTAs, else the split path.
ForwardPath choose_forward_path(const ForwardProblem& problem) {
  using namespace forward_detail;
  if (problem.layout != Layout::kContiguous) return ForwardPath::kSplit;
  if (problem.spatial <= kWarpMaxSpatial) return ForwardPath::kWarp;
  if (problem.spatial <= kBlockMaxSpatial) return ForwardPath::kBlock;
  if (resident_supported(TeamKind::kCluster, problem)) return ForwardPath::kCluster;
  return resident_supported(TeamKind::kCooperative, problem) ? ForwardPath::kCooperative : ForwardPath::kSplit;
}

bool forward_path_supported(ForwardPath path, const ForwardProblem& problem) {
  using namespace forward_detail;
  const bool contiguous = problem.layout == Layout::kContiguous;
  switch (path) {
    case ForwardPath::kAuto: return true;
    case ForwardPath::kBlock: return contiguous && problem.spatial <= kBlockMaxSpatial;
    case ForwardPath::kCluster: return resident_supported(TeamKind::kCluster, problem);
    case ForwardPath::kCooperative: return resident_supported(TeamKind::kCooperative, problem);
    case ForwardPath::kWarp: return contiguous && problem.spatial <= kWarpMaxSpatial;
    case ForwardPath::kSplit: return split_supported(problem);
  }
  return false;
}

size_t forward_workspace_bytes(const ForwardProblem& problem, ForwardPath path) {
  using namespace forward_detail;
  if (path == ForwardPath::kAuto) path = choose_forward_path(problem);
  if (problem.running_mean != nullptr || path == ForwardPath::kSplit) return split_workspace_bytes(problem);
  if (path == ForwardPath::kCooperative) {
    return variant_for(kResidentVariants, problem.dtype).cooperative_workspace_bytes(problem);
  }
  return 0;
}

// With running statistics (eval) every path is the same elementwise sweep.
cudaError_t forward(const ForwardProblem& problem, ForwardPath path, cudaStream_t stream) {
  using namespace forward_detail;
  if (problem.num_slices() <= 0 || problem.spatial <= 0) return cudaSuccess;
  if (problem.y == nullptr || !forward_path_supported(path, problem)) return cudaErrorInvalidValue;
  if (path == ForwardPath::kAuto) path = choose_forward_path(problem);
  if (problem.running_mean != nullptr || path == ForwardPath::kSplit) return launch_split(problem, stream);
  switch (path) {
    case ForwardPath::kBlock: return launch_block(problem, stream);
    case ForwardPath::kWarp: return launch_warp(problem, stream);
    case ForwardPath::kCooperative:
      return variant_for(kResidentVariants, problem.dtype).launch_cooperative(problem, stream);
    default: return variant_for(kResidentVariants, problem.dtype).launch_cluster(problem, stream);
  }
}

}  // namespace instance_norm
