"""InstanceNorm for PyTorch on NVIDIA GPUs, from CUDA C++ kernels built at import.

Importing or exec'ing this file reads the CUDA sources in kernels/ (found next to
this file, in $INSTANCE_NORM_KERNELS, or in ./kernels when exec'd without
__file__), builds them once with torch.utils.cpp_extension.load_inline into a
private cache directory named by a hash of sources, flags and versions, and
defines:

- ModelNew: drop-in for torch.nn.InstanceNorm2d (same constructor).
- instance_norm: the torch.nn.functional.instance_norm signature.

Supported so far: affine=False, no running statistics, CUDA float32 input of any
shape (N, C, *spatial) or unbatched (C, H, W). CPU and float64 inputs go to
PyTorch's own op; other unsupported options raise NotImplementedError naming them.
Each (n, c) slice of up to 262,144 fp32 values (512 x 512) is normalized by a
thread-block cluster that holds it in registers, so HBM is read once.
"""
import hashlib
import math
import os
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

_KERNEL_FILES = ("common.cuh", "instance_norm.h", "instance_norm_forward.cu", "instance_norm_entry.cpp")
_HEADER_FILES = ("common.cuh", "instance_norm.h")
_CUDA_FILES = ("instance_norm_forward.cu",)
_CPP_FILES = ("instance_norm_entry.cpp",)
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
    """{file name: source text} of every file in _KERNEL_FILES."""
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
    for part in [torch.__version__, str(torch.version.cuda), sys.version, *cuda_flags]:
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


def _load_extension(sources):
    """Build (first use only) and import the extension from {file name: source}."""
    cuda_flags = [*_NVCC_FLAGS, *_arch_flags()]
    name = _extension_name(sources, cuda_flags)
    build_dir = os.path.join(_build_root(), name)
    os.makedirs(build_dir, exist_ok=True)
    for header in _HEADER_FILES:
        _write_if_changed(os.path.join(build_dir, header), sources[header])
    if not os.path.isfile(os.path.join(build_dir, name + ".so")):
        print(f"instance_norm: building CUDA extension {name} in {build_dir} (first use only)", file=sys.stderr)
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


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    """torch.nn.functional.instance_norm on this project's kernels.

    input: (N, C, *spatial), at least one spatial dim. Each (n, c) slice is
    normalized by its own mean and biased variance: (x - mean) / sqrt(var + eps),
    statistics in fp32 (formula as in PyTorch's instance_norm). Returns a new
    contiguous tensor of the input's shape and dtype; the input is not modified.

    CUDA float32 runs the CUDA kernels; CPU and float64 inputs run
    torch.nn.functional.instance_norm. Raises ValueError for fewer than 3 dims or
    a single spatial element, NotImplementedError for running statistics,
    weight/bias, use_input_stats=False, float16/bfloat16 and inputs that require
    grad (not supported yet).
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"instance_norm: input must be a torch.Tensor, got {type(input).__name__}")
    for option, value in (("running_mean", running_mean), ("running_var", running_var),
                          ("weight", weight), ("bias", bias)):
        if value is not None:
            raise NotImplementedError(f"instance_norm: {option} is not supported yet (expected None)")
    if not use_input_stats:
        raise NotImplementedError("instance_norm: use_input_stats=False is not supported yet (expected True)")
    if input.dim() < 3:
        raise ValueError(f"instance_norm: input must have shape (N, C, *spatial), got {input.dim()} dims")
    if math.prod(input.shape[2:]) == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {list(input.shape)}")
    if not input.is_cuda or input.dtype == torch.float64:
        return F.instance_norm(input, eps=eps)
    if input.dtype != torch.float32:
        raise NotImplementedError(f"instance_norm: dtype {input.dtype} is not supported yet on CUDA (expected torch.float32)")
    if input.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("instance_norm: backward is not supported yet (input requires grad)")
    return _EXT.forward(input.contiguous(), float(eps))


class ModelNew(nn.Module):
    """Drop-in for torch.nn.InstanceNorm2d (same constructor) on this project's kernels.

    Input (N, C, H, W) or unbatched (C, H, W); output of the same shape and dtype.
    affine=True and track_running_stats=True raise NotImplementedError (not
    supported yet); device and dtype are accepted for compatibility (there are no
    parameters to place). Errors and warnings as nn.InstanceNorm2d: ValueError for
    other ranks, a warning when C differs from num_features.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False,
                 device=None, dtype=None):
        super().__init__()
        if affine:
            raise NotImplementedError("ModelNew: affine=True is not supported yet (expected affine=False)")
        if track_running_stats:
            raise NotImplementedError(
                "ModelNew: track_running_stats=True is not supported yet (expected track_running_stats=False)")
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")

    def forward(self, input):
        if input.dim() not in (3, 4):
            raise ValueError(f"expected 3D or 4D input (got {input.dim()}D input)")
        if input.size(-3) != self.num_features:
            warnings.warn(f"input's size at dim={input.dim() - 3} does not match num_features. You can silence "
                          "this warning by not passing in num_features, which is not used because affine=False")
        if input.dim() == 3:
            return instance_norm(input.unsqueeze(0), eps=self.eps).squeeze(0)
        return instance_norm(input, eps=self.eps)
