// InstanceNorm forward, pipelined path: cooperative teams of CTAs that take their
// slices one after another and use a slice's statistics three rounds after taking
// them, so the team exchange never stalls the reads and writes (docs/perf-notes.md
// #73-#75).
#include "common.cuh"
#include "instance_norm.h"
#include "pipelined.h"

#include <algorithm>

namespace instance_norm {
// load_inline compiles all .cu sources as one translation unit: each file keeps
// its internals in its own namespace.
namespace pipelined_detail {

constexpr int kDataThreads = 512;
constexpr int kVectors = 8;  // 16-byte vectors of a slice per data thread
// A thread's part of round j's slice stays in shared memory until round j + kLag.
constexpr int kLag = 3;
// Rounds whose CTA totals are in the workspace at once (see the kernel's comment).
constexpr int kTotalRounds = 8;
static_assert(kTotalRounds >= 2 * kLag, "a CTA publishes round j + 2 * kLag only after every CTA collected round j");
constexpr int kSlotBytes = kDataThreads * kVectors * 16;

// Bytes of the workspace before the totals: kTotalRounds arrival counters per team,
// rounded up to 16 bytes.
__host__ __device__ inline size_t counter_bytes(int64_t teams) { return team_counter_bytes(teams * kTotalRounds); }

constexpr int kDataWarps = kDataThreads / kWarpSize;
constexpr int kSlotVecs = kDataThreads * kVectors;
static_assert(kDataWarps <= kWarpSize, "the publisher's lanes take one warp total each");

// A CTA's place in its team and the team's exchange in global memory: arrival counters
// and CTA totals, each rotating over kTotalRounds rounds.
struct PipelinedTeam {
  int size;
  int rank;
  int64_t index;   // the team
  int64_t count;   // teams in the grid
  int64_t rounds;  // slices this team takes
  unsigned* arrivals;
  SliceStats* totals;
};

// The CTA's handovers in shared memory (see forward_pipelined_kernel): warp totals and
// slice totals rotating over kLag buffers, with mbarriers, one phase per round that
// uses the buffer: warp totals written (lane 0 of each data warp arrives) and read
// (every lane of the publisher); slice totals written (the collector's lane 0) and
// read (lane 0 of each data warp).
struct Handovers {
  SliceStats (&warp_totals)[kLag][kDataWarps];
  SliceStats (&slice_totals)[kLag];
  uint64_t (&warps_done)[kLag];
  uint64_t (&warp_totals_free)[kLag];
  uint64_t (&totals_ready)[kLag];
  uint64_t (&slice_totals_free)[kLag];
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Waits for the phase of `barrier` that round j completes.
__device__ __forceinline__ void wait_round(uint64_t* barrier, int64_t j) {
  wait_mbarrier_phase(barrier, static_cast<unsigned>((j / kLag) & 1));
}

// The publisher warp: each round, the data warps' totals combined in warp order, and
// the CTA total published to the team (release on the round's arrival counter).
__device__ __forceinline__ void publish_rounds(const PipelinedTeam& team, const Handovers& h, int lane) {
  for (int64_t j = 0; j < team.rounds; ++j) {
    const int b = static_cast<int>(j % kLag);
    wait_round(&h.warps_done[b], j);
    const SliceStats total = combine_team_totals<CombineStats, kWarpSize, SliceStats>(
        kDataWarps, [&](int w) { return h.warp_totals[b][w]; });
    cuda::ptx::mbarrier_arrive(&h.warp_totals_free[b]);  // this lane's read of round j's warp totals is done
    if (lane == 0) {
      publish_team_total(team.totals + (j % kTotalRounds) * team.size, team.rank, total,
                         &team.arrivals[j % kTotalRounds]);
    }
    __syncwarp();
  }
}

// The collector warp: each round, waits for every CTA of the team to have published
// (acquire), combines their totals in rank order and hands the slice's totals to the
// data warps.
__device__ __forceinline__ void collect_rounds(const PipelinedTeam& team, const Handovers& h, int lane) {
  for (int64_t j = 0; j < team.rounds; ++j) {
    if (lane == 0) {
      wait_team_arrivals(&team.arrivals[j % kTotalRounds],
                         static_cast<unsigned>(team.size) * static_cast<unsigned>(j / kTotalRounds + 1));
    }
    __syncwarp();
    const SliceStats result =
        combine_published_totals<CombineStats>(team.totals + (j % kTotalRounds) * team.size, team.size);
    if (lane == 0) {
      const int b = static_cast<int>(j % kLag);
      if (j >= kLag) wait_round(&h.slice_totals_free[b], j - kLag);  // round j - 3's totals read
      h.slice_totals[b] = result;
      cuda::ptx::mbarrier_arrive(&h.totals_ready[b]);  // release: read after the data warps' wait
    }
    __syncwarp();
  }
}

// A data warp's {scale, offset} for slice `slice` (round `round`'s, whose shift is
// `shift`): its totals from the collector (lane 0 waits and broadcasts them), rstd,
// the affine map folded in; the slice's mean and rstd saved by the team's first thread.
template <typename T>
__device__ __forceinline__ float2 output_map(const ForwardProblem& p, const PipelinedTeam& team, const Handovers& h,
                                             int64_t round, int64_t slice, const SliceShift& shift, int lane) {
  SliceStats stats{0.f, 0.f, 0.f};
  if (lane == 0) {
    const int b = static_cast<int>(round % kLag);
    wait_round(&h.totals_ready[b], round);
    stats = h.slice_totals[b];
    cuda::ptx::mbarrier_arrive(&h.slice_totals_free[b]);
  }
  stats = SliceStats{__shfl_sync(0xffffffffu, stats.count, 0), __shfl_sync(0xffffffffu, stats.mean, 0),
                     __shfl_sync(0xffffffffu, stats.m2, 0)};
  const float rstd = shift.rstd_of_d(stats.m2, static_cast<float>(static_cast<int>(p.spatial)), p.eps);
  const float2 affine = slice_affine<T>(p, slice);
  const float scale = rstd * affine.x;
  const float offset = affine.y - stats.mean * scale;
  if (threadIdx.x == 0 && team.rank == 0) save_slice_stats(p, slice, shift.mean(stats.mean), shift.rstd(rstd));
  return make_float2(scale, offset);
}

// A data warp's statistics of round j's slice, from the thread's `valid` vectors in
// its slot and their `sum` (of d): the column's M2 about its mean, the warp's total
// (Chan et al.'s merge, xor butterfly), handed to the publisher.
template <typename T>
__device__ __forceinline__ void hand_over_warp_total(const Handovers& h, int64_t j, const uint4* slot, int valid,
                                                     float sum, const SliceShift& shift, int warp, int lane) {
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  constexpr bool kHoldsD = sizeof(T) == sizeof(float);
  SliceStats stats{static_cast<float>(kPer * valid), 0.f, 0.f};
  if (valid > 0) {
    stats.mean = sum / stats.count;
    const LinearMap centered = kHoldsD ? LinearMap{1.f, -stats.mean} : shift.centered(stats.mean);
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      if (i < valid) {
        float v[kPer];
        S::unpack(slot[i * kDataThreads], v);
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          const float deviation = centered.apply(v[k]);
          stats.m2 += deviation * deviation;
        }
      }
    }
  }
  const SliceStats warp_total = warp_allreduce(stats, CombineStats());
  if (lane == 0) {
    const int b = static_cast<int>(j % kLag);
    if (j >= kLag) wait_round(&h.warp_totals_free[b], j - kLag);  // round j - 3's warp totals read
    h.warp_totals[b][warp] = warp_total;
    cuda::ptx::mbarrier_arrive(&h.warps_done[b]);  // release: the publisher reads warp_totals after it
  }
}

// The data warps' rounds (see forward_pipelined_kernel): round j writes y of slice
// j - kLag from the slot, moves slice j from registers into the slot while summing
// it, loads slice j + 1 into registers, then hands over slice j's statistics.
template <typename T, bool EPILOGUE>
__device__ __forceinline__ void data_rounds(const ForwardProblem& p, const PipelinedTeam& team, const Handovers& h,
                                            uint4* slots, int warp, int lane) {
  using S = Storage<T>;
  constexpr int kPer = S::kPerVector;
  // float32 slots hold d = (x - shift) * k, as the resident kernel's registers do, so M2
  // is taken about the mean exactly; 16-bit slots hold x, M2's centering folded into
  // one FMA (its rounding far below 16-bit resolution: forward_resident_kernel).
  constexpr bool kHoldsD = sizeof(T) == sizeof(float);
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int spatial = static_cast<int>(p.spatial);
  const int num_vecs = spatial / kPer;
  const int first = team.rank * kSlotVecs + threadIdx.x;
  const int valid = valid_count<kDataThreads>(num_vecs, first, kVectors);
  const int64_t rounds = team.rounds;
  // The thread's column of round j's slice in x (j < rounds), and that slice's first value.
  const auto source = [&](int64_t j) {
    return reinterpret_cast<const uint4*>(x + (team.index + j * team.count) * spatial) + first;
  };
  const auto first_value = [&](int64_t j) {
    return j < rounds ? S::to_float(x[(team.index + j * team.count) * spatial]) : 0.f;
  };

  uint4 ahead[kVectors];  // at the start of round j: slice j's column (loads issued in round j - 1)
  if (rounds > 0) {
    const uint4* from = source(0);
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      if (i < valid) ahead[i] = __ldg(from + i * kDataThreads);
    }
  }
  // Shifts of slices j - 3 (output), j - 2, j - 1 and j (statistics) in round j.
  SliceShift shifts[kLag + 1] = {SliceShift::of(0.f), SliceShift::of(0.f), SliceShift::of(0.f),
                                 SliceShift::of(first_value(0))};
  for (int64_t j = 0; j < rounds + kLag; ++j) {
    const float first_next = first_value(j + 1);
    const bool output = j >= kLag;
    const bool statistics = j < rounds;
    const bool load = j + 1 < rounds;
    const SliceShift shift_output = shifts[0];
    const SliceShift shift = shifts[kLag];
    float2 map = make_float2(0.f, 0.f);
    if (output) map = output_map<T>(p, team, h, j - kLag, team.index + (j - kLag) * team.count, shift_output, lane);
    const uint4* next = source(load ? j + 1 : 0);
    uint4* out = reinterpret_cast<uint4*>(y + (output ? team.index + (j - kLag) * team.count : team.index) * spatial) +
                 first;
    uint4* const slot = slots + static_cast<int>(j % kLag) * kSlotVecs + threadIdx.x;  // j - 3's, then j's
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kVectors; ++i) {
      if (i < valid) {
        if (output) {
          float v[kPer];
          S::unpack(slot[i * kDataThreads], v);
#pragma unroll
          for (int k = 0; k < kPer; ++k) v[k] = __fmaf_rn(kHoldsD ? v[k] : shift_output.apply(v[k]), map.x, map.y);
          if constexpr (EPILOGUE) apply_epilogue(p.epilogue, p.y, reinterpret_cast<const T*>(out + i * kDataThreads), v);
          store_streaming(out + i * kDataThreads, S::pack(v));
        }
        if (statistics) {
          float v[kPer];
          S::unpack(ahead[i], v);
#pragma unroll
          for (int k = 0; k < kPer; ++k) sum += v[k] = shift.apply(v[k]);
          slot[i * kDataThreads] = kHoldsD ? S::pack(v) : ahead[i];
        }
        if (load) ahead[i] = __ldg(next + i * kDataThreads);
      }
    }
    if (statistics) hand_over_warp_total<T>(h, j, slot, valid, sum, shift, warp, lane);
#pragma unroll
    for (int k = 0; k < kLag; ++k) shifts[k] = shifts[k + 1];
    shifts[kLag] = SliceShift::of(first_next);
  }
}
#endif

// y = (x - mean) * rstd * weight + bias per slice (n, c) of x, (num_slices, spatial)
// contiguous float32, float16 or bfloat16 (T), statistics in float32 as every path.
// A cooperative launch of teams of `size` consecutive CTAs; team t takes slices t,
// t + teams, ... in rounds j = 0, 1, ...; CTA `rank` of the team holds values
// [rank * kDataThreads * kVectors * kPer, ...) of each, thread i of it the 16-byte
// vectors i + kDataThreads * v (v < kVectors, a column).
// Each CTA has 16 data warps and two more:
//   data threads, round j: one loop over the thread's column that, vector by vector,
//     writes y of slice j - kLag from its shared-memory slot, moves slice j (loaded
//     into registers in round j - 1; float32 as d, see kHoldsD) into that slot while
//     summing it, and loads slice j + 1 into the registers; then the column's M2
//     about its mean (from the slot), the warp's total (Chan et al.'s merge, xor
//     butterfly), handed to the publisher through an mbarrier. Reads and writes are
//     issued all through the round, and each vector's load has a whole round to
//     arrive.
//   the publisher: combines round j's warp totals in warp order and publishes the CTA
//     total (global memory, arrival counter with release).
//   the collector: waits for every CTA of the team to have published round j
//     (acquire), combines the totals in rank order and hands them to the data warps
//     through an mbarrier (lane 0 of each data warp reads them and broadcasts them by
//     shuffles). The data warps need them at the start of round j + kLag, two rounds
//     after the last CTA publishes: the exchange's latency and the team's spread are
//     hidden (one warp doing both jobs chained every publish to the previous
//     collect, so the team ran at the exchange's latency: docs/perf-notes.md #74).
// So results are bit-identical run to run, and every CTA of a team applies the same
// mean and rstd. Shared memory: kLag slots of kSlotBytes; slot j % kLag holds slice
// j - kLag, then slice j, each vector read before it is rewritten by the same thread,
// so no barrier guards the slots.
// Handovers in shared memory: warp totals and slice totals rotate over kLag buffers,
// each with a pair of mbarriers (written, read): a writer of round j waits until
// round j - kLag's reader is done, a reader until round j is written. Those waits do
// not block in practice (round j - kLag's totals were read long before); they keep
// each buffer's reuse ordered within the CTA.
// Team counters and totals in global memory rotate over kTotalRounds: a CTA
// publishes round j + 8 after its data warps read round j + 5's totals, so every CTA
// had published round j + 5, after its data warps read round j + 2's, after its
// collector was done with round j.
// sm_90+ (mbarrier parity waits); the body is empty before. EPILOGUE: compiled with
// the epilogue (launched for problems with one), so the plain kernel keeps the code
// it had without it (docs/perf-notes.md #111).
template <typename T, bool EPILOGUE>
__global__ void __launch_bounds__(kDataThreads + 2 * kWarpSize, 1) forward_pipelined_kernel(const ForwardProblem p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ SliceStats warp_totals[kLag][kDataWarps];
  __shared__ SliceStats slice_totals[kLag];
  __shared__ uint64_t warps_done[kLag];
  __shared__ uint64_t warp_totals_free[kLag];
  __shared__ uint64_t totals_ready[kLag];
  __shared__ uint64_t slice_totals_free[kLag];
  extern __shared__ uint4 slots[];  // [kLag][kVectors][kDataThreads]
  const Handovers h{warp_totals, slice_totals, warps_done, warp_totals_free, totals_ready, slice_totals_free};

  PipelinedTeam team;
  team.size = team_size_for(p.spatial, kSlotVecs * Storage<T>::kPerVector);
  team.rank = static_cast<int>(blockIdx.x % team.size);
  team.index = blockIdx.x / team.size;
  team.count = gridDim.x / team.size;
  team.arrivals = static_cast<unsigned*>(p.workspace) + team.index * kTotalRounds;
  team.totals = reinterpret_cast<SliceStats*>(static_cast<char*>(p.workspace) + counter_bytes(team.count)) +
                team.index * kTotalRounds * team.size;
  const int64_t num_slices = p.num_slices();
  team.rounds = team.index < num_slices ? (num_slices - team.index + team.count - 1) / team.count : 0;
  const int warp = static_cast<int>(threadIdx.x / kWarpSize);
  const int lane = static_cast<int>(threadIdx.x % kWarpSize);
  if (threadIdx.x == 0) {
    for (int b = 0; b < kLag; ++b) {
      cuda::ptx::mbarrier_init(&warps_done[b], kDataWarps);
      cuda::ptx::mbarrier_init(&warp_totals_free[b], kWarpSize);
      cuda::ptx::mbarrier_init(&totals_ready[b], 1);
      cuda::ptx::mbarrier_init(&slice_totals_free[b], kDataWarps);
    }
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  __syncthreads();  // the only CTA barrier

  if (warp == kDataWarps) {
    publish_rounds(team, h, lane);
    return;
  }
  if (warp == kDataWarps + 1) {
    collect_rounds(team, h, lane);
    return;
  }
  data_rounds<T, EPILOGUE>(p, team, h, slots, warp, lane);
#endif
}

// The kernel of a dtype, with or without the epilogue.
void (*kernel_for(DType dtype, bool epilogue))(const ForwardProblem) {
  switch (dtype) {
    case DType::kFloat16: return epilogue ? forward_pipelined_kernel<__half, true> : forward_pipelined_kernel<__half, false>;
    case DType::kBFloat16:
      return epilogue ? forward_pipelined_kernel<__nv_bfloat16, true> : forward_pipelined_kernel<__nv_bfloat16, false>;
    default: return epilogue ? forward_pipelined_kernel<float, true> : forward_pipelined_kernel<float, false>;
  }
}

constexpr int kThreads = kDataThreads + 2 * kWarpSize;
constexpr int kSharedBytes = kLag * kSlotBytes;

int resident_ctas(const ForwardProblem& p) {
  return max_resident_ctas(reinterpret_cast<const void*>(kernel_for(p.dtype, p.epilogue.active())), kThreads,
                           kSharedBytes, true);
}

}  // namespace pipelined_detail

int64_t pipelined_cta_capacity(DType dtype) {
  using namespace pipelined_detail;
  return int64_t{kDataThreads} * kVectors * values_per_vector(dtype);
}

ForwardPlan pipelined_plan(const ForwardProblem& p) {
  using namespace pipelined_detail;
  ForwardPlan plan{};
  const int size = team_size_for(p.spatial, static_cast<int>(pipelined_cta_capacity(p.dtype)));
  const int resident = resident_ctas(p);
  if (p.layout != Layout::kContiguous || !vector_aligned(p) || size <= 0 || size > resident || p.num_slices() <= 0) {
    return plan;
  }
  plan.path = ForwardPath::kPipelined;
  plan.team_size = size;
  plan.teams = std::min<int64_t>(p.num_slices(), resident / size);
  plan.rounds = ceil_div(p.num_slices(), plan.teams);
  const size_t counters = counter_bytes(plan.teams);
  plan.workspace_bytes = counters + static_cast<size_t>(plan.teams * kTotalRounds * size) * sizeof(SliceStats);
  plan.launch = {LaunchKind::kCooperative, kernel_for(p.dtype, p.epilogue.active()),
                 static_cast<unsigned>(plan.teams * size), kThreads, kSharedBytes, 0, counters};
  return plan;
}

}  // namespace instance_norm
