// The forward's split path (several CTAs per slice, two reads, any layout, size,
// alignment and GPU), whose sweep is also the eval-mode forward with running
// statistics.
//
// Split path, three launches:
//   1. partial statistics (count, mean, M2) of each chunk of each slice: contiguous,
//      a CTA per (slice, chunk of kChunk values); channels_last, a CTA per (n, chunk
//      of kRowsPerChunk spatial rows, tile of 32 channels);
//   2. one warp per slice combines its chunks in a fixed order (Chan et al.) into
//      {shift, mean, rstd * weight, bias} (or takes running_mean/var in eval);
//   3. an elementwise sweep y = ((x - shift) - mean) * scale + bias over the flat tensor.
// All statistics are of d = (x - shift) * k (SliceShift, shift = the slice's first
// value), as on the other paths: chunk means stay small, so combining them loses
// nothing to the magnitude of x (1e4 + 0.1 * randn keeps its precision), a constant
// slice gives exactly 0, and values near 1e30 do not overflow.
// Every reduction has a fixed order, so results are bit-identical run to run.
#include "common.cuh"
#include "split.h"

namespace instance_norm {
// load_inline compiles all .cu sources as one translation unit: each file keeps
// its internals in its own namespace.
namespace split_detail {

constexpr int kThreads = 256;
constexpr int kValuesPerThread = 16;
constexpr int64_t kChunk = kThreads * kValuesPerThread;  // contiguous: values per partial
constexpr int kTileChannels = kWarpSize;                 // channels_last: block of 32 channels x 8 rows
constexpr int kTileRows = kThreads / kTileChannels;
constexpr int kRowsPerChunk = kTileRows * kValuesPerThread;  // channels_last: rows per partial
constexpr int kSweepUnroll = 8;                              // vectors per thread per sweep tile
constexpr int64_t kSweepTile = kThreads * kSweepUnroll;

int64_t chunks_per_slice(const ForwardProblem& p) {
  const int64_t chunk = p.layout == Layout::kContiguous ? kChunk : kRowsPerChunk;
  return ceil_div(p.spatial, chunk);
}

int64_t partials_bytes(const ForwardProblem& p) {
  if (p.running_mean != nullptr) return 0;
  const int64_t bytes = p.num_slices() * chunks_per_slice(p) * static_cast<int64_t>(sizeof(SliceStats));
  return round_up(bytes, 16);
}

// Statistics of this thread's `count` values d[0..count) (already shifted): their
// mean, then the centered M2 (two passes over registers).
template <int N>
__device__ __forceinline__ SliceStats thread_stats(const float (&d)[N], int count) {
  SliceStats stats{static_cast<float>(count), 0.f, 0.f};
  if (count == 0) return stats;
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) sum += k < count ? d[k] : 0.f;
  stats.mean = sum / stats.count;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float deviation = k < count ? d[k] - stats.mean : 0.f;
    stats.m2 += deviation * deviation;
  }
  return stats;
}

// V values of x at `offset` (V = 1, or one 16-byte vector) as float.
template <typename T, int V>
__device__ __forceinline__ void load_values(const T* x, int64_t offset, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = Storage<T>::to_float(__ldg(x + offset));
  } else {
    Storage<T>::unpack(__ldg(reinterpret_cast<const uint4*>(x + offset)), out);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_values(T* y, int64_t offset, const float (&in)[V]) {
  if constexpr (V == 1) {
    y[offset] = Storage<T>::from_float(in[0]);
  } else {
    store_streaming(reinterpret_cast<uint4*>(y + offset), Storage<T>::pack(in));
  }
}

// The first value (the shift) of slice (n, channel), for either layout.
template <typename T>
__device__ __forceinline__ float slice_shift(const ForwardProblem& p, int64_t n, int64_t channel) {
  const int64_t first = p.layout == Layout::kContiguous ? (n * p.num_channels + channel) * p.spatial
                                                        : n * p.spatial * p.num_channels + channel;
  return Storage<T>::to_float(__ldg(static_cast<const T*>(p.x) + first));
}

// Kernel 1, contiguous: partials[slice * chunks + chunk] for chunks of kChunk values;
// thread t reads units t + k * kThreads of its chunk (coalesced), a unit being V
// values: one 16-byte vector where x and spatial allow, else one value.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    partial_stats_contiguous_kernel(const ForwardProblem p, int64_t chunks, SliceStats* partials) {
  constexpr int kUnits = kValuesPerThread / V;
  __shared__ typename BlockStatsReduce<kThreads>::TempStorage storage;
  const T* x = static_cast<const T*>(p.x);
  const int64_t num_tiles = p.num_slices() * chunks;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t slice = tile / chunks;
    const int64_t begin = (tile - slice * chunks) * kChunk;
    const int size = static_cast<int>(min(kChunk, p.spatial - begin));  // a multiple of V
    const T* chunk_x = x + slice * p.spatial + begin;
    const SliceShift shift = SliceShift::of(Storage<T>::to_float(__ldg(x + slice * p.spatial)));
    const int units = min(kUnits, max(0, (size / V - static_cast<int>(threadIdx.x) + kThreads - 1) / kThreads));
    float d[kValuesPerThread];
#pragma unroll
    for (int k = 0; k < kUnits; ++k) {
      float v[V];
      if (k < units) {
        load_values<T, V>(chunk_x, (threadIdx.x + static_cast<int64_t>(k) * kThreads) * V, v);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < V; ++j) d[k * V + j] = k < units ? shift.apply(v[j]) : 0.f;
    }
    const SliceStats total = BlockStatsReduce<kThreads>::allreduce(thread_stats(d, units * V), storage);
    if (threadIdx.x == 0) partials[tile] = total;
  }
}

// Kernel 1, channels_last: a (32, 8) block covers 32 channels x kRowsPerChunk rows of
// one n; thread (c, r) reads rows r + 8 k of channel c (a warp reads 32 consecutive
// channels of one row). The 8 row groups are combined in order through shared memory into
// partials[(n * C + c) * chunks + chunk].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    partial_stats_channels_last_kernel(const ForwardProblem p, int64_t chunks, SliceStats* partials) {
  using S = Storage<T>;
  __shared__ SliceStats row_groups[kTileRows][kTileChannels];
  const T* x = static_cast<const T*>(p.x);
  const int64_t channel_tiles = (p.num_channels + kTileChannels - 1) / kTileChannels;
  const int64_t num_tiles = p.batch * chunks * channel_tiles;
  const int tx = threadIdx.x % kTileChannels;
  const int ty = threadIdx.x / kTileChannels;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t n = tile / (chunks * channel_tiles);
    const int64_t rest = tile - n * chunks * channel_tiles;
    const int64_t chunk = rest / channel_tiles;
    const int64_t channel = (rest - chunk * channel_tiles) * kTileChannels + tx;
    const int64_t row_begin = chunk * kRowsPerChunk;
    const int rows = static_cast<int>(min(static_cast<int64_t>(kRowsPerChunk), p.spatial - row_begin));
    const bool active = channel < p.num_channels;
    const T* column = x + (n * p.spatial + row_begin) * p.num_channels + channel;
    const SliceShift shift = SliceShift::of(active ? slice_shift<T>(p, n, channel) : 0.f);
    const int count = active ? min(kValuesPerThread, max(0, (rows - ty + kTileRows - 1) / kTileRows)) : 0;
    float d[kValuesPerThread];
#pragma unroll
    for (int k = 0; k < kValuesPerThread; ++k) {
      d[k] = k < count ? shift.apply(S::to_float(__ldg(column + (ty + k * kTileRows) * p.num_channels))) : 0.f;
    }
    row_groups[ty][tx] = thread_stats(d, count);
    __syncthreads();
    if (ty == 0 && active) {
      SliceStats total = row_groups[0][tx];
#pragma unroll
      for (int r = 1; r < kTileRows; ++r) total = combine(total, row_groups[r][tx]);
      partials[(n * p.num_channels + channel) * chunks + chunk] = total;
    }
    __syncthreads();  // row_groups is rewritten by the next tile
  }
}

// Kernel 2: per slice {shift, mean of x - shift, rstd * weight[c], bias[c]} (scaled
// back from d by 1 / k and k, which is exact); the slice's statistics are its chunks' partials combined (and saved to the optional
// outputs), or running_mean[c] and running_var[c] in eval (shift 0). One warp per
// slice: lane l combines chunks l, l + 32, ... in order, then the symmetric xor
// butterfly (a fixed order: bit-identical run to run). A slice of 128^3 values has
// 512 chunks, which one thread would walk with a dependent load each.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    slice_stats_kernel(const ForwardProblem p, int64_t chunks, const SliceStats* partials, float4* slice_stats) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_slices = p.num_slices();
  for (int64_t slice = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; slice < num_slices;
       slice += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t n = slice / p.num_channels;
    const int64_t channel = slice - n * p.num_channels;
    float shift = 0.f, mean, rstd;
    if (p.running_mean != nullptr) {
      mean = __ldg(p.running_mean + channel);
      rstd = rsqrtf(__ldg(p.running_var + channel) + p.eps);
    } else {
      const SliceShift slice_shift_scale = SliceShift::of(slice_shift<T>(p, n, channel));
      SliceStats total{0.f, 0.f, 0.f};
      for (int64_t j = lane; j < chunks; j += kWarpSize) total = combine(total, partials[slice * chunks + j]);
      total = warp_allreduce(total, CombineStats());
      shift = slice_shift_scale.value();
      mean = slice_shift_scale.relative_mean(total.mean);
      rstd = slice_shift_scale.rstd(slice_shift_scale.rstd_of_d(total.m2, static_cast<float>(p.spatial), p.eps));
      if (lane == 0 && p.mean != nullptr) p.mean[slice] = slice_shift_scale.mean(total.mean);
      if (lane == 0 && p.rstd != nullptr) p.rstd[slice] = rstd;
    }
    const float weight = p.weight != nullptr ? __ldg(p.weight + channel) : 1.f;
    const float bias = p.bias != nullptr ? __ldg(p.bias + channel) : 0.f;
    if (lane == 0) slice_stats[slice] = make_float4(shift, mean, rstd * weight, bias);
  }
}

// Kernel 3: y = ((x - shift) - mean) * scale + bias with the float4 of the element's slice, over
// the flat tensor in units of V values (one vector, or one value where x, y or the
// row length is not vector-aligned). Units are split into (row, column) per unit
// with FastDivider, from a per-tile base that thread 0 splits in 64 bits:
//   contiguous:    row = slice, columns = spatial / V; the unit's values share the slice;
//   channels_last: row = n * spatial + s, columns = C / V; value k of the unit is
//                  channel column * V + k of slice n * C + channel.
template <typename T, Layout LAYOUT, int V>
__global__ void __launch_bounds__(kThreads)
    normalize_kernel(const ForwardProblem p, const float4* slice_stats, FastDivider columns, FastDivider spatial) {
  __shared__ int64_t tile_row, tile_column, tile_n, tile_s;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int64_t num_units = p.num_slices() * p.spatial / V;
  const int64_t num_tiles = (num_units + kSweepTile - 1) / kSweepTile;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    __syncthreads();  // the previous tile's readers are done with the shared base
    if (threadIdx.x == 0) {
      const int64_t base = tile * kSweepTile;
      tile_row = base / columns.divisor;
      tile_column = base - tile_row * columns.divisor;
      if constexpr (LAYOUT == Layout::kChannelsLast) {
        tile_n = tile_row / p.spatial;
        tile_s = tile_row - tile_n * p.spatial;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kSweepUnroll; ++k) {
      const int e = threadIdx.x + k * kThreads;
      const int64_t unit = tile * kSweepTile + e;
      if (unit >= num_units) break;
      const unsigned t = static_cast<unsigned>(tile_column + e);
      const unsigned q = columns.div(t);
      float v[V];
      load_values<T, V>(x, unit * V, v);
      if constexpr (LAYOUT == Layout::kContiguous) {
        const float4 s = slice_stats[tile_row + q];
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] = ((v[i] - s.x) - s.y) * s.z + s.w;
      } else {
        const int64_t n = tile_n + spatial.div(static_cast<unsigned>(tile_s + q));
        const int64_t first_slice = n * p.num_channels + static_cast<int64_t>(t - q * columns.divisor) * V;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float4 s = slice_stats[first_slice + i];
          v[i] = ((v[i] - s.x) - s.y) * s.z + s.w;
        }
      }
      apply_epilogue(p.epilogue, p.y, y + unit * V, v);
      store_values<T, V>(y, unit * V, v);
    }
  }
}

template <typename T, Layout LAYOUT>
cudaError_t launch_normalize(const ForwardProblem& p, const SplitPlan& plan, const float4* slice_stats,
                             cudaStream_t stream) {
  constexpr int kVector = Storage<T>::kPerVector;
  const int64_t row_length = LAYOUT == Layout::kContiguous ? p.spatial : p.num_channels;
  const FastDivider columns(static_cast<unsigned>(row_length / plan.sweep_unit));
  const FastDivider spatial(static_cast<unsigned>(p.spatial));
  if (plan.sweep_unit == kVector) {
    normalize_kernel<T, LAYOUT, kVector><<<plan.sweep_grid, kThreads, 0, stream>>>(p, slice_stats, columns, spatial);
  } else {
    normalize_kernel<T, LAYOUT, 1><<<plan.sweep_grid, kThreads, 0, stream>>>(p, slice_stats, columns, spatial);
  }
  return cudaGetLastError();
}

}  // namespace split_detail

bool split_supported(const ForwardProblem& p) {
  using namespace split_detail;
  return p.spatial < (int64_t{1} << 30) && p.num_channels < (int64_t{1} << 30);
}

ForwardPlan split_plan(const ForwardProblem& p) {
  using namespace split_detail;
  ForwardPlan plan{};
  plan.path = ForwardPath::kSplit;
  SplitPlan& split = plan.split;
  const int vector = values_per_vector(p.dtype);
  const bool contiguous = p.layout == Layout::kContiguous;
  split.chunks = chunks_per_slice(p);
  split.partials_bytes = static_cast<size_t>(partials_bytes(p));
  plan.workspace_bytes = split.partials_bytes + static_cast<size_t>(p.num_slices()) * sizeof(float4);
  split.vector_stats = contiguous && p.spatial % vector == 0 && aligned16(p.x);
  const int64_t channel_tiles = (p.num_channels + kTileChannels - 1) / kTileChannels;
  split.stats_grid = grid_for(contiguous ? p.num_slices() * split.chunks : p.batch * split.chunks * channel_tiles, 1);
  split.combine_grid = grid_for(p.num_slices(), kThreads / kWarpSize);
  // The sweep's rows: slices (contiguous) or positions (channels-last).
  const int64_t row_length = contiguous ? p.spatial : p.num_channels;
  split.sweep_unit = row_length % vector == 0 && aligned16(p.x) && aligned16(p.y) ? vector : 1;
  split.sweep_grid = grid_for(p.num_slices() * p.spatial / split.sweep_unit, kSweepTile);
  return plan;
}

cudaError_t launch_split(const ForwardProblem& p, const SplitPlan& plan, cudaStream_t stream) {
  using namespace split_detail;
  if (p.workspace == nullptr || !aligned16(p.workspace)) return cudaErrorInvalidValue;
  auto* partials = static_cast<SliceStats*>(p.workspace);
  auto* slice_stats = reinterpret_cast<float4*>(static_cast<char*>(p.workspace) + plan.partials_bytes);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool contiguous = p.layout == Layout::kContiguous;
    if (p.running_mean == nullptr) {
      if (contiguous) {
        constexpr int kVector = Storage<T>::kPerVector;
        if (plan.vector_stats) {
          partial_stats_contiguous_kernel<T, kVector><<<plan.stats_grid, kThreads, 0, stream>>>(p, plan.chunks,
                                                                                                partials);
        } else {
          partial_stats_contiguous_kernel<T, 1><<<plan.stats_grid, kThreads, 0, stream>>>(p, plan.chunks, partials);
        }
      } else {
        partial_stats_channels_last_kernel<T><<<plan.stats_grid, kThreads, 0, stream>>>(p, plan.chunks, partials);
      }
      const cudaError_t error = cudaGetLastError();
      if (error != cudaSuccess) return error;
    }
    slice_stats_kernel<T><<<plan.combine_grid, kThreads, 0, stream>>>(p, plan.chunks, partials, slice_stats);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    return contiguous ? launch_normalize<T, Layout::kContiguous>(p, plan, slice_stats, stream)
                      : launch_normalize<T, Layout::kChannelsLast>(p, plan, slice_stats, stream);
  });
}

}  // namespace instance_norm
