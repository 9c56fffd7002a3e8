// PyTorch entry point: checks arguments, then launches the kernels of
// instance_norm.h on the current stream of the input's device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "instance_norm.h"

namespace {

// Errors are raised with TORCH_CHECK (RuntimeError) and TORCH_CHECK_TYPE (TypeError):
// on torch 2.11 with this extension built by g++ 13, any TORCH_CHECK_VALUE that
// fires crashes the process (SIGSEGV) instead of raising ValueError (seen on the
// H200 machine, docs/perf-notes.md). The Python front raises ValueError itself.

// input: contiguous CUDA float32 tensor (N, C, *spatial) with at least 3 dims.
// Returns a new tensor of the same shape: every (n, c) slice normalized to zero
// mean and unit biased variance, (x - mean) / sqrt(var + eps).
// path: instance_norm::ForwardPath as an int (0 = choose automatically).
torch::Tensor forward(const torch::Tensor& input, double eps, int64_t path) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor, got a tensor on ", input.device());
  TORCH_CHECK_TYPE(input.scalar_type() == at::kFloat, "input must be float32, got ", input.scalar_type());
  TORCH_CHECK(input.dim() >= 3, "input must have at least 3 dims (N, C, *spatial), got ", input.dim());
  TORCH_CHECK(input.is_contiguous(), "input must be contiguous (torch.contiguous_format)");
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  TORCH_CHECK(path >= 0 && path < instance_norm::kNumForwardPaths, "path must be in [0, ",
                    instance_norm::kNumForwardPaths, "), got ", path);

  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t num_slices = input.size(0) * input.size(1);
  if (num_slices == 0 || input.numel() == 0) return torch::empty_like(input);
  const int64_t spatial = input.numel() / num_slices;
  const auto forward_path = static_cast<instance_norm::ForwardPath>(path);
  // empty_like output comes from the caching allocator, aligned far beyond 16 bytes.
  const bool aligned = spatial % 4 == 0 && reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0;
  TORCH_CHECK(instance_norm::forward_path_supported(forward_path, num_slices, spatial, aligned), "path ",
                    path, " cannot run ", num_slices, " slices of ", spatial,
                    " elements on this GPU (see kernels/instance_norm.h)");
  torch::Tensor output = torch::empty_like(input);
  C10_CUDA_CHECK(instance_norm::forward_f32(input.data_ptr<float>(), output.data_ptr<float>(), num_slices, spatial,
                                            static_cast<float>(eps), forward_path,
                                            c10::cuda::getCurrentCUDAStream().stream()));
  return output;
}

// The path kAuto would take for a contiguous, 16-byte-aligned input of this size on the current device.
int64_t chosen_path(int64_t num_slices, int64_t spatial) {
  return static_cast<int64_t>(instance_norm::choose_forward_path(num_slices, spatial, spatial % 4 == 0));
}

// Whether forward(..., path) can run a contiguous, 16-byte-aligned input of this size on the current device.
bool path_supported(int64_t num_slices, int64_t spatial, int64_t path) {
  return path >= 0 && path < instance_norm::kNumForwardPaths &&
         instance_norm::forward_path_supported(static_cast<instance_norm::ForwardPath>(path), num_slices, spatial,
                                               spatial % 4 == 0);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "InstanceNorm CUDA kernels (see kernels/instance_norm.h)";
  m.def("forward", &forward, "InstanceNorm forward without affine or running stats (N, C, *spatial) fp32",
        py::arg("input"), py::arg("eps"), py::arg("path") = 0);
  m.def("chosen_path", &chosen_path, "ForwardPath that path=0 takes for these slices on the current device",
        py::arg("num_slices"), py::arg("spatial"));
  m.def("path_supported", &path_supported, "Whether forward(..., path) can run these slices on the current device",
        py::arg("num_slices"), py::arg("spatial"), py::arg("path"));
}
