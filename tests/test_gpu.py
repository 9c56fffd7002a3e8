"""GPU tests (marked `gpu`): every kernel path against a float64 reference and
PyTorch on fresh random input, with poisoned outputs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

GENERIC, CLUSTER = 1, 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max abs error against float64 allowed per dtype: fp32 arithmetic, or one rounding of
# the output (|y| up to ~5 for these inputs) to the 16-bit type.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def float64_reference(x, weight=None, bias=None, eps=1e-5):
    """Instance norm of x (N, C, *spatial) in float64: mean, then biased variance of deviations."""
    flat = x.double().reshape(x.shape[0], x.shape[1], -1)
    mean = flat.mean(dim=2, keepdim=True)
    var = (flat - mean).square().mean(dim=2, keepdim=True)
    y = (flat - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.double().view(1, -1, 1)
    if bias is not None:
        y = y + bias.double().view(1, -1, 1)
    return y.reshape(x.shape)


def run_poisoned(solution, x, path, **kwargs):
    """forward(x, path) after filling the block its output will take with NaN; checks it took that block."""
    poison = torch.full_like(x, float("nan"))
    address = poison.data_ptr()
    del poison
    out = solution._EXT.forward(x, path=path, **kwargs)
    assert out.data_ptr() == address, "output did not land in the poisoned block"
    return out


def paths_for(solution, x):
    return [p for p in (GENERIC, CLUSTER) if solution._EXT.path_supported(x, p)]


def check_paths(solution, x, weight=None, bias=None, expect_cluster=None):
    """Every path that can run x matches float64 within the dtype's tolerance and leaves x unchanged."""
    x_before = x.clone()
    reference = float64_reference(x, weight, bias)
    paths = paths_for(solution, x)
    assert GENERIC in paths
    if expect_cluster is not None:
        assert (CLUSTER in paths) == expect_cluster
    for path in paths:
        out = run_poisoned(solution, x, path, weight=weight, bias=bias)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.isfinite(out).all(), f"path {path}: unwritten or non-finite elements"
        error = (out.double() - reference).abs().max().item()
        assert error <= TOLERANCE[x.dtype], f"path {path} {x.dtype}: max abs error {error:.3g} against float64"
    assert torch.equal(x, x_before), "input was modified"


# (N, C, H, W): full clusters, partly filled clusters, one-CTA clusters, odd sizes,
# beyond cluster capacity, tiny slices, 70,016 slices.
SHAPES = [((2, 3, 512, 512), True), ((3, 5, 300, 300), True), ((4, 8, 100, 100), True), ((2, 4, 64, 64), True),
          ((5, 7, 7, 7), False), ((2, 3, 33, 31), False), ((1, 2, 1024, 1024), False), ((1, 3, 724, 724), True),
          ((2, 2, 2, 2), True), ((70000 // 64 + 1, 64, 4, 4), True)]


@pytest.mark.parametrize("shape, fp32_cluster", SHAPES, ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else "")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_path_matches_float64(solution, shape, fp32_cluster, dtype):
    torch.manual_seed(hash(shape) % 2**31)
    x = (torch.randn(shape, device="cuda") * 3 + 1).to(dtype)
    # 16-bit vectors hold 8 values: sizes that are a multiple of 4 but not 8 take the generic path.
    per_vector = 4 if dtype == torch.float32 else 8
    expect = fp32_cluster and (shape[2] * shape[3]) % per_vector == 0
    check_paths(solution, x, expect_cluster=expect)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 128, 128), (3, 5, 9, 11)], ids=["cluster", "generic"])
def test_affine_matches_float64(solution, dtype, shape):
    torch.manual_seed(4)
    x = torch.randn(shape, device="cuda").to(dtype)
    weight = torch.randn(shape[1], device="cuda").to(dtype)
    bias = torch.randn(shape[1], device="cuda").to(dtype)
    check_paths(solution, x, weight, bias)
    check_paths(solution, x, weight=None, bias=bias)


def test_seed_shape_takes_the_cluster_path(solution):
    x = torch.empty(112, 64, 512, 512, device="cuda")
    assert solution._EXT.chosen_path(x) == CLUSTER


@pytest.mark.parametrize("name, reference, shape", [
    ("InstanceNorm1d", nn.InstanceNorm1d, (4, 16, 4096)),
    ("InstanceNorm2d", nn.InstanceNorm2d, (4, 16, 128, 128)),
    ("InstanceNorm3d", nn.InstanceNorm3d, (2, 8, 32, 32, 32)),
    ("ModelNew", nn.InstanceNorm2d, (4, 16, 128, 128))])
@pytest.mark.parametrize("affine", [False, True])
def test_modules_match_pytorch(solution, name, reference, shape, affine):
    torch.manual_seed(5)
    ours, theirs = getattr(solution, name)(shape[1], affine=affine).cuda(), reference(shape[1], affine=affine).cuda()
    if affine:
        with torch.no_grad():
            for module in (ours, theirs):
                module.weight.copy_(torch.linspace(-2, 2, shape[1]))
                module.bias.copy_(torch.linspace(1, -1, shape[1]))
    x = torch.rand(shape, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours(x[0]), theirs(x[0]), atol=1e-4, rtol=1e-4)


def test_misaligned_view_is_correct(solution):
    torch.manual_seed(2)
    storage = torch.randn(2 * 3 * 64 * 64 + 1, device="cuda")
    x = storage[1:].view(2, 3, 64, 64)
    assert x.data_ptr() % 16 != 0 and paths_for(solution, x) == [GENERIC]
    torch.testing.assert_close(solution.ModelNew(3)(x), float64_reference(x).float(), atol=1e-4, rtol=1e-4)


def test_non_contiguous_input_is_correct(solution):
    torch.manual_seed(3)
    x = torch.randn(2, 64, 64, 3, device="cuda").permute(0, 3, 1, 2)
    torch.testing.assert_close(solution.ModelNew(3)(x), float64_reference(x).float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(2, 3, 512, 512), (2, 3, 37, 37)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_slices_give_exact_zero(solution, shape, dtype):
    x = torch.full(shape, 1e10 if dtype != torch.float16 else 6e4, device="cuda").to(dtype)
    x[1] = -3.75
    for path in paths_for(solution, x):
        assert torch.count_nonzero(solution._EXT.forward(x, path=path)).item() == 0, f"path {path}"


def test_nan_stays_in_its_slice(solution):
    x = torch.randn(2, 3, 256, 256, device="cuda")
    x[1, 2, 5, 7] = float("nan")
    others = torch.ones(2, 3, dtype=torch.bool)
    others[1, 2] = False
    for path in paths_for(solution, x):
        out = solution._EXT.forward(x, path=path)
        assert torch.isnan(out[1, 2]).all(), f"path {path}"
        assert torch.isfinite(out[others]).all(), f"path {path}"


def test_same_input_gives_identical_bits(solution):
    x = torch.randn(8, 16, 512, 512, device="cuda")
    for path in paths_for(solution, x):
        assert torch.equal(solution._EXT.forward(x, path=path), solution._EXT.forward(x, path=path))


def test_input_requiring_grad_is_refused(solution):
    x = torch.rand(2, 3, 8, 8, device="cuda", requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward"):
        solution.ModelNew(3)(x)
    with pytest.raises(NotImplementedError, match="backward"):
        solution.ModelNew(3, affine=True).cuda()(x.detach())
    with torch.no_grad():
        solution.ModelNew(3, affine=True).cuda()(x)


def test_forced_path_that_cannot_run_is_refused(solution):
    x = torch.rand(1, 1, 1024, 1024, device="cuda")
    with pytest.raises(RuntimeError, match="cannot run"):
        solution._EXT.forward(x, path=CLUSTER)


def test_weight_on_another_device_is_refused(solution):
    x = torch.rand(2, 3, 8, 8, device="cuda")
    with pytest.raises(ValueError, match="weight must be on the input's device"):
        solution.instance_norm(x, weight=torch.ones(3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernelbench_style_harness(solution, dtype):
    """As a harness does: seed, build under no_grad, .to(device, dtype), reference first on the same
    tensors, then ModelNew, compare with allclose at the harness tolerance; 5 seeds."""
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    for seed in range(5):
        torch.manual_seed(seed)
        x = torch.rand(4, 64, 128, 128).to("cuda", dtype)
        with torch.no_grad():
            reference = nn.InstanceNorm2d(64).to("cuda", dtype)
            model = solution.ModelNew(64).to("cuda", dtype)
            expected = reference(x)
            x_before = x.clone()
            out = model(x)
        assert out is not x and out.dtype == dtype
        assert torch.equal(x, x_before)
        assert torch.allclose(out, expected, atol=tolerance, rtol=tolerance)
