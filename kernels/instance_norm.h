// Host API of the InstanceNorm CUDA kernels (pure CUDA C++, no PyTorch types).
// Forward: instance_norm_forward.cu (the paths and their choice),
// instance_norm_pipelined.cu (the pipelined path) and instance_norm_split.cu (the
// split path, any layout, and the eval sweep); backward: instance_norm_backward.cu;
// the per-channel reductions over n (running statistics, parameter gradients):
// instance_norm_channels.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace instance_norm {

// Storage dtypes of x, y, dy and dx; statistics and arithmetic are float32 for all.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Memory layout of an (N, C, *spatial) tensor with S = prod(spatial) values per
// (n, c) slice. Element (n, c, s) is at
//   kContiguous:   (n * C + c) * S + s   (torch.contiguous_format), or
//   kChannelsLast: (n * S + s) * C + c   (torch.channels_last / channels_last_3d and
//                                         the same order for 1d).
enum class Layout : int { kContiguous = 0, kChannelsLast = 1 };

// Forward kernel paths. kAuto lets plan_forward pick; the others force one (tests
// and bench.py use them to exercise and time every path).
enum class ForwardPath : int {
  kAuto = 0,
  // One CTA per slice, the slice held in shared memory (read once). Contiguous, any
  // alignment and GPU, slices whose copy fits one CTA (on an H200 up to about 58,000
  // fp32 or 116,000 fp16/bf16 values; two or more CTAs per SM up to 28,888 / 57,776
  // values, one CTA per SM above); chosen where two or more CTAs fit an SM, and above
  // that unless a resident team of one CTA holds the slice (block_preferred).
  // Channels-last: one CTA per tile of 8 fp32 or 16 fp16/bf16 channels of one image
  // at every position, where the tile fits a CTA (on an H200 up to about 7,200
  // positions; chosen up to 4,096), num_channels is a multiple of the 16-byte vector
  // and x and y are 16-byte aligned.
  kBlock = 1,
  // Cluster-resident (sm_90+), persistent: the slice is split over a cluster of up
  // to 16 CTAs that hold it in registers, so HBM is read once; each CTA stages its
  // next slice in shared memory while it normalizes the current one. Contiguous,
  // slices of up to 16 * 32,768 fp32 or 16 * 65,536 fp16/bf16 values, spatial a
  // multiple of the 16-byte vector (4 fp32 or 8 fp16/bf16 values), 16-byte aligned
  // x and y. Channels-last (sm_90+), persistent: clusters of up to 16 CTAs, an image
  // at a time, each CTA holding a contiguous run of positions with all their channels
  // in shared memory (read once; the next image's copied in as the current one is
  // written), per-channel sums exchanged through DSMEM; num_channels a multiple of
  // the vector and at most 2,048 fp32 or 4,096 fp16/bf16, 16-byte aligned x and y,
  // images up to about 3.4 MB on an H200 (less with thousands of channels, whose
  // per-channel sums take shared memory too).
  kCluster = 2,
  // One warp per slice, many slices per CTA, the slice held in registers (read
  // once). Contiguous, spatial <= kWarpMaxSpatial, any alignment and GPU.
  kWarp = 3,
  // Several CTAs per slice, any layout, size, alignment and GPU (channels-last input
  // where the block path does not take it): partial statistics per chunk, a tiny
  // kernel that combines them per slice, then a normalize sweep (two reads of x).
  // Needs workspace (ForwardPlan::workspace_bytes).
  kSplit = 4,
  // As kCluster, but the team of CTAs holding a slice is part of a cooperative
  // launch (all CTAs co-resident) and exchanges statistics through global memory:
  // no cluster-size limit (slices up to as many CTAs as are resident at once, e.g.
  // 128^3 fp32 on 64 CTAs), any GPU with room for the staged slice. Needs
  // workspace (ForwardPlan::workspace_bytes).
  kCooperative = 5,
  // Cooperative teams as kCooperative, pipelined (sm_90+): each CTA keeps its part of
  // a slice in shared memory for three rounds, so the team's statistics of a slice
  // are used two rounds after they are published and the exchange never stalls the
  // reads and writes. Contiguous, slices of up to (resident CTAs) * 16,384 fp32 or
  // 32,768 fp16/bf16 values, spatial a multiple of the 16-byte vector, 16-byte
  // aligned x and y. Needs workspace (ForwardPlan::workspace_bytes).
  kPipelined = 6,
};
constexpr int kNumForwardPaths = 7;
constexpr int64_t kWarpMaxSpatial = 1024;

// What follows the affine map in a fused layer: y = act(norm(x) * weight + bias
// [+ residual]). Activations as PyTorch defines them (torch.nn.functional):
//   kRelu       max(v, 0)
//   kLeakyRelu  v > 0 ? v : negative_slope * v
//   kSilu       v * sigmoid(v)
//   kGelu       0.5 v (1 + erf(v / sqrt(2)))
//   kGeluTanh   0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3)))   (approximate="tanh")
enum class Activation : int { kNone = 0, kRelu = 1, kLeakyRelu = 2, kSilu = 3, kGelu = 4, kGeluTanh = 5 };
constexpr int kNumActivations = 6;

struct Epilogue {
  Activation activation;  // kNone by zero-initialization
  float negative_slope;   // kLeakyRelu only
  // Added before the activation: the same shape, dtype and layout as x, 16-byte
  // aligned, device memory; or nullptr. In a forward that writes y padded
  // (forward_pads), y's padded shape instead, contiguous, added at each padded
  // value's position, without an activation.
  const void* residual;

  __host__ __device__ bool active() const { return activation != Activation::kNone || residual != nullptr; }
};

// A reflection pad after the epilogue, PyTorch's ReflectionPad1d/2d (F.pad(y, (left,
// right, top, bottom), mode="reflect")): each slice is height x width values (1 x L
// in 1D), padded by `top` and `bottom` rows and `left` and `right` columns, each
// smaller than the dim it pads; padded row i holds row reflect(i - top, height)
// (reflect(i, n) = |i| for i < n, 2 (n - 1) - i above), columns alike. In the
// forward, y is the padded output: (batch, num_channels, padded_spatial()); in the
// backward, dy is the padded gradient and each value's gradient is the sum of the
// padded values that hold it (up to 9). Zero-initialized: no pad. Only the block
// paths take it, contiguous, without a residual or (forward) with one of the padded
// shape (forward_pads, backward_pads),
// in kernels of their own that take it as a second parameter: a field of the
// problems would change every other kernel's machine code (docs/perf-notes.md #161).
struct ReflectionPad {
  int height, width;
  int top, bottom, left, right;

  __host__ __device__ bool active() const { return height > 0; }
  __host__ __device__ int padded_width() const { return width + left + right; }
  __host__ __device__ int padded_height() const { return height + top + bottom; }
  __host__ __device__ int64_t padded_spatial() const { return int64_t{padded_width()} * padded_height(); }
};

// y[n, c, s] = (x[n, c, s] - mean) * rstd * weight[c] + bias[c], rstd = 1 / sqrt(var + eps),
// where mean and the biased var are those of the slice (n, c) taken in float32
// (PyTorch's F.instance_norm with use_input_stats=True), or, when running_mean is
// given, running_mean[c] and running_var[c] (use_input_stats=False).
struct ForwardProblem {
  const void* x;  // (batch, num_channels, spatial) of dtype in `layout`, device memory
  void* y;        // same shape, dtype and layout, not overlapping x; nullptr only in support queries
  DType dtype;
  Layout layout;
  int64_t batch;
  int64_t num_channels;
  int64_t spatial;
  // [num_channels] contiguous values of parameter_dtype, or nullptr: weight 1, bias 0.
  const void* weight;
  const void* bias;
  float eps;
  // The dtype of weight and bias (both, where both are given): float32 or `dtype`.
  // The kernels convert each value to float32 once per slice, so parameters of a
  // 16-bit input's dtype need no cast per call. In the 4 bytes of padding after eps:
  // the struct's size and every other field's offset are as without it.
  DType parameter_dtype;
  // Optional outputs, [batch * num_channels] float32 or nullptr: each slice's mean
  // and rstd (saved for backward and for the running statistics). Written only
  // when the slice's own statistics are used (running_mean == nullptr).
  float* mean;
  float* rstd;
  // use_input_stats=False: [num_channels] float32 statistics to normalize with, or
  // nullptr for the slices' own. With them every path runs the same elementwise
  // normalize sweep.
  const float* running_mean;
  const float* running_var;
  // ForwardPlan::workspace_bytes of device memory, 16-byte aligned.
  void* workspace;
  // Applied to every y value on every path (none when zero-initialized).
  Epilogue epilogue;

  __host__ __device__ int64_t num_slices() const { return batch * num_channels; }
};

// How a plan's kernel is launched: plainly, in clusters of cluster_size CTAs along
// x, or cooperatively (all CTAs co-resident) after zeroing the first zeroed_bytes
// of the problem's workspace (the teams' arrival counters).
enum class LaunchKind : int { kPlain = 0, kCluster = 1, kCooperative = 2 };

template <typename Problem>
struct KernelLaunch {
  LaunchKind kind;
  void (*kernel)(const Problem);
  unsigned grid;  // CTAs
  int threads;    // per CTA
  int shared_bytes;  // dynamic shared memory per CTA
  int cluster_size;  // kCluster only
  size_t zeroed_bytes;  // kCooperative only
};

// The split path's three launches (instance_norm_split.cu): partial statistics per
// chunk, their combination per slice, the normalize sweep.
struct SplitPlan {
  int chunk_rounds;       // rounds of loads per chunk (1, 2 or 4), for the partials and the channels-last sweep
  int64_t chunks;         // partials per slice (contiguous: chunks of values; channels-last: of rows)
  size_t partials_bytes;  // the workspace's partials, before the per-slice float4s
  int stats_unit;         // values per unit of the partials' loads: one 16-byte vector, or 1
  bool staged_partials;   // channels-last partials through per-thread shared-memory slots (kStagedRounds)
  unsigned stats_grid;
  int combine_lanes;      // lanes per slice of the combination: a power of two up to a warp, or a CTA's threads
  unsigned combine_grid;
  int sweep_unit;         // values per unit of the sweep: one 16-byte vector, or 1
  int64_t sweep_chunks;   // channels-last: the sweep's chunks of rows per (n, channel tile)
  unsigned sweep_grid;
};

// How forward runs one problem on the current device: the path and everything its
// launch needs, made once per call by plan_forward; forward() launches it as is.
// Zero-initialized: path kAuto, a plan that cannot run.
struct ForwardPlan {
  // The path that runs; kAuto where the forced path cannot run this problem on this
  // device. With running statistics every path runs the split path's sweep, so a
  // plan that can run is kSplit's.
  ForwardPath path;
  size_t workspace_bytes;  // problem.workspace must hold these (0: none)
  KernelLaunch<ForwardProblem> launch;  // every path but kSplit
  // The resident and pipelined paths' teams: team_size CTAs each (the cluster size
  // on kCluster), `teams` of them in the grid, the busiest taking `rounds` slices
  // (kPipelined; the others one fewer at most).
  int team_size;
  int64_t teams;
  int64_t rounds;
  SplitPlan split;  // kSplit
  // With an active pad, y is padded: the block path's padded kernel runs with
  // launch's grid, threads and shared memory.
  ReflectionPad pad;
  void (*padded_kernel)(const ForwardProblem, const ReflectionPad);

  bool valid() const { return path != ForwardPath::kAuto; }
};

// The plan of `forced` for this problem on the current device, or with kAuto of the
// path the chooser takes (instance_norm_forward.cu). A forced path that cannot run
// the problem gives an invalid plan (an error for the caller, not a silent switch);
// every path runs an empty problem (no slices or no values: nothing to launch). A
// null y counts as aligned: a plan made before y exists is a support query.
// With an active `pad`, the plan writes y padded (forward_pads; else the plan is invalid).
ForwardPlan plan_forward(const ForwardProblem& problem, ForwardPath forced, const ReflectionPad& pad = {});

// Whether `forced` can write y padded by `pad`: contiguous, without running
// statistics, without a residual or with one of the padded shape and no activation,
// padded rows of one 16-byte vector at least, where the path is
// kBlock and runs the problem, or kAuto and the chooser takes the block path. Elsewhere a caller runs the problem without the
// pad and pads y itself. Makes no plan (plans_made does not count it).
bool forward_pads(const ForwardProblem& problem, const ReflectionPad& pad, ForwardPath forced);

// Launches the plan on `stream`; returns the first CUDA error (launch configuration
// included), or cudaErrorInvalidValue for an invalid plan, a null y or a missing
// workspace. The plan must be plan_forward's for this problem (its y included).
cudaError_t forward(const ForwardProblem& problem, const ForwardPlan& plan, cudaStream_t stream);

// The sizes the paths' limits above follow from, per dtype: for tests and tools,
// which read them through the extension.
struct ForwardCapacities {
  int64_t warp_spatial;   // kWarp: values per slice
  int64_t resident_cta;   // kCluster, kCooperative: values of a slice per CTA
  int max_cluster_size;   // kCluster: CTAs per cluster
  int64_t pipelined_cta;  // kPipelined: values of a slice per CTA
};
ForwardCapacities forward_capacities(DType dtype);

// PyTorch's running-statistics update of instance norm in training (batch_norm on
// the (1, N * C, *spatial) view, then the mean over n of the blended buffers):
//   running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean_n(mean[n, c])
//   running_var[c]  = (1 - momentum) * running_var[c]
//                     + momentum * mean_n(var[n, c] * spatial / (spatial - 1)),
// with var[n, c] = 1 / rstd[n, c]^2 - eps recovered from forward's outputs.
// running_mean, running_var: [channels] float32, updated in place; mean, rstd:
// [batch * channels] float32; spatial > 1.
cudaError_t update_running_stats(float* running_mean, float* running_var, const float* mean, const float* rstd,
                                 int64_t batch, int64_t channels, int64_t spatial, float momentum, float eps,
                                 cudaStream_t stream);

// Backward kernel paths, as ForwardPath.
enum class BackwardPath : int {
  kAuto = 0,
  // Any layout, size, alignment and GPU.
  kGeneric = 1,
  // Cluster-resident (sm_90+): x of a slice held on chip, dy streamed twice through
  // a ring in shared memory (the second time from L2), so HBM reads x and dy once.
  // Chosen for clusters of <= 8.
  kCluster = 2,
  // As kCluster, with a team of CTAs of a cooperative launch instead of a cluster
  // (sm_90+: bulk copies; no cluster-size limit); needs workspace
  // (BackwardPlan::workspace_bytes). Chosen for slices larger than a cluster of 8 holds.
  kCooperative = 3,
  // One CTA per slice, x and dy held in registers (read once), one launch, any GPU.
  // Contiguous, spatial a multiple of the 16-byte vector, slices of up to 16,384
  // fp32 or 32,768 fp16/bf16 values, 16-byte aligned x, dy and dx; no residual's
  // gradient through an activation. Chosen wherever it runs (docs/perf-notes.md #104).
  kBlock = 4,
};
constexpr int kNumBackwardPaths = 5;

// Gradient of the forward with the slice's own statistics (use_input_stats=True),
// after the epilogue's gradient (below),
// per slice with xhat = (x - mean) * rstd and w = weight[c] (1 without weight):
//   dx = rstd * w * (dy - sum(dy) / S - xhat * sum(dy * xhat) / S)
// and the per-slice sums sum(dy) and sum(dy * xhat), from which the caller forms
// dbias[c] = sum_n sum(dy) and dweight[c] = sum_n sum(dy * xhat) (deterministic, no
// atomics). Every sum is in float32.
struct BackwardProblem {
  const void* x;   // forward's input: (batch, num_channels, spatial) of dtype in `layout`
  const void* dy;  // gradient of y, same shape, dtype and layout
  void* dx;        // gradient of x, same shape, dtype and layout; nullptr only in support queries
  DType dtype;
  Layout layout;
  int64_t batch;
  int64_t num_channels;
  int64_t spatial;
  const float* mean;    // [batch * num_channels] from forward
  const float* rstd;    // [batch * num_channels] from forward
  const float* weight;  // [num_channels] float32, or nullptr for 1
  float* sum_dy;        // [batch * num_channels] out
  float* sum_dy_xhat;   // [batch * num_channels] out
  // The forward's epilogue. With an activation, dy is the gradient of act's output
  // and every path takes dy * act'(pre) in its place, pre = xhat * w + bias[c]
  // (+ residual) recomputed from x, mean and rstd; with a residual as well (the
  // generic path only), grad_residual (dy's shape, dtype and layout, 16-byte
  // aligned) receives that product, the residual's gradient. A residual without an
  // activation changes nothing here: its gradient is dy itself.
  Epilogue epilogue;
  const float* bias;    // [num_channels] float32, or nullptr for 0; read only with an activation
  void* grad_residual;
  // BackwardPlan::workspace_bytes of device memory, 16-byte aligned.
  void* workspace;

  __host__ __device__ int64_t num_slices() const { return batch * num_channels; }
};

// The parameter gradients from backward's per-slice sums, summed over n in a fixed
// order: grad_weight[c] = sum_n sum_dy_xhat[n, c], grad_bias[c] = sum_n sum_dy[n, c].
// grad_weight, grad_bias: [channels] float32 out; the sums: [batch * channels] float32.
cudaError_t parameter_gradients(float* grad_weight, float* grad_bias, const float* sum_dy_xhat, const float* sum_dy,
                                int64_t batch, int64_t channels, cudaStream_t stream);

// How the generic backward path cuts the problem: a function of shape and dtype only
// (not of the device or alignment), so the sums are the same bits on every GPU. The
// generic kernels take it as an argument.
struct GenericPlan {
  bool channels_last;
  int64_t chunk;          // contiguous: values per chunk (a multiple of 8); channels-last: rows per chunk
  int64_t chunks;         // chunks per slice (contiguous) or per image n (channels-last)
  int lanes_per_chunk;    // contiguous: lanes that share a chunk (a power of two <= 32)
  int lanes_per_slice;    // combine: lanes that share a slice's partials (a power of two <= 32)
  int lanes_per_row;      // channels-last: threads along C, one vector of channels each (a power of two <= 32)
  int64_t channel_tiles;  // channels-last: ceil(C / (lanes_per_row * values per vector))
  int64_t num_items;      // contiguous: (slice, chunk) lane-group items; channels-last: (n, chunk, tile) CTA items
  int64_t num_partials;
};

// How backward runs one problem on the current device, as ForwardPlan.
struct BackwardPlan {
  BackwardPath path;  // kAuto: the forced path cannot run this problem on this device
  size_t workspace_bytes;
  KernelLaunch<BackwardProblem> launch;  // kBlock, kCluster, kCooperative
  int team_size;  // kCluster, kCooperative: CTAs per team and teams in the grid
  int64_t teams;
  // kGeneric: the cut, whether its kernels read 16-byte vectors, and the grids of
  // the partial-sums and dx kernels (item_grid) and of the combine.
  GenericPlan generic;
  bool generic_vectorized;
  unsigned item_grid;
  unsigned combine_grid;
  // With an active pad, dy is the padded gradient: the block path's padded kernel
  // runs with launch's grid, threads and shared memory.
  ReflectionPad pad;
  void (*padded_kernel)(const BackwardProblem, const ReflectionPad);

  bool valid() const { return path != BackwardPath::kAuto; }
};

// As plan_forward; a null dx counts as aligned. Unlike the forward's, a forced path
// must run an empty problem's shape as any other's (nothing is launched for it).
// With an active `pad`, problem.dy is the gradient of y padded by it (backward_pads;
// else the plan is invalid).
BackwardPlan plan_backward(const BackwardProblem& problem, BackwardPath forced, const ReflectionPad& pad = {});

// Whether `forced` can read the gradient of y padded by `pad`: kBlock or kAuto
// (whose chooser takes the block path wherever it runs) where the block path runs
// the problem and an SM holds its padded kernel's staged slice. Elsewhere the
// caller folds the padded gradient itself. Makes no plan.
bool backward_pads(const BackwardProblem& problem, const ReflectionPad& pad, BackwardPath forced);
cudaError_t backward(const BackwardProblem& problem, const BackwardPlan& plan, cudaStream_t stream);

struct BackwardCapacities {
  int64_t block_spatial;  // kBlock: values per slice
};
BackwardCapacities backward_capacities(DType dtype);

// Test hook: the plans plan_forward and plan_backward have made in this process; a
// call of the ops plans once (tests/test_gpu_ops.py counts them).
struct PlanCounts {
  int64_t forward;
  int64_t backward;
};
PlanCounts plans_made();

// Testing only: another GPU's limits in place of the current device's, for every
// query the path choice makes (compute capability, shared memory per CTA and per
// SM, threads per SM; the SM count stays the device's). With the kernels built as
// compute_80 PTX, an H200 then runs exactly the paths that GPU would run
// (solution.py's INSTANCE_NORM_EMULATE). Call before the first launch: the queries
// are cached.
struct EmulatedDevice {
  int major;           // compute capability major (9 and up: clusters, bulk copies)
  int shared_per_cta;  // bytes of shared memory a CTA may opt in to
  int shared_per_sm;   // bytes of shared memory per SM
  int threads_per_sm;  // resident threads per SM
};
void emulate_device(const EmulatedDevice& device);

}  // namespace instance_norm
