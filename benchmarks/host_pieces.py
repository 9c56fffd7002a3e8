"""Host time of the single pieces a layer call is made of, on a CUDA GPU.

    python benchmarks/host_pieces.py [--calls 20000]

Builds a small extension of its own (load_inline, about a minute) and times, in C++
with std::chrono, loops of: an allocation through the dispatcher (at::empty_like,
at::empty) and straight from the CUDA caching allocator (at::detail::empty_*_cuda),
a view (as_strided, permute), a device guard, stream and device queries, and kernel
launches (<<<>>> and cudaLaunchKernelEx) of an empty kernel; then, from Python, a
pybind11 call without arguments and with the eleven arguments of the front's call
(tensor, four None, bool, two floats, None, float, None), and torch.neg (one ATen
launch) as the yardstick. Microseconds per call; compare rows of one run only (the
host's speed moves between runs). What the pieces add up to in a real layer call:
`python benchmarks/nets.py --profile`.
"""
import argparse
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

CUDA_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

__global__ void empty_kernel(float* p) {
  if (p != nullptr && threadIdx.x == 0) p[0] = 1.f;
}

// Nanoseconds per call of f over n calls, after 100 untimed ones.
template <typename F>
double per_call_ns(int64_t n, F f) {
  for (int i = 0; i < 100; ++i) f();
  const auto begin = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - begin).count() / n;
}

std::vector<std::pair<std::string, double>> pieces(const at::Tensor& x, int64_t n) {
  std::vector<std::pair<std::string, double>> out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  out.push_back({"at::empty_like", per_call_ns(n, [&] { at::empty_like(x); })});
  out.push_back({"at::detail::empty_strided_cuda", per_call_ns(n, [&] {
    at::detail::empty_strided_cuda(x.sizes(), x.strides(), x.scalar_type(), x.device()); })});
  out.push_back({"at::empty {2, 256}", per_call_ns(n, [&] { at::empty({2, 256}, x.options()); })});
  out.push_back({"at::detail::empty_cuda {2, 256}", per_call_ns(n, [&] {
    at::detail::empty_cuda({2, 256}, at::kFloat, x.device(), std::nullopt); })});
  out.push_back({"at::detail::empty_cuda {0}", per_call_ns(n, [&] {
    at::detail::empty_cuda({0}, at::kFloat, x.device(), std::nullopt); })});
  out.push_back({"x.to(kFloat) (returns x)", per_call_ns(n, [&] { x.to(at::kFloat); })});
  out.push_back({"x.as_strided", per_call_ns(n, [&] { x.as_strided({2, 4}, {4, 1}, 0); })});
  out.push_back({"x.permute", per_call_ns(n, [&] { x.permute({0, 2, 3, 1}); })});
  out.push_back({"CUDAGuard", per_call_ns(n, [&] { const c10::cuda::CUDAGuard guard(x.device()); })});
  out.push_back({"getCurrentCUDAStream", per_call_ns(n, [&] {
    c10::cuda::getCurrentCUDAStream(x.device().index()).stream(); })});
  out.push_back({"cudaGetDevice", per_call_ns(n, [&] { int device; cudaGetDevice(&device); })});
  out.push_back({"cudaDeviceGetAttribute", per_call_ns(n, [&] {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0); })});
  out.push_back({"launch <<<1, 32>>> + cudaGetLastError", per_call_ns(n, [&] {
    empty_kernel<<<1, 32, 0, stream>>>(nullptr); cudaGetLastError(); })});
  cudaDeviceSynchronize();
  out.push_back({"launch <<<256, 128>>> + cudaGetLastError", per_call_ns(n, [&] {
    empty_kernel<<<256, 128, 0, stream>>>(nullptr); cudaGetLastError(); })});
  cudaDeviceSynchronize();
  out.push_back({"cudaLaunchKernelEx <1, 32>", per_call_ns(n, [&] {
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(1);
    config.blockDim = dim3(32);
    config.stream = stream;
    cudaLaunchKernelEx(&config, empty_kernel, static_cast<float*>(nullptr)); })});
  cudaDeviceSynchronize();
  return out;
}
"""

CPP_SOURCE = r"""
#include <torch/extension.h>
std::vector<std::pair<std::string, double>> pieces(const at::Tensor& x, int64_t n);
at::Tensor front_arguments(const at::Tensor& input, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, double, double,
                           const std::optional<std::string>&, double, const std::optional<at::Tensor>&) {
  return input;
}
void no_arguments() {}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pieces", &pieces);
  m.def("front_arguments", &front_arguments);
  m.def("no_arguments", &no_arguments);
}
"""


def python_us(fn, calls):
    """Microseconds per call of fn over `calls` calls, after 100 untimed ones."""
    for _ in range(100):
        fn()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/host_pieces.py needs a CUDA GPU and none is visible.", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    ext = load_inline("instance_norm_host_pieces", cpp_sources=[CPP_SOURCE], cuda_sources=[CUDA_SOURCE],
                      extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"])
    x = torch.randn(1, 256, 64, 64, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; us per call")
    for name, ns in ext.pieces(x, args.calls):
        print(f"  {name:<44} {ns / 1000:6.2f}")
    front = (x, None, None, None, None, True, 0.1, 1e-5, None, 0.01, None)
    rows = (("pybind11 call, no arguments", lambda: ext.no_arguments()),
            ("pybind11 call, the front's 11 arguments", lambda: ext.front_arguments(*front)),
            ("torch.neg (one ATen launch)", lambda: torch.neg(x)))
    for name, fn in rows:
        print(f"  {name:<44} {python_us(fn, args.calls):6.2f}")
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
