"""InstanceNorm for PyTorch on NVIDIA GPUs, from CUDA C++ kernels built at import.

Importing or exec'ing this file reads the CUDA sources in kernels/ (found next to
this file, in $INSTANCE_NORM_KERNELS, or in ./kernels when exec'd without
__file__; a single-file bundle made with --bundle carries them in itself),
builds them once with torch.utils.cpp_extension.load_inline into a private cache
directory named by a hash of sources, flags and versions, and defines:

- ModelNew: drop-in for PyTorch's nn.InstanceNorm2d (same constructor).
- InstanceNorm1d, InstanceNorm2d, InstanceNorm3d: drop-ins for PyTorch's.
- instance_norm: the signature of PyTorch's F.instance_norm.

CUDA float32, float16 and bfloat16 inputs run the kernels: batched or unbatched,
affine or not, running statistics (training update and eval), contiguous or
channels-last read in place, every spatial size; statistics in float32; forward
and backward are torch.library custom ops with autograd, so torch.compile
(fullgraph) and CUDA graphs work. CPU and float64 inputs go to PyTorch's own op.
Every path but the split path reads HBM once: a warp per slice up to 1,024 values,
a CTA per slice in shared memory up to about 58,000 fp32 / 116,000 16-bit values on
an H200, and on Hopper larger slices (up to 524,288 fp32 / 1,048,576 16-bit values,
e.g. 512 x 512) held in registers by a thread-block cluster.
"""
import functools
import hashlib
import math
import os
import sys
import time
import warnings
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.nn import functional as F
import torch.utils.cpp_extension
from torch.autograd.function import once_differentiable
from torch.utils.cpp_extension import load_inline

_HEADER_FILES = ("common.cuh", "instance_norm.h", "pipelined.h", "split.h")
_CUDA_FILES = ("instance_norm_forward.cu", "instance_norm_pipelined.cu", "instance_norm_split.cu",
               "instance_norm_backward.cu")
_CPP_FILES = ("instance_norm_entry.cpp",)
_KERNEL_FILES = _HEADER_FILES + _CUDA_FILES + _CPP_FILES
# A bundle (python solution.py --bundle PATH) sets this to {file name: source text}
# of _KERNEL_FILES and then reads nothing from kernels/.
_KERNEL_SOURCES = None
# A build lock older than this is left from a killed build (a cold build takes < 60 s).
_STALE_LOCK_SECONDS = 300
# Compiled for when no GPU is visible at build time (CI): Hopper.
_FALLBACK_CAPABILITIES = ((9, 0),)
_NVCC_FLAGS = ("-O3",)


def _kernels_dir():
    """Directory holding the kernel sources: $INSTANCE_NORM_KERNELS (which must hold
    all of them: FileNotFoundError naming the missing ones), else kernels/ next to
    this file, else ./kernels (exec'd without __file__, as harnesses do)."""
    override = os.environ.get("INSTANCE_NORM_KERNELS")
    if override:
        missing = [name for name in _KERNEL_FILES if not os.path.isfile(os.path.join(override, name))]
        if missing:
            raise FileNotFoundError(f"instance_norm: INSTANCE_NORM_KERNELS={override} lacks " + ", ".join(missing))
        return override
    candidates = []
    if "__file__" in globals():
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels"))
    candidates.append(os.path.join(os.getcwd(), "kernels"))
    for directory in candidates:
        if all(os.path.isfile(os.path.join(directory, name)) for name in _KERNEL_FILES):
            return directory
    raise FileNotFoundError(
        "instance_norm: kernel sources not found; looked for " + ", ".join(_KERNEL_FILES)
        + " in " + ", ".join(candidates) + ". Run from the project root or set INSTANCE_NORM_KERNELS."
    )


def _read_sources():
    """{file name: source text} of every file in _KERNEL_FILES: the bundled copy
    when this is a bundle, else the files in _kernels_dir()."""
    if _KERNEL_SOURCES is not None:
        return dict(_KERNEL_SOURCES)
    directory = _kernels_dir()
    sources = {}
    for name in _KERNEL_FILES:
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            sources[name] = f.read()
    return sources


def _gencode(capability):
    """nvcc -gencode flag for a (major, minor) compute capability; sm_90a on Hopper."""
    major, minor = capability
    arch = f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def _arch_flags():
    """-gencode flags for every visible GPU, whatever TORCH_CUDA_ARCH_LIST says
    (load_inline adds no arch flags of its own once one is given); for
    _FALLBACK_CAPABILITIES when no GPU is visible."""
    if torch.cuda.is_available():
        capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    else:
        capabilities = set(_FALLBACK_CAPABILITIES)
    return [_gencode(c) for c in sorted(capabilities)]


def _extension_name(sources, cuda_flags):
    """Extension (and build directory) name: a hash of everything that changes
    the binary, so a changed source or flag never loads a stale build."""
    digest = hashlib.sha256()
    toolkit = str(torch.utils.cpp_extension.CUDA_HOME)
    for part in [torch.__version__, str(torch.version.cuda), sys.version, toolkit, *cuda_flags]:
        digest.update(part.encode())
        digest.update(b"\0")
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    return "instance_norm_" + digest.hexdigest()[:16]


def _build_root():
    """Parent of the private build directories: $INSTANCE_NORM_BUILD_ROOT or ~/.cache/instance_norm_cuda."""
    return os.environ.get("INSTANCE_NORM_BUILD_ROOT") or os.path.join(
        os.path.expanduser("~"), ".cache", "instance_norm_cuda"
    )


def _write_if_changed(path, text):
    """Write text to path unless it already holds it (a rewrite would make ninja rebuild)."""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _clear_stale_lock(build_dir, library):
    """Remove a build lock left by an interrupted build. Older torch versions lock
    by the file's existence (FileBaton), so a killed build's lock makes every later
    load_inline wait forever; torch 2.14 holds an OS lock on a file it leaves in
    place, which is harmless. So only a lock with no built library beside it and
    older than any build (_STALE_LOCK_SECONDS) is removed."""
    lock = os.path.join(build_dir, "lock")
    if (os.path.exists(lock) and not os.path.exists(library)
            and time.time() - os.path.getmtime(lock) > _STALE_LOCK_SECONDS):
        print(f"instance_norm: removing {lock}, left by an interrupted build", file=sys.stderr)
        os.remove(lock)


def _load_extension(sources):
    """Build (first use only) and import the extension from {file name: source}."""
    cuda_flags = [*_NVCC_FLAGS, *_arch_flags()]
    name = _extension_name(sources, cuda_flags)
    build_dir = os.path.join(_build_root(), name)
    os.makedirs(build_dir, exist_ok=True)
    for header in _HEADER_FILES:
        _write_if_changed(os.path.join(build_dir, header), sources[header])
    library = os.path.join(build_dir, name + ".so")
    _clear_stale_lock(build_dir, library)
    if not os.path.isfile(library):
        print(f"instance_norm: building CUDA extension {name} in {build_dir} (first use only; if it hangs, "
              f"delete {os.path.join(build_dir, 'lock')})", file=sys.stderr)
    return load_inline(
        name=name,
        cpp_sources=[sources[f] for f in _CPP_FILES],
        cuda_sources=[sources[f] for f in _CUDA_FILES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=cuda_flags,
        extra_include_paths=[build_dir],
        build_directory=build_dir,
        verbose=False,
    )


def _python_literal(text):
    """text as a triple-quoted Python literal that keeps its lines (so a checker
    that reads the bundle line by line sees the kernel code)."""
    quote = "'" * 3
    return quote + text.replace("\\", "\\\\").replace(quote, "\\'" * 3) + quote


def bundle(path):
    """Write a self-contained single-file solution to `path`: this file with
    _KERNEL_SOURCES set to the kernel sources, so it reads nothing from kernels/."""
    with open(os.path.abspath(__file__), encoding="utf-8") as f:
        source = f.read()
    marker = "\n_KERNEL_SOURCES = None\n"
    if marker not in source:
        raise RuntimeError(f"solution.bundle: {marker.strip()!r} not found in {__file__}: already a bundle?")
    entries = "".join(f"    {name!r}: {_python_literal(text)},\n" for name, text in _read_sources().items())
    with open(path, "w", encoding="utf-8") as f:
        f.write(source.replace(marker, "\n_KERNEL_SOURCES = {\n" + entries + "}\n", 1))


def _command_line():
    """python solution.py [--bundle PATH]: --bundle (and --help) run before, and
    without, the build. parse_known_args: a harness that runs this file as
    __main__ with its own arguments gets the import-time build and nothing else."""
    import argparse

    parser = argparse.ArgumentParser(description="InstanceNorm CUDA kernels for PyTorch (see README.md).")
    parser.add_argument("--bundle", metavar="PATH", help="write a single-file solution with the kernel sources inlined")
    bundle_path = parser.parse_known_args()[0].bundle
    if bundle_path:
        bundle(bundle_path)
        print(f"instance_norm: wrote {bundle_path}", file=sys.stderr)
        sys.exit(0)


if __name__ == "__main__":
    _command_line()

_EXT = _load_extension(_read_sources())


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _channels_last_order(dim):
    """Dim order (0, 2, ..., dim - 1, 1): the tensor is channels-last when its permute by this is contiguous."""
    return (0, *range(2, dim), 1)


def _readable(x):
    """x itself where the kernels read it in place (contiguous, or channels-last:
    torch.channels_last / channels_last_3d and the same order for 1d), else a
    contiguous copy. The output keeps this tensor's layout."""
    if x.is_contiguous() or x.permute(_channels_last_order(x.dim())).is_contiguous():
        return x
    return x.contiguous()


def _like_layout(t, like):
    """t with the strides of `like` (contiguous or channels-last), copying only if needed."""
    if like.is_contiguous():
        return t.contiguous()
    order = _channels_last_order(like.dim())
    if t.permute(order).is_contiguous():
        return t
    inverse = sorted(range(like.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(inverse)


# torch.library custom ops with fake implementations and autograd: the face of the
# kernels that torch.compile (fullgraph) traces. Eager calls use _EXT directly, or
# _ForwardFunction when a gradient is needed (the op dispatch costs tens of
# microseconds per call, which dominates small inputs).
@torch.library.custom_op("instance_norm_cuda::forward", mutates_args=())
def _forward_op(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) of input (N, C, *spatial) in a native layout; mean and rstd float32 (N * C)."""
    y, mean, rstd = _EXT.forward_with_stats(input, weight, bias, eps)
    return y, mean, rstd


@_forward_op.register_fake
def _forward_fake(input, weight, bias, eps):
    slices = input.shape[0] * input.shape[1]
    return (torch.empty_like(input), input.new_empty(slices, dtype=torch.float32),
            input.new_empty(slices, dtype=torch.float32))


@torch.library.custom_op("instance_norm_cuda::backward", mutates_args=())
def _backward_op(grad_output: torch.Tensor, input: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                 weight: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_input, grad_weight, grad_bias); grad_output in input's layout; the two
    parameter gradients are float32 (C)."""
    grad_input, grad_weight, grad_bias = _EXT.backward(grad_output, input, mean, rstd, weight)
    return grad_input, grad_weight, grad_bias


@_backward_op.register_fake
def _backward_fake(grad_output, input, mean, rstd, weight):
    channels = input.shape[1]
    return (torch.empty_like(input), input.new_empty(channels, dtype=torch.float32),
            input.new_empty(channels, dtype=torch.float32))


def _forward_setup_context(ctx, inputs, output):
    input, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(input, weight, mean, rstd)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gradients(ctx, grad_output, backward):
    """(grad_input, grad_weight, grad_bias, None) from the saved (input, weight, mean,
    rstd) by `backward` (_EXT.backward, or the custom op under torch.compile). Only y
    is differentiable: mean and rstd are saved statistics."""
    input, weight, mean, rstd = ctx.saved_tensors
    grad_input, grad_weight, grad_bias = backward(_like_layout(grad_output, input), input, mean, rstd, weight)
    # None where no parameter was given, or (eager) none needed a gradient.
    return (grad_input, None if weight is None or grad_weight is None else grad_weight.to(weight.dtype),
            None if ctx.bias_dtype is None or grad_bias is None else grad_bias.to(ctx.bias_dtype), None)


def _forward_backward(ctx, grad_output, grad_mean, grad_rstd):
    return _gradients(ctx, grad_output, _backward_op)


_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup_context)


class _ForwardFunction(torch.autograd.Function):
    """Eager autograd of the forward, calling the extension directly: the custom op's
    dispatch costs tens of microseconds per call, which dominates small inputs. Same
    saved tensors and gradients as _forward_op's autograd (which torch.compile uses);
    the backward is not itself differentiable (double backward raises)."""

    @staticmethod
    def forward(ctx, input, weight, bias, eps):
        y, mean, rstd = _EXT.forward_with_stats(input, weight, bias, eps)
        _forward_setup_context(ctx, (input, weight, bias, eps), (y, mean, rstd))
        ctx.mark_non_differentiable(mean, rstd)
        # grad_mean and grad_rstd are never used: autograd then passes None for them
        # instead of allocating and zero-filling two (N * C) tensors per backward.
        ctx.set_materialize_grads(False)
        return y, mean, rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output, grad_mean, grad_rstd):
        if grad_output is None:
            return None, None, None, None
        # Where neither weight nor bias needs a gradient (none given, or frozen:
        # requires_grad=False) the backward skips the per-channel reductions.
        channel_sums = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        return _gradients(ctx, grad_output, functools.partial(_EXT.backward, channel_sums=channel_sums))


@torch.library.custom_op("instance_norm_cuda::forward_eval", mutates_args=())
def _forward_eval_op(input: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                     weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """Normalization with the running statistics (use_input_stats=False)."""
    return _EXT.forward_eval(input, running_mean, running_var, weight, bias, eps)


@_forward_eval_op.register_fake
def _forward_eval_fake(input, running_mean, running_var, weight, bias, eps):
    return torch.empty_like(input)


def _forward_eval_setup_context(ctx, inputs, output):
    input, running_mean, running_var, weight, bias, eps = inputs
    ctx.save_for_backward(input, running_mean, running_var, weight)
    ctx.eps = eps
    ctx.bias_dtype = None if bias is None else bias.dtype


def _forward_eval_backward(ctx, grad_output):
    """With fixed statistics y is affine in x: grad_input = grad_output * rstd[c] * weight[c]
    (the running buffers get no gradient, as in PyTorch)."""
    input, running_mean, running_var, weight = ctx.saved_tensors
    shape = (1, -1) + (1,) * (input.dim() - 2)
    rstd = torch.rsqrt(running_var.float() + ctx.eps).view(shape)
    scale = rstd if weight is None else rstd * weight.float().view(shape)
    grad = grad_output.float()
    grad_input = (grad * scale).to(input.dtype)
    reduce_dims = [0, *range(2, input.dim())]
    grad_weight = None
    if weight is not None:
        xhat = (input.float() - running_mean.float().view(shape)) * rstd
        grad_weight = (grad * xhat).sum(reduce_dims).to(weight.dtype)
    grad_bias = None if ctx.bias_dtype is None else grad.sum(reduce_dims).to(ctx.bias_dtype)
    return grad_input, None, None, grad_weight, grad_bias, None


_forward_eval_op.register_autograd(_forward_eval_backward, setup_context=_forward_eval_setup_context)


@torch.library.custom_op("instance_norm_cuda::update_running_stats", mutates_args=("running_mean", "running_var"))
def _update_running_stats_op(running_mean: torch.Tensor, running_var: torch.Tensor, mean: torch.Tensor,
                             rstd: torch.Tensor, batch: int, spatial: int, momentum: float, eps: float) -> None:
    """PyTorch's running-statistics update from the forward's per-slice mean and rstd, in place."""
    _EXT.update_running_stats(running_mean, running_var, mean, rstd, batch, spatial, momentum, eps)


@_update_running_stats_op.register_fake
def _update_running_stats_fake(running_mean, running_var, mean, rstd, batch, spatial, momentum, eps):
    return None


def _check_channel_tensor(name, value, input):
    """weight, bias, running_mean, running_var: None or a floating tensor of C elements on the input's device."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"instance_norm: {name} must be a torch.Tensor or None, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"instance_norm: {name} must be a floating-point tensor, got {value.dtype}")
    channels = input.shape[1]
    if value.numel() != channels:
        raise ValueError(f"instance_norm: {name} must have C = {channels} elements, got {value.numel()}")
    if value.device != input.device:
        raise ValueError(f"instance_norm: {name} must be on the input's device {input.device}, got {value.device}")


def _needs_autograd(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    """PyTorch's F.instance_norm on this project's kernels, with autograd.

    input: (N, C, *spatial), at least one spatial dim, any strides. With
    use_input_stats (the default) each (n, c) slice is normalized by its own mean
    and biased variance, (x - mean) / sqrt(var + eps), computed in float32; if
    running_mean and running_var are given (C elements each) they are then
    updated in place as PyTorch does: running = (1 - momentum) * running +
    momentum * (mean over n of the slices' mean, resp. unbiased variance). With
    use_input_stats=False the slices are normalized by running_mean[c] and
    running_var[c] (both required). The result is then scaled by weight[c] and
    shifted by bias[c] when given. Returns a new tensor of the input's shape and
    dtype, in its layout when that is contiguous or channels-last (other strides
    give a contiguous result); the input is not modified.

    CUDA float32, float16 and bfloat16 run the CUDA kernels: directly in eager mode
    (through a torch.autograd.Function when a gradient is needed), through
    torch.library custom ops with autograd under torch.compile; CPU and float64
    inputs run PyTorch's F.instance_norm. Raises TypeError for a non-floating input or
    parameter, ValueError for fewer than 3 dims, a single spatial element with
    use_input_stats, missing running statistics with use_input_stats=False, or a
    weight, bias or running buffer of the wrong size or device.
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"instance_norm: input must be a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"instance_norm: input must be a floating-point tensor, got {input.dtype}")
    if input.dim() < 3:
        raise ValueError(f"instance_norm: input must have shape (N, C, *spatial), got {input.dim()} dims")
    for name, value in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                        ("bias", bias)):
        _check_channel_tensor(name, value, input)
    if (running_mean is None) != (running_var is None):
        raise ValueError("instance_norm: running_mean and running_var must be given together (both None, or both "
                         "tensors of C elements)")
    if use_input_stats and math.prod(input.shape[2:]) == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {list(input.shape)}")
    if not use_input_stats and running_mean is None:
        raise ValueError("instance_norm: use_input_stats=False needs running_mean and running_var (got None)")
    if not input.is_cuda or input.dtype not in _KERNEL_DTYPES:
        return F.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
    x = _readable(input)
    eps = float(eps)
    eager = not torch.compiler.is_compiling()
    if not use_input_stats:
        if eager and not _needs_autograd(input, weight, bias):
            return _EXT.forward_eval(x, running_mean, running_var, weight, bias, eps)
        return _forward_eval_op(x, running_mean, running_var, weight, bias, eps)
    if eager:
        if _needs_autograd(input, weight, bias):
            y, mean, rstd = _ForwardFunction.apply(x, weight, bias, eps)
        elif running_mean is None:
            return _EXT.forward(x, weight, bias, eps)
        else:
            y, mean, rstd = _EXT.forward_with_stats(x, weight, bias, eps)
        if running_mean is not None:
            _EXT.update_running_stats(running_mean, running_var, mean, rstd, x.shape[0], math.prod(x.shape[2:]),
                                      float(momentum), eps)
        return y
    y, mean, rstd = _forward_op(x, weight, bias, eps)
    if running_mean is None:
        return y
    _update_running_stats_op(running_mean, running_var, mean.detach(), rstd.detach(), x.shape[0], math.prod(x.shape[2:]),
                             float(momentum), eps)
    return y


class _InstanceNorm(nn.Module):
    """Base of InstanceNorm1d/2d/3d: the constructor, parameters, buffers, state
    dict and behaviour of PyTorch's _InstanceNorm (same errors and warnings;
    momentum=None means no running-statistics update, as in PyTorch), forward on
    this project's kernels. With affine=True, weight (ones) and bias (zeros, unless
    bias=False) are Parameters of C elements; with track_running_stats=True,
    running_mean (zeros), running_var (ones) and num_batches_tracked are buffers,
    updated in training and used in eval. .to() moves and casts them all.
    Subclasses set _spatial_dims."""

    _version = 2
    _spatial_dims = 2

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False,
                 device=None, dtype=None, *, bias=True):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **factory))
            if bias:
                self.bias = nn.Parameter(torch.zeros(num_features, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features, **factory))
            self.register_buffer("running_var", torch.ones(num_features, **factory))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)

    def reset_running_stats(self):
        if self.track_running_stats:
            self.running_mean.zero_()
            self.running_var.fill_(1)
            self.num_batches_tracked.zero_()

    def reset_parameters(self):
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"bias={self.bias is not None}, track_running_stats={self.track_running_stats}")

    def forward(self, input):
        batched, unbatched = self._spatial_dims + 2, self._spatial_dims + 1
        if input.dim() not in (unbatched, batched):
            raise ValueError(f"expected {unbatched}D or {batched}D input (got {input.dim()}D input)")
        feature_dim = input.dim() - unbatched
        if input.size(feature_dim) != self.num_features:
            if self.affine:
                raise ValueError(f"expected input's size at dim={feature_dim} to match num_features "
                                 f"({self.num_features}), but got: {input.size(feature_dim)}.")
            warnings.warn(f"input's size at dim={feature_dim} does not match num_features. You can silence "
                          "this warning by not passing in num_features, which is not used because affine=False")
        x = input.unsqueeze(0) if input.dim() == unbatched else input
        y = instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                          self.training or not self.track_running_stats,
                          self.momentum if self.momentum is not None else 0.0, self.eps)
        return y.squeeze(0) if input.dim() == unbatched else y


class InstanceNorm1d(_InstanceNorm):
    """Drop-in for PyTorch's nn.InstanceNorm1d: input (N, C, L) or (C, L)."""

    _spatial_dims = 1


class InstanceNorm2d(_InstanceNorm):
    """Drop-in for PyTorch's nn.InstanceNorm2d: input (N, C, H, W) or (C, H, W)."""

    _spatial_dims = 2


class InstanceNorm3d(_InstanceNorm):
    """Drop-in for PyTorch's nn.InstanceNorm3d: input (N, C, D, H, W) or (C, D, H, W)."""

    _spatial_dims = 3


class ModelNew(InstanceNorm2d):
    """Drop-in for PyTorch's nn.InstanceNorm2d (same constructor), the class a
    kernel-eval harness instantiates: ModelNew(num_features)."""
