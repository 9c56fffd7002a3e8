// Per-channel reductions over the batch n, from the per-slice values the forward and
// backward kernels write: PyTorch's running-statistics update and the parameter
// gradients. One thread per channel sums its n entries in order n = 0 .. batch - 1, in
// double: deterministic, one launch each.
#include "common.cuh"

namespace instance_norm {
// load_inline compiles all .cu sources as one translation unit: each file keeps
// its internals in its own namespace.
namespace channels_detail {

constexpr int kThreads = 256;

// Running statistics, one thread per channel; the sums over n are in double, in n order.
__global__ void update_running_stats_kernel(float* running_mean, float* running_var, const float* mean,
                                            const float* rstd, int64_t batch, int64_t channels, int64_t spatial,
                                            float momentum, float eps) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < channels;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    double mean_sum = 0.0, var_sum = 0.0;
    for (int64_t n = 0; n < batch; ++n) {
      const double r = rstd[n * channels + c];
      mean_sum += mean[n * channels + c];
      var_sum += fmax(1.0 / (r * r) - eps, 0.0);
    }
    const double unbiased = var_sum / batch * spatial / (spatial - 1);
    running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * (mean_sum / batch));
    running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
  }
}

// One thread per channel sums its batch entries in order n = 0 .. batch - 1 (in
// double, stored as float32): deterministic, and one launch for both gradients.
__global__ void parameter_gradients_kernel(float* grad_weight, float* grad_bias, const float* sum_dy_xhat,
                                           const float* sum_dy, int64_t batch, int64_t channels) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < channels;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    double weight_sum = 0.0, bias_sum = 0.0;
    for (int64_t n = 0; n < batch; ++n) {
      weight_sum += sum_dy_xhat[n * channels + c];
      bias_sum += sum_dy[n * channels + c];
    }
    grad_weight[c] = static_cast<float>(weight_sum);
    grad_bias[c] = static_cast<float>(bias_sum);
  }
}

}  // namespace channels_detail

cudaError_t update_running_stats(float* running_mean, float* running_var, const float* mean, const float* rstd,
                                 int64_t batch, int64_t channels, int64_t spatial, float momentum, float eps,
                                 cudaStream_t stream) {
  using namespace channels_detail;
  if (channels <= 0 || batch <= 0) return cudaSuccess;
  if (spatial <= 1) return cudaErrorInvalidValue;
  update_running_stats_kernel<<<grid_for(channels, kThreads), kThreads, 0, stream>>>(
      running_mean, running_var, mean, rstd, batch, channels, spatial, momentum, eps);
  return cudaGetLastError();
}

cudaError_t parameter_gradients(float* grad_weight, float* grad_bias, const float* sum_dy_xhat, const float* sum_dy,
                                int64_t batch, int64_t channels, cudaStream_t stream) {
  using namespace channels_detail;
  if (channels <= 0) return cudaSuccess;
  parameter_gradients_kernel<<<grid_for(channels, kThreads), kThreads, 0, stream>>>(grad_weight, grad_bias,
                                                                                   sum_dy_xhat, sum_dy, batch, channels);
  return cudaGetLastError();
}

}  // namespace instance_norm
