// Host API of the InstanceNorm CUDA kernels (pure CUDA C++, no PyTorch types).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace instance_norm {

// Storage dtypes of x and y; statistics and arithmetic are float32 for all.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Forward kernel paths. kAuto lets choose_forward_path pick; the others force one
// (tests and bench.py use them to exercise and time every path).
enum class ForwardPath : int {
  kAuto = 0,
  // One CTA per slice, any spatial size, alignment and GPU; reads the slice twice.
  kGeneric = 1,
  // Cluster-resident (sm_90+), persistent: the slice is split over a cluster of up
  // to 16 CTAs that hold it in registers, so HBM is read once; each CTA stages its
  // next slice in shared memory while it normalizes the current one. Slices of up
  // to 16 * 32,768 values, spatial a multiple of the 16-byte vector (4 fp32 or 8
  // fp16/bf16 values), 16-byte aligned x and y.
  kCluster = 2,
};
constexpr int kNumForwardPaths = 3;

// y[s, i] = (x[s, i] - mean_s) / sqrt(var_s + eps) * weight[c] + bias[c], c = s %
// num_channels, for each slice s of `spatial` contiguous values; mean_s and the
// biased var_s are taken over the slice in float32 (PyTorch's F.instance_norm
// without running statistics).
struct ForwardProblem {
  const void* x;  // [num_slices, spatial] of dtype, device memory
  void* y;        // same shape and dtype, not overlapping x; nullptr only in support queries
  DType dtype;
  int64_t num_slices;
  int64_t spatial;
  int64_t num_channels;
  const float* weight;  // [num_channels] float32, or nullptr for 1
  const float* bias;    // [num_channels] float32, or nullptr for 0
  float eps;
};

// The path kAuto takes for this problem on the current device: kCluster where it
// can run it, else kGeneric.
ForwardPath choose_forward_path(const ForwardProblem& problem);

// Whether `path` can run this problem on the current device (a forced path that
// cannot is an error, not a silent switch). A null y counts as aligned.
bool forward_path_supported(ForwardPath path, const ForwardProblem& problem);

// Launches the forward on `stream`; returns the first CUDA error (launch
// configuration included), or cudaErrorInvalidValue for a path that cannot run
// this problem.
cudaError_t forward(const ForwardProblem& problem, ForwardPath path, cudaStream_t stream);

}  // namespace instance_norm
