// Host API of the InstanceNorm CUDA kernels (pure CUDA C++, no PyTorch types).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace instance_norm {

// Forward kernel variants. kAuto lets choose_forward_path pick; the others force
// one (tests and bench.py use them to exercise and time every path).
enum class ForwardPath : int {
  kAuto = 0,
  // One CTA per slice, any spatial size, alignment and GPU; reads the slice twice.
  kGeneric = 1,
  // Cluster-resident (sm_90+), persistent: the slice is split over a cluster of up
  // to 16 CTAs that hold it in registers, so HBM is read once; each CTA stages its
  // next slice in shared memory while it normalizes the current one. Slices of up
  // to 16 * 32,768 fp32 values, spatial % 4 == 0, 16-byte aligned data.
  kCluster = 2,
};
constexpr int kNumForwardPaths = 3;

// The path kAuto takes for these slices on the current device: kCluster where it
// can run them, else kGeneric. `aligned` says
// whether x and y are 16-byte aligned and spatial is a multiple of 4.
ForwardPath choose_forward_path(int64_t num_slices, int64_t spatial, bool aligned);

// Whether `path` can run these slices on the current device (a forced path that
// cannot is an error, not a silent switch).
bool forward_path_supported(ForwardPath path, int64_t num_slices, int64_t spatial, bool aligned);

// y[s, i] = (x[s, i] - mean_s) / sqrt(var_s + eps) for each slice s of `spatial`
// contiguous fp32 values, mean_s and the biased var_s taken over that slice (as
// torch.nn.functional.instance_norm without running stats or affine).
// x, y: device pointers to num_slices * spatial floats, not overlapping.
// Launches on `stream`; returns the first CUDA error (launch configuration
// included), or cudaErrorInvalidValue for a path that cannot run these slices.
cudaError_t forward_f32(const float* x, float* y, int64_t num_slices, int64_t spatial, float eps,
                        ForwardPath path, cudaStream_t stream);

}  // namespace instance_norm
