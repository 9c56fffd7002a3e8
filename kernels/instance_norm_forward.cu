// InstanceNorm forward on contiguous (num_slices, spatial) data of float32,
// float16 or bfloat16: the warp- and CTA-per-slice and resident (cluster or
// cooperative team) kernels, and the one place that chooses a path (the split
// path and the eval-mode sweep are in instance_norm_split.cu).
#include "common.cuh"
#include "instance_norm.h"
#include "pipelined.h"
#include "split.h"
#include "tuning.h"

#include <algorithm>
#include <utility>

namespace instance_norm {
// load_inline compiles all .cu sources as one translation unit: each file keeps
// its internals in its own namespace.
namespace forward_detail {

// Warp path, for slices of at most kWarpMaxSpatial values: a warp per slice, up to
// 16 warps per CTA (warp_plan: fewer where there are few slices, so they spread over
// the SMs), grid-stride over slices, any alignment and GPU. Lane l holds
// elements l + 32 k (k < VALUES) in registers, so the slice is read once and each
// load instruction of a warp reads consecutive elements; many warps are resident per
// SM, so many slices are in flight at once. The mean and then the centered M2 are
// summed over the warp (an xor butterfly, a fixed order). Statistics of the shifted,
// scaled values (SliceShift), as on the other paths.
constexpr int kWarpPathThreads = 512;

// The CTAs per SM a warp-path kernel's registers leave room for when a lane may use
// `registers` of them (of an SM's 65536): its __launch_bounds__ minimum, which caps
// the registers at that. The plain kernels of one vector a lane fit 32 (4 CTAs, every
// warp slot) and of 8 values 40 (3 CTAs): uncapped, ptxas gave the 16-bit ones 36
// and 46, a CTA less per SM, and a problem of many such slices ran 11% slower
// (docs/perf-notes.md #187). The others may use 64 (2 CTAs); the 16-bit 8-value
// epilogue kernels spilled at 40.
constexpr int warp_path_ctas(int registers) { return 65536 / (kWarpPathThreads * registers); }

// EPILOGUE: compiled with the epilogue (launched for problems with one); the plain
// kernels keep their registers (32 values a lane spilled with the epilogue's code).
template <typename T, int VALUES, bool EPILOGUE>
__global__ void __launch_bounds__(kWarpPathThreads, warp_path_ctas(VALUES == 8 && !EPILOGUE ? 40 : 64))
    forward_warp_kernel(const ForwardProblem p) {
  using S = Storage<T>;
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int lane = threadIdx.x % kWarpSize;
  const int spatial = static_cast<int>(p.spatial);
  const int64_t num_slices = p.num_slices();
  // Taken once: without parameters no slice computes its channel (slice % C, a 64-bit
  // division).
  const bool has_affine = p.weight != nullptr || p.bias != nullptr;
  // The stride is the grid's warps with 16-warp CTAs; with fewer warps per CTA the
  // grid holds a warp for every slice (warp_plan), so each warp takes one slice and a
  // stride at least the grid's warp count ends its loop. A stride from blockDim.x would
  // hold a register across the loop and spill the 32-value kernels (ptxas, sm_90a).
  // blockIdx.x * blockDim.x < 2^32: grid_for caps the grid at 2^20 CTAs.
  for (int64_t slice = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize; slice < num_slices;
       slice += static_cast<int64_t>(gridDim.x) * (kWarpPathThreads / kWarpSize)) {
    const T* slice_x = x + slice * spatial;
    // The slice's weight and bias are loaded with its values, not after its
    // statistics, which would be a second memory latency per slice; late only in the
    // 32-value epilogue kernels, whose registers are full (hoisted there, the bf16
    // one spilled).
    constexpr bool kEarlyAffine = !(EPILOGUE && VALUES == 32);
    // In the 16-bit kernels of 8 values a lane the values stay raw until every load is
    // issued, the weight's and bias's too: a conversion right after its load waits for
    // it there. Raw first, the 2-value kernels timed slower with affine and the
    // 32-value ones slower in L2, and spilled on sm_80 (docs/perf-notes.md #187).
    constexpr bool kRawFirst = sizeof(T) == 2 && VALUES == 8;
    float d[VALUES];
    LoadedAffine loaded{};
    float2 affine = make_float2(1.f, 0.f);
    if constexpr (kRawFirst) {
      T raw[VALUES];
#pragma unroll
      for (int k = 0; k < VALUES; ++k) {
        const int i = lane + k * kWarpSize;
        raw[k] = i < spatial ? __ldg(slice_x + i) : S::from_float(0.f);
      }
      if (has_affine) loaded = load_slice_affine<T>(p, slice);
#pragma unroll
      for (int k = 0; k < VALUES; ++k) d[k] = S::to_float(raw[k]);
    } else {
#pragma unroll
      for (int k = 0; k < VALUES; ++k) {
        const int i = lane + k * kWarpSize;
        d[k] = i < spatial ? S::to_float(__ldg(slice_x + i)) : 0.f;
      }
      if (kEarlyAffine && has_affine) affine = slice_affine<T>(p, slice);
    }
    // The shift (the slice's first value) is lane 0's first load: taken from it, not
    // loaded on its own, so no load waits on another and a slice costs one memory
    // latency, which is the whole time of a problem of a few slices.
    const SliceShift shift = SliceShift::of(__shfl_sync(0xffffffffu, d[0], 0));
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < VALUES; ++k) {
      if (lane + k * kWarpSize < spatial) d[k] = shift.apply(d[k]);
      sum += d[k];
    }
    const float mean = warp_allreduce(sum, Sum()) / static_cast<float>(spatial);
    float m2 = 0.f;
#pragma unroll
    for (int k = 0; k < VALUES; ++k) {
      const float deviation = lane + k * kWarpSize < spatial ? d[k] - mean : 0.f;
      m2 += deviation * deviation;
    }
    const float rstd = shift.rstd_of_d(warp_allreduce(m2, Sum()), static_cast<float>(spatial), p.eps);
    if (lane == 0) save_slice_stats(p, slice, shift.mean(mean), shift.rstd(rstd));
    if constexpr (kRawFirst) {
      affine = affine_of<T>(p, loaded);
    } else if (!kEarlyAffine && has_affine) {
      affine = slice_affine<T>(p, slice);
    }
    const float scale = rstd * affine.x;
    T* slice_y = y + slice * spatial;
#pragma unroll
    for (int k = 0; k < VALUES; ++k) {
      const int i = lane + k * kWarpSize;
      if (i < spatial) {
        const float value = (d[k] - mean) * scale + affine.y;
        slice_y[i] = S::from_float(EPILOGUE ? epilogue_value(p.epilogue, p.y, slice_y + i, value) : value);
      }
    }
  }
}

// The warp path on 16-bit slices of whole 16-byte vectors at 16-byte aligned x and y
// (vector_aligned): as forward_warp_kernel, but lane l holds the slice's vectors l +
// 32 k (k < VECTORS) as raw bits, 4 registers a vector, so a warp's load instruction
// reads 512 consecutive bytes where forward_warp_kernel's reads 64, and a slice takes
// an eighth of the load and store instructions: forward_warp_kernel's 16-bit loads
// waited on memory several times as long as its fp32 ones (docs/perf-notes.md #185).
// The three loops over the registers are the resident kernels': the sum of d, M2
// about the mean folded into the shift (one FMA a value), and y, the values converted
// to float at each use.
template <typename T, int VECTORS, bool EPILOGUE>
__global__ void __launch_bounds__(kWarpPathThreads, warp_path_ctas(VECTORS == 1 && !EPILOGUE ? 32 : 64))
    forward_warp_vector_kernel(const ForwardProblem p) {
  static_assert(sizeof(T) == 2, "16-bit values (fp32 takes forward_warp_kernel)");
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  const int lane = threadIdx.x % kWarpSize;
  const int spatial = static_cast<int>(p.spatial);
  const int vectors = spatial / kPer;
  // This lane's vectors of each slice: those with l + 32 k < vectors (valid_count's
  // count without its cap, which the chooser's VECTORS covers; through valid_count
  // ptxas lays this kernel out anew, and that code was no faster: docs/perf-notes.md
  // #186).
  const int valid = vectors > lane ? (vectors - lane + kWarpSize - 1) / kWarpSize : 0;
  const int64_t num_slices = p.num_slices();
  const bool has_affine = p.weight != nullptr || p.bias != nullptr;  // as in forward_warp_kernel
  // The stride as in forward_warp_kernel.
  for (int64_t slice = (blockIdx.x * blockDim.x + threadIdx.x) / kWarpSize; slice < num_slices;
       slice += static_cast<int64_t>(gridDim.x) * (kWarpPathThreads / kWarpSize)) {
    const uint4* slice_x = static_cast<const uint4*>(p.x) + slice * vectors;
    uint4 raw[VECTORS];
#pragma unroll
    for (int k = 0; k < VECTORS; ++k) {
      raw[k] = k < valid ? __ldg(slice_x + lane + k * kWarpSize) : make_uint4(0, 0, 0, 0);
    }
    // The weight and bias with the values, as in forward_warp_kernel.
    constexpr bool kEarlyAffine = !(EPILOGUE && VECTORS * kPer == 32);
    const LoadedAffine loaded = kEarlyAffine && has_affine ? load_slice_affine<T>(p, slice) : LoadedAffine{};
    // The shift is the slice's first value, lane 0's first: its word is shuffled and
    // converted after, so no instruction waits on the slice's load before the weight
    // and bias loads are issued.
    float first[kPer];
    S::unpack(make_uint4(__shfl_sync(0xffffffffu, raw[0].x, 0), 0, 0, 0), first);
    const SliceShift shift = SliceShift::of(first[0]);
    float sum = 0.f;
    for_each_unpacked<T>(raw, valid, [&](int, const float(&v)[kPer]) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) sum += shift.apply(v[j]);
    });
    const float mean = warp_allreduce(sum, Sum()) / static_cast<float>(spatial);
    const LinearMap centered = shift.centered(mean);
    float m2 = 0.f;
    for_each_unpacked<T>(raw, valid, [&](int, const float(&v)[kPer]) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const float deviation = centered.apply(v[j]);
        m2 += deviation * deviation;
      }
    });
    const float rstd = shift.rstd_of_d(warp_allreduce(m2, Sum()), static_cast<float>(spatial), p.eps);
    if (lane == 0) save_slice_stats(p, slice, shift.mean(mean), shift.rstd(rstd));
    const float2 affine = kEarlyAffine    ? affine_of<T>(p, loaded)
                          : has_affine    ? slice_affine<T>(p, slice)
                                          : make_float2(1.f, 0.f);
    const float scale = rstd * affine.x;
    uint4* slice_y = static_cast<uint4*>(p.y) + slice * vectors;
    for_each_unpacked<T>(raw, valid, [&](int k, const float(&v)[kPer]) {
      float out[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) out[j] = centered.apply(v[j]) * scale + affine.y;
      uint4* out_vector = slice_y + lane + k * kWarpSize;
      if constexpr (EPILOGUE) apply_epilogue<T, kPer>(p.epilogue, p.y, reinterpret_cast<const T*>(out_vector), out);
      *out_vector = S::pack(out);
    });
  }
}

// Whether M2 = S2 - S1 * mean_d from the sums S1 of d and S2 of d^2 (one sweep over
// the slice) is as accurate as the block paths need: where the shift lies within
// kShiftedSumsMaxShiftStds standard deviations of the slice's mean, mean_d^2 <= 4
// var_d. The error bound of this shifted textbook formula is about (1 + mean_d^2 /
// var_d) times that of the sums (Chan, Golub & LeVeque, "Algorithms for computing
// the sample variance: analysis and recommendations", The American Statistician 37,
// 1983), so here at most about 5 times the bound of the M2 of d about its mean. Where
// the shift is farther out (an outlier as the slice's first value), where
// cancellation leaves m2 negative, where S2 overflowed (m2 = Inf while the M2 about
// the mean may be finite), and for NaN, the caller takes the M2 about the mean in
// another sweep. With Gaussian data about 5% of slices do.
constexpr float kShiftedSumsMaxShiftStds = 2.f;
__device__ __forceinline__ bool shifted_sums_m2_is_accurate(float mean_d, float m2, float count) {
  return isfinite(m2) && mean_d * mean_d * count <= kShiftedSumsMaxShiftStds * kShiftedSumsMaxShiftStds * m2;
}

// Block path: one CTA per slice (block_plan below says where it runs, block_preferred
// where the chooser takes it), the slice held in shared memory (spatial * sizeof(T)
// bytes, rounded up to 16, of dynamic shared memory), so an SM holds as many slices
// at once as its shared memory and 2,048 threads allow (on an H200 three 64 KB fp32
// slices of 16,384 values, six 32 KB 16-bit ones in 128-thread CTAs or four in
// 512-thread CTAs (block_launch_for); one above about 113 KB) and one CTA's
// reductions overlap the other CTAs' reads and writes. HBM is read once: 16-byte
// cp.async copies where the slice starts 16-byte aligned, else scalar loads. Then
// sweeps over shared memory (16-byte reads of the whole vectors, scalar ones of the
// fewer than 8 values after them), with d = (x - shift) * k (SliceShift) as on the
// resident paths: the sums of d and d^2 in one sweep, M2 = S2 - S1 * mean_d where
// shifted_sums_m2_is_accurate (else a sweep for the M2 of d about its mean), and
// y = d * scale + (bias - mean * scale). One sweep for both sums rather than one each:
// a sweep, a block reduction and about 3 of 7 instructions per value fewer, where the
// sweeps' instructions bind; per-vector Chan merges save a sweep but add more
// instructions than they save (docs/perf-notes.md #88, #90). 2048 / THREADS CTAs per SM in the launch
// bounds hold the kernel at 32 registers (without them ptxas takes 40-63 in four of
// the nine, and fewer 512-thread CTAs than the shared memory allows would fit an SM);
// the padded kernels get 1536 / THREADS, 40 registers, which their store loop's
// positions need (at 32 the 16-bit ones spill).
// Grid-stride over slices, any alignment and GPU. Pad: empty, or ReflectionPad, the
// padded kernel (forward_pads), whose y is the slices padded by `pad`, each value
// from its reflected source in shared memory, plus the residual's value at its own
// position where the residual has the padded shape (no activation then), 16-byte
// stores where the padded slice's 16-byte blocks lie wholly inside it. The pad
// is an optional trailing parameter, not a field of the problem nor an argument of
// a shared body, so that the plain kernels keep their machine code (both moved
// ptxas's output, docs/perf-notes.md #161).
template <typename T, int THREADS, typename... Pad>
__global__ void __launch_bounds__(THREADS, (sizeof...(Pad) == 0 ? 2048 : 1536) / THREADS)
    forward_block_kernel(const ForwardProblem p, Pad... pad) {
  static_assert(sizeof...(Pad) <= 1, "one pad at most");
  constexpr bool kPadded = sizeof...(Pad) == 1;
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  using SumsReduce = BlockAllReduce<float2, THREADS, SumFloat2>;
  using Reduce = BlockAllReduce<float, THREADS, Sum>;
  __shared__ union {
    typename SumsReduce::TempStorage sums;
    typename Reduce::TempStorage m2;
  } storage;
  extern __shared__ uint4 slice_vectors[];  // the slice, from element 0
  T* const slice_values = reinterpret_cast<T*>(slice_vectors);
  const int spatial = static_cast<int>(p.spatial);
  const int num_vecs = spatial / kPer;
  const int64_t num_slices = p.num_slices();
  // f(x) for each value x of the slice this thread takes: those of its vectors
  // v = threadIdx.x + THREADS * j, then of the values after the last whole vector.
  const auto for_each_value = [&](auto f) {
    for (int v = threadIdx.x; v < num_vecs; v += THREADS) {
      float values[kPer];
      S::unpack(slice_vectors[v], values);
#pragma unroll
      for (int k = 0; k < kPer; ++k) f(values[k]);
    }
    for (int i = num_vecs * kPer + threadIdx.x; i < spatial; i += THREADS) f(S::to_float(slice_values[i]));
  };
  for (int64_t slice = blockIdx.x; slice < num_slices; slice += gridDim.x) {
    const T* slice_x = static_cast<const T*>(p.x) + slice * spatial;
    T* slice_y = static_cast<T*>(p.y) + slice * spatial;
    if (aligned16(slice_x)) {
      const unsigned shared_base = static_cast<unsigned>(__cvta_generic_to_shared(slice_vectors));
      for (int v = threadIdx.x; v < num_vecs; v += THREADS) {
        cp_async_16<0>(shared_base + 16u * v, reinterpret_cast<const uint4*>(slice_x) + v);
      }
      for (int i = num_vecs * kPer + threadIdx.x; i < spatial; i += THREADS) slice_values[i] = __ldg(slice_x + i);
      cp_async_wait_all();
    } else {
#pragma unroll 8
      for (int i = threadIdx.x; i < spatial; i += THREADS) slice_values[i] = __ldg(slice_x + i);
    }
    // Loaded before the reductions' barriers (after them it would be a further memory
    // latency per slice), but after the wait for the slice's copies: with affine, a
    // second latency per slice (docs/perf-notes.md #186f).
    const float2 affine = slice_affine<T>(p, slice);
    __syncthreads();
    const SliceShift shift = SliceShift::of(S::to_float(slice_values[0]));
    float2 sums = make_float2(0.f, 0.f);  // of d and d^2
    for_each_value([&](float x) {
      const float d = shift.apply(x);
      sums.x += d;
      sums.y = __fmaf_rn(d, d, sums.y);
    });
    sums = SumsReduce::allreduce(sums, storage.sums);
    const float count = static_cast<float>(spatial);
    const float mean = sums.x / count;  // of d
    float m2 = sums.y - sums.x * mean;
    if (!shifted_sums_m2_is_accurate(mean, m2, count)) {  // uniform: every thread has the same sums
      float centered = 0.f;
      for_each_value([&](float x) {
        const float deviation = shift.apply(x) - mean;
        centered += deviation * deviation;
      });
      m2 = Reduce::allreduce(centered, storage.m2);
    }
    const float rstd = shift.rstd_of_d(m2, count, p.eps);
    if (threadIdx.x == 0) save_slice_stats(p, slice, shift.mean(mean), shift.rstd(rstd));
    const float scale = rstd * affine.x;
    const float offset = affine.y - mean * scale;
    const auto y_of = [&](float x) { return __fmaf_rn(shift.apply(x), scale, offset); };
    if constexpr (kPadded) {
      const ReflectionPad padding{pad...};
      const int width = padding.padded_width(), padded = static_cast<int>(padding.padded_spatial());
      T* const padded_y = static_cast<T*>(p.y) + slice * padded;
      // One loop per activation, chosen once per slice, and one with a residual of the
      // padded shape (forward_pads: then without an activation), added at each padded
      // value's own position: 16-byte stores of the padded slice's aligned 16-byte
      // blocks, scalar ones of the values before the first and after the last.
      const auto store = [&](auto activation, auto with_residual) {
        constexpr bool kResidual = decltype(with_residual)::value;
        static_assert(!kResidual || decltype(activation)::value == Activation::kNone,
                      "a padded residual comes without an activation");
        // The padded output of the slice's value `source`, and the sources of a padded
        // row's values and of a padded column's.
        const auto value_at = [&](int source) {
          const float value = y_of(S::to_float(slice_values[source]));
          return activate<decltype(activation)::value>(value, p.epilogue.negative_slope);
        };
        const auto source_row = [&](int row) { return reflect(row - padding.top, padding.height) * padding.width; };
        const auto source_column = [&](int column) { return reflect(column - padding.left, padding.width); };
        const BlockSpan span = BlockSpan::of(padded_y, padded);
        // Each block's first (row, column) of the padded slice. A padded row holds a
        // whole block (forward_pads), so a block spans two rows at most, whose
        // sources are found once per block.
        RowCursor position(span.lead + static_cast<int>(threadIdx.x) * kPer, THREADS * kPer, width);
        for (int b = threadIdx.x; b < span.blocks; b += THREADS) {
          float values[kPer];
          int source = source_row(position.row), c = position.column;
          const int next = source_row(position.row + 1);  // past the slice for its last row: then not used
#pragma unroll
          for (int k = 0; k < kPer; ++k) {
            values[k] = value_at(source + source_column(c));
            if (++c == width) c = 0, source = next;
          }
          T* const out = padded_y + span.lead + b * kPer;
          if constexpr (kResidual) add_residual<T, kPer>(p.epilogue.residual, p.y, out, values);
          store_streaming(reinterpret_cast<uint4*>(out), S::pack(values));
          position.advance();
        }
        for (int j = threadIdx.x; j < span.lead + span.rest; j += THREADS) {
          const int i = span.value<T>(j);
          float value[1] = {value_at(source_row(i / width) + source_column(i % width))};
          if constexpr (kResidual) add_residual<T, 1>(p.epilogue.residual, p.y, padded_y + i, value);
          padded_y[i] = S::from_float(value[0]);
        }
      };
      using cuda::std::integral_constant;
      using None = integral_constant<Activation, Activation::kNone>;
      if (p.epilogue.residual != nullptr) {
        store(None(), cuda::std::true_type());
      } else if (p.epilogue.activation == Activation::kNone) {
        store(None(), cuda::std::false_type());
      } else {
        with_activation(p.epilogue.activation, [&](auto activation) { store(activation, cuda::std::false_type()); });
      }
    } else if (aligned16(slice_y)) {
      for (int v = threadIdx.x; v < num_vecs; v += THREADS) {
        float values[kPer];
        S::unpack(slice_vectors[v], values);
#pragma unroll
        for (int k = 0; k < kPer; ++k) values[k] = y_of(values[k]);
        apply_epilogue(p.epilogue, p.y, slice_y + v * kPer, values);
        store_streaming(reinterpret_cast<uint4*>(slice_y) + v, S::pack(values));
      }
      for (int i = num_vecs * kPer + threadIdx.x; i < spatial; i += THREADS) {
        slice_y[i] = S::from_float(epilogue_value(p.epilogue, p.y, slice_y + i, y_of(S::to_float(slice_values[i]))));
      }
    } else {
      for (int i = threadIdx.x; i < spatial; i += THREADS) {
        slice_y[i] = S::from_float(epilogue_value(p.epilogue, p.y, slice_y + i, y_of(S::to_float(slice_values[i]))));
      }
    }
    __syncthreads();  // every thread has read the slice before the next one overwrites it
  }
}

// Block path, channels-last: one CTA per tile of one image n: V 16-byte vectors of
// channels (V * kPer channels: 8 fp32 or 16 fp16/bf16 for V = 2) at all `spatial`
// positions, held in shared memory as [spatial][V] vectors (a position's V vectors
// are consecutive in x, 16 * V bytes; positions are num_channels values apart). In
// the last tile of an image, columns past num_channels are inactive. Thread t takes column
// v = t % V, the same kPer channels in every sweep, at positions t / V + (THREADS / V) j.
// Each channel's sums go through an xor butterfly over its column's lanes of a warp,
// then the warps' totals in order through shared memory (a fixed order: run-to-run
// identical). Statistics of d = (x - shift) * k per channel, shift = the slice's
// value at position 0 (SliceShift), as on the other paths: the sums of d and d^2 in
// one sweep, then, where any active channel of the tile fails
// shifted_sums_m2_is_accurate, a sweep for the M2 about the mean for the whole tile
// (one sweep for both sums instead of two, as the contiguous block kernel:
// docs/perf-notes.md #91).
// Needs num_channels a multiple of the vector (4 fp32 or 8 fp16/bf16 values) and
// 16-byte aligned x and y.
// The channels-last block kernel's column reduction: thread t works on column
// t % V (every V-th lane of each warp); allreduce gives each thread the CTA's totals
// of its column's PER values. A shuffle butterfly within each warp, then one warp
// total per column through shared memory. Two barriers per call; the second also
// keeps the next call from rewriting warp_totals before every warp has read it.
template <int THREADS, int V, int PER>
struct ColumnTotals {
  static constexpr int kWarps = THREADS / kWarpSize;

  __device__ __forceinline__ static void allreduce(float (&values)[PER]) {
    __shared__ float warp_totals[kWarps][V * PER];
    __shared__ float channel_totals[V * PER];
    const int lane = static_cast<int>(threadIdx.x % kWarpSize);
    const int warp = static_cast<int>(threadIdx.x / kWarpSize);
#pragma unroll
    for (int offset = kWarpSize / 2; offset >= V; offset /= 2) {
#pragma unroll
      for (int k = 0; k < PER; ++k) values[k] += __shfl_xor_sync(0xffffffffu, values[k], offset);
    }
    if (lane < V) {
#pragma unroll
      for (int k = 0; k < PER; ++k) warp_totals[warp][lane * PER + k] = values[k];
    }
    __syncthreads();
    if (threadIdx.x < V * PER) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += warp_totals[w][threadIdx.x];
      channel_totals[threadIdx.x] = total;
    }
    __syncthreads();
    const int column = static_cast<int>(threadIdx.x % V);
#pragma unroll
    for (int k = 0; k < PER; ++k) values[k] = channel_totals[column * PER + k];
  }
};

template <typename T, int THREADS, int V>
__global__ void __launch_bounds__(THREADS, 1024 / THREADS) forward_block_channels_last_kernel(const ForwardProblem p) {
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  constexpr int kRowStride = THREADS / V;  // positions a column advances per step
  static_assert(kWarpSize % V == 0, "a column's lanes are every V-th lane of a warp");
  static_assert(V * kPer <= THREADS, "a thread per channel of the tile loads its weight and bias");
  extern __shared__ uint4 tile[];  // [spatial][V]
  __shared__ float2 tile_affine[V * kPer];  // (weight, bias) of the tile's channels
  const volatile float* tile_affine_words = reinterpret_cast<const volatile float*>(tile_affine);
  const int spatial = static_cast<int>(p.spatial);
  const int64_t pixel_vectors = p.num_channels / kPer;  // 16-byte vectors per position
  const int64_t tiles_per_image = (pixel_vectors + V - 1) / V;
  const int64_t num_tiles = p.batch * tiles_per_image;
  const int column = static_cast<int>(threadIdx.x % V);
  const unsigned tile_base = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  using Totals = ColumnTotals<THREADS, V, kPer>;
  for (int64_t t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const int64_t n = t / tiles_per_image;
    const int64_t first_vector = (t - n * tiles_per_image) * V;  // of each position's vectors
    const bool active = column < pixel_vectors - first_vector;   // this column is in the tile
    const uint4* tile_x = static_cast<const uint4*>(p.x) + n * spatial * pixel_vectors + first_vector + column;
    uint4* tile_y = static_cast<uint4*>(p.y) + n * spatial * pixel_vectors + first_vector + column;
    if (active) {
      for (int s = static_cast<int>(threadIdx.x / V); s < spatial; s += kRowStride) {
        cp_async_16<0>(tile_base + 16u * (s * V + column), tile_x + s * pixel_vectors);
      }
    }
    // The tile's weight and bias, one channel a thread, loaded while its copies are in
    // flight and published by the barrier below: no global load is left after the
    // reductions. Read there through a volatile pointer, one pair at each use: held in
    // registers, the 16-bit kernels spilled on sm_80 (docs/perf-notes.md #188).
    if (threadIdx.x < V * kPer) {
      const int64_t channel = first_vector * kPer + threadIdx.x;
      float2 affine = make_float2(1.f, 0.f);
      if (channel < p.num_channels) {
        // 16-bit: both loads issued before either conversion, which waits on its load
        // (channel_affine converted the weight before it issued the bias's load). Here,
        // not in channel_affine: in the contiguous block kernel the same form made fp32
        // parameters on 16-bit input 7-10% slower (docs/perf-notes.md #189e, #190b).
        if constexpr (sizeof(T) == 2) {
          affine = affine_of<T>(p, load_channel_affine<T>(p, channel));
        } else {
          affine = channel_affine<T>(p, channel);
        }
      }
      tile_affine[threadIdx.x] = affine;
    }
    cp_async_wait_all();
    __syncthreads();
    SliceShift shift[kPer];
    {
      float first[kPer];
      S::unpack(active ? tile[column] : make_uint4(0, 0, 0, 0), first);
#pragma unroll
      for (int k = 0; k < kPer; ++k) shift[k] = SliceShift::of(first[k]);
    }
    // f(x) for each of this thread's vectors of the tile, unpacked.
    const auto for_each_vector = [&](auto f) {
      if (!active) return;
      for (int s = static_cast<int>(threadIdx.x / V); s < spatial; s += kRowStride) {
        float values[kPer];
        S::unpack(tile[s * V + column], values);
        f(s, values);
      }
    };
    float mean[kPer] = {};
    float m2[kPer] = {};
    for_each_vector([&](int, const float(&values)[kPer]) { add_shifted_sums(shift, values, mean, m2); });
    Totals::allreduce(mean);
    Totals::allreduce(m2);
    // A count of the channels that fail the test, not a bool: with a bool flag, ptxas
    // (nvcc 13.0) spilled 8 bytes in 16-bit kernels on sm_80 (64 registers).
    const float count = static_cast<float>(spatial);
    int inaccurate = 0;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      m2[k] -= mean[k] * (mean[k] / count);
      mean[k] /= count;
      inaccurate += !shifted_sums_m2_is_accurate(mean[k], m2[k], count);
    }
    if (__syncthreads_or(active ? inaccurate : 0)) {  // the M2 sweep about the mean for the whole tile
#pragma unroll
      for (int k = 0; k < kPer; ++k) m2[k] = 0.f;
      for_each_vector([&](int, const float(&values)[kPer]) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const float deviation = shift[k].apply(values[k]) - mean[k];
          m2[k] += deviation * deviation;
        }
      });
      Totals::allreduce(m2);
    }
    // y = d * scale_d + offset per channel, as on the contiguous block path, computed as
    // (x - shift) * (k * scale_d) + offset: the same rounding (d = k * (x - shift)
    // rounded, k a power of two), three registers per channel instead of four (16-bit
    // kernels spilled with four). x - shift overflows only for values above 1.7e38 of
    // the other sign than the shift.
    const int64_t first_slice = n * p.num_channels + (first_vector + column) * kPer;
    float shift_value[kPer], scale[kPer], offset[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const float rstd = shift[k].rstd_of_d(m2[k], static_cast<float>(spatial), p.eps);
      if (active && threadIdx.x < V) save_slice_stats(p, first_slice + k, shift[k].mean(mean[k]), shift[k].rstd(rstd));
      const int channel = column * kPer + k;  // of the tile
      const float2 affine = make_float2(tile_affine_words[2 * channel], tile_affine_words[2 * channel + 1]);
      const float scale_d = rstd * affine.x;
      offset[k] = affine.y - mean[k] * scale_d;
      scale[k] = scale_d * shift[k].scale;
      shift_value[k] = shift[k].value();
    }
    for_each_vector([&](int s, const float(&values)[kPer]) {
      float out[kPer];
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[k] = __fmaf_rn(values[k] - shift_value[k], scale[k], offset[k]);
      apply_epilogue(p.epilogue, p.y, reinterpret_cast<const T*>(tile_y + s * pixel_vectors), out);
      store_streaming(tile_y + s * pixel_vectors, S::pack(out));
    });
    __syncthreads();  // every thread has read the tile before the next one overwrites it
  }
}

// Cluster path, channels-last (sm_90+), persistent: thread-block clusters of `ranks`
// CTAs, as many as are resident at once and at most one per image; cluster k
// normalizes images k, k + clusters, ... CTA rank r holds positions
// [r * chunk, (r + 1) * chunk) of the image with all C channels (chunk =
// ceil(spatial / ranks)), one contiguous piece of x read once into shared memory by
// 16-byte cp.async copies in order, coalesced as a copy's reads. A position is
// pv = C / kPer 16-byte vectors; thread t < rows * pv (rows = THREADS / pv positions
// per step) takes vector column t % pv, the same kPer channels at every position it
// visits (t / pv + rows * j), and copies exactly the vectors it reads; the other
// threads neither copy nor read. So a thread that has written y of one of its
// vectors copies the next image's vector into the same place at once: the next
// image's read overlaps this image's writes with no barrier between them, as the
// contiguous resident paths stage their next slice (one CTA per SM ran its load,
// reduction and store one after another: docs/perf-notes.md #147).
// Statistics per channel of d = (x - shift) * k (SliceShift of the image's value at
// position 0), as on the other paths: each thread's sums of d and d^2, totalled over
// the CTA's rows in row order through shared memory, then over the cluster's ranks in
// rank order through DSMEM, so every CTA of the cluster has the same bits and takes
// the same branches. M2 = S2 - S1 * mean_d where shifted_sums_m2_is_accurate for
// every channel of the image, else a sweep for the M2 about the mean (as the block
// paths). y = (x - shift) * scale + offset per channel, written in the order it was
// read. Needs num_channels a multiple of the vector with pv <= THREADS, 16-byte
// aligned x and y, and ChannelsLastCluster<THREADS>::bytes of dynamic shared memory.
template <int THREADS>
struct ChannelsLastCluster {
  // Dynamic shared memory, in this order: the chunk (chunk * pv 16-byte vectors), the
  // per-thread sums [rows][C], then per channel the CTA's sums of d and d^2 (float2,
  // read by the other ranks), the CTA's M2 about the mean (likewise), and mean_d, M2,
  // shift, scale and offset of the image.
  static constexpr int kChannelFloats = 2 + 1 + 5;
  __host__ __device__ static int64_t bytes(int64_t spatial, int64_t channels, int per_vector, int ranks) {
    const int64_t vectors_per_position = channels / per_vector;
    const int64_t rows = THREADS / vectors_per_position;
    return ceil_div(spatial, int64_t{ranks}) * vectors_per_position * 16 +
           (rows * channels + kChannelFloats * channels) * int64_t{sizeof(float)};
  }
  // write(c, total) for each channel c < channels this thread is given (c =
  // threadIdx.x + THREADS * j), total = the sum over the CTA's rows, in row order, of
  // values[c % PER] of the threads of column c / PER. Active thread t's values go to
  // thread_sums[t * PER + k] = [row][column * PER + k]. Returns with thread_sums free
  // again.
  template <int PER, typename Write>
  __device__ __forceinline__ static void totals(float* thread_sums, int channels, int rows, bool active,
                                                const float (&values)[PER], Write write) {
    if (active) {
#pragma unroll
      for (int k = 0; k < PER; ++k) thread_sums[threadIdx.x * PER + k] = values[k];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < channels; c += THREADS) {
      float total = 0.f;
      for (int row = 0; row < rows; ++row) total += thread_sums[row * channels + c];
      write(c, total);
    }
    __syncthreads();
  }
};

template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) forward_channels_last_cluster_kernel(const ForwardProblem p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  using Columns = ChannelsLastCluster<THREADS>;
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t clusters = gridDim.x / ranks;
  const int channels = static_cast<int>(p.num_channels);
  const int spatial = static_cast<int>(p.spatial);
  const int pv = channels / kPer;  // 16-byte vectors per position
  const int rows = THREADS / pv;
  const int active_threads = rows * pv;
  const int chunk = ceil_div(spatial, ranks);
  const int first_position = min(spatial, rank * chunk);
  const int vectors = (min(spatial, first_position + chunk) - first_position) * pv;

  extern __shared__ uint4 chunk_vectors[];
  float* const thread_sums = reinterpret_cast<float*>(chunk_vectors + chunk * pv);  // [rows][channels]
  float2* const cta_sums = reinterpret_cast<float2*>(thread_sums + rows * channels);
  float* const cta_m2 = reinterpret_cast<float*>(cta_sums + channels);
  float* const image_mean_d = cta_m2 + channels;
  float* const image_m2 = image_mean_d + channels;
  float* const shift_values = image_m2 + channels;
  float* const scales = shift_values + channels;
  float* const offsets = scales + channels;

  const int column = static_cast<int>(threadIdx.x) % pv;
  const bool active = static_cast<int>(threadIdx.x) < active_threads;
  const unsigned chunk_base = static_cast<unsigned>(__cvta_generic_to_shared(chunk_vectors));
  // This CTA's chunk of image `image` in x.
  const auto chunk_x_of = [&](int64_t image) {
    return static_cast<const uint4*>(p.x) + (image * spatial + first_position) * pv;
  };
  // f(v, values) for each of this thread's vectors v of the chunk, unpacked.
  const auto for_each_vector = [&](auto f) {
    if (!active) return;
    for (int v = threadIdx.x; v < vectors; v += active_threads) {
      float values[kPer];
      S::unpack(chunk_vectors[v], values);
      f(v, values);
    }
  };
  int64_t n = blockIdx.x / ranks;
  if (active) {
    const uint4* const chunk_x = chunk_x_of(n);
    for (int v = threadIdx.x; v < vectors; v += active_threads) cp_async_16<0>(chunk_base + 16u * v, chunk_x + v);
  }
  for (; n < p.batch; n += clusters) {
    const uint4* const image_x = static_cast<const uint4*>(p.x) + n * spatial * pv;
    uint4* const chunk_y = static_cast<uint4*>(p.y) + (n * spatial + first_position) * pv;
    const uint4* const next_chunk_x = n + clusters < p.batch ? chunk_x_of(n + clusters) : nullptr;
    SliceShift shift[kPer];
    {
      float first[kPer];
      S::unpack(__ldg(image_x + column), first);
#pragma unroll
      for (int k = 0; k < kPer; ++k) shift[k] = SliceShift::of(first[k]);
    }
    cp_async_wait_all();  // this thread's vectors of image n, which it alone reads

    float sum_d[kPer] = {};
    float sum_d2[kPer] = {};
    for_each_vector([&](int, const float(&values)[kPer]) { add_shifted_sums(shift, values, sum_d, sum_d2); });
    Columns::totals(thread_sums, channels, rows, active, sum_d, [&](int c, float total) { cta_sums[c].x = total; });
    Columns::totals(thread_sums, channels, rows, active, sum_d2, [&](int c, float total) { cta_sums[c].y = total; });
    cluster.sync();  // every rank's sums are published
    const float count = static_cast<float>(spatial);
    int inaccurate = 0;  // channels of this thread that fail the test
    for (int c = threadIdx.x; c < channels; c += THREADS) {
      float2 total = make_float2(0.f, 0.f);
      for (int r = 0; r < ranks; ++r) {
        const float2 part = *cluster.map_shared_rank(cta_sums + c, r);
        total.x += part.x;
        total.y += part.y;
      }
      image_mean_d[c] = total.x / count;
      image_m2[c] = total.y - total.x * (total.x / count);
      inaccurate += !shifted_sums_m2_is_accurate(image_mean_d[c], image_m2[c], count);
    }
    // This CTA has read the other ranks' sums; the matching wait, before the CTA
    // rewrites what they read (or exits), lets no rank go on while another still
    // reads it.
    cluster.barrier_arrive();
    if (__syncthreads_or(inaccurate)) {  // the same totals, so the same branch, on every rank
      cluster.barrier_wait();
      float m2[kPer] = {};
      for_each_vector([&](int, const float(&values)[kPer]) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const float deviation = shift[k].apply(values[k]) - image_mean_d[column * kPer + k];
          m2[k] += deviation * deviation;
        }
      });
      Columns::totals(thread_sums, channels, rows, active, m2, [&](int c, float total) { cta_m2[c] = total; });
      cluster.sync();
      for (int c = threadIdx.x; c < channels; c += THREADS) {
        float total = 0.f;
        for (int r = 0; r < ranks; ++r) total += *cluster.map_shared_rank(cta_m2 + c, r);
        image_m2[c] = total;
      }
      cluster.barrier_arrive();
    }
    // y = d * scale_d + offset per channel, computed as (x - shift) * (k * scale_d) +
    // offset, as on the channels-last block path.
    for (int c = threadIdx.x; c < channels; c += THREADS) {
      const SliceShift channel_shift = SliceShift::of(S::to_float(reinterpret_cast<const T*>(image_x)[c]));
      const float rstd = channel_shift.rstd_of_d(image_m2[c], count, p.eps);
      const int64_t slice = n * channels + c;
      if (rank == 0) save_slice_stats(p, slice, channel_shift.mean(image_mean_d[c]), channel_shift.rstd(rstd));
      const float2 affine = channel_affine<T>(p, c);  // not slice % C: no 64-bit division
      const float scale_d = rstd * affine.x;
      offsets[c] = affine.y - image_mean_d[c] * scale_d;
      scales[c] = scale_d * channel_shift.scale;
      shift_values[c] = channel_shift.value();
    }
    __syncthreads();
    float shift_value[kPer], scale[kPer], offset[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int c = active ? column * kPer + k : 0;
      shift_value[k] = shift_values[c];
      scale[k] = scales[c];
      offset[k] = offsets[c];
    }
    for_each_vector([&](int v, const float(&values)[kPer]) {
      float out[kPer];
#pragma unroll
      for (int k = 0; k < kPer; ++k) out[k] = __fmaf_rn(values[k] - shift_value[k], scale[k], offset[k]);
      apply_epilogue(p.epilogue, p.y, reinterpret_cast<const T*>(chunk_y + v), out);
      store_streaming(chunk_y + v, S::pack(out));
      // The store took the values this thread read from vector v, so that read has
      // returned (in-order issue) before the copy below overwrites it.
      if (next_chunk_x != nullptr) cp_async_16<0>(chunk_base + 16u * v, next_chunk_x + v);
    });
    cluster.barrier_wait();
  }
#endif
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
template <typename T, int THREADS, int VALUES_PER_THREAD, typename STORE, bool EARLY_AFFINE, typename P, typename Team>
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

  // This thread's vectors of a slice are first + i * THREADS for i < valid. valid_count's
  // expression written out: through the helper the compiler orders these kernels' code
  // differently, and the 16-bit kernels ran slower (docs/perf-notes.md #138).
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
    // EARLY_AFFINE: the slice's weight and bias (of type P) are loaded here, ahead of
    // the next slice's copies, and converted after the allreduce; loaded there, their
    // latency showed in the forward's time (docs/perf-notes.md #154, #155, #157).
    StoredPair<P> early_affine{};
    if constexpr (EARLY_AFFINE) early_affine = channel_parameters<P>(p, slice % p.num_channels);

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
    // Without EARLY_AFFINE (problems with no weight and no bias, and every problem
    // with an epilogue) the pair is loaded here, not held through the passes. The
    // plain kernels serve problems without parameters (resident_variant_for): they
    // read float32, which tests no dtype and keeps their machine code
    // (docs/perf-notes.md #157).
    constexpr bool kPlain = cuda::std::is_same_v<STORE, NoEpilogue> && !EARLY_AFFINE;
    using Read = std::conditional_t<kPlain, float, T>;
    const float2 affine = EARLY_AFFINE ? make_float2(Storage<P>::to_float(early_affine.weight),
                                                     Storage<P>::to_float(early_affine.bias))
                                       : slice_affine<Read>(p, slice);
    const float scale = rstd * affine.x;
    const float offset = affine.y - mean * scale;
    uint4* slice_y = reinterpret_cast<uint4*>(y + slice * spatial);
    const auto store_slice = [&](auto epilogue) {
      with_valid_count<kVecs>(valid, [&](auto count) {
        for_each_unpacked<T>(raw, count, [&](int i, const float(&v)[kPer]) {
          float out[kPer];
#pragma unroll
          for (int k = 0; k < kPer; ++k) out[k] = __fmaf_rn(kHoldsD ? v[k] : shift.apply(v[k]), scale, offset);
          epilogue(p.y, reinterpret_cast<const T*>(slice_y + first + i * THREADS), out);
          store_streaming(slice_y + first + i * THREADS, epilogue.template pack<T>(out));
        });
      });
    };
    STORE::with(p.epilogue, store_slice);
    // After the stores, where the values' registers are free (saving earlier spills).
    if (threadIdx.x == 0 && team.rank() == 0) save_slice_stats(p, slice, shift.mean(mean), shift.rstd(rstd));
    first_value = next_first_value;
  }
  team.finish();
}

// STORE: the epilogue type of the store loop (common.cuh): NoEpilogue for problems
// without one, whose kernels keep the code they had without epilogues (with the
// epilogue's code in them, they ran slower: docs/perf-notes.md #111); float32
// DynamicEpilogue, one kernel for every epilogue; 16-bit ActivationEpilogue, a kernel
// per activation: its stores unpack each vector again, and a switch over the
// activation there grew the kernel fivefold, and the store loops of all activations
// in one kernel spilled (docs/perf-notes.md #115, #118, #132).
// EARLY_AFFINE: problems with a weight or a bias and no epilogue take kernels of their
// own, whose rounds load the pair at the top. The plain kernels (false) keep their
// machine code: edits of the round have laid it out anew and slowed it
// (docs/perf-notes.md #154, #155). Both must keep the same resources (registers,
// shared memory): chosen_path and path_supported plan a problem without parameters.
// P: the type of the parameters an EARLY_AFFINE kernel reads, float or T (a run-time
// test of the dtype in the round laid the kernels out anew and slowed them,
// docs/perf-notes.md #157); float in the other kernels, which read the pair late.
template <typename T, int THREADS, int VALUES_PER_THREAD, TeamKind TEAM, typename STORE, bool EARLY_AFFINE,
          typename P>
__global__ void __launch_bounds__(THREADS, 1) forward_resident_kernel(const ForwardProblem p) {
  with_team<TEAM>(p.workspace, team_size_for(p.spatial, THREADS * VALUES_PER_THREAD), [&](const auto& team) {
    forward_resident<T, THREADS, VALUES_PER_THREAD, STORE, EARLY_AFFINE, P>(p, team);
  });
}

template <typename T, int THREADS, int VALUES, typename STORE, bool EARLY_AFFINE, typename P>
constexpr ResidentVariant<ForwardProblem> resident_variant(DType dtype) {
  return {dtype,
          THREADS,
          THREADS * VALUES,
          THREADS * VALUES * static_cast<int>(sizeof(T)),
          static_cast<int>(sizeof(SliceStats)),
          forward_resident_kernel<T, THREADS, VALUES, TeamKind::kCluster, STORE, EARLY_AFFINE, P>,
          forward_resident_kernel<T, THREADS, VALUES, TeamKind::kCooperative, STORE, EARLY_AFFINE, P>,
          false};
}

// 512 threads x 16 vectors: 128 KB of registers plus 128 KB of the staged next
// slice per CTA, one CTA per SM. A 512 x 512 slice takes a cluster of 8 in fp32 (64
// values per thread) and of 4 in fp16/bf16 (128 values per thread)
// (docs/perf-notes.md compares shapes). PLAIN: without an epilogue; else with
// activation A (kNone: the residual alone). EARLY_AFFINE: see forward_resident_kernel;
// INPUT_PARAMETERS: its parameters of the input's dtype, else float32.
template <bool PLAIN, Activation A = Activation::kNone, bool EARLY_AFFINE = false, bool INPUT_PARAMETERS = false>
constexpr ResidentVariant<ForwardProblem> kResidentVariants[] = {
    resident_variant<float, 512, 64, std::conditional_t<PLAIN, NoEpilogue, DynamicEpilogue>, EARLY_AFFINE, float>(
        DType::kFloat32),
    resident_variant<__half, 512, 128, std::conditional_t<PLAIN, NoEpilogue, ActivationEpilogue<A>>, EARLY_AFFINE,
                     std::conditional_t<INPUT_PARAMETERS, __half, float>>(DType::kFloat16),
    resident_variant<__nv_bfloat16, 512, 128, std::conditional_t<PLAIN, NoEpilogue, ActivationEpilogue<A>>,
                     EARLY_AFFINE, std::conditional_t<INPUT_PARAMETERS, __nv_bfloat16, float>>(DType::kBFloat16),
};

// The resident variant of p's dtype, parameters and epilogue. Parameters are float32
// or of the input's dtype (ForwardProblem::parameter_dtype).
const ResidentVariant<ForwardProblem>& resident_variant_for(const ForwardProblem& p) {
  if (!p.epilogue.active()) {
    if (p.weight == nullptr && p.bias == nullptr) return variant_for(kResidentVariants<true>, p.dtype);
    return p.parameter_dtype == DType::kFloat32
               ? variant_for(kResidentVariants<true, Activation::kNone, true>, p.dtype)
               : variant_for(kResidentVariants<true, Activation::kNone, true, true>, p.dtype);
  }
  const ResidentVariant<ForwardProblem>* variant = &variant_for(kResidentVariants<false>, p.dtype);
  dispatch_activation(p.epilogue.activation, [&](auto activation) {
    variant = &variant_for(kResidentVariants<false, decltype(activation)::value>, p.dtype);
    return cudaSuccess;
  });
  return *variant;
}

bool resident_supported(TeamKind team, const ForwardProblem& p) {
  const ResidentVariant<ForwardProblem>& variant = resident_variant_for(p);
  return p.layout == Layout::kContiguous && vector_aligned(p) &&
         (team == TeamKind::kCluster ? variant.cluster_fits(p.spatial) : variant.cooperative_fits(p.spatial));
}

using Kernel = void (*)(const ForwardProblem);

// The warp path's warps per CTA: 16 (kWarpPathThreads) where there are at least 16
// slices per SM; with fewer, the least power of two that covers the slices per SM, so
// they spread over all SMs instead of queueing on a few SMs' loads and stores (a
// problem of a few slices takes one memory latency, not 16 slices' traffic through
// one SM; docs/perf-notes.md #182). Below 16 warps, slices <= warps * SMs, so the grid
// (at most one CTA per SM, under grid_for's cap) has a warp for every slice, which the
// kernel's stride needs.
int warp_path_warps_per_cta(int64_t num_slices) {
  constexpr int kMaxWarps = kWarpPathThreads / kWarpSize;
  const int sms = current_sm_count();
  if (sms <= 0) return kMaxWarps;
  const int64_t per_sm = ceil_div(num_slices, int64_t{sms});
  int warps = 1;
  while (warps < kMaxWarps && warps < per_sm) warps *= 2;
  return warps;
}

// The warp path: the smallest variant that holds the slice (a warp of 32 x {2, 8,
// 32} values), a warp per slice.
ForwardPlan warp_plan(const ForwardProblem& p) {
  ForwardPlan plan{};
  if (p.layout != Layout::kContiguous || p.spatial > kWarpMaxSpatial) return plan;
  Kernel kernel = nullptr;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    // 16-bit slices of whole aligned vectors above 2 values a lane take the vector
    // kernel. fp32 keeps a value per load: its warp loads already read whole 128-byte
    // lines, and the vector kernel timed the same within 3% (docs/perf-notes.md #185).
    const auto variant = [&](auto values) -> Kernel {
      constexpr int kValues = decltype(values)::value;
      constexpr int kVectors = kValues / Storage<T>::kPerVector;
      if constexpr (sizeof(T) == 2 && kVectors > 0) {
        if (vector_aligned(p)) {
          return p.epilogue.active() ? forward_warp_vector_kernel<T, kVectors, true>
                                     : forward_warp_vector_kernel<T, kVectors, false>;
        }
      }
      return p.epilogue.active() ? forward_warp_kernel<T, kValues, true> : forward_warp_kernel<T, kValues, false>;
    };
    if (p.spatial <= 2 * kWarpSize) {
      kernel = variant(cuda::std::integral_constant<int, 2>());
    } else if (p.spatial <= 8 * kWarpSize) {
      kernel = variant(cuda::std::integral_constant<int, 8>());
    } else {
      kernel = variant(cuda::std::integral_constant<int, 32>());
    }
    return cudaSuccess;
  });
  plan.path = ForwardPath::kWarp;
  const int warps = warp_path_warps_per_cta(p.num_slices());
  plan.launch = {LaunchKind::kPlain, kernel, grid_for(p.num_slices(), warps), warps * kWarpSize, 0, 0, 0};
  return plan;
}

// The block path's launch: 128-thread CTAs for contiguous slices whose copy lets
// kBlockSmallCtasPerSm or more of them share an SM (on an H200 slices up to about 37
// KB: 9,464 fp32 / 18,928 16-bit values) where there are at least
// kBlockSmallMinSlicesPerSm slices per SM; else CTAs of 128, 256 or 512 threads, the
// largest that gives each thread at least kBlockVectorsPerThread 16-byte vectors of
// its slice or tile, so large slices take 512-thread CTAs, up to four per SM; dynamic
// shared memory for the slice (rounded up to 16 bytes) or the channels-last tile
// (kChannelsLastTileVectors 16-byte vectors per position); one CTA per slice or tile,
// grid-stride. Why (kernels/tuning.h): small CTAs, six or more to an SM, keep more
// slices' loads in flight than a few large ones. Channels-last tiles keep the vectors
// rule (not measured).
constexpr int kChannelsLastTileVectors = 2;  // 32-byte rows: 8 fp32 or 16 fp16/bf16 channels
// Larger slices never take the block path (no GPU has this much shared memory per CTA).
constexpr int64_t kBlockMaxBytes = 1 << 20;

// Shared-memory bytes of the block path's slice or tile (at most kBlockMaxBytes + 15).
int64_t block_bytes(const ForwardProblem& p) {
  if (p.layout == Layout::kChannelsLast) return p.spatial * kChannelsLastTileVectors * 16;
  return round_up(p.spatial * element_bytes(p.dtype), 16);
}

// CTAs of the block path: one per slice, or per channels-last tile.
int64_t block_work(const ForwardProblem& p) {
  if (p.layout == Layout::kContiguous) return p.num_slices();
  const int64_t pixel_vectors = p.num_channels / values_per_vector(p.dtype);
  return p.batch * ceil_div(pixel_vectors, kChannelsLastTileVectors);
}

// How many CTAs of a plain launch fit one SM at once; also raises the kernel's
// shared-memory limit (ctas_per_sm).
int launch_ctas_per_sm(const KernelLaunch<ForwardProblem>& launch) {
  return ctas_per_sm(reinterpret_cast<const void*>(launch.kernel), launch.threads, launch.shared_bytes);
}

template <typename T>
KernelLaunch<ForwardProblem> block_launch_for(const ForwardProblem& p) {
  const int shared_bytes = static_cast<int>(block_bytes(p));
  const int64_t vectors = shared_bytes / 16;
  const auto launch = [&](auto threads) -> KernelLaunch<ForwardProblem> {
    constexpr int kThreads = decltype(threads)::value;
    const Kernel kernel = p.layout == Layout::kChannelsLast
                              ? forward_block_channels_last_kernel<T, kThreads, kChannelsLastTileVectors>
                              : static_cast<Kernel>(forward_block_kernel<T, kThreads>);
    return {LaunchKind::kPlain, kernel, grid_for(block_work(p), 1), kThreads, shared_bytes, 0, 0};
  };
  const int sms = current_sm_count();
  if (p.layout == Layout::kContiguous && sms > 0 && p.num_slices() >= int64_t{kBlockSmallMinSlicesPerSm} * sms) {
    const KernelLaunch<ForwardProblem> small = launch(cuda::std::integral_constant<int, 128>());
    if (launch_ctas_per_sm(small) >= kBlockSmallCtasPerSm) return small;
  }
  if (vectors >= 512 * kBlockVectorsPerThread) return launch(cuda::std::integral_constant<int, 512>());
  if (vectors >= 256 * kBlockVectorsPerThread) return launch(cuda::std::integral_constant<int, 256>());
  return launch(cuda::std::integral_constant<int, 128>());
}

// The block path's layout conditions: any contiguous input; channels-last with
// num_channels a multiple of the 16-byte vector and 16-byte aligned x and y.
bool block_input_supported(const ForwardProblem& p) {
  return p.layout == Layout::kContiguous ||
         (p.num_channels % values_per_vector(p.dtype) == 0 && aligned16(p.x) && aligned16(p.y));
}

// The block path runs a contiguous slice (any alignment) whose shared-memory copy
// fits one CTA on the current device: on an H200 up to about 227 KB, 58,000 fp32 or
// 116,000 fp16/bf16 values; and channels-last input (block_input_supported) where one
// tile fits a CTA (on an H200 up to about 7,200 positions).
ForwardPlan block_plan(const ForwardProblem& p) {
  ForwardPlan plan{};
  if (!block_input_supported(p) || block_bytes(p) > kBlockMaxBytes) return plan;
  dispatch_dtype(p.dtype, [&](auto tag) {
    plan.launch = block_launch_for<decltype(tag)>(p);
    return cudaSuccess;
  });
  if (plan.launch.kernel != nullptr && launch_ctas_per_sm(plan.launch) >= 1) plan.path = ForwardPath::kBlock;
  return plan;
}

// The block plan of p with y padded by `pad` (forward_pads): the plain plan's launch
// with the padded kernel of its dtype and CTA size.
ForwardPlan padded_block_plan(const ForwardProblem& p, const ReflectionPad& pad) {
  ForwardPlan plan = block_plan(p);
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (plan.launch.threads) {
      case 128: plan.padded_kernel = forward_block_kernel<T, 128, ReflectionPad>; break;
      case 256: plan.padded_kernel = forward_block_kernel<T, 256, ReflectionPad>; break;
      default: plan.padded_kernel = forward_block_kernel<T, 512, ReflectionPad>; break;
    }
    return cudaSuccess;
  });
  // Raises the padded kernel's shared-memory limit as the plain one's was.
  if (!plan.valid() || ctas_per_sm(reinterpret_cast<const void*>(plan.padded_kernel), plan.launch.threads,
                                   plan.launch.shared_bytes) < 1) {
    return {};
  }
  plan.pad = pad;
  return plan;
}

// The channels-last cluster kernel's CTA size, one CTA per SM (its own writes overlap
// the next image's read; at two, 64 registers, ptxas spilled the 16-bit kernels);
// positions of up to 512 16-byte vectors (2,048 fp32 or 4,096 16-bit channels).
constexpr int kChannelsLastClusterThreads = 512;
using ChannelsLastClusterShared = ChannelsLastCluster<kChannelsLastClusterThreads>;

// The channels-last cluster path, where the input is whole vectors of channels at
// aligned x and y (block_input_supported), a position has at most
// kChannelsLastClusterThreads vectors, and an image fits a cluster of
// kChannelsLastClusterSizes[0] or [1] CTAs (on an H200 up to about 1.7 or 3.4 MB);
// clusters of the smaller size that fits, as many as are resident at once, at most
// one per image.
ForwardPlan channels_last_cluster_plan(const ForwardProblem& p) {
  ForwardPlan plan{};
  const int per_vector = values_per_vector(p.dtype);
  if (!block_input_supported(p) || p.num_channels / per_vector > kChannelsLastClusterThreads) return plan;
  Kernel kernel = nullptr;
  dispatch_dtype(p.dtype, [&](auto tag) {
    kernel = forward_channels_last_cluster_kernel<decltype(tag), kChannelsLastClusterThreads>;
    return cudaSuccess;
  });
  for (const int ranks : kChannelsLastClusterSizes) {
    const int64_t bytes = ChannelsLastClusterShared::bytes(p.spatial, p.num_channels, per_vector, ranks);
    if (bytes > kBlockMaxBytes) continue;
    const int shared_bytes = static_cast<int>(bytes);
    const int clusters =
        ctas_per_sm(reinterpret_cast<const void*>(kernel), kChannelsLastClusterThreads, shared_bytes) < 1
            ? 0
            : max_active_clusters(reinterpret_cast<const void*>(kernel), kChannelsLastClusterThreads, shared_bytes,
                                  ranks);
    if (clusters < 1) continue;
    plan.path = ForwardPath::kCluster;
    plan.team_size = ranks;
    plan.teams = std::min<int64_t>(p.batch, clusters);
    plan.launch = {LaunchKind::kCluster, kernel, static_cast<unsigned>(plan.teams * ranks),
                   kChannelsLastClusterThreads, shared_bytes, ranks, 0};
    break;
  }
  return plan;
}

// The cluster or cooperative path, where resident_supported; channels-last input
// takes channels_last_cluster_plan's cluster path.
ForwardPlan resident_plan(TeamKind team, const ForwardProblem& p) {
  ForwardPlan plan{};
  if (p.layout == Layout::kChannelsLast) return team == TeamKind::kCluster ? channels_last_cluster_plan(p) : plan;
  if (!resident_supported(team, p)) return plan;
  const ResidentVariant<ForwardProblem>& variant = resident_variant_for(p);
  if (team == TeamKind::kCluster) {
    plan.path = ForwardPath::kCluster;
    variant.plan_cluster(p, plan);
  } else {
    plan.path = ForwardPath::kCooperative;
    variant.plan_cooperative(p, plan);
  }
  return plan;
}

// Where the chooser gives a slice the block path (block: block_plan(p); measured on
// an H200, docs/perf-notes.md #54, #55, #59). Slices whose copies leave room for two
// or more CTAs per SM (up to about 113 KB: 28,888 fp32 or 57,776 16-bit values): one
// CTA's reductions overlap another's reads and writes. Larger ones run one CTA per
// SM: faster than a cluster of two or more CTAs (and than the split path's two
// reads), slower than a resident team of one CTA, whose slice sits in registers,
// where there are more slices than teams (the team stages its next slice while it
// writes the current one), so those keep their team unless the slices fit one round
// of teams. Channels-last tiles up to kChannelsLastChosenMaxBytes (kernels/tuning.h),
// and larger ones where a tile holds every channel of its image, so that it reads the
// image whole, as a copy does: measured, 1.26-2.9x faster than the cluster path, whose
// cost per image is the same for a few channels as for many (docs/perf-notes.md #148,
// #150; tiles of two full vectors; half-full ones, 4 fp32 or 8 16-bit channels, not
// measured).
bool block_preferred(const ForwardProblem& p, const ForwardPlan& block) {
  if (!block.valid()) return false;
  if (p.layout == Layout::kChannelsLast) {
    return block_bytes(p) <= kChannelsLastChosenMaxBytes || block_work(p) == p.batch;
  }
  if (launch_ctas_per_sm(block.launch) >= 2) return true;
  const ResidentVariant<ForwardProblem>& variant = resident_variant_for(p);
  if (variant.team_size(p.spatial) > 1) return true;
  // A one-CTA team gains from its later rounds, where its staging of the next slice
  // overlaps the current one; measured, it overtakes one block CTA per SM between 1.45
  // and 2 rounds, and the rule switches after one (docs/perf-notes.md #60).
  int64_t teams = 0;
  if (resident_supported(TeamKind::kCluster, p)) {
    teams = variant.active_clusters(1);
  } else if (resident_supported(TeamKind::kCooperative, p)) {
    teams = variant.resident_ctas();
  }
  return p.num_slices() <= teams || teams == 0;
}

// Where slices exceed a cluster, the pipelined path in fp32 where it keeps at least as
// many SMs busy as cooperative teams and its teams take kPipelinedMinRounds slices or
// more (the busiest; the others at most one fewer): its first three rounds only read,
// its last three only write, so it needs enough rounds to amortize them
// (kernels/tuning.h). In 16-bit it was slower than the cooperative path, which 16-bit
// slices keep (docs/perf-notes.md #75, #80, #81).
bool pipelined_preferred(const ForwardPlan& pipelined, const ForwardPlan& cooperative) {
  return pipelined.valid() && cooperative.valid() && pipelined.rounds >= kPipelinedMinRounds &&
         pipelined.teams * pipelined.team_size >= cooperative.teams * cooperative.team_size;
}

// Where a slice fits only one cooperative team on the GPU, the split path in its place
// for fp32 problems whose team would take kSplitOverOneTeamMinRounds slices or more:
// one team walks the slices one after another, with a block reduction and a team
// barrier per slice that leave DRAM half busy, while the split path's two reads keep
// it streaming (docs/perf-notes.md #114, #120). 16-bit slices keep the team.
bool split_preferred(const ForwardProblem& p, const ForwardPlan& cooperative) {
  return p.dtype == DType::kFloat32 && cooperative.teams == 1 && p.num_slices() >= kSplitOverOneTeamMinRounds;
}

static_assert(kWarpMaxSpatial == 32 * kWarpSize, "the warp path's largest variant holds 32 values per lane");

// Slices that fit a warp take the warp path; larger ones the block path where
// block_preferred, else the cluster path where it runs, else the pipelined path where
// pipelined_preferred (fp32 only), else cooperative teams where the slice fits the
// resident CTAs and not split_preferred, else the split path. Channels-last input takes the block path where
// block_preferred, else the cluster path where it runs, else the split path.
ForwardPlan chosen_plan(const ForwardProblem& p) {
  if (p.layout != Layout::kContiguous) {
    const ForwardPlan block = block_plan(p);
    if (block_preferred(p, block)) return block;
    const ForwardPlan cluster = channels_last_cluster_plan(p);
    return cluster.valid() ? cluster : split_plan(p);
  }
  if (p.spatial <= kWarpMaxSpatial) return warp_plan(p);
  const ForwardPlan block = block_plan(p);
  if (block_preferred(p, block)) return block;
  const ForwardPlan cluster = resident_plan(TeamKind::kCluster, p);
  if (cluster.valid()) return cluster;
  const ForwardPlan cooperative = resident_plan(TeamKind::kCooperative, p);
  if (p.dtype == DType::kFloat32 && cooperative.valid()) {
    const ForwardPlan pipelined = pipelined_plan(p);
    if (pipelined_preferred(pipelined, cooperative)) return pipelined;
  }
  return cooperative.valid() && !split_preferred(p, cooperative) ? cooperative : split_plan(p);
}

// The plan of `path` (kAuto: the chooser's), invalid where it cannot run p.
ForwardPlan path_plan(ForwardPath path, const ForwardProblem& p) {
  switch (path) {
    case ForwardPath::kAuto: return chosen_plan(p);
    case ForwardPath::kBlock: return block_plan(p);
    case ForwardPath::kCluster: return resident_plan(TeamKind::kCluster, p);
    case ForwardPath::kWarp: return warp_plan(p);
    case ForwardPath::kSplit: return split_supported(p) ? split_plan(p) : ForwardPlan{};
    case ForwardPath::kCooperative: return resident_plan(TeamKind::kCooperative, p);
    case ForwardPath::kPipelined: return pipelined_plan(p);
  }
  return {};
}

}  // namespace forward_detail

ForwardPlan plan_forward(const ForwardProblem& problem, ForwardPath forced, const ReflectionPad& pad) {
  using namespace forward_detail;
  ++plan_counters().forward;
  if (pad.active()) return forward_pads(problem, pad, forced) ? padded_block_plan(problem, pad) : ForwardPlan{};
  if (problem.num_slices() <= 0 || problem.spatial <= 0) {
    ForwardPlan plan{};  // nothing to launch, on any path
    plan.path = forced == ForwardPath::kAuto ? chosen_plan(problem).path : forced;
    return plan;
  }
  // With running statistics (eval) every path is the same elementwise sweep, the
  // split path's; a forced path must still be one that runs the problem.
  if (problem.running_mean != nullptr) {
    return forced == ForwardPath::kAuto || path_plan(forced, problem).valid() ? split_plan(problem) : ForwardPlan{};
  }
  return path_plan(forced, problem);
}

bool forward_pads(const ForwardProblem& p, const ReflectionPad& pad, ForwardPath forced) {
  using namespace forward_detail;
  // The kernel's store loop takes a 16-byte block over two padded rows at most.
  if (!pad.active() || p.layout != Layout::kContiguous ||
      (p.epilogue.residual != nullptr && p.epilogue.activation != Activation::kNone) || p.running_mean != nullptr ||
      p.num_slices() <= 0 || p.spatial <= 0 || pad.padded_width() < values_per_vector(p.dtype)) {
    return false;
  }
  if (forced == ForwardPath::kBlock) return block_plan(p).valid();
  return forced == ForwardPath::kAuto && p.spatial > kWarpMaxSpatial && block_preferred(p, block_plan(p));
}

cudaError_t forward(const ForwardProblem& problem, const ForwardPlan& plan, cudaStream_t stream) {
  if (problem.num_slices() <= 0 || problem.spatial <= 0) return cudaSuccess;
  if (problem.y == nullptr || !plan.valid()) return cudaErrorInvalidValue;
  if (plan.path == ForwardPath::kSplit) return launch_split(problem, plan.split, stream);
  if (plan.pad.active()) {
    const KernelLaunch<ForwardProblem>& launch = plan.launch;
    plan.padded_kernel<<<launch.grid, launch.threads, launch.shared_bytes, stream>>>(problem, plan.pad);
    return cudaGetLastError();
  }
  return launch_kernel(plan.launch, problem, stream);
}

ForwardCapacities forward_capacities(DType dtype) {
  using namespace forward_detail;
  return {kWarpMaxSpatial, variant_for(kResidentVariants<true>, dtype).cta_capacity, kMaxClusterSize,
          pipelined_cta_capacity(dtype)};
}

PlanCounts plans_made() { return {plan_counters().forward.load(), plan_counters().backward.load()}; }

void emulate_device(const EmulatedDevice& device) {
  emulation().device = device;
  emulation().active = true;
}

}  // namespace instance_norm
