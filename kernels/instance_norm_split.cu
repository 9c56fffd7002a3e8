// The forward's split path (several CTAs per slice, two reads, any layout, size,
// alignment and GPU), whose sweep is also the eval-mode forward with running
// statistics.
//
// Split path, three launches:
//   1. partial statistics (count, mean, M2) of each chunk of each slice, a CTA per
//      chunk: contiguous, chunks of contiguous_chunk_units units (values or 16-byte
//      vectors) of one slice; channels-last, chunks of ChannelsLastTiling::chunk_rows
//      positions of one n for a tile of up to 32 units of channels;
//   2. a group of lanes per slice (a CTA for thousands of chunks) combines its chunks
//      in a fixed order (Chan et al.) into {shift, mean, rstd * weight, bias} (or
//      takes running_mean/var in eval);
//   3. an elementwise sweep y = ((x - shift) - mean) * scale + bias: contiguous over
//      the flat tensor; channels-last by the partials' tiling, each thread holding
//      its channels' float4s in registers.
// Each CTA of kernels 1 and 3 moves up to about 128 KB of vectors (chunk_rounds of
// kLoads 16-byte loads per thread, each round's loads in flight at once): enough
// bytes in flight per SM for the copy's bandwidth, and one block reduction per 128 KB
// (docs/perf-notes.md #112); small tensors take fewer rounds per chunk, so their
// partials still spread over the SMs (split_chunk_rounds).
// All statistics are of d = (x - shift) * k (SliceShift, shift = the slice's first
// value), as on the other paths: chunk means stay small, so combining them loses
// nothing to the magnitude of x (1e4 + 0.1 * randn keeps its precision), a constant
// slice gives exactly 0, and values near 1e30 do not overflow.
// Every reduction has a fixed order, so results are bit-identical run to run.
#include "common.cuh"
#include "split.h"
#include "tuning.h"

namespace instance_norm {
// load_inline compiles all .cu sources as one translation unit: each file keeps
// its internals in its own namespace.
namespace split_detail {

constexpr int kThreads = 256;
// Units each thread loads at once (a unit: one 16-byte vector, or one value where x
// is not vector-aligned), and the most rounds of such loads per CTA chunk.
constexpr int kLoads = 8;
constexpr int kMaxChunkRounds = 4;
constexpr int kSweepUnroll = 8;  // contiguous sweep: units per thread per tile
constexpr int64_t kSweepTile = kThreads * kSweepUnroll;

// How the channels-last kernels share out a problem: each position's C values are a
// row of C / V units (V values each; rows are C values apart); a CTA takes a tile of
// tile_units consecutive units of the row (a warp reads them contiguously) for
// row_groups rows at a time: thread t takes unit t % tile_units of rows
// t / tile_units + k * row_groups. The fewer than 32 threads past
// row_groups * tile_units idle. A CTA's chunk is chunk_rows rows of one n:
// chunk_rounds rounds of kLoads rows per row group.
struct ChannelsLastTiling {
  int row_units;
  int tile_units;
  int row_groups;
  int channel_tiles;
  int64_t chunk_rows;

  __host__ __device__ static ChannelsLastTiling of(int64_t num_channels, int values_per_unit, int chunk_rounds) {
    ChannelsLastTiling t;
    t.row_units = static_cast<int>(num_channels / values_per_unit);
    t.tile_units = t.row_units < kWarpSize ? t.row_units : kWarpSize;
    t.row_groups = kThreads / t.tile_units;
    t.channel_tiles = (t.row_units + t.tile_units - 1) / t.tile_units;
    t.chunk_rows = int64_t{chunk_rounds} * kLoads * t.row_groups;
    return t;
  }
  __host__ __device__ int64_t chunks(int64_t spatial) const { return (spatial + chunk_rows - 1) / chunk_rows; }
};

// Values per unit: one 16-byte vector where rows (contiguous: slices; channels-last:
// positions) are whole vectors and `pointers` are 16-byte aligned, else 1.
template <typename... Pointers>
int unit_values(const ForwardProblem& p, Pointers... pointers) {
  const int64_t row_length = p.layout == Layout::kContiguous ? p.spatial : p.num_channels;
  const int vector = values_per_vector(p.dtype);
  return row_length % vector == 0 && (aligned16(pointers) && ...) ? vector : 1;
}

// Contiguous chunks: units per CTA chunk.
__host__ __device__ constexpr int64_t contiguous_chunk_units(int chunk_rounds) {
  return int64_t{kThreads} * kLoads * chunk_rounds;
}

int64_t chunks_per_slice(const ForwardProblem& p, int stats_unit, int chunk_rounds) {
  if (p.layout == Layout::kChannelsLast) {
    return ChannelsLastTiling::of(p.num_channels, stats_unit, chunk_rounds).chunks(p.spatial);
  }
  return ceil_div(p.spatial / stats_unit, contiguous_chunk_units(chunk_rounds));
}

// CTAs of the partial statistics (kernel 1) at chunk_rounds rounds per chunk.
int64_t partials_ctas(const ForwardProblem& p, int stats_unit, int chunk_rounds) {
  const int64_t chunks = chunks_per_slice(p, stats_unit, chunk_rounds);
  if (p.layout == Layout::kContiguous) return p.num_slices() * chunks;
  return p.batch * chunks * ChannelsLastTiling::of(p.num_channels, stats_unit, chunk_rounds).channel_tiles;
}

// Rounds per chunk: kMaxChunkRounds, halved (down to 1) while the partials would
// give the GPU fewer than kMinCtasPerSm CTAs per SM: a small tensor then still keeps
// every SM's loads in flight (kernels/tuning.h).
int split_chunk_rounds(const ForwardProblem& p, int stats_unit) {
  const int64_t wanted = int64_t{kMinCtasPerSm} * current_sm_count();
  int rounds = kMaxChunkRounds;
  while (rounds > 1 && partials_ctas(p, stats_unit, rounds) < wanted) rounds /= 2;
  return rounds;
}

// One unit's bits as loaded: a 16-byte vector (V > 1) or one value. A round keeps its
// units packed and unpacks them at each use, so a 16-bit round holds 4 registers per
// vector in flight, not 8 floats.
template <typename T, int V>
using UnitBits = std::conditional_t<V == 1, T, uint4>;

template <typename T, int V>
__device__ __forceinline__ UnitBits<T, V> load_unit(const T* x, int64_t offset) {
  if constexpr (V == 1) {
    return __ldg(x + offset);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(x + offset));
  }
}

template <typename T, int V>
__device__ __forceinline__ void unpack_unit(const UnitBits<T, V>& bits, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = Storage<T>::to_float(bits);
  } else {
    Storage<T>::unpack(bits, out);
  }
}

// One unit's V values to y at `offset` (load_unit's counterpart): a streaming 16-byte
// store, or one value.
template <typename T, int V>
__device__ __forceinline__ void store_unit(T* y, int64_t offset, const float (&in)[V]) {
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

// This thread's units of one round, first + k * stride for k < count (count <=
// kLoads), every load issued before any use.
template <typename T, int V>
__device__ __forceinline__ void load_round(const T* x, int64_t first, int64_t stride, int count,
                                           UnitBits<T, V> (&bits)[kLoads]) {
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    if (k < count) bits[k] = load_unit<T, V>(x, first + k * stride);
  }
}

// How many of a round's kLoads rows, round + k * row_groups, lie before the chunk's
// end, `left` rows on (no 64-bit division per round).
__device__ __forceinline__ int rows_in_round(int64_t left, int row_groups) {
  int count = 0;
#pragma unroll
  for (int k = 0; k < kLoads; ++k) count += int64_t{k} * row_groups < left;
  return count;
}

// Statistics of SLICES slices over the same positions, so with one count: a thread's
// statistics of its unit's channels (contiguous: of its one slice). merge() is
// combine() (Chan et al.) for all slices at once, with one division for them all.
template <int SLICES>
struct SharedCountStats {
  float count;
  float mean[SLICES];
  float m2[SLICES];

  __device__ __forceinline__ static SharedCountStats empty() {
    SharedCountStats s;
    s.count = 0.f;
#pragma unroll
    for (int j = 0; j < SLICES; ++j) s.mean[j] = s.m2[j] = 0.f;
    return s;
  }

  // Merges the statistics of other positions; from empty() it takes b's exactly.
  __device__ __forceinline__ void merge(const SharedCountStats& b) {
    const float total = count + b.count;
    const float b_weight = total > 0.f ? b.count / total : 0.f;  // nb / n
    const float cross = count * b_weight;                           // na * nb / n
#pragma unroll
    for (int j = 0; j < SLICES; ++j) {
      const float delta = b.mean[j] - mean[j];
      mean[j] = __fmaf_rn(delta, b_weight, mean[j]);
      m2[j] = (m2[j] + b.m2[j]) + __fmul_rn(delta, delta) * cross;
    }
    count = total;
  }

  __device__ __forceinline__ SliceStats of(int j) const { return {count, mean[j], m2[j]}; }
};

// Statistics of a round's first `count` units, per slice, in a single sweep: with center
// c = d of the slice's value in the round's first unit (unit k's bits are units(k): a
// round's registers, or its shared-memory slots) and t = d - c, the sums S1 of t
// and S2 of t^2 give mean_d = c + S1 / n and M2 = S2 - S1 * (S1 / n). The center is
// one of the round's values, so (c - mean)^2 <= M2 and S2 <= (n + 1) M2: the
// subtraction loses at most log2(n + 1) bits (docs/perf-notes.md #166).
template <typename T, int V, int SLICES, typename Units>
__device__ __forceinline__ SharedCountStats<SLICES> round_stats(Units units, int count,
                                                                const SliceShift (&shift)[SLICES]) {
  LinearMap centered[SLICES];
  float center[SLICES];
  {
    float v[V];
    unpack_unit<T, V>(units(0), v);
#pragma unroll
    for (int j = 0; j < SLICES; ++j) {
      center[j] = shift[j].apply(v[j]);
      centered[j] = shift[j].centered(center[j]);
    }
  }
  float s1[SLICES] = {};
  float s2[SLICES] = {};
#pragma unroll
  for (int k = 0; k < kLoads; ++k) {
    if (k < count) {
      float v[V];
      unpack_unit<T, V>(units(k), v);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float t = centered[i % SLICES].apply(v[i]);
        s1[i % SLICES] += t;
        s2[i % SLICES] = __fmaf_rn(t, t, s2[i % SLICES]);
      }
    }
  }
  SharedCountStats<SLICES> out = SharedCountStats<SLICES>::empty();
  out.count = static_cast<float>(count * (V / SLICES));
  const float inverse = count > 0 ? 1.f / out.count : 0.f;
#pragma unroll
  for (int j = 0; j < SLICES; ++j) {
    const float relative = s1[j] * inverse;
    out.mean[j] = count > 0 ? center[j] + relative : 0.f;
    out.m2[j] = relu(__fmaf_rn(-s1[j], relative, s2[j]));  // rounding may leave it just below 0; NaN kept
  }
  return out;
}

// Kernel 1, contiguous: partials[slice * chunks + chunk] for chunks of
// contiguous_chunk_units(chunk_rounds) units; per round thread t reads units t + k * kThreads of
// the round's kThreads * kLoads (coalesced), merges their statistics into its own,
// and the CTA reduces once per chunk.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    partial_stats_contiguous_kernel(const ForwardProblem p, int64_t chunks, int chunk_rounds, SliceStats* partials) {
  constexpr int64_t kRoundUnits = int64_t{kThreads} * kLoads;
  const int64_t chunk_units = contiguous_chunk_units(chunk_rounds);
  __shared__ typename BlockStatsReduce<kThreads>::TempStorage storage;
  const T* x = static_cast<const T*>(p.x);
  const int64_t slice_units = p.spatial / V;
  const int64_t num_tiles = p.num_slices() * chunks;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t slice = tile / chunks;
    const int64_t begin = (tile - slice * chunks) * chunk_units;
    const int64_t end = min(begin + chunk_units, slice_units);
    const T* slice_x = x + slice * p.spatial;
    const SliceShift shift[1] = {SliceShift::of(Storage<T>::to_float(__ldg(slice_x)))};
    SharedCountStats<1> stats = SharedCountStats<1>::empty();
    for (int64_t round = begin; round < end; round += kRoundUnits) {
      const int64_t first = round + threadIdx.x;
      const int count = static_cast<int>(valid_count<kThreads>(end, first, kLoads));
      UnitBits<T, V> bits[kLoads];
      load_round<T, V>(slice_x, first * V, int64_t{kThreads} * V, count, bits);
      stats.merge(round_stats<T, V, 1>([&](int k) { return bits[k]; }, count, shift));
    }
    const SliceStats total = BlockStatsReduce<kThreads>::allreduce(stats.of(0), storage);
    if (threadIdx.x == 0) partials[tile] = total;
  }
}

// The CTA tile of a channels-last kernel's tile index: n, chunk of rows and channel
// tile (channel tiles vary fastest, so neighbouring CTAs read neighbouring bytes).
struct ChannelsLastTile {
  int64_t n;
  int64_t chunk;
  int unit;  // this thread's unit of the row
  bool active;

  __device__ static ChannelsLastTile of(const ChannelsLastTiling& t, int64_t tile, int64_t chunks) {
    const int64_t n = tile / (chunks * t.channel_tiles);
    const int64_t rest = tile - n * chunks * t.channel_tiles;
    const int64_t chunk = rest / t.channel_tiles;
    const int channel_tile = static_cast<int>(rest - chunk * t.channel_tiles);
    const int unit = channel_tile * t.tile_units + static_cast<int>(threadIdx.x) % t.tile_units;
    const bool active = static_cast<int>(threadIdx.x) / t.tile_units < t.row_groups && unit < t.row_units;
    return {n, chunk, unit, active};
  }
};

// The row groups' statistics of one channels-last tile combined through shared
// memory by a fixed tree (row group g takes in g + step for step = 1, 2, 4, ...) into
// partials[(n * C + channel) * chunks + chunk]. Every thread of the CTA calls it.
template <int V>
__device__ __forceinline__ void store_tile_partials(const ForwardProblem& p, const ChannelsLastTiling& tiling,
                                                    const ChannelsLastTile& tile, int group, int64_t chunks,
                                                    const SharedCountStats<V>& stats,
                                                    SliceStats (&group_stats)[kThreads][V], SliceStats* partials) {
#pragma unroll
  for (int i = 0; i < V; ++i) group_stats[threadIdx.x][i] = stats.of(i);
  __syncthreads();
  for (int step = 1; step < tiling.row_groups; step *= 2) {
    if (group % (2 * step) == 0 && group + step < tiling.row_groups) {
      const int other = threadIdx.x + step * tiling.tile_units;
#pragma unroll
      for (int i = 0; i < V; ++i) group_stats[threadIdx.x][i] = combine(group_stats[threadIdx.x][i], group_stats[other][i]);
    }
    __syncthreads();
  }
  if (group == 0 && tile.active) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int64_t channel = int64_t{tile.unit} * V + i;
      partials[(tile.n * p.num_channels + channel) * chunks + tile.chunk] = group_stats[threadIdx.x][i];
    }
  }
  __syncthreads();  // group_stats is rewritten by the next tile
}

// The shift of each of a channels-last tile's V channels: the slice's first value.
template <typename T, int V>
__device__ __forceinline__ void tile_shifts(const T* column, SliceShift (&shift)[V]) {
  float first[V];
  unpack_unit<T, V>(load_unit<T, V>(column, 0), first);
#pragma unroll
  for (int i = 0; i < V; ++i) shift[i] = SliceShift::of(first[i]);
}

// Bytes of dynamic shared memory of the staged channels-last partials: kStagedRounds
// slots of kLoads 16-byte units per thread.
constexpr int kStagedBytes = kStagedRounds * kLoads * kThreads * 16;

// The next round this thread copies in the staged channels-last partials. A CTA's
// rounds, in order: round r < chunk_rounds of tile blockIdx.x + t * gridDim.x for t =
// 0, 1, ..., rounds past a chunk's end copying nothing, so every thread of the CTA
// counts the same rounds. The tile is decoded once per tile, not per round.
template <typename T, int V>
struct StagedCursor {
  const T* unit;    // this thread's unit in row `row` (null: nothing to copy in this tile)
  int64_t row;      // this thread's first row of the round
  int64_t row_end;  // the chunk's end
  int64_t tile_index;
  int round;

  __device__ void enter(const ForwardProblem& p, const ChannelsLastTiling& tiling, int64_t chunks, int group,
                        int64_t num_tiles, int64_t index) {
    tile_index = index;
    round = 0;
    unit = nullptr;
    row = row_end = 0;
    if (index >= num_tiles) return;
    const ChannelsLastTile tile = ChannelsLastTile::of(tiling, index, chunks);
    const int64_t row_begin = tile.chunk * tiling.chunk_rows;
    row_end = min(row_begin + tiling.chunk_rows, p.spatial);
    row = row_begin + group;
    if (tile.active) {
      unit = static_cast<const T*>(p.x) + tile.n * p.spatial * p.num_channels + row * p.num_channels +
             int64_t{tile.unit} * V;
    }
  }

  // cp.async-copies the round's units into this thread's slot `slot` (unit k at
  // slots + (slot * kLoads + k) * kThreads * 16 bytes), commits the group (empty
  // where the round has no rows of this thread's), and moves to the next round.
  __device__ void stage(const ForwardProblem& p, const ChannelsLastTiling& tiling, int64_t chunks, int group,
                        int64_t num_tiles, int chunk_rounds, unsigned slots, int slot) {
    if (unit != nullptr && row < row_end) {
      const int count = rows_in_round(row_end - row, tiling.row_groups);
      const int64_t stride = int64_t{tiling.row_groups} * p.num_channels;
      const unsigned slot_base = slots + static_cast<unsigned>(slot * kLoads * kThreads * 16);
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        if (k < count) cp_async_16<0>(slot_base + k * kThreads * 16, unit + k * stride);
      }
    }
    cp_async_commit();
    if (++round < chunk_rounds) {
      const int64_t round_rows = int64_t{kLoads} * tiling.row_groups;
      row += round_rows;
      if (unit != nullptr) unit += round_rows * p.num_channels;
    } else {
      enter(p, tiling, chunks, group, num_tiles, tile_index + gridDim.x);
    }
  }
};

// Kernel 1, channels_last: per ChannelsLastTiling, thread (unit u, row group g) of a
// CTA merges the statistics of rows g + k * row_groups of its chunk for each of its
// V channels; the row groups' statistics are then combined (store_tile_partials).
// STAGED (16-byte units only; launched with kStagedBytes of dynamic shared memory):
// each thread copies the round after the one it reduces into its own shared-memory
// slots (cp.async), across tile boundaries too, so its next loads stay in flight
// through a round's arithmetic and a tile's reduction without registers held for
// them; a thread reads back only its own slots, so no barrier guards them.
template <typename T, int V, bool STAGED>
__global__ void __launch_bounds__(kThreads, STAGED                    ? kStagedPartialsCtasPerSm
                                            : sizeof(T) == sizeof(float) ? kChannelsLastPartialsFp32CtasPerSm
                                                                         : kChannelsLastPartials16BitCtasPerSm)
    partial_stats_channels_last_kernel(const ForwardProblem p, int64_t chunks, int chunk_rounds, SliceStats* partials) {
  static_assert(!STAGED || V > 1, "the staged partials copy 16-byte units");
  __shared__ SliceStats group_stats[kThreads][V];
  extern __shared__ uint4 staged_rounds[];
  const T* x = static_cast<const T*>(p.x);
  const ChannelsLastTiling tiling = ChannelsLastTiling::of(p.num_channels, V, chunk_rounds);
  const int group = static_cast<int>(threadIdx.x) / tiling.tile_units;
  const int64_t num_tiles = p.batch * chunks * tiling.channel_tiles;
  const int64_t round_rows = int64_t{kLoads} * tiling.row_groups;
  const unsigned slots = static_cast<unsigned>(__cvta_generic_to_shared(staged_rounds)) + threadIdx.x * 16;
  StagedCursor<T, V> ahead;
  int slot = 0;
  SliceShift shift[V];
  int64_t shift_key = -1;  // n * row_units + unit of the shifts in `shift`
  if constexpr (STAGED) {
    ahead.enter(p, tiling, chunks, group, num_tiles, blockIdx.x);
    for (int s = 0; s + 1 < kStagedRounds; ++s) ahead.stage(p, tiling, chunks, group, num_tiles, chunk_rounds, slots, s);
  }
  for (int64_t tile_index = blockIdx.x; tile_index < num_tiles; tile_index += gridDim.x) {
    const ChannelsLastTile tile = ChannelsLastTile::of(tiling, tile_index, chunks);
    const int64_t row_begin = tile.chunk * tiling.chunk_rows;
    const int64_t row_end = min(row_begin + tiling.chunk_rows, p.spatial);
    const T* column = x + tile.n * p.spatial * p.num_channels + int64_t{tile.unit} * V;  // row 0, this unit
    SharedCountStats<V> stats = SharedCountStats<V>::empty();
    // A thread's next tile is usually of the same n and channels (more rows), whose
    // shifts it holds already: it loads them only when they change.
    const int64_t key = tile.n * tiling.row_units + tile.unit;
    if (tile.active && key != shift_key) {
      tile_shifts<T, V>(column, shift);
      shift_key = key;
    }
    if constexpr (STAGED) {
      for (int r = 0; r < chunk_rounds; ++r) {
        ahead.stage(p, tiling, chunks, group, num_tiles, chunk_rounds, slots, (slot + kStagedRounds - 1) % kStagedRounds);
        cp_async_wait_group<kStagedRounds - 1>();  // this thread's copies of round r have landed
        const int64_t round = row_begin + group + r * round_rows;
        if (tile.active && round < row_end) {
          const int count = rows_in_round(row_end - round, tiling.row_groups);
          const uint4* round_slots = staged_rounds + slot * kLoads * kThreads + threadIdx.x;
          stats.merge(round_stats<T, V, V>([&](int k) { return round_slots[k * kThreads]; }, count, shift));
        }
        slot = (slot + 1) % kStagedRounds;
      }
    } else if (tile.active) {
      for (int64_t round = row_begin + group; round < row_end; round += round_rows) {
        const int count = rows_in_round(row_end - round, tiling.row_groups);
        UnitBits<T, V> bits[kLoads];
        load_round<T, V>(column, round * p.num_channels, tiling.row_groups * p.num_channels, count, bits);
        stats.merge(round_stats<T, V, V>([&](int k) { return bits[k]; }, count, shift));
      }
    }
    store_tile_partials<V>(p, tiling, tile, group, chunks, stats, group_stats, partials);
  }
  if constexpr (STAGED) cp_async_wait_all();  // the empty groups past the last round
}

// Kernel 2: per slice {shift, mean of x - shift, rstd * weight[c], bias[c]} (scaled
// back from d by 1 / k and k, which is exact); the slice's statistics are its chunks'
// partials combined (and saved to the optional outputs), or running_mean[c] and
// running_var[c] in eval (shift 0). `lanes` lanes take a slice (lanes_for(chunks); 1
// in eval), or with CTA_PER_SLICE a whole CTA (from kCtaPerSliceMinChunks chunks on,
// kernels/tuning.h): lane l combines chunks l, l + lanes, ... in order, kCombineLoads
// loads in flight, then a butterfly (a block reduction across a CTA). Fixed orders:
// bit-identical run to run. A CTA per slice of a few chunks made the many-slice split
// problems pay a block reduction per slice (docs/perf-notes.md #130).
constexpr int kCombineLoads = 8;

// Chunks lane, lane + lanes, ... of one slice's partials, combined in that order.
__device__ __forceinline__ SliceStats combine_chunks(const SliceStats* slice_partials, int64_t chunks, int lane,
                                                     int lanes) {
  SliceStats total{0.f, 0.f, 0.f};
  for (int64_t base = lane; base < chunks; base += int64_t{lanes} * kCombineLoads) {
    SliceStats part[kCombineLoads];
#pragma unroll
    for (int u = 0; u < kCombineLoads; ++u) {
      const int64_t chunk = base + int64_t{u} * lanes;
      part[u] = chunk < chunks ? slice_partials[chunk] : SliceStats{0.f, 0.f, 0.f};
    }
#pragma unroll
    for (int u = 0; u < kCombineLoads; ++u) total = combine(total, part[u]);
  }
  return total;
}

// The float4 of one slice from its combined statistics `total` of d (or, in eval,
// the running statistics), and its mean and rstd to the optional outputs.
template <typename T>
__device__ __forceinline__ void store_slice_stats(const ForwardProblem& p, int64_t slice, const SliceStats& total,
                                                  float4* slice_stats) {
  const int64_t n = slice / p.num_channels;
  const int64_t channel = slice - n * p.num_channels;
  float shift = 0.f, mean, rstd;
  if (p.running_mean != nullptr) {
    mean = __ldg(p.running_mean + channel);
    rstd = rsqrtf(__ldg(p.running_var + channel) + p.eps);
  } else {
    const SliceShift slice_shift_scale = SliceShift::of(slice_shift<T>(p, n, channel));
    shift = slice_shift_scale.value();
    mean = slice_shift_scale.relative_mean(total.mean);
    rstd = slice_shift_scale.rstd(slice_shift_scale.rstd_of_d(total.m2, static_cast<float>(p.spatial), p.eps));
    save_slice_stats(p, slice, slice_shift_scale.mean(total.mean), rstd);
  }
  const float2 affine = channel_affine<T>(p, channel);
  slice_stats[slice] = make_float4(shift, mean, rstd * affine.x, affine.y);
}

template <typename T, bool CTA_PER_SLICE>
__global__ void __launch_bounds__(kThreads)
    slice_stats_kernel(const ForwardProblem p, int64_t chunks, int lanes, const SliceStats* partials,
                       float4* slice_stats) {
  const int64_t num_slices = p.num_slices();
  if constexpr (CTA_PER_SLICE) {
    __shared__ typename BlockStatsReduce<kThreads>::TempStorage storage;
    for (int64_t slice = blockIdx.x; slice < num_slices; slice += gridDim.x) {
      const SliceStats total = BlockStatsReduce<kThreads>::allreduce(
          combine_chunks(partials + slice * chunks, chunks, threadIdx.x, kThreads), storage);
      if (threadIdx.x == 0) store_slice_stats<T>(p, slice, total, slice_stats);
    }
  } else {
    const bool eval = p.running_mean != nullptr;
    for_each_group_item<kThreads>(num_slices, lanes, [&](int64_t slice, bool in_range, int lane) {
      SliceStats total{0.f, 0.f, 0.f};
      if (in_range && !eval) total = combine_chunks(partials + slice * chunks, chunks, lane, lanes);
      total = group_allreduce(total, lanes, CombineStats());
      if (in_range && lane == 0) store_slice_stats<T>(p, slice, total, slice_stats);
    });
  }
}

// y of V values from their x and the float4s of their slices, the epilogue applied,
// stored at `offset`.
template <typename T, int V>
__device__ __forceinline__ void normalize_store(const ForwardProblem& p, int64_t offset, float (&v)[V],
                                                const float4 (&s)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = ((v[i] - s[i].x) - s[i].y) * s[i].z + s[i].w;
  T* y = static_cast<T*>(p.y);
  apply_epilogue(p.epilogue, p.y, y + offset, v);
  store_unit<T, V>(y, offset, v);
}

// Kernel 3 walks its tiles from the tensor's end: CTAs start in blockIdx order, and
// kernel 1's last CTAs read the tensor's end, which L2 (50 MB on an H200) may still
// hold, so the sweep's first reads come from L2 instead of HBM.
__device__ __forceinline__ int64_t last_first(int64_t step, int64_t num_tiles) { return num_tiles - 1 - step; }

// Kernel 3, contiguous: y = ((x - shift) - mean) * scale + bias with the float4 of
// the element's slice, over the flat tensor in units of V values (one vector, or one
// value where x, y or the slice is not vector-aligned); a unit's values share a
// slice. Units are split into (slice, column) with FastDivider, from a per-tile base
// that thread 0 splits in 64 bits.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    normalize_contiguous_kernel(const ForwardProblem p, const float4* slice_stats, FastDivider columns) {
  __shared__ int64_t tile_row, tile_column;
  const T* x = static_cast<const T*>(p.x);
  const int64_t num_units = p.num_slices() * p.spatial / V;
  const int64_t num_tiles = (num_units + kSweepTile - 1) / kSweepTile;
  for (int64_t step = blockIdx.x; step < num_tiles; step += gridDim.x) {
    const int64_t tile = last_first(step, num_tiles);
    __syncthreads();  // the previous tile's readers are done with the shared base
    if (threadIdx.x == 0) {
      const int64_t base = tile * kSweepTile;
      tile_row = base / columns.divisor;
      tile_column = base - tile_row * columns.divisor;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kSweepUnroll; ++k) {
      const int e = threadIdx.x + k * kThreads;
      const int64_t unit = tile * kSweepTile + e;
      if (unit >= num_units) break;
      const unsigned q = columns.div(static_cast<unsigned>(tile_column + e));
      float v[V];
      unpack_unit<T, V>(load_unit<T, V>(x, unit * V), v);
      const float4 slice = slice_stats[tile_row + q];
      float4 s[V];
#pragma unroll
      for (int i = 0; i < V; ++i) s[i] = slice;
      normalize_store<T, V>(p, unit * V, v, s);
    }
  }
}

// Kernel 3, channels_last: per ChannelsLastTiling (chunks of sweep_chunks), each
// thread holds the float4s of its unit's V channels in registers and sweeps its rows,
// kLoads loads in flight.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    normalize_channels_last_kernel(const ForwardProblem p, const float4* slice_stats, int64_t chunks,
                                   int chunk_rounds) {
  const T* x = static_cast<const T*>(p.x);
  const ChannelsLastTiling tiling = ChannelsLastTiling::of(p.num_channels, V, chunk_rounds);
  const int group = static_cast<int>(threadIdx.x) / tiling.tile_units;
  const int64_t num_tiles = p.batch * chunks * tiling.channel_tiles;
  const int64_t round_rows = int64_t{kLoads} * tiling.row_groups;
  const int64_t row_stride = tiling.row_groups * p.num_channels;
  for (int64_t step = blockIdx.x; step < num_tiles; step += gridDim.x) {
    const ChannelsLastTile tile = ChannelsLastTile::of(tiling, last_first(step, num_tiles), chunks);
    if (!tile.active) continue;
    float4 s[V];
#pragma unroll
    for (int i = 0; i < V; ++i) s[i] = slice_stats[tile.n * p.num_channels + int64_t{tile.unit} * V + i];
    const int64_t row_begin = tile.chunk * tiling.chunk_rows;
    const int64_t row_end = min(row_begin + tiling.chunk_rows, p.spatial);
    const int64_t column = tile.n * p.spatial * p.num_channels + int64_t{tile.unit} * V;  // row 0, this unit
    for (int64_t round = row_begin + group; round < row_end; round += round_rows) {
      const int count = rows_in_round(row_end - round, tiling.row_groups);
      const int64_t first = column + round * p.num_channels;
      UnitBits<T, V> bits[kLoads];
      load_round<T, V>(x, first, row_stride, count, bits);
#pragma unroll
      for (int k = 0; k < kLoads; ++k) {
        if (k < count) {
          float v[V];
          unpack_unit<T, V>(bits[k], v);
          normalize_store<T, V>(p, first + k * row_stride, v, s);
        }
      }
    }
  }
}

// Whether the staged channels-last partials run this problem: 16-bit values in
// 16-byte units, and two CTAs with their slots fit an SM of the current device
// (else the unstaged kernel, which needs no dynamic shared memory).
bool stages_partials(const ForwardProblem& p, int stats_unit) {
  if (p.layout != Layout::kChannelsLast || stats_unit == 1 || element_bytes(p.dtype) != 2) return false;
  const void* kernel = p.dtype == DType::kBFloat16
                           ? reinterpret_cast<const void*>(partial_stats_channels_last_kernel<__nv_bfloat16, 8, true>)
                           : reinterpret_cast<const void*>(partial_stats_channels_last_kernel<__half, 8, true>);
  return ctas_per_sm(kernel, kThreads, kStagedBytes) >= kStagedPartialsCtasPerSm;
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
  const bool contiguous = p.layout == Layout::kContiguous;
  split.stats_unit = unit_values(p, p.x);
  split.staged_partials = p.running_mean == nullptr && stages_partials(p, split.stats_unit);
  split.sweep_unit = unit_values(p, p.x, p.y);
  split.chunk_rounds = split_chunk_rounds(p, split.stats_unit);
  split.chunks = chunks_per_slice(p, split.stats_unit, split.chunk_rounds);
  const int64_t partials = p.running_mean != nullptr ? 0 : p.num_slices() * split.chunks;
  split.partials_bytes = static_cast<size_t>(round_up(partials * static_cast<int64_t>(sizeof(SliceStats)), 16));
  plan.workspace_bytes = split.partials_bytes + static_cast<size_t>(p.num_slices()) * sizeof(float4);
  if (p.running_mean == nullptr && split.chunks >= kCtaPerSliceMinChunks) {
    split.combine_lanes = kThreads;
    split.combine_grid = grid_for(p.num_slices(), 1);
  } else {
    split.combine_lanes = p.running_mean != nullptr ? 1 : lanes_for(split.chunks);
    split.combine_grid = grid_for(p.num_slices(), kThreads / split.combine_lanes);
  }
  if (contiguous) {
    split.stats_grid = grid_for(partials, 1);
    split.sweep_grid = grid_for(p.num_slices() * p.spatial / split.sweep_unit, kSweepTile);
  } else {
    const ChannelsLastTiling stats = ChannelsLastTiling::of(p.num_channels, split.stats_unit, split.chunk_rounds);
    const ChannelsLastTiling sweep = ChannelsLastTiling::of(p.num_channels, split.sweep_unit, split.chunk_rounds);
    split.stats_grid = grid_for(p.batch * split.chunks * stats.channel_tiles, 1);
    // Staged: as many CTAs as run at once, each streaming its tiles back to back.
    if (split.staged_partials) {
      split.stats_grid = std::min<unsigned>(split.stats_grid, current_sm_count() * kStagedPartialsCtasPerSm);
    }
    split.sweep_chunks = sweep.chunks(p.spatial);
    split.sweep_grid = grid_for(p.batch * split.sweep_chunks * sweep.channel_tiles, 1);
  }
  return plan;
}

namespace split_detail {

// Kernel 1 for T and the plan's unit.
template <typename T>
void launch_partial_stats(const ForwardProblem& p, const SplitPlan& plan, SliceStats* partials, cudaStream_t stream) {
  constexpr int kVector = Storage<T>::kPerVector;
  const bool vector = plan.stats_unit == kVector;
  if (p.layout == Layout::kContiguous) {
    auto kernel = vector ? partial_stats_contiguous_kernel<T, kVector> : partial_stats_contiguous_kernel<T, 1>;
    kernel<<<plan.stats_grid, kThreads, 0, stream>>>(p, plan.chunks, plan.chunk_rounds, partials);
  } else {
    auto kernel = vector ? partial_stats_channels_last_kernel<T, kVector, false>
                         : partial_stats_channels_last_kernel<T, 1, false>;
    if constexpr (sizeof(T) == 2) {
      if (plan.staged_partials) {
        partial_stats_channels_last_kernel<T, kVector, true>
            <<<plan.stats_grid, kThreads, kStagedBytes, stream>>>(p, plan.chunks, plan.chunk_rounds, partials);
        return;
      }
    }
    kernel<<<plan.stats_grid, kThreads, 0, stream>>>(p, plan.chunks, plan.chunk_rounds, partials);
  }
}

// Kernel 3 for T and the plan's unit.
template <typename T>
void launch_normalize(const ForwardProblem& p, const SplitPlan& plan, const float4* slice_stats,
                      cudaStream_t stream) {
  constexpr int kVector = Storage<T>::kPerVector;
  const bool vector = plan.sweep_unit == kVector;
  if (p.layout == Layout::kContiguous) {
    const FastDivider columns(static_cast<unsigned>(p.spatial / plan.sweep_unit));
    auto kernel = vector ? normalize_contiguous_kernel<T, kVector> : normalize_contiguous_kernel<T, 1>;
    kernel<<<plan.sweep_grid, kThreads, 0, stream>>>(p, slice_stats, columns);
  } else {
    auto kernel = vector ? normalize_channels_last_kernel<T, kVector> : normalize_channels_last_kernel<T, 1>;
    kernel<<<plan.sweep_grid, kThreads, 0, stream>>>(p, slice_stats, plan.sweep_chunks, plan.chunk_rounds);
  }
}

}  // namespace split_detail

cudaError_t launch_split(const ForwardProblem& p, const SplitPlan& plan, cudaStream_t stream) {
  using namespace split_detail;
  if (p.workspace == nullptr || !aligned16(p.workspace)) return cudaErrorInvalidValue;
  auto* partials = static_cast<SliceStats*>(p.workspace);
  auto* slice_stats = reinterpret_cast<float4*>(static_cast<char*>(p.workspace) + plan.partials_bytes);
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.running_mean == nullptr) {
      launch_partial_stats<T>(p, plan, partials, stream);
      const cudaError_t error = cudaGetLastError();
      if (error != cudaSuccess) return error;
    }
    auto combine = plan.combine_lanes == kThreads ? slice_stats_kernel<T, true> : slice_stats_kernel<T, false>;
    combine<<<plan.combine_grid, kThreads, 0, stream>>>(p, plan.chunks, plan.combine_lanes, partials, slice_stats);
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
    launch_normalize<T>(p, plan, slice_stats, stream);
    return cudaGetLastError();
  });
}

}  // namespace instance_norm
