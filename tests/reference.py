"""Float64 references and helpers shared by the GPU tests; the kernel paths' ids and
capacities as the extension exports them (tests/conftest.py has it built)."""
import torch

import solution

# Kernel paths (kernels/instance_norm.h, ForwardPath and BackwardPath).
_FORWARD_IDS, _BACKWARD_IDS = solution._EXT.forward_paths, solution._EXT.backward_paths
BLOCK, CLUSTER, WARP, SPLIT, COOPERATIVE, PIPELINED = (
    _FORWARD_IDS[name] for name in ("block", "cluster", "warp", "split", "cooperative", "pipelined"))
FORWARD_PATHS = (BLOCK, CLUSTER, WARP, SPLIT, COOPERATIVE, PIPELINED)
BACKWARD_GENERIC, BACKWARD_CLUSTER, BACKWARD_COOPERATIVE, BACKWARD_BLOCK = (
    _BACKWARD_IDS[name] for name in ("generic", "cluster", "cooperative", "block"))
BACKWARD_PATHS = (BACKWARD_GENERIC, BACKWARD_CLUSTER, BACKWARD_COOPERATIVE, BACKWARD_BLOCK)
# Paths that need Hopper (sm_90: clusters, bulk copies); other GPUs, and the GPUs
# INSTANCE_NORM_EMULATE names, run the rest.
HOPPER_FORWARD_PATHS = (CLUSTER, PIPELINED)
HOPPER_BACKWARD_PATHS = (BACKWARD_CLUSTER, BACKWARD_COOPERATIVE)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max abs error against float64 allowed per dtype: fp32 arithmetic, or one rounding of
# the output (|y| up to ~5 for these inputs) to the 16-bit type.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def forward_capacity(name):
    """{dtype: values} of one of the forward's capacities (ForwardCapacities in kernels/instance_norm.h)."""
    return {dtype: solution._EXT.forward_capacities[str(dtype).removeprefix("torch.")][name] for dtype in DTYPES}


def backward_capacity(name):
    """{dtype: values} of one of the backward's capacities (BackwardCapacities)."""
    return {dtype: solution._EXT.backward_capacities[str(dtype).removeprefix("torch.")][name] for dtype in DTYPES}


def hopper(solution):
    """Whether the path choice sees a Hopper GPU (clusters, bulk copies): not when a GPU is emulated."""
    return solution.emulated_device() is None and torch.cuda.get_device_capability(0) >= (9, 0)


def float64_stats(x):
    """Per-slice mean and biased variance of x (N, C, *spatial) in float64, shape (N, C)."""
    flat = x.double().reshape(x.shape[0], x.shape[1], -1)
    mean = flat.mean(dim=2)
    var = (flat - mean.unsqueeze(2)).square().mean(dim=2)
    return mean, var


def float64_reference(x, weight=None, bias=None, eps=1e-5, running_mean=None, running_var=None):
    """Instance norm of x (N, C, *spatial) in float64 with the slices' statistics, or
    with running_mean/var (C) when given."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    if running_mean is None:
        mean, var = float64_stats(x)
        mean, var = mean.view(*mean.shape, *(1,) * (x.dim() - 2)), var.view(*var.shape, *(1,) * (x.dim() - 2))
    else:
        mean, var = running_mean.double().view(shape), running_var.double().view(shape)
    y = (x.double() - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double().view(shape)
    if bias is not None:
        y = y + bias.double().view(shape)
    return y


def run_poisoned(fn, like, value=float("nan")):
    """fn() after filling the block its output (shaped like `like`) will take with
    `value` (NaN, or a finite value where NaN is an expected output); checks the output
    took that block, so unwritten elements show."""
    poison = torch.full_like(like, value)
    address = poison.data_ptr()
    del poison
    out = fn()
    first = out[0] if isinstance(out, tuple) else out
    assert first.data_ptr() == address, "output did not land in the poisoned block"
    return out


def channels_last(x):
    """x with channels-last strides for any rank (channels_last, channels_last_3d, and 1d alike)."""
    order = (0, *range(2, x.dim()), 1)
    inverse = sorted(range(x.dim()), key=order.__getitem__)
    return x.permute(order).contiguous().permute(inverse)
