"""InstanceNorm for PyTorch on NVIDIA GPUs, from CUDA C++ kernels built at import.

Importing or exec'ing this file where a CUDA GPU is visible (or with
INSTANCE_NORM_BUILD=1) reads the CUDA sources in kernels/ (found next to this file,
in $INSTANCE_NORM_KERNELS, or in ./kernels when exec'd without __file__; a
single-file bundle made with --bundle carries them in itself), builds them once
with torch.utils.cpp_extension.load_inline into a private cache directory named by
a hash of sources, flags and versions (a failed build raises), and defines:

- ModelNew: drop-in for PyTorch's nn.InstanceNorm2d (same constructor).
- InstanceNorm1d, InstanceNorm2d, InstanceNorm3d: drop-ins for PyTorch's.
- instance_norm: the signature of PyTorch's F.instance_norm.

CUDA float32, float16 and bfloat16 inputs run the kernels: batched or unbatched,
affine or not, running statistics (training update and eval), contiguous or
channels-last read in place, every spatial size; statistics in float32. The ops
(instance_norm_cuda::instance_norm, forward, backward, forward_eval,
update_running_stats) and their autograd are registered in C++ (TORCH_LIBRARY in
kernels/instance_norm_entry.cpp), their fake kernels here, so eager calls cost one
call into C++, the backward never enters Python, and torch.compile (fullgraph),
CUDA graphs and torch.export work. CPU and float64 inputs go to PyTorch's own op.
Where no GPU is visible and INSTANCE_NORM_BUILD is not 1, the import builds
nothing and warns once: every input then runs PyTorch's ops (_front_python).
Every path but the split path reads HBM once: a warp per slice up to 1,024 values,
a CTA per slice in shared memory up to about 58,000 fp32 / 116,000 16-bit values on
an H200, and on Hopper larger slices (up to 524,288 fp32 / 1,048,576 16-bit values,
e.g. 512 x 512) held in registers by a thread-block cluster.
"""
import hashlib
import inspect
import logging
import math
import numbers
import operator
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "ModelNew", "bundle",
           "convert_instance_norm", "emulated_device", "instance_norm", "set_compile_fusion"]

_HEADER_FILES = ("common.cuh", "instance_norm.h", "pipelined.h", "split.h", "tuning.h")
_CUDA_FILES = ("instance_norm_forward.cu", "instance_norm_pipelined.cu", "instance_norm_split.cu",
               "instance_norm_channels.cu", "instance_norm_backward.cu")
_CPP_FILES = ("instance_norm_entry.cpp",)
_KERNEL_FILES = _HEADER_FILES + _CUDA_FILES + _CPP_FILES
# A bundle (python solution.py --bundle PATH) sets this to {file name: source text}
# of _KERNEL_FILES and then reads nothing from kernels/.
_KERNEL_SOURCES = None
# A build lock older than this is left from a killed build (a cold build takes < 60 s).
_STALE_LOCK_SECONDS = 300
# Compiled for when no GPU is visible at build time (CI): Hopper.
_FALLBACK_CAPABILITIES = ((9, 0),)
# Test mode, for testing only: INSTANCE_NORM_EMULATE=a100 or l40s builds the kernels
# as compute_80 PTX (the driver compiles it for the GPU at hand; no code differs
# between sm_80, sm_86 and sm_89) and makes the path choice see that GPU's compute
# capability, shared memory per CTA and per SM and threads per SM (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability"), so a Hopper
# GPU runs the paths that GPU would run, in the same kernels. The SM count stays
# the real one; times are not that GPU's.
_EMULATED_DEVICES = {
    "a100": {"capability": (8, 0), "shared_per_cta": 163 * 1024, "shared_per_sm": 164 * 1024, "threads_per_sm": 2048},
    "l40s": {"capability": (8, 9), "shared_per_cta": 99 * 1024, "shared_per_sm": 100 * 1024, "threads_per_sm": 1536},
}
_EMULATED_PTX = "-gencode=arch=compute_80,code=compute_80"
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
    candidates = list(dict.fromkeys(candidates))  # one entry when this file is in the working directory
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


def emulated_device():
    """The GPU INSTANCE_NORM_EMULATE names (an entry of _EMULATED_DEVICES), or None
    when it is unset or empty. Raises ValueError for another value."""
    name = os.environ.get("INSTANCE_NORM_EMULATE", "")
    if name and name not in _EMULATED_DEVICES:
        raise ValueError(f"instance_norm: INSTANCE_NORM_EMULATE must be empty or one of {sorted(_EMULATED_DEVICES)}, "
                         f"got {name!r}")
    return _EMULATED_DEVICES.get(name)


def _arch_flags():
    """-gencode flags for every visible GPU, whatever TORCH_CUDA_ARCH_LIST says
    (load_inline adds no arch flags of its own once one is given); for
    _FALLBACK_CAPABILITIES when no GPU is visible; compute_80 PTX alone when a
    device is emulated."""
    if emulated_device() is not None:
        return [_EMULATED_PTX]
    if torch.cuda.is_available():
        capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    else:
        capabilities = set(_FALLBACK_CAPABILITIES)
    return [_gencode(c) for c in sorted(capabilities)]


def _extension_name(sources, cuda_flags):
    """Extension (and build directory) name: a hash of everything that changes
    the binary, so a changed source or flag never loads a stale build."""
    import torch.utils.cpp_extension  # here, not at import: it logs a warning where no CUDA runtime is found

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
    from torch.utils.cpp_extension import load_inline

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


def _build_wanted():
    """Whether the import builds the extension: a CUDA GPU is visible, or
    INSTANCE_NORM_BUILD=1 asks for it (empty, unset or 0: only with a GPU).
    Raises ValueError for another value."""
    value = os.environ.get("INSTANCE_NORM_BUILD", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"instance_norm: INSTANCE_NORM_BUILD must be empty, 0 or 1, got {value!r}")
    return value == "1" or torch.cuda.is_available()


def _extension_or_none():
    """The built extension (built on first use; a failed build raises) when
    _build_wanted(), else None after one warning: no GPU, so nothing is built and
    the layers and instance_norm run PyTorch's ops (_front_python)."""
    if _build_wanted():
        return _load_extension(_read_sources())
    warnings.warn("instance_norm: no CUDA GPU is visible, so the CUDA extension is not built and every layer and "
                  "instance_norm runs PyTorch's own ops on CPU (set INSTANCE_NORM_BUILD=1 to build it anyway)",
                  stacklevel=2)
    return None


if __name__ == "__main__":
    _command_line()

_EXT = _extension_or_none()
_EMULATED = emulated_device()
if _EXT is not None and _EMULATED is not None:
    _EXT.emulate_device(_EMULATED["capability"][0], _EMULATED["shared_per_cta"], _EMULATED["shared_per_sm"],
                        _EMULATED["threads_per_sm"])


def _register_fake(name):
    """Decorator: `fn` becomes the fake (meta) kernel of instance_norm_cuda::<name>,
    what torch.compile runs on fake tensors for output shapes, dtypes and strides.
    A second exec of this file in one process shares the loaded ops and their
    fake kernels: a registered one is kept. Without the extension (no ops) it
    registers nothing."""
    qualname = f"instance_norm_cuda::{name}"

    def register(fn):
        if _EXT is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
            torch.library.register_fake(qualname)(fn)
        return fn

    return register


@_register_fake("forward")
def _forward_fake(input, weight, bias, eps, activation, negative_slope, residual, reflection_pad=()):
    """(y like input, or contiguous of the padded shape with reflection_pad; stats float32 (2, N * C):
    mean, rstd); input already contiguous or channels-last."""
    _install_compile_fusion()
    slices = input.shape[0] * input.shape[1]
    y = input.new_empty(_padded_shape(input.shape, reflection_pad)) if reflection_pad else torch.empty_like(input)
    return y, input.new_empty((2, slices), dtype=torch.float32)


def _padded_shape(shape, reflection_pad):
    """shape with its last dims padded by reflection_pad (F.pad order: the last dim's two values first)."""
    shape = list(shape)
    for i, value in enumerate(reflection_pad):
        shape[len(shape) - 1 - i // 2] += value
    return shape


@_register_fake("backward")
def _backward_fake(grad_output, input, stats, weight, bias, activation, negative_slope, residual, channel_sums,
                   reflection_pad=()):
    """(grad_input like input, grad_parameters float32 (2, C): grad_weight, grad_bias, (2, 0) without
    channel_sums; grad_residual like input with a residual and an activation, else float32 (0))."""
    channels = input.shape[1] if channel_sums else 0
    grad_residual = (torch.empty_like(input) if residual is not None and activation != 0
                     else input.new_empty(0, dtype=torch.float32))
    return torch.empty_like(input), input.new_empty((2, channels), dtype=torch.float32), grad_residual


@_register_fake("forward_eval")
def _forward_eval_fake(input, running_mean, running_var, weight, bias, eps, activation, negative_slope, residual):
    _install_compile_fusion()
    return torch.empty_like(input)


@_register_fake("update_running_stats")
def _update_running_stats_fake(running_mean, running_var, input, stats, momentum, eps):
    return None


# The front as an op (what torch.compile traces); None without the extension.
_instance_norm_op = None if _EXT is None else torch.ops.instance_norm_cuda.instance_norm.default
# A dropped convolution bias's gradient (_DroppedBias); None without the extension.
_ZERO_GRADIENT_OP = None if _EXT is None else torch.ops.instance_norm_cuda.zero_gradient.default


# The activation names instance_norm takes (None: no activation), as in torch.nn.functional;
# "gelu_tanh" is F.gelu(approximate="tanh").
ACTIVATIONS = (None, "relu", "leaky_relu", "silu", "gelu", "gelu_tanh")
# Their list in the error messages of the functional and the modules alike.
_ACTIVATION_CHOICES = "None, " + ", ".join(map(repr, ACTIVATIONS[1:-1])) + " or " + repr(ACTIVATIONS[-1])


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5, activation=None, negative_slope=0.01,
                  residual=None, reflection_pad=None):
    """PyTorch's F.instance_norm on this project's kernels, with autograd, and a
    fused epilogue: act(instance_norm(...) + residual), then a reflection pad.

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

    Epilogue, fused into the same kernels (the forward reads x and the residual
    once and writes y once; the backward recomputes the pre-activation from x and
    the saved statistics): residual, a tensor of the input's shape, dtype and
    device, is added after the affine map; then activation, one of ACTIVATIONS,
    is applied: "relu", "leaky_relu" (with negative_slope), "silu", "gelu" (erf
    form) or "gelu_tanh" (tanh form), as torch.nn.functional defines them. So
    instance_norm(x, ..., activation="relu", residual=r) equals
    F.relu(F.instance_norm(x, ...) + r). With reflection_pad, residual may instead
    have the padded shape, without an activation: it is then added after the pad,
    F.pad(F.instance_norm(x, ...), reflection_pad, mode="reflect") + r. A residual
    block whose sum is padded again by the next block can keep its sums padded
    that way, one kernel a layer (the compile rewrite does this for CycleGAN's).

    reflection_pad, a sequence of 2 ints per spatial dim in F.pad's order (the last
    dim's left and right first), each >= 0 and less than the size of the dim it
    pads, pads the result as F.pad(y, reflection_pad, mode="reflect") (nn.
    ReflectionPad1d/2d/3d) does; the result is then contiguous. The forward kernel
    writes the padded output and the backward kernel reads the padded gradient
    where the slices take the block paths (contiguous 1D and 2D input without a
    residual or with one of the padded shape: up to 16,384 fp32 or 32,768 16-bit
    values a slice); elsewhere PyTorch's pad runs after the kernels and its backward
    before them.

    CUDA float32, float16 and bfloat16 run the CUDA kernels; CPU and float64
    inputs, and all inputs when the extension is not built (no GPU visible), run
    PyTorch's F.instance_norm. Eager calls go to the extension's front
    (kernels/instance_norm_entry.cpp) in one call; under torch.compile the same
    front is the op instance_norm_cuda::instance_norm, which traces into the ops
    forward, backward, forward_eval and update_running_stats. Raises TypeError for a
    non-tensor or non-floating input or parameter, ValueError for fewer than 3 dims,
    a single spatial element with use_input_stats, missing running statistics with
    use_input_stats=False, a weight, bias or running buffer of the wrong size or
    device, an unknown activation, a reflection_pad of the wrong length or a value
    out of range (TypeError for a non-integer one), or a residual of another shape
    or device, or of the padded shape with an activation (TypeError for another
    dtype).
    """
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"instance_norm: input must be a torch.Tensor, got {type(input).__name__}")
    for name, value in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                        ("bias", bias)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"instance_norm: {name} must be a torch.Tensor or None, got {type(value).__name__}")
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise TypeError(f"instance_norm: residual must be a torch.Tensor or None, got {type(residual).__name__}")
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"instance_norm: activation must be {_ACTIVATION_CHOICES}, got {type(activation).__name__}")
    momentum = _real("momentum", momentum, as_torch_float=True)
    eps = _real("eps", eps, as_torch_float=True)
    return _front(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, activation,
                  _real("negative_slope", negative_slope), residual,
                  _int_tuple("reflection_pad", reflection_pad))


def _real(name, value, as_torch_float=False, owner="instance_norm"):
    """`value` (a real number, not a bool) as a float; with as_torch_float, whatever
    F.instance_norm's float arguments take (a bool or a one-element tensor too).
    TypeError naming `owner` and `name` otherwise."""
    taken = (isinstance(value, numbers.Real) and (as_torch_float or not isinstance(value, bool))
             or as_torch_float and isinstance(value, torch.Tensor) and value.numel() == 1)
    if not taken:
        raise TypeError(f"{owner}: {name} must be a real number, got {type(value).__name__}")
    return float(value)


def _int_tuple(name, value):
    """None, or `value` (a sequence of ints) as a tuple of ints: TypeError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or not all(
            isinstance(item, int) and not isinstance(item, bool) for item in value):
        raise TypeError(f"instance_norm: {name} must be None or a sequence of ints, got {value!r}")
    return tuple(int(item) for item in value)


def _front(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, activation=None,
           negative_slope=0.01, residual=None, reflection_pad=None):
    """The extension's front (validation, dispatch, running-statistics update): one
    direct call in eager mode; under torch.compile the op, which Dynamo can trace.
    Without the extension, _front_python."""
    if _EXT is None:
        return _front_python(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps,
                             activation, negative_slope, residual, reflection_pad)
    if torch.compiler.is_compiling():
        return _instance_norm_op(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps,
                                 activation, negative_slope, residual, reflection_pad)
    return _EXT.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps,
                              activation, negative_slope, residual, reflection_pad)


def _front_python(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, activation,
                  negative_slope, residual, reflection_pad):
    """The extension's front for CPU and float64 inputs, in Python, for when the
    extension is not built: the same checks and errors (_check_front_arguments),
    then PyTorch's instance_norm (running statistics updated in place as there),
    the epilogue act(y + residual) and the reflection pad as PyTorch ops (a residual
    of the padded shape added after the pad), with PyTorch's autograd."""
    _check_front_arguments(input, running_mean, running_var, weight, bias, use_input_stats, activation, residual,
                           reflection_pad)
    y = torch.instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, False)
    if residual is not None and residual.shape != input.shape:  # of the padded shape: added after the pad
        return F.pad(y, reflection_pad, mode="reflect") + residual
    y = _apply_activation(y if residual is None else y + residual, activation, negative_slope)
    return F.pad(y, reflection_pad, mode="reflect") if reflection_pad else y


def _apply_activation(y, activation, negative_slope):
    """activation (one of ACTIVATIONS, or "none") applied to y as torch.nn.functional defines it."""
    if activation == "relu":
        return F.relu(y)
    if activation == "leaky_relu":
        return F.leaky_relu(y, negative_slope)
    if activation == "silu":
        return F.silu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    return y


def _scalar_type_name(dtype):
    """dtype's name as the extension's messages print it (C++ ScalarType: torch.int64 is Long)."""
    return torch.empty(0, dtype=dtype).type()[len("torch."):-len("Tensor")]


def _check_channel_tensor(name, value, input):
    """None, or a floating tensor of C elements and at most one dimension on input's device:
    TypeError, ValueError otherwise."""
    if value is None:
        return
    if not value.is_floating_point():
        raise TypeError(f"instance_norm: {name} must be a floating-point tensor, got {_scalar_type_name(value.dtype)}")
    if value.dim() > 1:
        raise ValueError(f"instance_norm: {name} must be a 1-D tensor of C = {input.shape[1]} elements, "
                         f"got {value.dim()} dimensions")
    if value.numel() != input.shape[1]:
        raise ValueError(f"instance_norm: {name} must have C = {input.shape[1]} elements, got {value.numel()}")
    if value.device != input.device:
        raise ValueError(f"instance_norm: {name} must be on the input's device {input.device}, got {value.device}")


def _check_front_arguments(input, running_mean, running_var, weight, bias, use_input_stats, activation, residual,
                           reflection_pad):
    """The extension front's checks of its arguments (check_arguments, activation_code,
    check_reflection_pad and check_residual in kernels/instance_norm_entry.cpp), in
    its order and with its messages: TypeError for a non-floating input or parameter
    or a residual of another dtype; ValueError for fewer than 3 dims, a parameter or
    buffer of the wrong size or device, running_mean without running_var (or the
    reverse), a single spatial element with use_input_stats, no running statistics
    without it, an unknown activation, a reflection_pad (a tuple of ints or None) of
    the wrong length or out of range, a residual of another shape or device, or of
    the padded shape with an activation."""
    if not input.is_floating_point():
        raise TypeError(f"instance_norm: input must be a floating-point tensor, got {_scalar_type_name(input.dtype)}")
    if input.dim() < 3:
        raise ValueError(f"instance_norm: input must have shape (N, C, *spatial), got {input.dim()} dims")
    for name, value in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight),
                        ("bias", bias)):
        _check_channel_tensor(name, value, input)
    if (running_mean is None) != (running_var is None):
        raise ValueError("instance_norm: running_mean and running_var must be given together (both None, or both "
                         "tensors of C elements)")
    if use_input_stats and input.shape[2:].numel() == 1:
        raise ValueError(f"Expected more than 1 spatial element when training, got input size {list(input.shape)}")
    if not use_input_stats and running_mean is None:
        raise ValueError("instance_norm: use_input_stats=False needs running_mean and running_var (got None)")
    if activation is not None and activation not in ACTIVATIONS and activation != "none":
        raise ValueError(f"instance_norm: activation must be {_ACTIVATION_CHOICES}, got {activation!r}")
    if reflection_pad:
        spatial_dims = input.dim() - 2
        if spatial_dims > 3:
            raise ValueError(f"instance_norm: reflection_pad needs 1 to 3 spatial dims, got {spatial_dims}")
        if len(reflection_pad) != 2 * spatial_dims:
            raise ValueError(f"instance_norm: reflection_pad must have {2 * spatial_dims} values (2 per spatial dim), "
                             f"got {len(reflection_pad)}")
        for i, value in enumerate(reflection_pad):
            dim = input.dim() - 1 - i // 2
            if not 0 <= value < input.shape[dim]:
                raise ValueError("instance_norm: reflection_pad values must be >= 0 and less than the size of the "
                                 f"dim they pad, got {value} for dim {dim} of size {input.shape[dim]}")
    if residual is not None:
        _check_residual(input, activation, residual, reflection_pad)


def _check_residual(input, activation, residual, reflection_pad):
    """The front's checks of a residual (check_residual in kernels/instance_norm_entry.cpp):
    the input's dtype (TypeError), device and shape, or with reflection_pad the padded
    shape, which takes no activation (ValueError)."""
    if residual.dtype != input.dtype:
        raise TypeError(f"instance_norm: residual must have the input's dtype {_scalar_type_name(input.dtype)}, "
                        f"got {_scalar_type_name(residual.dtype)}")
    padded = _padded_shape(input.shape, reflection_pad) if reflection_pad else None
    if residual.shape != input.shape and list(residual.shape) != padded:
        also = f" or the padded shape {padded}" if padded else ""
        raise ValueError(f"instance_norm: residual must have the input's shape {list(input.shape)}{also}, "
                         f"got {list(residual.shape)}")
    if residual.shape != input.shape and activation not in (None, "none"):
        raise ValueError("instance_norm: a residual of the padded shape is added after the pad and takes no "
                         f"activation, got activation '{activation}'")
    if residual.device != input.device:
        raise ValueError(f"instance_norm: residual must be on the input's device {input.device}, "
                         f"got {residual.device}")


# PyTorch's norms take (and print) a `bias` keyword from torch 2.14 on; the repr
# follows the installed torch's.
_TORCH_NORMS_TAKE_BIAS = "bias" in inspect.signature(nn.InstanceNorm2d).parameters


class _InstanceNorm(nn.Module):
    """Base of InstanceNorm1d/2d/3d: the constructor, parameters, buffers, state
    dict and behaviour of PyTorch's _InstanceNorm (same errors and warnings;
    momentum=None means no running-statistics update, as in PyTorch), forward on
    this project's kernels. With affine=True, weight (ones) and bias (zeros, unless
    bias=False) are Parameters of C elements; with track_running_stats=True,
    running_mean (zeros), running_var (ones) and num_batches_tracked are buffers,
    updated in training and used in eval. .to() moves and casts them all.
    activation (one of ACTIVATIONS) and negative_slope fuse an activation into the
    layer: forward returns act(norm(x)), as instance_norm's epilogue;
    reflection_pad (2 ints per spatial dim, F.pad's order, as instance_norm takes
    it) then pads that as nn.ReflectionPad1d/2d/3d would. Subclasses set
    _spatial_dims."""

    _version = 2
    _spatial_dims = 2

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False,
                 device=None, dtype=None, *, bias=True, activation=None, negative_slope=0.01, reflection_pad=None):
        super().__init__()
        if activation is not None and not isinstance(activation, str):
            raise TypeError(f"{type(self).__name__}: activation must be {_ACTIVATION_CHOICES}, "
                            f"got {type(activation).__name__}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: activation must be {_ACTIVATION_CHOICES}, got {activation!r}")
        self.activation = activation
        owner = type(self).__name__
        self.negative_slope = _real("negative_slope", negative_slope, owner=owner)
        _real("eps", eps, as_torch_float=True, owner=owner)  # kept as given, as PyTorch keeps it
        if momentum is not None:
            _real("momentum", momentum, as_torch_float=True, owner=owner)
        self.reflection_pad = _int_tuple("reflection_pad", reflection_pad)
        if self.reflection_pad is not None and (len(self.reflection_pad) != 2 * self._spatial_dims
                                                or min(self.reflection_pad, default=0) < 0):
            raise ValueError(f"{type(self).__name__}: reflection_pad must be {2 * self._spatial_dims} values >= 0 "
                             f"(2 per spatial dim), got {self.reflection_pad}")
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
        bias = f"bias={self.bias is not None}, " if _TORCH_NORMS_TAKE_BIAS else ""
        activation = "" if self.activation is None else f", activation={self.activation!r}"
        if self.activation == "leaky_relu":
            activation += f", negative_slope={self.negative_slope}"
        if self.reflection_pad is not None:
            activation += f", reflection_pad={self.reflection_pad}"
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"{bias}track_running_stats={self.track_running_stats}{activation}")

    def forward(self, input):
        shape = input.shape  # one call into torch for the rank and C (size() costs more)
        feature_dim = len(shape) - self._spatial_dims - 1  # 1 batched, 0 unbatched
        if feature_dim not in (0, 1):
            raise ValueError(f"expected {self._spatial_dims + 1}D or {self._spatial_dims + 2}D input "
                             f"(got {len(shape)}D input)")
        if shape[feature_dim] != self.num_features:
            if self.affine:
                raise ValueError(f"expected input's size at dim={feature_dim} to match num_features "
                                 f"({self.num_features}), but got: {shape[feature_dim]}.")
            warnings.warn(f"input's size at dim={feature_dim} does not match num_features. You can silence "
                          "this warning by not passing in num_features, which is not used because affine=False")
        # Parameters and buffers straight from their dicts: nn.Module.__getattr__ costs
        # host time on every call. They are tensors or None by construction, so the
        # front takes them without the functional's type checks.
        parameters, buffers = self._parameters, self._buffers
        y = _front(input if feature_dim else input.unsqueeze(0), buffers["running_mean"], buffers["running_var"],
                   parameters["weight"], parameters["bias"], self.training or not self.track_running_stats,
                   0.0 if self.momentum is None else float(self.momentum), float(self.eps), self.activation,
                   float(self.negative_slope), None, self.reflection_pad)
        return y if feature_dim else y.squeeze(0)


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


# PyTorch's norm classes the converter replaces (exactly these: a subclass may
# change forward) and ours for each.
_CONVERTED = {nn.InstanceNorm1d: InstanceNorm1d, nn.InstanceNorm2d: InstanceNorm2d, nn.InstanceNorm3d: InstanceNorm3d}


def _fusable_activation(module):
    """(activation, negative_slope) of an activation module the norms can fuse, else None."""
    if module._forward_hooks or module._forward_pre_hooks:
        return None
    if type(module) is nn.ReLU:
        return "relu", 0.01
    if type(module) is nn.LeakyReLU:
        return "leaky_relu", float(module.negative_slope)
    if type(module) is nn.SiLU:
        return "silu", 0.01
    if type(module) is nn.GELU:
        return ("gelu_tanh" if module.approximate == "tanh" else "gelu"), 0.01
    return None


def _converted_norm(norm):
    """This project's layer in place of PyTorch's `norm`: the same hyperparameters,
    the same Parameter and buffer objects (an optimizer holding them keeps working),
    device, dtype and train/eval state."""
    # Built on the meta device (nothing allocated), then given norm's own tensors.
    ours = _CONVERTED[type(norm)](norm.num_features, norm.eps, norm.momentum, norm.affine, norm.track_running_stats,
                                  device="meta")
    for name in ("weight", "bias"):
        ours.register_parameter(name, norm._parameters.get(name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        ours.register_buffer(name, norm._buffers.get(name))
    ours.train(norm.training)
    return ours


# The reflection pads the converter folds into a norm of as many spatial dims.
_REFLECTION_PADS = {nn.ReflectionPad1d: 1, nn.ReflectionPad2d: 2, nn.ReflectionPad3d: 3}


def _fold_reflection_pads(sequential, prefix, folded):
    """Folds each nn.ReflectionPad1d/2d/3d (without hooks) that follows one of our
    norms of its spatial dims in `sequential`, directly or after nn.Identity
    modules without hooks (those the activation fusion leaves), into the norm's
    reflection_pad, putting nn.Identity in its place; appends the pads' names."""
    names = list(sequential._modules)
    for i, name in enumerate(names):
        norm = sequential._modules[name]
        if not isinstance(norm, _InstanceNorm) or norm.reflection_pad is not None:
            continue
        j = i + 1
        while j < len(names) and type(sequential._modules[names[j]]) is nn.Identity and not (
                sequential._modules[names[j]]._forward_hooks or sequential._modules[names[j]]._forward_pre_hooks):
            j += 1
        pad = sequential._modules[names[j]] if j < len(names) else None
        if (_REFLECTION_PADS.get(type(pad)) == norm._spatial_dims and not pad._forward_hooks
                and not pad._forward_pre_hooks):
            norm.reflection_pad = tuple(int(value) for value in pad.padding)
            sequential._modules[names[j]] = nn.Identity().train(pad.training)
            folded.append(f"{prefix}.{names[j]}" if prefix else names[j])


def convert_instance_norm(module, fuse_activations=True, fuse_padding=True):
    """Replace every nn.InstanceNorm1d/2d/3d in `module` (itself included) with this
    project's layer, as nn.SyncBatchNorm.convert_sync_batchnorm does for batch norm:
    the same Parameters and buffers, train/eval state, device and dtype. With
    fuse_activations, an activation module (nn.ReLU, nn.LeakyReLU, nn.SiLU, nn.GELU)
    right after a converted norm inside an nn.Sequential is folded into the norm
    (its activation=) and replaced by nn.Identity. With fuse_padding, an
    nn.ReflectionPad1d/2d/3d after such a norm (or after its folded activation) is
    folded into the norm (its reflection_pad=) and replaced by nn.Identity. Returns
    the converted module (a new object only when `module` is itself a norm); what
    was converted and fused is logged at INFO level by the logger "instance_norm":
    each count followed by the modules' qualified names (as named_modules gives them).
    TypeError where `module` is not an nn.Module or a fuse option not a bool."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_instance_norm: module must be an nn.Module, got {type(module).__name__}")
    for name, value in (("fuse_activations", fuse_activations), ("fuse_padding", fuse_padding)):
        if not isinstance(value, bool):
            raise TypeError(f"convert_instance_norm: {name} must be a bool, got {type(value).__name__}")
    converted, fused, padded = [], [], []

    def convert(name, child):
        if type(child) in _CONVERTED:
            converted.append(name or type(child).__name__)
            return _converted_norm(child)
        for child_name, grandchild in list(child.named_children()):
            setattr(child, child_name, convert(f"{name}.{child_name}" if name else child_name, grandchild))
        if fuse_activations and isinstance(child, nn.Sequential):
            names = list(child._modules)
            for first, second in zip(names, names[1:]):
                norm, activation = child._modules[first], child._modules[second]
                fusable = _fusable_activation(activation) if isinstance(norm, _InstanceNorm) else None
                if fusable is not None and norm.activation is None:
                    norm.activation, norm.negative_slope = fusable
                    child._modules[second] = nn.Identity().train(activation.training)
                    fused.append(f"{name}.{second}" if name else second)
        if fuse_padding and isinstance(child, nn.Sequential):
            _fold_reflection_pads(child, name, padded)
        return child

    module = convert("", module)
    logging.getLogger("instance_norm").info(
        "convert_instance_norm: norms converted: %d (%s); activations fused: %d (%s); reflection pads fused: %d (%s)",
        len(converted), ", ".join(converted), len(fused), ", ".join(fused), len(padded), ", ".join(padded))
    return module


# Epilogue fusion under torch.compile. A rewrite of the graph Dynamo captures
# (inductor's pre_grad_custom_pass hook, which runs before AOTAutograd derives the
# backward, so the fused op's own autograd serves the backward) folds the activation,
# the residual add and the reflection pad that follow our norm into its epilogue:
# F.relu(norm(x)), norm(x) + r and F.pad(norm(x), p, "reflect") become one
# instance_norm_cuda::instance_norm call, forward and backward, as inductor fuses
# PyTorch's own norm with them; a residual sum that the next block both pads and adds
# stays padded (_pad_kept_for_users). Pre-grad graphs are not
# functional, so the rewrite fires only where it cannot change what the graph
# computes: the norm's output has that one user, the added tensor has the output's
# shape, dtype and device (no broadcast, no type promotion), and no node between
# the norm and its user may mutate a tensor or read the running statistics it updates.
# It also drops the bias of a convolution whose only user is a norm that normalizes
# by the input's own statistics with no running statistics (_drop_convolution_bias):
# a per-channel constant is one constant over each slice, which the mean removes, so
# the bias changes neither the norm's output nor anything after it and its exact
# gradient is zero (a non-finite bias, with which eager's output is NaN, is dropped
# alike). Inductor runs a convolution's bias as a pass over the output and its
# gradient as a reduction over the input's gradient, where our op keeps it from
# fusing them. Verified on torch 2.11 and 2.14; before 2.11 it is not installed. On
# other graph forms it matches nothing and changes nothing.
_COMPILE_FUSION = {"enabled": True}
# Without the extension there is no op to fold into: the rewrite matches nothing.
_FRONT_SCHEMA = () if _instance_norm_op is None else _instance_norm_op._schema.arguments
_FRONT_ARGUMENTS = tuple(argument.name for argument in _FRONT_SCHEMA)
_FRONT_DEFAULTS = {argument.name: argument.default_value for argument in _FRONT_SCHEMA if argument.has_default_value()}
_FRONT_TARGETS = () if _instance_norm_op is None else (_instance_norm_op, torch.ops.instance_norm_cuda.instance_norm)
_RELU_TARGETS = (torch.relu, torch.relu_, F.relu, F.relu_)
# Convolutions as Dynamo captures them (F.conv2d is torch.conv2d); the bias is argument 2 of each.
_CONVOLUTION_TARGETS = (torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
                        torch.conv_transpose3d)
_ADD_TARGETS = (operator.add, torch.add)
# F.pad as Dynamo captures it (torch._C._nn.pad), and as written.
_PAD_TARGETS = (torch._C._nn.pad, F.pad)
_INPLACE_OPERATORS = (operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul, operator.setitem, operator.delitem)
_MINIMUM_TORCH_FOR_COMPILE_FUSION = (2, 11)


def set_compile_fusion(enabled):
    """Turns the torch.compile epilogue fusion on (the default, True) or off (False)
    for graphs compiled from now on (inductor's cache key includes the setting).
    TypeError where `enabled` is not a bool."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_compile_fusion: enabled must be a bool, got {type(enabled).__name__}")
    _COMPILE_FUSION["enabled"] = enabled


def _activation_applied(node):
    """(activation, negative_slope) that FX node `node` of a Dynamo graph applies to
    its first argument, if one instance_norm can fuse, else None."""
    args, kwargs = node.args, node.kwargs
    if node.op == "call_method":
        return ("relu", 0.01) if node.target in ("relu", "relu_") else None
    if node.op != "call_function":
        return None
    if node.target in _RELU_TARGETS:
        return "relu", 0.01
    if node.target is F.leaky_relu:
        slope = args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
        return ("leaky_relu", float(slope)) if type(slope) in (int, float) else None
    if node.target is F.silu:
        return "silu", 0.01
    if node.target is F.gelu:
        approximate = args[1] if len(args) > 1 else kwargs.get("approximate", "none")
        return {"none": ("gelu", 0.01), "tanh": ("gelu_tanh", 0.01)}.get(approximate)
    return None


def _tensor_added(node, norm):
    """The other operand of `node` when it is an out-of-place add of `norm`'s output
    and another FX node (alpha 1), else None."""
    is_add = (node.op == "call_function" and node.target in _ADD_TARGETS) or (
        node.op == "call_method" and node.target == "add")
    if not is_add or len(node.args) != 2 or set(node.kwargs) - {"alpha"} or node.kwargs.get("alpha", 1) != 1:
        return None
    first, second = node.args
    other = second if first is norm else first
    return other if isinstance(other, torch.fx.Node) and other is not norm else None


def _reflection_pad_applied(node, norm, arguments):
    """The pad that FX node `node` applies to the output of front call `norm` (its
    arguments by name are `arguments`), as a list, when `node` is F.pad(norm's
    output, pad, "reflect") and our kernels write that pad and read its gradient
    (instance_norm's reflection_pad): the output static, contiguous, 1D or 2D, no
    residual, the input's own statistics, slices of whole 16-byte vectors larger
    than the warp path's and within the backward block path's (forward_capacities,
    backward_capacities), padded rows of one 16-byte vector at least. Elsewhere PyTorch's pad would run inside our op, where
    inductor fuses its own; None."""
    if node.op != "call_function" or node.target not in _PAD_TARGETS or not node.args or node.args[0] is not norm:
        return None
    call = dict(zip(("input", "pad", "mode", "value"), node.args), **node.kwargs)
    pad, output_type, value = call.get("pad"), _static_tensor_type(norm), norm.meta.get("example_value")
    if (call.get("mode") != "reflect" or call.get("value") is not None or not isinstance(pad, (tuple, list))
            or not all(type(item) is int for item in pad) or output_type is None or arguments["residual"] is not None
            or arguments["use_input_stats"] is not True):
        return None
    shape, dtype, _ = output_type
    dtype_name = str(dtype).split(".")[-1]
    if dtype_name not in _EXT.backward_capacities or len(shape) not in (3, 4) or len(pad) != 2 * (len(shape) - 2):
        return None
    spatial, per_vector = math.prod(shape[2:]), 16 // value.element_size()
    if (not value.is_contiguous() or spatial % per_vector or shape[-1] + pad[0] + pad[1] < per_vector
            or not _EXT.forward_capacities[dtype_name]["warp_spatial"] < spatial
            <= _EXT.backward_capacities[dtype_name]["block_spatial"]
            or not all(0 <= item < shape[len(shape) - 1 - i // 2] for i, item in enumerate(pad))):
        return None
    return list(pad)


def _static_tensor_type(node):
    """(shape, dtype, device) of the tensor FX node `node` produced while Dynamo traced, when its shape is static."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or not all(type(size) is int for size in value.shape):
        return None
    return tuple(value.shape), value.dtype, value.device


def _may_mutate(node):
    """Whether FX node `node` of a pre-grad graph may write a tensor in place (conservative)."""
    if node.op == "call_module":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True or True in node.args[1:]:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    schema = getattr(node.target, "_schema", None)
    return (name.endswith("_") and not name.endswith("__")) or (schema is not None and schema.is_mutable)


def _movable_to(norm, user, arguments):
    """Whether front call `norm` (its arguments by name) may move to just before FX
    node `user`: no node strictly between may mutate a tensor (one the norm reads),
    nor read the running statistics the norm updates."""
    updated = {arguments["running_mean"], arguments["running_var"]} - {None} if arguments["use_input_stats"] else set()
    node = norm.next
    while node is not user:
        if _may_mutate(node) or updated & set(node.all_input_nodes):
            return False
        node = node.next
    return True


def _absorb_user(graph, norm, arguments):
    """Folds the one user of FX node `norm` (a front call whose arguments by name are
    `arguments`) into a new front call in the user's place when the epilogue can take
    it: a reflection pad the kernels take (_reflection_pad_applied) when the norm has
    none; an activation when the norm has neither; a residual add when it has none
    of the three. Returns the new node, or None."""
    (user,) = norm.users
    if arguments["reflection_pad"] is not None or not _movable_to(norm, user, arguments):
        return None
    pad = _reflection_pad_applied(user, norm, arguments)
    activation = _activation_applied(user) if user.args and user.args[0] is norm else None
    if pad is not None:
        fused = dict(arguments, reflection_pad=pad)
    elif arguments["activation"] is not None:
        return None
    elif activation is not None:
        fused = dict(arguments, activation=activation[0], negative_slope=activation[1])
    else:
        residual = _tensor_added(user, norm) if arguments["residual"] is None else None
        output_type = _static_tensor_type(norm)
        if (residual is None or output_type is None or _static_tensor_type(residual) != output_type
                or _static_tensor_type(user) != output_type):
            return None
        fused = dict(arguments, residual=residual)
    with graph.inserting_before(user):
        node = graph.call_function(_instance_norm_op, tuple(fused[name] for name in _FRONT_ARGUMENTS))
    node.meta = dict(norm.meta, example_value=user.meta.get("example_value"))
    user.replace_all_uses_with(node)
    graph.erase_node(user)
    graph.erase_node(norm)
    return node


def _pad_kept_for_users(graph, norm, arguments, crops):
    """Where a reflection pad the kernels take (_reflection_pad_applied, the residual
    aside) is one of several users of FX node `norm` (a front call whose arguments by
    name are `arguments`), e.g. the sum of a residual block that the next block both
    pads and adds: replaces norm by a front call that writes the padded output
    (reflection_pad=), which the pad's users take, and gives norm's other users a crop
    of it (a view). A residual that is such a crop (`crops`: {crop node: (padded node,
    pad)}) with the same pad is read padded instead (added after the pad, no
    activation), so a chain of residual blocks keeps its sums padded. The other users
    must be adds or front calls (none writes in place into the shared storage).
    Records the new crop in `crops`; returns the new node, or None."""
    unpadded = dict(arguments, residual=None)
    pads = [user for user in norm.users if _reflection_pad_applied(user, norm, unpadded) is not None]
    others = [user for user in norm.users if user not in pads]
    residual = arguments["residual"]
    if (len(pads) != 1 or arguments["reflection_pad"] is not None
            or not all(user.target in _FRONT_TARGETS or _tensor_added(user, norm) is not None for user in others)):
        return None
    (pad_node,) = pads
    pad = _reflection_pad_applied(pad_node, norm, unpadded)
    if residual is not None and (crops.get(residual, (None, None))[1] != pad or arguments["activation"] is not None):
        return None
    fused = dict(arguments, reflection_pad=pad, residual=None if residual is None else crops[residual][0])
    padded_value = pad_node.meta["example_value"]
    with graph.inserting_before(norm):
        node = graph.call_function(_instance_norm_op, tuple(fused[name] for name in _FRONT_ARGUMENTS))
        node.meta = dict(norm.meta, example_value=padded_value)
        if others:
            shape = norm.meta["example_value"].shape
            window = tuple(slice(pad[2 * i], pad[2 * i] + shape[-1 - i]) for i in reversed(range(len(pad) // 2)))
            crop = graph.call_function(operator.getitem, (node, (slice(None), slice(None), *window)))
            with padded_value.fake_mode:
                crop.meta = dict(norm.meta, example_value=padded_value[(slice(None), slice(None), *window)])
            crops[crop] = (node, pad)
            norm.replace_all_uses_with(crop)
    pad_node.replace_all_uses_with(node)
    graph.erase_node(pad_node)
    graph.erase_node(norm)
    if residual is not None and not residual.users:
        graph.erase_node(residual)
        del crops[residual]
    return node


class _DroppedBias(torch.autograd.Function):
    """What _drop_convolution_bias puts between a convolution whose bias it dropped and
    the norm after it: forward, x itself (autograd makes the output a view of x, no
    copy); backward, x's gradient passed on and zeros of the bias's shape, dtype and
    device for the bias, its exact gradient (instance_norm_cuda::zero_gradient, which
    _merge_zero_gradients fills as one buffer for all of a graph's dropped biases)."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(bias)
        return x

    @staticmethod
    def backward(ctx, grad):
        (bias,) = ctx.saved_tensors
        return grad, _ZERO_GRADIENT_OP(bias)


def _drop_convolution_bias(graph, norm, arguments):
    """Drops the bias of the convolution that FX node `norm` (a front call whose
    arguments by name are `arguments`) normalizes, when that cannot change the graph's
    results: the norm uses the input's statistics (use_input_stats True) and no
    running statistics, and the convolution's output has no other use. The bias then
    adds one constant to each slice, which the mean removes. The bias keeps its
    place in the backward through _DroppedBias, with a zero gradient. Returns whether
    it dropped one."""
    convolution = arguments["input"]
    if (arguments["use_input_stats"] is not True or arguments["running_mean"] is not None
            or arguments["running_var"] is not None or not isinstance(convolution, torch.fx.Node)
            or convolution.op != "call_function" or convolution.target not in _CONVOLUTION_TARGETS
            or len(convolution.users) != 1 or list(norm.args).count(convolution) != 1
            or convolution in norm.kwargs.values()):
        return False
    in_args = len(convolution.args) > 2
    bias = convolution.args[2] if in_args else convolution.kwargs.get("bias")
    if not isinstance(bias, torch.fx.Node):
        return False
    if in_args:
        convolution.args = (*convolution.args[:2], None, *convolution.args[3:])
    else:
        convolution.kwargs = dict(convolution.kwargs, bias=None)
    with graph.inserting_before(norm):
        node = graph.call_function(_DroppedBias.apply, (convolution, bias))
    node.meta = dict(convolution.meta)
    norm.replace_input_with(convolution, node)
    return True


def _fuse_epilogues(graph):
    """Rewrites an FX graph from Dynamo in place: each instance_norm_cuda::instance_norm
    call takes the activation (relu, leaky_relu, silu, gelu), the residual add and the
    reflection pad that follow it into its epilogue, as instance_norm(...,
    activation=, residual=, reflection_pad=) defines them, and the bias of the
    convolution before it is dropped where the norm removes it (_drop_convolution_bias).
    Returns the number of activations, adds, pads and biases folded."""
    folded, crops = 0, {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _FRONT_TARGETS:
            continue
        arguments = dict(_FRONT_DEFAULTS, **dict(zip(_FRONT_ARGUMENTS, node.args)), **node.kwargs)
        while len(node.users) == 1:
            fused = _absorb_user(graph, node, arguments)
            if fused is None:
                break
            node, folded = fused, folded + 1
            arguments = dict(zip(_FRONT_ARGUMENTS, node.args))
        if _drop_convolution_bias(graph, node, arguments):  # the norm's input is now the _DroppedBias node
            folded += 1
            arguments = dict(_FRONT_DEFAULTS, **dict(zip(_FRONT_ARGUMENTS, node.args)), **node.kwargs)
        folded += _pad_kept_for_users(graph, node, arguments, crops) is not None
    return folded


def _merge_zero_gradients(graph):
    """Rewrites an inductor post-grad graph in place: the instance_norm_cuda::
    zero_gradient calls (the gradients of the convolution biases _drop_convolution_bias
    dropped) of one dtype and device become slices of one zero buffer (aten.full of
    their total size, inserted before the first of them), which inductor fills in one
    kernel where it would launch one per bias; the gradients are then views of that
    buffer, which autograd keeps as they are. Only 1-d calls of a static size are
    merged (a convolution's bias is 1-d). Returns the number of calls replaced."""
    groups = {}
    for node in graph.nodes:
        value = node.meta.get("val") if node.op == "call_function" and node.target is _ZERO_GRADIENT_OP else None
        if value is not None and value.dim() == 1 and isinstance(value.numel(), int):
            groups.setdefault((value.dtype, value.device), []).append(node)
    replaced = 0
    for (dtype, device), nodes in groups.items():
        if len(nodes) < 2:
            continue
        values = [node.meta["val"] for node in nodes]
        total = sum(value.numel() for value in values)
        with graph.inserting_before(nodes[0]):
            zeros = graph.call_function(torch.ops.aten.full.default, ([total], 0.0),
                                        {"dtype": dtype, "layout": torch.strided, "device": device,
                                         "pin_memory": False})
        with values[0].fake_mode:
            zeros.meta["val"] = torch.zeros(total, dtype=dtype, device=device)
            start = 0
            for node, value in zip(nodes, values):
                with graph.inserting_before(node):
                    piece = graph.call_function(torch.ops.aten.slice.Tensor, (zeros, 0, start, start + value.numel()))
                piece.meta["val"] = zeros.meta["val"][start:start + value.numel()]
                node.replace_all_uses_with(piece)
                graph.erase_node(node)
                start += value.numel()
        replaced += len(nodes)
    return replaced


def _fusion_fingerprint():
    """What identifies the rewrites for inductor's cache: their code and whether they are on."""
    functions = (_fuse_epilogues, _absorb_user, _activation_applied, _tensor_added, _reflection_pad_applied,
                 _static_tensor_type, _may_mutate, _movable_to, _drop_convolution_bias, _pad_kept_for_users,
                 _DroppedBias.forward, _DroppedBias.backward, _merge_zero_gradients)
    code = repr([(f.__code__.co_code, f.__code__.co_consts, f.__code__.co_names) for f in functions])
    return hashlib.sha256(f"{code}{_COMPILE_FUSION['enabled']}".encode()).hexdigest()


def _graph_pass(name, rewrite, message, installed):
    """An inductor CustomGraphPass named `name` that runs rewrite(graph) (returning a
    count, logged with `message` when not 0) while the fusion is on, then the passes
    `installed` (the hook's value before: None, one callable or, from torch 2.14, a list)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    previous = tuple(installed) if isinstance(installed, (list, tuple)) else (installed,) if installed else ()

    class InstanceNormPass(CustomGraphPass):
        instance_norm_pass = name

        def __call__(self, graph):
            if _COMPILE_FUSION["enabled"]:
                count = rewrite(graph)
                if count:
                    logging.getLogger("instance_norm").info(message, count)
            for other in previous:
                other(graph)

        def __reduce__(self):
            # Inductor pickles its config into cache keys; this stands in for the
            # hook there (a class defined in a function cannot be pickled).
            return str, (f"instance_norm {name} {self.uuid()}",)

        def uuid(self):
            # A hook without a uuid makes inductor skip its cache, as it would without ours.
            others = [other.uuid() if hasattr(other, "uuid") else None for other in previous]
            return None if None in others else _fusion_fingerprint() + "".join(map(str, others))

    return InstanceNormPass()


def _install_compile_fusion():
    """Installs _fuse_epilogues as inductor's pre_grad_custom_pass and
    _merge_zero_gradients as its post_grad_custom_post_pass, each keeping what the hook
    held before (run after ours). Called from the fake kernels, i.e. while Dynamo traces
    our op: inductor is loaded by then when it is the backend, and importing it here
    at import time would cost about 1.5 s. Does nothing without inductor loaded,
    before torch 2.11, or for a hook that has ours already."""
    config = sys.modules.get("torch._inductor.config")
    if config is None or tuple(int(v) for v in torch.__version__.split(".")[:2]) < _MINIMUM_TORCH_FOR_COMPILE_FUSION:
        return
    for hook, name, rewrite, message in (
            ("pre_grad_custom_pass", "epilogue fusion", _fuse_epilogues,
             "torch.compile: folded %d activations, residual adds, reflection pads and convolution biases into "
             "instance norms"),
            ("post_grad_custom_post_pass", "zero gradients", _merge_zero_gradients,
             "torch.compile: %d dropped convolution biases' zero gradients filled as one buffer")):
        installed = getattr(config, hook)
        if getattr(installed, "instance_norm_pass", None) != name:
            setattr(config, hook, _graph_pass(name, rewrite, message, installed))
