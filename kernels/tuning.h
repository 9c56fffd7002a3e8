// The path choosers' thresholds and the launch shapes they choose between, in one
// place: each with why it has its value and where the measurements are
// (docs/perf-notes.md, by version number). Each sits in the namespace of the file
// that uses it.
#pragma once

#include <cstdint>

namespace instance_norm {

// instance_norm_forward.cu: the block path's CTA size, and where the chooser takes
// the block and pipelined paths.
namespace forward_detail {

// Block CTAs of 128, 256 or 512 threads, the largest that gives each thread at least
// this many 16-byte vectors of its slice or tile (docs/perf-notes.md #54; 8 lost: #76).
constexpr int kBlockVectorsPerThread = 4;
// 128-thread block CTAs where this many fit an SM: more slices' loads in flight; they
// won on every slice size where six fit and lost at five or fewer (docs/perf-notes.md
// #83-#85).
constexpr int kBlockSmallCtasPerSm = 6;
// ... and only with at least this many slices per SM: with fewer, 128- and 512-thread
// CTAs split by shape (docs/perf-notes.md #83-#85).
constexpr int kBlockSmallMinSlicesPerSm = 4;
// The largest channels-last tile the chooser gives the block path, unless one tile
// holds every channel of its image (block_preferred); larger ones run when forced,
// and those inputs take the cluster path where a cluster holds an image, else the
// split path. Why: one CTA per SM cannot overlap a tile's load, reductions and
// store, and above 128 KB the split path was as fast or faster (docs/perf-notes.md
// #59); the cluster path beat both above it (#145, #147).
constexpr int64_t kChannelsLastChosenMaxBytes = 128 << 10;
// The channels-last cluster path's cluster sizes, the first that holds the image:
// 8 (two clusters to a GPC of 16 or more SMs) or 16. Measured on an H200 (x copy,
// docs/perf-notes.md #146): clusters of 8 led those of 6 and 16 on (128, 64, 100,
// 100) bf16 (1.48 against 1.60 and 1.58) and those of 16 on (8, 256, 56, 56) bf16
// (1.72 against 2.56); where 8 do not hold the image, 16 led 12-14 on (128, 64, 100,
// 100) fp32 (1.55 against 1.60-1.67) and about 10 on (32, 64, 128, 128) bf16 (1.94
// against 2.16).
constexpr int kChannelsLastClusterSizes[] = {8, 16};
// The pipelined path (fp32) is chosen only where its busiest team takes this many
// slices: its first three rounds only read and its last three only write; it led the
// cooperative path from 3 rounds on and lost at 2 (docs/perf-notes.md #75, #80, #81).
constexpr int64_t kPipelinedMinRounds = 3;
// fp32 slices that only one cooperative team holds take the split path from this
// many slices on (2048 x 2048 slices: at 16 and 64 slices the split path led, at 8 the
// team; docs/perf-notes.md #114, #120). Between 8 and 16 not measured.
constexpr int64_t kSplitOverOneTeamMinRounds = 16;

}  // namespace forward_detail

// instance_norm_split.cu: how the split path cuts a problem into chunks.
namespace split_detail {

// Chunks get fewer rounds of loads (4, 2, 1) while the partial statistics would
// otherwise run fewer than this many CTAs per SM: at 4 rounds a (1, 64, 100, 100)
// bf16 channels-last tensor ran its partials in 10 CTAs, slower than eager
// (docs/perf-notes.md #119). Eight 256-thread CTAs fill an SM's 64 warps. An
// estimate, not measured one by one.
constexpr int kMinCtasPerSm = 8;
// The fp32 channels-last partial statistics run three CTAs per SM (launch bounds:
// 80 registers, against 98 for two): more loads in flight; in 16-bit three spilled
// and lost (docs/perf-notes.md #122).
constexpr int kChannelsLastPartialsFp32CtasPerSm = 3;
// The 16-bit ones run two (launch bounds: 128 registers): their single-sweep round
// statistics take 128 with 12 bytes of spills, against 145 and one CTA per SM
// unbounded (docs/perf-notes.md #166).
constexpr int kChannelsLastPartials16BitCtasPerSm = 2;
// The 16-bit channels-last partials copy each round into shared memory (cp.async)
// while they reduce the one before: kStagedRounds slots of a round's loads per
// thread (64 KB per CTA at 2). Unstaged they issued a round, waited on it, then
// reduced it, at a third of DRAM's bandwidth (docs/perf-notes.md #130).
constexpr int kStagedRounds = 2;
// CTAs per SM the staged partials run (launch bounds: 128 registers), and the
// least the device must hold for them to be chosen.
constexpr int kStagedPartialsCtasPerSm = 2;
// A slice's partials are combined by a whole CTA from this many chunks on (by
// lanes_for(chunks) lanes below): 256 = a warp's 32 lanes with 8 loads in flight each,
// so a slice under it takes one round of loads. A CTA per slice of 20 chunks cost
// 8,192-slice problems 34 us (docs/perf-notes.md #130); the threshold itself was not
// varied.
constexpr int64_t kCtaPerSliceMinChunks = 256;

}  // namespace split_detail

// instance_norm_backward.cu: the block path's limits, where the chooser takes the
// resident paths, and how the generic path cuts a problem.
namespace backward_detail {

// Block path: 16-byte vectors of x and of dy each thread holds in registers (64 of
// the 128 registers its launch bounds allow); with kBlockLargeThreads, the largest
// slice it takes: 16,384 fp32 / 32,768 16-bit values (docs/perf-notes.md #104).
constexpr int kBlockVectorsPerThread = 8;
// Block CTAs: 128 threads for slices they hold, four or more to an SM, so one slice's
// loads overlap another's reduction; 512 threads above (docs/perf-notes.md #104).
constexpr int kBlockSmallThreads = 128;
constexpr int kBlockLargeThreads = 512;
// The resident paths are chosen from this many values per slice: below, a slice moves
// too few bytes per CTA to hide a block reduction and a team barrier, and the generic
// path (all SMs, many warps in flight) is taken; forced, the resident paths run smaller
// slices. An estimate, not measured.
constexpr int64_t kClusterMinSpatial = 4096;
// Clusters of more than this many CTAs are not chosen: 16-CTA clusters were slower
// than the generic path (docs/perf-notes.md #14-#24, when dy was held on chip too);
// cooperative teams take those slices, faster than the generic path (#41).
constexpr int64_t kClusterMaxChosenSize = 8;
// Generic path, chunk sizes in values per warp (a channels-last CTA takes
// kGenericWarps times as many): a tensor big enough to fill the GPU is cut into at
// least kTargetWarpItems work items, about 132 SMs x 64 resident warps, one full
// wave, so a single 128^3 slice still spreads over every SM; chunks of at least
// kMinChunkValues (enough loads in flight per warp; at most 2,048 partials per slice
// for the combine) and at most kMaxChunkValues (many items for big tensors, so the
// last wave's tail is short). Not measured one by one.
constexpr int64_t kTargetWarpItems = 8192;
constexpr int64_t kMinChunkValues = 1024;
constexpr int64_t kMaxChunkValues = 16384;

}  // namespace backward_detail

}  // namespace instance_norm
