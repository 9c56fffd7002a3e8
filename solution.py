"""InstanceNorm for PyTorch on NVIDIA GPUs, from CUDA C++ kernels built at import.

Importing or exec'ing this file reads the CUDA sources in kernels/ (found next to
this file, in $INSTANCE_NORM_KERNELS, or in ./kernels when exec'd without
__file__), builds them once with torch.utils.cpp_extension.load_inline into a
private cache directory named by a hash of sources, flags and versions, and
defines:

- ModelNew: drop-in for PyTorch's nn.InstanceNorm2d (same constructor).
- InstanceNorm1d, InstanceNorm2d, InstanceNorm3d: drop-ins for PyTorch's.
- instance_norm: the signature of PyTorch's F.instance_norm.

Supported so far: CUDA float32, float16 and bfloat16 input, batched or unbatched,
affine or not; statistics in float32. CPU and float64 inputs go to PyTorch's own
op. Running statistics and backward raise NotImplementedError naming the option.
Each (n, c) slice of up to 524,288 values (e.g. 512 x 512) is normalized on Hopper
by a thread-block cluster that holds it in registers, so HBM is read once.
"""
import hashlib
import math
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
from torch.nn import functional as F
import torch.utils.cpp_extension
from torch.utils.cpp_extension import load_inline

_HEADER_FILES = ("common.cuh", "instance_norm.h")
_CUDA_FILES = ("instance_norm_forward.cu",)
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
    """Directory holding the kernel sources: $INSTANCE_NORM_KERNELS, else kernels/
    next to this file, else ./kernels (exec'd without __file__, as harnesses do)."""
    candidates = []
    if os.environ.get("INSTANCE_NORM_KERNELS"):
        candidates.append(os.environ["INSTANCE_NORM_KERNELS"])
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


_EXT = _load_extension(_read_sources())


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_channel_parameter(name, value, input):
    """weight/bias: None or a floating tensor of C elements on the input's device."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"instance_norm: {name} must be a torch.Tensor or None, got {type(value).__name__}")
    channels = input.shape[1]
    if value.numel() != channels:
        raise ValueError(f"instance_norm: {name} must have C = {channels} elements, got {value.numel()}")
    if value.device != input.device:
        raise ValueError(f"instance_norm: {name} must be on the input's device {input.device}, got {value.device}")


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    """PyTorch's F.instance_norm on this project's kernels.

    input: (N, C, *spatial), at least one spatial dim. Each (n, c) slice is
    normalized by its own mean and biased variance, (x - mean) / sqrt(var + eps),
    then scaled by weight[c] and shifted by bias[c] when given (C elements each).
    Statistics are float32 for every dtype (formula as PyTorch's instance_norm).
    Returns a new contiguous tensor of the input's shape and dtype; the input is
    not modified.

    CUDA float32, float16 and bfloat16 run the CUDA kernels; CPU and float64
    inputs run PyTorch's F.instance_norm. Raises TypeError for a
    non-floating input, ValueError for fewer than 3 dims, a single spatial element
    or a weight/bias of the wrong size or device, NotImplementedError for running
    statistics, use_input_stats=False and, when grad is enabled, inputs or
    parameters that require grad (not supported yet).
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"instance_norm: input must be a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"instance_norm: input must be a floating-point tensor, got {input.dtype}")
    for option, value in (("running_mean", running_mean), ("running_var", running_var)):
        if value is not None:
            raise NotImplementedError(f"instance_norm: {option} is not supported yet (expected None)")
    if not use_input_stats:
        raise NotImplementedError("instance_norm: use_input_stats=False is not supported yet (expected True)")
    if input.dim() < 3:
        raise ValueError(f"instance_norm: input must have shape (N, C, *spatial), got {input.dim()} dims")
    if math.prod(input.shape[2:]) == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {list(input.shape)}")
    _check_channel_parameter("weight", weight, input)
    _check_channel_parameter("bias", bias, input)
    if not input.is_cuda or input.dtype not in _KERNEL_DTYPES:
        return F.instance_norm(input, weight=weight, bias=bias, eps=eps)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        raise NotImplementedError("instance_norm: backward is not supported yet (an input or parameter requires "
                                  "grad; run under torch.no_grad() or torch.inference_mode())")
    return _EXT.forward(input.contiguous(), weight, bias, float(eps))


class _InstanceNorm(nn.Module):
    """Base of InstanceNorm1d/2d/3d: the constructor and behaviour of PyTorch's
    _InstanceNorm (same parameters, including torch 2.14's keyword-only bias;
    same errors and warnings), forward on this project's kernels. With
    affine=True, weight (ones) and bias (zeros, unless bias=False) are
    Parameters of C elements, so .to() moves and casts them. Subclasses set
    _spatial_dims."""

    _spatial_dims = 2

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False,
                 device=None, dtype=None, *, bias=True):
        super().__init__()
        if track_running_stats:
            raise NotImplementedError(f"{type(self).__name__}: track_running_stats=True is not supported yet "
                                      "(expected track_running_stats=False)")
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

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
        if input.dim() == unbatched:
            return instance_norm(input.unsqueeze(0), weight=self.weight, bias=self.bias, eps=self.eps).squeeze(0)
        return instance_norm(input, weight=self.weight, bias=self.bias, eps=self.eps)


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


if __name__ == "__main__":
    import argparse

    # parse_known_args: a harness that runs this file as __main__ with its own
    # arguments gets the import-time build and nothing else.
    _parser = argparse.ArgumentParser(description="InstanceNorm CUDA kernels for PyTorch (see README.md).")
    _parser.add_argument("--bundle", metavar="PATH", help="write a single-file solution with the kernel sources inlined")
    _bundle_path = _parser.parse_known_args()[0].bundle
    if _bundle_path:
        bundle(_bundle_path)
        print(f"instance_norm: wrote {_bundle_path}", file=sys.stderr)
