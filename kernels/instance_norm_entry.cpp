// PyTorch entry point: checks arguments, then launches the kernels of
// instance_norm.h on the current stream of the input's device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <string>

#include "instance_norm.h"

namespace {

// Errors are raised with TORCH_CHECK (RuntimeError) and TORCH_CHECK_TYPE (TypeError),
// and numbers in messages go through text(): on the H200 machine (torch 2.11, this
// extension built by g++ 13) every check that fired with an integer streamed into
// its message, TORCH_CHECK_VALUE or TORCH_CHECK alike, crashed the process
// (SIGSEGV), while checks whose messages held a device or dtype raised normally
// (docs/perf-notes.md). The Python front validates first and raises ValueError.
template <typename Number>
std::string text(Number value) {
  return std::to_string(value);
}

instance_norm::DType storage_dtype(const torch::Tensor& input) {
  switch (input.scalar_type()) {
    case at::kFloat: return instance_norm::DType::kFloat32;
    case at::kHalf: return instance_norm::DType::kFloat16;
    case at::kBFloat16: return instance_norm::DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK_TYPE(false, "input must be float32, float16 or bfloat16, got ", input.scalar_type());
  return instance_norm::DType::kFloat32;  // not reached
}

// weight or bias: None, or C values on the input's device; returned as contiguous float32.
std::optional<torch::Tensor> channel_parameter(const std::optional<torch::Tensor>& parameter, const char* name,
                                               const torch::Tensor& input) {
  if (!parameter.has_value()) return std::nullopt;
  TORCH_CHECK(parameter->device() == input.device(), name, " must be on the input's device ", input.device(),
              ", got ", parameter->device());
  TORCH_CHECK(parameter->numel() == input.size(1), name, " must have C = ", text(input.size(1)), " elements, got ",
              text(parameter->numel()));
  return parameter->to(at::kFloat).contiguous();
}

instance_norm::ForwardProblem make_problem(const torch::Tensor& input, const std::optional<torch::Tensor>& weight,
                                           const std::optional<torch::Tensor>& bias, double eps) {
  instance_norm::ForwardProblem problem{};
  problem.x = input.data_ptr();
  problem.dtype = storage_dtype(input);
  problem.num_slices = input.size(0) * input.size(1);
  problem.spatial = problem.num_slices > 0 ? input.numel() / problem.num_slices : 0;
  problem.num_channels = input.size(1);
  problem.weight = weight ? weight->data_ptr<float>() : nullptr;
  problem.bias = bias ? bias->data_ptr<float>() : nullptr;
  problem.eps = static_cast<float>(eps);
  return problem;
}

void check_input(const torch::Tensor& input) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor, got a tensor on ", input.device());
  storage_dtype(input);
  TORCH_CHECK(input.dim() >= 3, "input must have at least 3 dims (N, C, *spatial), got ", text(input.dim()));
  TORCH_CHECK(input.is_contiguous(), "input must be contiguous (torch.contiguous_format)");
}

// input: contiguous CUDA tensor (N, C, *spatial) of float32, float16 or bfloat16.
// weight, bias: None or C values (any float dtype, on the input's device).
// Returns a new tensor of the input's shape and dtype: every (n, c) slice
// normalized to zero mean and unit biased variance, (x - mean) / sqrt(var + eps),
// then times weight[c] plus bias[c]; statistics in float32.
// path: instance_norm::ForwardPath as an int (0 = choose automatically).
torch::Tensor forward(const torch::Tensor& input, const std::optional<torch::Tensor>& weight,
                      const std::optional<torch::Tensor>& bias, double eps, int64_t path) {
  check_input(input);
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", text(eps));
  TORCH_CHECK(path >= 0 && path < instance_norm::kNumForwardPaths, "path must be in [0, ",
              text(instance_norm::kNumForwardPaths), "), got ", text(path));
  const c10::cuda::CUDAGuard device_guard(input.device());
  const std::optional<torch::Tensor> weight_f32 = channel_parameter(weight, "weight", input);
  const std::optional<torch::Tensor> bias_f32 = channel_parameter(bias, "bias", input);
  instance_norm::ForwardProblem problem = make_problem(input, weight_f32, bias_f32, eps);
  const auto forward_path = static_cast<instance_norm::ForwardPath>(path);
  // A null y counts as aligned: empty_like's memory comes from the caching allocator.
  TORCH_CHECK(instance_norm::forward_path_supported(forward_path, problem), "path ", text(path), " cannot run ",
              text(problem.num_slices), " slices of ", text(problem.spatial), " ", input.scalar_type(),
              " elements on this GPU (see kernels/instance_norm.h)");
  torch::Tensor output = torch::empty_like(input);
  problem.y = output.data_ptr();
  C10_CUDA_CHECK(instance_norm::forward(problem, forward_path, c10::cuda::getCurrentCUDAStream().stream()));
  return output;
}

// The path forward(input, ..., path=0) takes for this input on its device.
int64_t chosen_path(const torch::Tensor& input) {
  check_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  return static_cast<int64_t>(instance_norm::choose_forward_path(make_problem(input, {}, {}, 0.0)));
}

// Whether forward(input, ..., path) can run this input on its device.
bool path_supported(const torch::Tensor& input, int64_t path) {
  check_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  return path >= 0 && path < instance_norm::kNumForwardPaths &&
         instance_norm::forward_path_supported(static_cast<instance_norm::ForwardPath>(path),
                                               make_problem(input, {}, {}, 0.0));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "InstanceNorm CUDA kernels (see kernels/instance_norm.h)";
  m.def("forward", &forward,
        "InstanceNorm forward, (N, C, *spatial) float32/float16/bfloat16, optional per-channel weight and bias",
        py::arg("input"), py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("eps") = 1e-5,
        py::arg("path") = 0);
  m.def("chosen_path", &chosen_path, "ForwardPath that path=0 takes for this input on its device", py::arg("input"));
  m.def("path_supported", &path_supported, "Whether forward(input, ..., path) can run this input on its device",
        py::arg("input"), py::arg("path"));
}
