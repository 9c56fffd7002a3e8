// InstanceNorm backward (use_input_stats=True) on contiguous or channels-last data
// of float32, float16 or bfloat16: the resident kernels (x held on chip by a
// cluster or a cooperative team, dy read twice, the second time from L2), the
// generic partial-sums / combine / dx kernels, and the one place that chooses
// between them.
//
// Formula: the standard batch-norm backward applied per instance (PyTorch's
// batch_norm_backward_elemt on the (1, N * C, *spatial) view). With S values per
// slice, xhat = (x - mean) * rstd and a = rstd * w:
//   dx = a * (dy - sum(dy) / S - xhat * sum(dy * xhat) / S)
//      = a * dy + b * (x - mean) + c,   b = -a * rstd * sum(dy * xhat) / S,  c = -a * sum(dy) / S.
// Every kernel accumulates sum(dy) and sum(dy * (x - mean)) (as PyTorch's dot_p)
// and scales the latter by rstd once per slice.
// Determinism: every sum is taken in an order fixed by the problem's shape (per-thread
// sequential sums, xor butterflies, shared-memory trees, partials combined in chunk
// order), never by atomics or scheduling, so dx and the sums are bit-identical run to run.
#include "common.cuh"
#include "instance_norm.h"
#include "tuning.h"

#include <algorithm>
#include <type_traits>
#include <utility>

namespace instance_norm {
// load_inline compiles all .cu sources as one translation unit: each file keeps
// its internals in its own namespace.
namespace backward_detail {

// ---- per-slice arithmetic shared by every kernel ----

__device__ __forceinline__ float channel_weight(const BackwardProblem& p, int64_t channel) {
  return p.weight != nullptr ? __ldg(p.weight + channel) : 1.f;
}

// The epilogue's gradient: dy of act's output to dy of the affine map's output,
// dy * act'(pre) with pre = (x - mean) * scale + bias (+ residual), scale = rstd *
// weight. Uniform per slice (one channel).
struct PreActivation {
  float mean, scale, bias;
};

__device__ __forceinline__ PreActivation pre_activation(const BackwardProblem& p, float mean, float rstd,
                                                        float weight, int64_t channel) {
  return {mean, rstd * weight, p.bias != nullptr ? __ldg(p.bias + channel) : 0.f};
}

template <Activation A>
__device__ __forceinline__ float through_epilogue(const Epilogue& e, const PreActivation& m, float x, float dy,
                                                  float residual) {
  return dy * activation_derivative<A>(fmaf(x - m.mean, m.scale, m.bias) + residual, e.negative_slope);
}

// dx = a * dy + b * (x - mean) + c (see the top of the file). The sums are scaled
// by inv_spatial = 1 / S, as PyTorch's norm_fct; each kernel divides once, not per
// slice (a float division has a slow-path subroutine call that costs registers).
struct DxCoefficients {
  float mean, a, b, c;
};

__device__ __forceinline__ DxCoefficients dx_coefficients(float mean, float rstd, float weight, float sum_dy,
                                                          float sum_dy_xhat, float inv_spatial) {
  const float a = rstd * weight;
  return {mean, a, -a * rstd * sum_dy_xhat * inv_spatial, -a * sum_dy * inv_spatial};
}

__device__ __forceinline__ float input_gradient(const DxCoefficients& k, float x, float dy) {
  return fmaf(k.a, dy, fmaf(k.b, x - k.mean, k.c));
}

// (sum(dy), sum(dy * (x - mean))) += one value's terms.
__device__ __forceinline__ void accumulate(float2& sums, float x, float dy, float mean) {
  sums.x += dy;
  sums.y = fmaf(dy, x - mean, sums.y);
}

// ---- generic path: any layout, size, alignment and GPU ----
//
// (a) partial sums (sum(dy), sum(dy * (x - mean))) of each chunk into the workspace,
// (b) a combine of each slice's chunks in chunk order into sum_dy / sum_dy_xhat,
// (c) the dx sweep (second read of x and dy; for slices up to a few hundred KB it
//     hits L2).
// Workspace: float2 partials. Contiguous: [slice][chunk] (chunk = a run of
// plan.chunk values of the slice). Channels-last: [n][chunk][channel] (chunk = a
// run of plan.chunk rows s of image n), so a CTA writes its channels contiguously.
constexpr int kGenericThreads = 256;
constexpr int kGenericWarps = kGenericThreads / kWarpSize;
// Groups of values whose loads a thread issues before using any of them.
constexpr int kUnroll = 4;
// Chunk sizes: kTargetWarpItems, kMinChunkValues and kMaxChunkValues
// (kernels/tuning.h). Small slices take one chunk each, shared by as few lanes as
// cover it.
constexpr unsigned kMaxGridCtas = 1u << 16;  // the kernels grid-stride over their items

// A run of up to one vector of consecutive values: its element offset and how many
// of its values are in range (<= 0: none).
struct Group {
  int64_t offset;
  int count;
};

// One 16-byte vector (VECTOR: aligned and whole whenever count > 0) or `count`
// scalars of `group`, as float; 0 for values out of range, whose terms then add
// (+-)0 to the sums.
template <typename T, bool VECTOR>
__device__ __forceinline__ void load_values(const T* base, Group group, float (&out)[Storage<T>::kPerVector]) {
  using S = Storage<T>;
  if constexpr (VECTOR) {
    if (group.count > 0) {
      S::unpack(__ldg(reinterpret_cast<const uint4*>(base + group.offset)), out);
    } else {
#pragma unroll
      for (int k = 0; k < S::kPerVector; ++k) out[k] = 0.f;
    }
  } else {
#pragma unroll
    for (int k = 0; k < S::kPerVector; ++k) {
      out[k] = k < group.count ? S::to_float(__ldg(base + group.offset + k)) : 0.f;
    }
  }
}

template <typename T, bool VECTOR>
__device__ __forceinline__ void store_values(T* base, Group group, const float (&values)[Storage<T>::kPerVector]) {
  using S = Storage<T>;
  if constexpr (VECTOR) {
    if (group.count > 0) store_streaming(reinterpret_cast<uint4*>(base + group.offset), S::pack(values));
  } else {
#pragma unroll
    for (int k = 0; k < S::kPerVector; ++k) {
      if (k < group.count) base[group.offset + k] = S::from_float(values[k]);
    }
  }
}

// dy[k] through the epilogue for one group of values (contiguous: one slice's
// PreActivation; channels-last: one per value). The residual's values of the group
// are read where there is one; with grad_residual they are also written there.
template <typename T, bool VECTOR, int N, typename MapOf>
__device__ __forceinline__ void group_through_epilogue(const BackwardProblem& p, Group group, const float (&x)[N],
                                                       const float (&dy)[N], float (&out)[N], MapOf map_of) {
  float residual[N];
  if (p.epilogue.residual != nullptr) {
    load_values<T, VECTOR>(static_cast<const T*>(p.epilogue.residual), group, residual);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) residual[k] = 0.f;
  }
  with_activation(p.epilogue.activation, [&](auto a) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      out[k] = through_epilogue<decltype(a)::value>(p.epilogue, map_of(k), x[k], dy[k], residual[k]);
    }
  });
}

// For s = first, first + step, ... < last: loads x and dy of group_at(s) and calls
// f(group, x, dy). kUnroll groups are loaded before any is used, so each thread
// keeps 2 * kUnroll loads in flight. group_at(s) must give count <= 0 for s >= last.
template <typename T, bool VECTOR, typename GroupAt, typename F>
__device__ __forceinline__ void sweep(const T* x, const T* dy, int64_t first, int64_t last, int64_t step,
                                      GroupAt group_at, F f) {
  constexpr int kPer = Storage<T>::kPerVector;
  for (int64_t s = first; s < last; s += step * kUnroll) {
    Group groups[kUnroll];
    float x_values[kUnroll][kPer], dy_values[kUnroll][kPer];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      groups[u] = group_at(s + u * step);
      load_values<T, VECTOR>(x, groups[u], x_values[u]);
      load_values<T, VECTOR>(dy, groups[u], dy_values[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) f(groups[u], x_values[u], dy_values[u]);
  }
}

// Contiguous item = (slice, chunk): the elements [begin, end); empty out of range.
struct ContiguousChunk {
  int64_t slice, begin, end;
};

__device__ __forceinline__ ContiguousChunk contiguous_chunk(const BackwardProblem& p, const GenericPlan& plan,
                                                            int64_t item, bool in_range) {
  if (!in_range) return {0, 0, 0};
  const int64_t slice = item / plan.chunks;
  const int64_t chunk = item - slice * plan.chunks;
  const int64_t base = slice * p.spatial;
  return {slice, base + chunk * plan.chunk, base + min((chunk + 1) * plan.chunk, p.spatial)};
}

// Lane group_lane of the chunk's group takes the vectors group_lane,
// group_lane + lanes_per_chunk, ... of [begin, end), sweep step lanes_per_chunk *
// kPer. In VECTOR mode begin and end are multiples of the vector (spatial and
// plan.chunk are), so every group is a whole aligned vector. Offsets passed here
// are below end + kUnroll * step, so count fits an int.
template <int PER_VECTOR>
__device__ __forceinline__ auto contiguous_groups(int64_t end) {
  return [end](int64_t offset) {
    return Group{offset, static_cast<int>(min(static_cast<int64_t>(PER_VECTOR), end - offset))};
  };
}

template <typename T, bool VECTOR>
__global__ void __launch_bounds__(kGenericThreads, 1)
    partial_sums_contiguous_kernel(const BackwardProblem p, const GenericPlan plan, float2* partials) {
  constexpr int kPer = Storage<T>::kPerVector;
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  const int64_t step = static_cast<int64_t>(plan.lanes_per_chunk) * kPer;
  for_each_group_item<kGenericThreads>(plan.num_items, plan.lanes_per_chunk, [&](int64_t item, bool in_range, int group_lane) {
    const ContiguousChunk chunk = contiguous_chunk(p, plan, item, in_range);
    const float mean = in_range ? __ldg(p.mean + chunk.slice) : 0.f;
    const bool epilogue = p.epilogue.activation != Activation::kNone;
    const int64_t channel = chunk.slice % p.num_channels;
    const PreActivation map =
        epilogue && in_range ? pre_activation(p, mean, __ldg(p.rstd + chunk.slice), channel_weight(p, channel), channel)
                             : PreActivation{0.f, 0.f, 0.f};
    float2 sums = make_float2(0.f, 0.f);
    sweep<T, VECTOR>(x, dy, chunk.begin + group_lane * kPer, chunk.end, step, contiguous_groups<kPer>(chunk.end),
                     [&](Group group, const float(&xv)[kPer], const float(&dyv)[kPer]) {
                       float g[kPer];
#pragma unroll
                       for (int k = 0; k < kPer; ++k) g[k] = dyv[k];
                       if (epilogue) group_through_epilogue<T, VECTOR>(p, group, xv, dyv, g, [&](int) { return map; });
#pragma unroll
                       for (int k = 0; k < kPer; ++k) accumulate(sums, xv[k], g[k], mean);
                     });
    sums = group_allreduce(sums, plan.lanes_per_chunk, SumFloat2());
    if (in_range && group_lane == 0) partials[item] = sums;
  });
}

template <typename T, bool VECTOR>
__global__ void __launch_bounds__(kGenericThreads, 1)
    input_gradient_contiguous_kernel(const BackwardProblem p, const GenericPlan plan) {
  constexpr int kPer = Storage<T>::kPerVector;
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  T* dx = static_cast<T*>(p.dx);
  const float inv_spatial = 1.f / static_cast<float>(p.spatial);
  const int64_t step = static_cast<int64_t>(plan.lanes_per_chunk) * kPer;
  for_each_group_item<kGenericThreads>(plan.num_items, plan.lanes_per_chunk, [&](int64_t item, bool in_range, int group_lane) {
    if (!in_range) return;  // no shuffles below
    const ContiguousChunk chunk = contiguous_chunk(p, plan, item, in_range);
    const int64_t slice = chunk.slice;
    const int64_t channel = slice % p.num_channels;
    const float mean = __ldg(p.mean + slice), rstd = __ldg(p.rstd + slice), weight = channel_weight(p, channel);
    const DxCoefficients coefficients =
        dx_coefficients(mean, rstd, weight, __ldg(p.sum_dy + slice), __ldg(p.sum_dy_xhat + slice), inv_spatial);
    const bool epilogue = p.epilogue.activation != Activation::kNone;
    const PreActivation map = epilogue ? pre_activation(p, mean, rstd, weight, channel) : PreActivation{0.f, 0.f, 0.f};
    sweep<T, VECTOR>(x, dy, chunk.begin + group_lane * kPer, chunk.end, step, contiguous_groups<kPer>(chunk.end),
                     [&](Group group, const float(&xv)[kPer], const float(&dyv)[kPer]) {
                       float g[kPer], out[kPer];
#pragma unroll
                       for (int k = 0; k < kPer; ++k) g[k] = dyv[k];
                       if (epilogue) {
                         group_through_epilogue<T, VECTOR>(p, group, xv, dyv, g, [&](int) { return map; });
                         if (p.grad_residual != nullptr) store_values<T, VECTOR>(static_cast<T*>(p.grad_residual), group, g);
                       }
#pragma unroll
                       for (int k = 0; k < kPer; ++k) out[k] = input_gradient(coefficients, xv[k], g[k]);
                       store_values<T, VECTOR>(dx, group, out);
                     });
  });
}

// Channels-last: one CTA per item (n, chunk of rows, tile of channels). Thread t
// owns the vector of channels tile * tile_width + (t % lanes_per_row) * kPer and
// the rows chunk_first + t / lanes_per_row + i * row_groups, so a warp reads
// lanes_per_row consecutive vectors per row (coalesced; a warp covers several rows
// when C is small). VECTOR needs C % kPer == 0 (every row starts on a vector).
// CTA b takes the run of items [b, b + 1) * ceil(num_items / gridDim.x), ordered
// (n, chunk, tile) with tile fastest, and steps through it with a mixed-radix
// counter: 64-bit divisions (subroutine calls) only once per CTA.
struct ChannelsLastItems {
  int64_t item, end;  // this CTA's next item and the end of its run
  int64_t n, chunk, tile;

  __device__ explicit ChannelsLastItems(const GenericPlan& plan) {
    const int64_t per_cta = (plan.num_items + gridDim.x - 1) / gridDim.x;
    item = blockIdx.x * per_cta;
    end = min(item + per_cta, plan.num_items);
    const int64_t image_chunk = item / plan.channel_tiles;
    tile = item - image_chunk * plan.channel_tiles;
    n = image_chunk / plan.chunks;
    chunk = image_chunk - n * plan.chunks;
  }
  __device__ bool valid() const { return item < end; }
  __device__ void advance(const GenericPlan& plan) {
    ++item;
    if (++tile < plan.channel_tiles) return;
    tile = 0;
    if (++chunk < plan.chunks) return;
    chunk = 0;
    ++n;
  }
};

// This thread's part of the current item.
struct ChannelsLastItem {
  int64_t n, chunk, first_channel;  // first_channel: this thread's first channel
  int count;                        // channels this thread owns (<= 0: none)
  int64_t row_first, row_end;       // this thread's first row, and the chunk's end
  int row_groups;                   // rows the CTA covers per step
};

template <int PER_VECTOR>
__device__ __forceinline__ ChannelsLastItem channels_last_item(const BackwardProblem& p, const GenericPlan& plan,
                                                               const ChannelsLastItems& items) {
  const int tile_width = plan.lanes_per_row * PER_VECTOR;
  const int64_t first_channel = items.tile * tile_width + (threadIdx.x % plan.lanes_per_row) * PER_VECTOR;
  const int count = static_cast<int>(min(static_cast<int64_t>(PER_VECTOR), p.num_channels - first_channel));
  const int64_t row_begin = items.chunk * plan.chunk;
  return {items.n,
          items.chunk,
          first_channel,
          count,
          row_begin + threadIdx.x / plan.lanes_per_row,
          min(row_begin + plan.chunk, p.spatial),
          kGenericThreads / plan.lanes_per_row};
}

// The PreActivation of this thread's channel k of a channels-last item, read at
// each use (L1 hits) rather than held in registers through the sweep: the 16-bit
// kernels hold 8 channels, and 24 more registers spilled. The lambda holds copies
// (a reference to the item would put it in local memory).
__device__ __forceinline__ auto channels_last_map(const BackwardProblem& p, const ChannelsLastItem& it) {
  const int64_t first_slice = it.n * p.num_channels + it.first_channel, first_channel = it.first_channel;
  const int last = max(it.count - 1, 0);
  const float *mean = p.mean, *rstd = p.rstd, *weight = p.weight, *bias = p.bias;
  return [=](int k) {
    const int j = min(k, last);
    return PreActivation{__ldg(mean + first_slice + j),
                         __ldg(rstd + first_slice + j) * (weight != nullptr ? __ldg(weight + first_channel + j) : 1.f),
                         bias != nullptr ? __ldg(bias + first_channel + j) : 0.f};
  };
}

template <typename T, bool VECTOR, typename F>
__device__ __forceinline__ void sweep_rows(const BackwardProblem& p, const ChannelsLastItem& it, F f) {
  const int64_t image = it.n * p.spatial;
  const int64_t channels = p.num_channels;
  sweep<T, VECTOR>(static_cast<const T*>(p.x), static_cast<const T*>(p.dy), it.row_first, it.row_end, it.row_groups,
                   [&](int64_t row) {
                     return Group{(image + row) * channels + it.first_channel, row < it.row_end ? it.count : 0};
                   },
                   f);
}

template <typename T, bool VECTOR>
__global__ void __launch_bounds__(kGenericThreads, 1)
    partial_sums_channels_last_kernel(const BackwardProblem p, const GenericPlan plan, float2* partials) {
  constexpr int kPer = Storage<T>::kPerVector;
  // Thread t's sums at [t * kPer, (t + 1) * kPer) = [row group][channel in tile].
  __shared__ float2 thread_sums[kGenericThreads * kPer];
  const int tile_width = plan.lanes_per_row * kPer;
  for (ChannelsLastItems items(plan); items.valid(); items.advance(plan)) {
    const ChannelsLastItem it = channels_last_item<kPer>(p, plan, items);
    const bool epilogue = p.epilogue.activation != Activation::kNone;
    float mean[kPer];
    float2 sums[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      mean[k] = k < it.count ? __ldg(p.mean + it.n * p.num_channels + it.first_channel + k) : 0.f;
      sums[k] = make_float2(0.f, 0.f);
    }
    sweep_rows<T, VECTOR>(p, it, [&](Group group, const float(&xv)[kPer], const float(&dyv)[kPer]) {
      float g[kPer];
#pragma unroll
      for (int k = 0; k < kPer; ++k) g[k] = dyv[k];
      if (epilogue) group_through_epilogue<T, VECTOR>(p, group, xv, dyv, g, channels_last_map(p, it));
#pragma unroll
      for (int k = 0; k < kPer; ++k) accumulate(sums[k], xv[k], g[k], mean[k]);
    });
#pragma unroll
    for (int k = 0; k < kPer; ++k) thread_sums[threadIdx.x * kPer + k] = sums[k];
    __syncthreads();
    // Tree over the row groups (a power of two) in fixed pairs: deterministic.
    for (int half = it.row_groups / 2; half > 0; half /= 2) {
      for (int j = threadIdx.x; j < half * tile_width; j += kGenericThreads) {
        thread_sums[j] = SumFloat2()(thread_sums[j], thread_sums[j + half * tile_width]);
      }
      __syncthreads();
    }
    if (static_cast<int>(threadIdx.x) < plan.lanes_per_row) {
      float2* out = partials + (it.n * plan.chunks + it.chunk) * p.num_channels + it.first_channel;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        if (k < it.count) out[k] = thread_sums[threadIdx.x * kPer + k];
      }
    }
    __syncthreads();  // thread_sums is rewritten by the next item
  }
}

template <typename T, bool VECTOR>
__global__ void __launch_bounds__(kGenericThreads, 1)
    input_gradient_channels_last_kernel(const BackwardProblem p, const GenericPlan plan) {
  constexpr int kPer = Storage<T>::kPerVector;
  T* dx = static_cast<T*>(p.dx);
  const float inv_spatial = 1.f / static_cast<float>(p.spatial);
  for (ChannelsLastItems items(plan); items.valid(); items.advance(plan)) {
    const ChannelsLastItem it = channels_last_item<kPer>(p, plan, items);
    const bool epilogue = p.epilogue.activation != Activation::kNone;
    DxCoefficients coefficients[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t channel = it.first_channel + k;
      const int64_t slice = it.n * p.num_channels + channel;
      coefficients[k] = k < it.count ? dx_coefficients(__ldg(p.mean + slice), __ldg(p.rstd + slice),
                                                       channel_weight(p, channel), __ldg(p.sum_dy + slice),
                                                       __ldg(p.sum_dy_xhat + slice), inv_spatial)
                                     : DxCoefficients{0.f, 0.f, 0.f, 0.f};
    }
    sweep_rows<T, VECTOR>(p, it, [&](Group group, const float(&xv)[kPer], const float(&dyv)[kPer]) {
      float g[kPer], out[kPer];
#pragma unroll
      for (int k = 0; k < kPer; ++k) g[k] = dyv[k];
      if (epilogue) {
        group_through_epilogue<T, VECTOR>(p, group, xv, dyv, g, channels_last_map(p, it));
        if (p.grad_residual != nullptr) store_values<T, VECTOR>(static_cast<T*>(p.grad_residual), group, g);
      }
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[k] = input_gradient(coefficients[k], xv[k], g[k]);
      store_values<T, VECTOR>(dx, group, out);
    });
  }
}

// lanes_per_slice lanes per slice: lane l sums the slice's chunks l, l +
// lanes_per_slice, ... in order, then an xor butterfly; writes sum_dy and
// sum_dy_xhat = rstd * sum(dy * (x - mean)).
__global__ void __launch_bounds__(kGenericThreads, 1)
    combine_partials_kernel(const BackwardProblem p, const GenericPlan plan, const float2* partials) {
  const int64_t chunk_stride = plan.channels_last ? p.num_channels : 1;
  const int64_t lanes = plan.lanes_per_slice;
  for_each_group_item<kGenericThreads>(p.num_slices(), plan.lanes_per_slice, [&](int64_t slice, bool in_range,
                                                                          int group_lane) {
    int64_t first = 0, chunks = 0;  // partials[first + chunk * chunk_stride], chunk < chunks
    if (in_range) {
      const int64_t channel = plan.channels_last ? slice % p.num_channels : 0;
      first = plan.channels_last ? (slice - channel) * plan.chunks + channel : slice * plan.chunks;
      chunks = plan.chunks;
    }
    float2 sums = make_float2(0.f, 0.f);
    for (int64_t chunk = group_lane; chunk < chunks; chunk += lanes * kUnroll) {
      float2 part[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = chunk + u * lanes;
        part[u] = c < chunks ? partials[first + c * chunk_stride] : make_float2(0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) sums = SumFloat2()(sums, part[u]);
    }
    sums = group_allreduce(sums, plan.lanes_per_slice, SumFloat2());
    if (in_range && group_lane == 0) {
      p.sum_dy[slice] = sums.x;
      p.sum_dy_xhat[slice] = sums.y * __ldg(p.rstd + slice);
    }
  });
}

// Streaming stores of dx_raw[j] to column[j * THREADS] for b + j < valid.
template <int THREADS, int N, int... J>
__device__ __forceinline__ void store_batch(uint4* column, int b, int valid, const uint4 (&dx_raw)[N],
                                            std::integer_sequence<int, J...>) {
  ((b + J < valid ? store_streaming_at<J * THREADS * 16>(column, dx_raw[J]) : void()), ...);
}

// The dy ring of the resident paths: kDyRingSlots slots of kDyBatch vectors per
// thread (96 KB for 512 threads), so 12 of a thread's dy vectors are in flight: the
// fastest of the ring shapes and register batches tried on the seed shape
// (docs/perf-notes.md #41).
constexpr int kDyBatch = 4;
constexpr int kDyRingSlots = 3;

// ---- resident paths (sm_90+), persistent, x and dy read from HBM once: kCluster (a
// thread-block cluster per slice) and kCooperative (a team of CTAs of a cooperative
// launch; common.cuh, teams) ----

// The grid holds as many teams of ceil(spatial / (THREADS * VALUES_PER_THREAD))
// CTAs as can be resident at once; team k takes slices k, k + teams, ...
// (one team per slice is limited by the launch rate: docs/perf-notes.md).
// For each slice, CTA rank r owns the values [r, r + 1) * THREADS * VALUES_PER_THREAD;
// thread t owns its 16-byte vectors first + i * THREADS of x and of dy.
//
// x: thread 0 stages the CTA's part of a slice (contiguous) into shared memory
// with one bulk copy that completes on an mbarrier. Per slice every thread waits
// for it, moves its column to registers, and after a CTA barrier thread 0 stages
// the next slice's x into the same shared memory, so that read overlaps the rest.
// dy: each thread streams its column through a ring of kDyRingSlots slots of
// kDyBatch vectors in shared memory, with its own cp.async groups, and refills a
// slot as soon as it has read it, the next slice's first fills included: 12 vectors
// stay in flight per thread across the team exchange, without registers.
// Per slice: sum dy and dy * (x - mean) over the first read of dy (asking L2 to
// keep it), reduce the two sums over the team (one team barrier: every CTA gets the
// same bits), then compute dx from the second read of dy (from L2 when it kept it)
// and write it with streaming stores. HBM: x and dy read once when L2 keeps the
// team's dy (1 MB per fp32 512 x 512 slice) between the reads, dx written once
// (ncu: DRAM reads equal x's and dy's bytes; docs/perf-notes.md #37). The x staging is
// not a per-thread cp.async group because a wait for a later dy group would also wait
// for it (groups complete in order), holding the first dy read until the next slice's x
// has arrived (docs/perf-notes.md #40).
// Registers hold the raw 16-byte vectors of x (unpacked to float when used), so a
// 16-bit variant holds twice the values of a float32 one in the same registers.
// Needs resident_variant's shared bytes of dynamic shared memory, spatial %
// Storage<T>::kPerVector == 0, 16-byte aligned x, dy and dx, and a team size the
// device can run (the launcher checks).
// ACTIVATION: the epilogue's activation, whose derivative is compiled in (kNone: the
// plain kernels, with their own code and registers). One kernel per activation, not
// a run-time switch per vector: the switch made the derivative's kernels far slower
// than the plain one (docs/perf-notes.md #100).
template <typename T, int THREADS, int VALUES_PER_THREAD, Activation ACTIVATION, typename Team>
__device__ __forceinline__ void backward_resident(const BackwardProblem& p, const Team& team) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  static_assert(VALUES_PER_THREAD % kPer == 0, "values are held as whole 16-byte vectors");
  constexpr int kVecs = VALUES_PER_THREAD / kPer;
  constexpr int kCtaVecs = THREADS * kVecs;
  constexpr int kBatch = kDyBatch;
  static_assert(kVecs % kBatch == 0, "dy is read in whole batches");
  constexpr int kFillsPerRead = kVecs / kBatch;
  constexpr int kFillsPerSlice = 2 * kFillsPerRead;  // dy is read twice
  constexpr int kSlots = kDyRingSlots;
  static_assert(kSlots <= kFillsPerRead, "the ring is no deeper than one read of dy");
  constexpr int kSlotBytes = kBatch * THREADS * 16;
  __shared__ TeamStorage<float2, THREADS> storage;
  __shared__ uint64_t x_full;  // mbarrier: the staged x has arrived
  // x, [kVecs][THREADS], then the dy ring, [kSlots][kBatch][THREADS]: each thread
  // owns its column of both.
  extern __shared__ uint4 staged[];

  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  T* dx = static_cast<T*>(p.dx);
  const int64_t num_slices = p.num_slices();
  const int spatial = static_cast<int>(p.spatial);
  const int64_t num_teams = team.count();
  const bool writes_sums = team.rank() == 0 && threadIdx.x == 0;
  const float inv_spatial = 1.f / static_cast<float>(spatial);
  const unsigned zero = static_cast<unsigned>(spatial) >> 31;  // spatial < 2^31: 0, unknown to the compiler

  // This thread's vectors of a slice are first + i * THREADS for i < valid.
  const int num_vecs = spatial / kPer;
  const int cta_first = team.rank() * kCtaVecs;
  const int first = cta_first + threadIdx.x;
  const int valid = valid_count<THREADS>(num_vecs, first, kVecs);

  // Thread 0: the CTA's x of `slice` into staged[0, kCtaVecs).
  const unsigned x_bytes = 16u * static_cast<unsigned>(min(kCtaVecs, max(0, num_vecs - cta_first)));
  const auto stage_x = [&](int64_t slice) {
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                         &x_full, x_bytes);
    bulk_copy_to_shared(static_cast<unsigned>(__cvta_generic_to_shared(staged)),
                        reinterpret_cast<const uint4*>(x + slice * spatial) + cta_first, x_bytes,
                        static_cast<unsigned>(__cvta_generic_to_shared(&x_full)));
  };

  // The dy ring. Fills are numbered n = 0, 1, ... over this team's slices (fill g of
  // a slice: read g / kFillsPerRead of dy, batch g % kFillsPerRead); fill n is one
  // cp.async group into slot n % kSlots, issued as soon as fill n - kSlots has been
  // read from that slot, so before fill n is read the groups after it are its
  // kSlots - 1 successors.
  const unsigned ring_column =
      static_cast<unsigned>(__cvta_generic_to_shared(staged + kCtaVecs + threadIdx.x));
  int slot = 0;  // of the next fill to read
  // fill_slice == num_slices (past the team's last slice): an empty group, so every
  // thread commits the same groups; its address, past dy, is never dereferenced. The
  // first read of dy asks L2 to keep it for the second.
  const auto fill = [&](int g, int64_t fill_slice, unsigned slot_column) {
    const int batch = g % kFillsPerRead;
    const uint4* column =
        reinterpret_cast<const uint4*>(dy + fill_slice * spatial) + first + batch * kBatch * THREADS;
    const int count = fill_slice < num_slices ? valid - batch * kBatch : 0;
    if (g < kFillsPerRead) {
      stage_column<THREADS, true>(slot_column, column, count, std::make_integer_sequence<int, kBatch>());
    } else {
      stage_column<THREADS>(slot_column, column, count, std::make_integer_sequence<int, kBatch>());
    }
  };
  // Fill g of `slice` (this thread's vectors b + j, b = batch * kBatch) into dy_raw,
  // zero past valid; then the slot gets fill g + kSlots (the next slice's when past
  // this one).
  const auto read_fill = [&](int g, int64_t slice, int64_t next, uint4(&dy_raw)[kBatch]) {
    const int b = g % kFillsPerRead * kBatch;
    cp_async_wait_group<kSlots - 1>();
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      dy_raw[j] =
          b + j < valid ? staged[kCtaVecs + (slot * kBatch + j) * THREADS + threadIdx.x] : make_uint4(0, 0, 0, 0);
    }
    const unsigned slot_column = after_reading(ring_column + static_cast<unsigned>(slot * kSlotBytes), dy_raw, zero);
    if (g + kSlots < kFillsPerSlice) {
      fill(g + kSlots, slice, slot_column);
    } else {
      fill(g + kSlots - kFillsPerSlice, min(next, num_slices), slot_column);
    }
    slot = slot + 1 == kSlots ? 0 : slot + 1;
  };

  int64_t slice = team.index();
  if (threadIdx.x == 0) {
    cuda::ptx::mbarrier_init(&x_full, 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  __syncthreads();
  if (slice < num_slices) {
    if (threadIdx.x == 0) stage_x(slice);
#pragma unroll
    for (int g = 0; g < kSlots; ++g) fill(g, slice, ring_column + static_cast<unsigned>(g * kSlotBytes));
  }
  for (int round = 0; slice < num_slices; slice += num_teams, ++round) {
    const int64_t next = slice + num_teams;
    // Issued before the wait so their latency overlaps it.
    const float mean = __ldg(p.mean + slice);
    const float rstd = __ldg(p.rstd + slice);
    const float weight = channel_weight(p, slice % p.num_channels);

    uint4 x_raw[kVecs];
    wait_mbarrier_phase(&x_full, static_cast<unsigned>(round) & 1u);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) x_raw[i] = i < valid ? staged[i * THREADS + threadIdx.x] : make_uint4(0, 0, 0, 0);
    __syncthreads();  // every column read before the bulk copy overwrites them
    if (threadIdx.x == 0 && next < num_slices) {
      cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);  // those reads before the async proxy's writes
      stage_x(next);
    }

    // x and dy of one vector as float, dy through the activation's derivative (with an
    // activation; no residual on this path), the map rebuilt at each use (its bias read
    // from L1) so no registers are held.
    const auto unpack_pair = [&](const uint4& x_bits, const uint4& dy_bits, float(&xv)[kPer], float(&dyv)[kPer]) {
      S::unpack(x_bits, xv);
      S::unpack(dy_bits, dyv);
      if constexpr (ACTIVATION != Activation::kNone) {
        const PreActivation map = pre_activation(p, mean, rstd, weight, slice % p.num_channels);
#pragma unroll
        for (int k = 0; k < kPer; ++k) dyv[k] = through_epilogue<ACTIVATION>(p.epilogue, map, xv[k], dyv[k], 0.f);
      }
    };

    // Pass 1, dy's first read (HBM), in batches, L2 asked to keep it for the second:
    // this thread's sums of dy and dy * (x - mean).
    const auto sum_pass = [&]() {
      float2 sums = make_float2(0.f, 0.f);
#pragma unroll
      for (int b = 0; b < kVecs; b += kBatch) {
        uint4 dy_raw[kBatch];
        read_fill(b / kBatch, slice, next, dy_raw);
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (b + j < valid) {
            float xv[kPer], dyv[kPer];
            unpack_pair(x_raw[b + j], dy_raw[j], xv, dyv);
#pragma unroll
            for (int k = 0; k < kPer; ++k) accumulate(sums, xv[k], dyv[k], mean);
          }
        }
        asm volatile("" ::: "memory");  // one batch of dy in registers at a time
      }
      return sums;
    };
    // Pass 2, dy's second and last read (from L2 when it kept it): dx from the
    // team's totals, stored streaming.
    const auto dx_pass = [&](const DxCoefficients& coefficients) {
      uint4* slice_dx = reinterpret_cast<uint4*>(dx + slice * spatial) + first;
#pragma unroll
      for (int b = 0; b < kVecs; b += kBatch) {
        uint4 dy_raw[kBatch];
        read_fill(kFillsPerRead + b / kBatch, slice, next, dy_raw);
        uint4 dx_raw[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          float xv[kPer], dyv[kPer], out[kPer];
          unpack_pair(x_raw[b + j], dy_raw[j], xv, dyv);
#pragma unroll
          for (int k = 0; k < kPer; ++k) out[k] = input_gradient(coefficients, xv[k], dyv[k]);
          dx_raw[j] = S::pack(out);
        }
        store_batch<THREADS>(slice_dx + b * THREADS, b, valid, dx_raw, std::make_integer_sequence<int, kBatch>());
        asm volatile("" ::: "memory");  // one batch of dy in registers at a time
      }
    };

    const float2 total = team.template allreduce<SumFloat2>(sum_pass(), storage, round);
    const float sum_dy_xhat = total.y * rstd;
    if (writes_sums) {
      p.sum_dy[slice] = total.x;
      p.sum_dy_xhat[slice] = sum_dy_xhat;
    }
    dx_pass(dx_coefficients(mean, rstd, weight, total.x, sum_dy_xhat, inv_spatial));
  }
  team.finish();
#endif
}

// Built for sm_80 the body is empty; the launcher runs these kernels on sm_90+ only.
template <typename T, int THREADS, int VALUES_PER_THREAD, TeamKind TEAM, Activation ACTIVATION>
__global__ void __launch_bounds__(THREADS, 1) backward_resident_kernel(const BackwardProblem p) {
  with_team<TEAM>(p.workspace, team_size_for(p.spatial, THREADS * VALUES_PER_THREAD),
                  [&](const auto& team) { backward_resident<T, THREADS, VALUES_PER_THREAD, ACTIVATION>(p, team); });
}

// Each CTA holds cta_capacity values of x; shared_bytes: the staged next slice's x
// and the dy ring.
template <typename T, int THREADS, int VALUES, Activation ACTIVATION>
constexpr ResidentVariant<BackwardProblem> resident_variant(DType dtype) {
  return {dtype,
          THREADS,
          THREADS * VALUES,
          THREADS * VALUES * static_cast<int>(sizeof(T)) + kDyRingSlots * kDyBatch * THREADS * 16,
          static_cast<int>(sizeof(float2)),
          backward_resident_kernel<T, THREADS, VALUES, TeamKind::kCluster, ACTIVATION>,
          backward_resident_kernel<T, THREADS, VALUES, TeamKind::kCooperative, ACTIVATION>,
          true};
}

// One CTA per SM (512 threads): 64 registers of x per thread (128 KB of registers
// per CTA), 128 KB of the staged next slice's x and the 96 KB dy ring in shared
// memory. float32 512 x 64: a 512 x 512 slice takes a cluster of 8; the 16-bit
// variants hold 128 values of x in the same registers, so a 512 x 512 slice takes a
// cluster of 4.
template <Activation ACTIVATION>
constexpr ResidentVariant<BackwardProblem> kResidentVariants[] = {
    resident_variant<float, 512, 64, ACTIVATION>(DType::kFloat32),
    resident_variant<__half, 512, 128, ACTIVATION>(DType::kFloat16),
    resident_variant<__nv_bfloat16, 512, 128, ACTIVATION>(DType::kBFloat16),
};

// The resident variant of p's dtype and activation.
const ResidentVariant<BackwardProblem>& resident_variant_for(const BackwardProblem& p) {
  switch (p.epilogue.activation) {
    case Activation::kRelu: return variant_for(kResidentVariants<Activation::kRelu>, p.dtype);
    case Activation::kLeakyRelu: return variant_for(kResidentVariants<Activation::kLeakyRelu>, p.dtype);
    case Activation::kSilu: return variant_for(kResidentVariants<Activation::kSilu>, p.dtype);
    case Activation::kGelu: return variant_for(kResidentVariants<Activation::kGelu>, p.dtype);
    case Activation::kGeluTanh: return variant_for(kResidentVariants<Activation::kGeluTanh>, p.dtype);
    default: return variant_for(kResidentVariants<Activation::kNone>, p.dtype);
  }
}

// ---- block path: one CTA per slice, x and dy held in registers (any GPU) ----
//
// Thread t of a CTA of THREADS owns the 16-byte vectors t + i * THREADS, i <
// kBlockVectorsPerThread, of x and of dy of its CTA's slice. It issues all their
// loads before the first use, sums dy and dy * (x - mean), the CTA reduces the two
// sums (cub), and dx comes from the same registers: x and dy read once, dx written
// once, in one launch. Small CTAs (kBlockSmallThreads) run several to an SM, so one
// slice's loads overlap another's reduction; the resident paths' one 512-thread CTA
// per SM takes several latency-bound rounds over a few hundred small slices.
// Needs whole 16-byte vectors (spatial % Storage<T>::kPerVector == 0) at 16-byte
// aligned x, dy and dx, and spatial / kPerVector <= THREADS * kBlockVectorsPerThread.
// The CTAs grid-stride over the slices. Sizes: kernels/tuning.h. Pad: empty, or
// ReflectionPad (the padded kernel, as forward_block_kernel's): dy is the gradient
// of the slices padded by `pad`, staged per slice in dynamic shared memory
// (stage_values: 16-byte cp.async copies, coalesced, in flight beside x's loads;
// padded_staging_bytes); the CTA folds the pads into the values they reflect
// (fold_reflection_pad: two sweeps of a few additions per row and per column), and
// each thread reads its vectors' values from their padded positions
// (padded_own_vector): the gradient PyTorch's pad backward gives the norm's.
constexpr int64_t kBlockMaxVectors = int64_t{kBlockLargeThreads} * kBlockVectorsPerThread;

// Register cap: 128 per thread for both sizes (four 128-thread CTAs or one
// 512-thread CTA per SM at least); the 16 vectors take 64 of them.
template <typename T, int THREADS, Activation ACTIVATION, typename... Pad>
__global__ void __launch_bounds__(THREADS, kBlockLargeThreads / THREADS)
    backward_block_kernel(const BackwardProblem p, Pad... pad) {
  static_assert(sizeof...(Pad) <= 1, "one pad at most");
  constexpr bool kPadded = sizeof...(Pad) == 1;
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  constexpr int kVecs = kBlockVectorsPerThread;
  constexpr bool kEpilogue = ACTIVATION != Activation::kNone;
  using Reduce = BlockAllReduce<float2, THREADS, SumFloat2>;
  __shared__ typename Reduce::TempStorage storage;

  const int slice_vecs = static_cast<int>(p.spatial) / kPer;
  const int tid = static_cast<int>(threadIdx.x);
  const int valid = valid_count<THREADS>(slice_vecs, tid, kVecs);
  const float inv_spatial = 1.f / static_cast<float>(p.spatial);
  for (int64_t slice = blockIdx.x; slice < p.num_slices(); slice += gridDim.x) {
    const int64_t first = slice * slice_vecs + tid;
    const uint4* x = static_cast<const uint4*>(p.x) + first;
    const uint4* dy = static_cast<const uint4*>(p.dy) + first;
    uint4 x_raw[kVecs], dy_raw[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
        x_raw[i] = __ldg(x + i * THREADS);
        if constexpr (!kPadded) dy_raw[i] = __ldg(dy + i * THREADS);
      }
    }
    const int64_t channel = slice % p.num_channels;
    const float mean = __ldg(p.mean + slice), rstd = __ldg(p.rstd + slice), weight = channel_weight(p, channel);
    const PreActivation map = kEpilogue ? pre_activation(p, mean, rstd, weight, channel) : PreActivation{};
    if constexpr (kPadded) {
      // The slice of dy staged in shared memory, after the loads of x and the slice's
      // statistics are issued: the staging's scalar loads at the slice's ends, and
      // the syncs after it, wait.
      extern __shared__ uint4 staged_vectors[];
      T* const staged = reinterpret_cast<T*>(staged_vectors);
      const ReflectionPad padding{pad...};
      const int padded = static_cast<int>(padding.padded_spatial());
      T* const padded_dy =
          staged + stage_values<T, THREADS>(staged, static_cast<const T*>(p.dy) + slice * padded, padded);
      cp_async_wait_all();
      __syncthreads();
      fold_reflection_pad<T, THREADS>(padded_dy, padding);
      RowCursor position(tid * kPer, THREADS * kPer, padding.width);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (i < valid) dy_raw[i] = padded_own_vector(padded_dy, padding, position.row, position.column);
        position.advance();
      }
    }
    // Vector i as floats, dy through the activation's derivative with an epilogue.
    const auto unpack = [&](int i, float(&xv)[kPer], float(&dyv)[kPer]) {
      S::unpack(x_raw[i], xv);
      S::unpack(dy_raw[i], dyv);
      if constexpr (kEpilogue) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) dyv[k] = through_epilogue<ACTIVATION>(p.epilogue, map, xv[k], dyv[k], 0.f);
      }
    };

    float2 sums = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
        float xv[kPer], dyv[kPer];
        unpack(i, xv, dyv);
#pragma unroll
        for (int k = 0; k < kPer; ++k) accumulate(sums, xv[k], dyv[k], mean);
      }
    }
    const float2 total = Reduce::allreduce(sums, storage);
    const float sum_dy_xhat = total.y * rstd;
    if (tid == 0) {
      p.sum_dy[slice] = total.x;
      p.sum_dy_xhat[slice] = sum_dy_xhat;
    }
    const DxCoefficients coefficients = dx_coefficients(mean, rstd, weight, total.x, sum_dy_xhat, inv_spatial);
    uint4* dx = static_cast<uint4*>(p.dx) + first;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (i < valid) {
        float xv[kPer], dyv[kPer], out[kPer];
        unpack(i, xv, dyv);
#pragma unroll
        for (int k = 0; k < kPer; ++k) out[k] = input_gradient(coefficients, xv[k], dyv[k]);
        store_streaming(dx + i * THREADS, S::pack(out));
      }
    }
    if constexpr (kPadded) __syncthreads();  // every thread has read the staged slice before the next one
  }
}

// ---- host: the choice of path and the launches ----

// Channels-last with one channel or one spatial value is the contiguous layout.
bool channels_last(const BackwardProblem& p) {
  return p.layout == Layout::kChannelsLast && p.num_channels > 1 && p.spatial > 1;
}

GenericPlan generic_plan(const BackwardProblem& p) {
  GenericPlan plan{};
  const int64_t per_vector = values_per_vector(p.dtype);
  const int64_t total = p.num_slices() * p.spatial;
  const int64_t warp_values = std::clamp(ceil_div(total, kTargetWarpItems), kMinChunkValues, kMaxChunkValues);
  plan.channels_last = channels_last(p);
  if (!plan.channels_last) {
    // Equal chunks, a multiple of 8 values so that every chunk starts on a vector.
    plan.chunks = ceil_div(p.spatial, warp_values);
    plan.chunk = ceil_div(ceil_div(p.spatial, plan.chunks), 8) * 8;
    plan.chunks = ceil_div(p.spatial, plan.chunk);
    plan.lanes_per_chunk = lanes_for(ceil_div(std::min(plan.chunk, p.spatial), per_vector));
    plan.lanes_per_row = 1;
    plan.channel_tiles = 1;
    plan.num_items = p.num_slices() * plan.chunks;
    plan.num_partials = plan.num_items;
  } else {
    // Enough lanes along C to cover it with one vector each; the CTA's other
    // threads cover more rows. Rows per chunk: a multiple of the CTA's row groups.
    plan.lanes_per_row = lanes_for(ceil_div(p.num_channels, per_vector));
    const int64_t tile_width = plan.lanes_per_row * per_vector;
    const int64_t row_groups = kGenericThreads / plan.lanes_per_row;
    plan.channel_tiles = ceil_div(p.num_channels, tile_width);
    const int64_t cta_values = kGenericWarps * warp_values;
    plan.chunk = ceil_div(ceil_div(cta_values, std::min(p.num_channels, tile_width)), row_groups) * row_groups;
    plan.chunks = ceil_div(p.spatial, plan.chunk);
    plan.lanes_per_chunk = kWarpSize;
    plan.num_items = p.batch * plan.chunks * plan.channel_tiles;
    plan.num_partials = p.batch * plan.chunks * p.num_channels;
  }
  plan.lanes_per_slice = lanes_for(plan.chunks);
  return plan;
}

// Whether the generic kernels can use 16-byte vectors: every group of values they
// touch starts on a vector (spatial, resp. C, a multiple of the vector) and the
// tensors are 16-byte aligned.
bool generic_vectorized(const BackwardProblem& p, const GenericPlan& plan) {
  const int64_t row = plan.channels_last ? p.num_channels : p.spatial;
  return row % values_per_vector(p.dtype) == 0 && aligned16(p.x) && aligned16(p.dy) && aligned16(p.dx);
}

// CTAs for `items` shared out to groups of `group_lanes` lanes (capped: the
// kernels grid-stride).
unsigned group_grid(int64_t items, int group_lanes) {
  const int64_t warps = ceil_div(items, kWarpSize / group_lanes);
  return static_cast<unsigned>(std::min<int64_t>(ceil_div(warps, kGenericWarps), kMaxGridCtas));
}

unsigned cta_grid(int64_t items) { return static_cast<unsigned>(std::min<int64_t>(items, kMaxGridCtas)); }

// The generic path runs every problem; an empty one needs no cut (nothing to launch).
BackwardPlan generic_backward_plan(const BackwardProblem& p) {
  BackwardPlan plan{};
  plan.path = BackwardPath::kGeneric;
  if (p.num_slices() <= 0 || p.spatial <= 0) return plan;
  const GenericPlan& generic = plan.generic = generic_plan(p);
  plan.generic_vectorized = generic_vectorized(p, generic);
  plan.workspace_bytes =
      static_cast<size_t>(ceil_div(generic.num_partials * static_cast<int64_t>(sizeof(float2)), 16) * 16);
  plan.item_grid = generic.channels_last ? cta_grid(generic.num_items)
                                         : group_grid(generic.num_items, generic.lanes_per_chunk);
  plan.combine_grid = group_grid(p.num_slices(), generic.lanes_per_slice);
  return plan;
}

cudaError_t launch_generic(const BackwardProblem& p, const BackwardPlan& plan, cudaStream_t stream) {
  if (p.workspace == nullptr) return cudaErrorInvalidValue;
  const GenericPlan& generic = plan.generic;
  float2* partials = static_cast<float2*>(p.workspace);
  return dispatch_dtype(p.dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const auto launch = [&](auto vector_tag) {
      constexpr bool kVector = decltype(vector_tag)::value;
      if (generic.channels_last) {
        partial_sums_channels_last_kernel<T, kVector><<<plan.item_grid, kGenericThreads, 0, stream>>>(p, generic,
                                                                                                      partials);
      } else {
        partial_sums_contiguous_kernel<T, kVector><<<plan.item_grid, kGenericThreads, 0, stream>>>(p, generic,
                                                                                                   partials);
      }
      cudaError_t error = cudaGetLastError();
      if (error != cudaSuccess) return error;
      combine_partials_kernel<<<plan.combine_grid, kGenericThreads, 0, stream>>>(p, generic, partials);
      error = cudaGetLastError();
      if (error != cudaSuccess) return error;
      if (generic.channels_last) {
        input_gradient_channels_last_kernel<T, kVector><<<plan.item_grid, kGenericThreads, 0, stream>>>(p, generic);
      } else {
        input_gradient_contiguous_kernel<T, kVector><<<plan.item_grid, kGenericThreads, 0, stream>>>(p, generic);
      }
      return cudaGetLastError();
    };
    return plan.generic_vectorized ? launch(std::true_type{}) : launch(std::false_type{});
  });
}

// What the resident and block paths need: contiguous slices of whole 16-byte vectors
// at 16-byte aligned x, dy and dx, and no residual's gradient through an activation
// (the generic path alone writes that).
bool whole_aligned_vectors(const BackwardProblem& p) {
  const bool residual_gradient = p.epilogue.residual != nullptr && p.epilogue.activation != Activation::kNone;
  return !channels_last(p) && !residual_gradient && p.spatial % values_per_vector(p.dtype) == 0 && aligned16(p.x) &&
         aligned16(p.dy) && aligned16(p.dx);
}

// The cluster or cooperative path, where the slices are whole aligned vectors and
// a team of the kind fits (an empty problem: nothing to launch).
BackwardPlan resident_plan(TeamKind team, const BackwardProblem& p) {
  BackwardPlan plan{};
  if (!whole_aligned_vectors(p)) return plan;
  const ResidentVariant<BackwardProblem>& variant = resident_variant_for(p);
  const bool cluster = team == TeamKind::kCluster;
  if (!(cluster ? variant.cluster_fits(p.spatial) : variant.cooperative_fits(p.spatial))) return plan;
  plan.path = cluster ? BackwardPath::kCluster : BackwardPath::kCooperative;
  if (p.num_slices() <= 0 || p.spatial <= 0) return plan;
  if (cluster) {
    variant.plan_cluster(p, plan);
  } else {
    variant.plan_cooperative(p, plan);
  }
  return plan;
}

int64_t slice_vectors(const BackwardProblem& p) { return p.spatial / values_per_vector(p.dtype); }

// Dynamic shared-memory bytes of the padded block kernel: one padded slice of dy
// (stage_values).
int padded_staging_bytes(const BackwardProblem& p, const ReflectionPad& pad) {
  return static_cast<int>(round_up(pad.padded_spatial() * element_bytes(p.dtype) + 16, 16));
}

// The block path: slices of whole aligned vectors up to kBlockMaxVectors, in the
// small CTA where it holds the slice, else the large one; one CTA per slice,
// grid-stride. With an active pad, the padded kernel of the same launch with its
// staging (padded_staging_bytes), where an SM holds one such CTA (else no plan).
BackwardPlan block_plan(const BackwardProblem& p, const ReflectionPad& pad = {}) {
  BackwardPlan plan{};
  if (!whole_aligned_vectors(p) || slice_vectors(p) > kBlockMaxVectors) return plan;
  const bool small = slice_vectors(p) <= int64_t{kBlockSmallThreads} * kBlockVectorsPerThread;
  dispatch_dtype(p.dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    return dispatch_activation(p.epilogue.activation, [&](auto activation_tag) {
      constexpr Activation kActivation = decltype(activation_tag)::value;
      const auto launch = [&](auto threads) {
        constexpr int kThreads = decltype(threads)::value;
        plan.launch = {LaunchKind::kPlain, backward_block_kernel<T, kThreads, kActivation>, 0, kThreads, 0, 0, 0};
        if (pad.active()) plan.padded_kernel = backward_block_kernel<T, kThreads, kActivation, ReflectionPad>;
      };
      if (small) {
        launch(cuda::std::integral_constant<int, kBlockSmallThreads>());
      } else {
        launch(cuda::std::integral_constant<int, kBlockLargeThreads>());
      }
      return cudaSuccess;
    });
  });
  if (pad.active()) {
    plan.launch.shared_bytes = padded_staging_bytes(p, pad);
    if (ctas_per_sm(reinterpret_cast<const void*>(plan.padded_kernel), plan.launch.threads,
                    plan.launch.shared_bytes) < 1) {
      return {};
    }
  }
  plan.pad = pad;
  plan.path = BackwardPath::kBlock;
  plan.launch.grid = cta_grid(p.num_slices());
  return plan;
}

// Every slice the block path holds (up to 16,384 fp32 or 32,768 16-bit values): it
// beat the cluster, cooperative and generic paths on every such size timed, 256 to
// 16,384 values, few slices and many (docs/perf-notes.md #104). Larger slices: those a
// cluster of <= kClusterMaxChosenSize CTAs holds on the cluster path where the GPU
// has one, larger ones on a cooperative team; slices below kClusterMinSpatial, and
// those no team of the kind holds, on the generic path.
BackwardPlan chosen_plan(const BackwardProblem& p) {
  BackwardPlan plan = block_plan(p);
  if (plan.valid()) return plan;
  if (p.spatial < kClusterMinSpatial) return generic_backward_plan(p);
  const TeamKind team = resident_variant_for(p).team_size(p.spatial) <= kClusterMaxChosenSize ? TeamKind::kCluster
                                                                                               : TeamKind::kCooperative;
  plan = resident_plan(team, p);
  return plan.valid() ? plan : generic_backward_plan(p);
}

}  // namespace backward_detail

BackwardPlan plan_backward(const BackwardProblem& problem, BackwardPath forced, const ReflectionPad& pad) {
  using namespace backward_detail;
  ++plan_counters().backward;
  if (pad.active()) return backward_pads(problem, pad, forced) ? block_plan(problem, pad) : BackwardPlan{};
  switch (forced) {
    case BackwardPath::kAuto: return chosen_plan(problem);
    case BackwardPath::kGeneric: return generic_backward_plan(problem);
    case BackwardPath::kCluster: return resident_plan(TeamKind::kCluster, problem);
    case BackwardPath::kCooperative: return resident_plan(TeamKind::kCooperative, problem);
    case BackwardPath::kBlock: return block_plan(problem);
  }
  return {};
}

bool backward_pads(const BackwardProblem& problem, const ReflectionPad& pad, BackwardPath forced) {
  using namespace backward_detail;
  return pad.active() && problem.num_slices() > 0 && problem.spatial > 0 &&
         (forced == BackwardPath::kAuto || forced == BackwardPath::kBlock) && block_plan(problem, pad).valid();
}

cudaError_t backward(const BackwardProblem& problem, const BackwardPlan& plan, cudaStream_t stream) {
  using namespace backward_detail;
  if (problem.num_slices() <= 0 || problem.spatial <= 0) return cudaSuccess;
  if (problem.dx == nullptr || !plan.valid()) return cudaErrorInvalidValue;
  if (plan.path == BackwardPath::kGeneric) return launch_generic(problem, plan, stream);
  if (plan.pad.active()) {
    const KernelLaunch<BackwardProblem>& launch = plan.launch;
    plan.padded_kernel<<<launch.grid, launch.threads, launch.shared_bytes, stream>>>(problem, plan.pad);
    return cudaGetLastError();
  }
  return launch_kernel(plan.launch, problem, stream);
}

BackwardCapacities backward_capacities(DType dtype) {
  using namespace backward_detail;
  return {kBlockMaxVectors * values_per_vector(dtype)};
}

}  // namespace instance_norm
