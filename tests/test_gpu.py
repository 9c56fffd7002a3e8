"""GPU tests (marked `gpu`): every kernel path against a float64 reference and
nn.InstanceNorm2d on fresh random input, with poisoned outputs."""
import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.gpu

GENERIC = 1
CLUSTER_PATHS = (2,)
TOLERANCE = 1e-4


def float64_reference(x, eps=1e-5):
    """Instance norm of x (N, C, *spatial) in float64: mean, then biased variance of deviations."""
    flat = x.double().reshape(x.shape[0], x.shape[1], -1)
    mean = flat.mean(dim=2, keepdim=True)
    var = (flat - mean).square().mean(dim=2, keepdim=True)
    return ((flat - mean) / torch.sqrt(var + eps)).reshape(x.shape)


def run_poisoned(solution, x, path):
    """forward(x, path) after filling the block its output will take with NaN; checks it took that block."""
    poison = torch.full_like(x, float("nan"))
    address = poison.data_ptr()
    del poison
    out = solution._EXT.forward(x, 1e-5, path)
    assert out.data_ptr() == address, "output did not land in the poisoned block"
    return out


def paths_for(solution, x):
    n, c = x.shape[:2]
    spatial = x[0, 0].numel()
    return [p for p in (GENERIC, *CLUSTER_PATHS) if solution._EXT.path_supported(n * c, spatial, p)]


# (N, C, H, W): full cluster, partly filled clusters, one-CTA clusters, odd sizes, beyond cluster capacity.
SHAPES = [(2, 3, 512, 512), (3, 5, 300, 300), (4, 8, 100, 100), (2, 4, 64, 64), (5, 7, 7, 7),
          (2, 3, 33, 31), (1, 2, 1024, 1024), (1, 3, 724, 724), (2, 2, 2, 2), (70000 // 64 + 1, 64, 4, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_path_matches_float64_and_pytorch(solution, shape):
    torch.manual_seed(hash(shape) % 2**31)
    x = torch.randn(shape, device="cuda") * 3 + 1
    x_before = x.clone()
    reference = float64_reference(x)
    pytorch = nn.InstanceNorm2d(shape[1])(x)
    paths = paths_for(solution, x)
    assert GENERIC in paths
    for path in paths:
        out = run_poisoned(solution, x, path)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert torch.isfinite(out).all(), f"path {path}: unwritten or non-finite elements"
        error = (out.double() - reference).abs().max().item()
        assert error <= TOLERANCE, f"path {path}: max abs error {error:.3g} against float64"
        torch.testing.assert_close(out, pytorch, atol=TOLERANCE, rtol=TOLERANCE)
    assert torch.equal(x, x_before), "input was modified"


def test_seed_size_slices_take_a_cluster_path(solution):
    assert solution._EXT.chosen_path(112 * 64, 512 * 512) in CLUSTER_PATHS
    assert set(CLUSTER_PATHS) <= set(paths_for(solution, torch.empty(1, 1, 512, 512, device="cuda")))


def test_model_new_matches_pytorch_batched_and_unbatched(solution):
    torch.manual_seed(1)
    x = torch.rand(4, 16, 128, 128, device="cuda")
    model, reference = solution.ModelNew(16).cuda(), nn.InstanceNorm2d(16).cuda()
    torch.testing.assert_close(model(x), reference(x), atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(model(x[0]), reference(x[0]), atol=TOLERANCE, rtol=TOLERANCE)


def test_misaligned_view_is_correct(solution):
    torch.manual_seed(2)
    storage = torch.randn(2 * 3 * 64 * 64 + 1, device="cuda")
    x = storage[1:].view(2, 3, 64, 64)
    assert x.data_ptr() % 16 != 0
    torch.testing.assert_close(solution.ModelNew(3)(x), float64_reference(x).float(), atol=TOLERANCE, rtol=TOLERANCE)


def test_non_contiguous_input_is_correct(solution):
    torch.manual_seed(3)
    x = torch.randn(2, 64, 64, 3, device="cuda").permute(0, 3, 1, 2)
    torch.testing.assert_close(solution.ModelNew(3)(x), float64_reference(x).float(), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("shape", [(2, 3, 512, 512), (2, 3, 37, 37)])
def test_constant_slices_give_exact_zero(solution, shape):
    x = torch.full(shape, 1e10, device="cuda")
    x[1] = -3.75
    for path in paths_for(solution, x):
        out = solution._EXT.forward(x, 1e-5, path)
        assert torch.count_nonzero(out).item() == 0, f"path {path}"


def test_nan_stays_in_its_slice(solution):
    x = torch.randn(2, 3, 256, 256, device="cuda")
    x[1, 2, 5, 7] = float("nan")
    for path in paths_for(solution, x):
        out = solution._EXT.forward(x, 1e-5, path)
        assert torch.isnan(out[1, 2]).all(), f"path {path}"
        others = torch.ones(2, 3, dtype=torch.bool)
        others[1, 2] = False
        assert torch.isfinite(out[others]).all(), f"path {path}"


def test_same_input_gives_identical_bits(solution):
    x = torch.randn(8, 16, 512, 512, device="cuda")
    for path in paths_for(solution, x):
        assert torch.equal(solution._EXT.forward(x, 1e-5, path), solution._EXT.forward(x, 1e-5, path))


def test_input_requiring_grad_is_refused(solution):
    x = torch.rand(2, 3, 8, 8, device="cuda", requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward"):
        solution.ModelNew(3)(x)
    with torch.no_grad():
        solution.ModelNew(3)(x)


def test_unsupported_dtype_names_it(solution):
    with pytest.raises(NotImplementedError, match="float16"):
        solution.ModelNew(3)(torch.rand(2, 3, 8, 8, device="cuda", dtype=torch.float16))


def test_forced_path_that_cannot_run_is_refused(solution):
    x = torch.rand(1, 1, 1024, 1024, device="cuda")
    with pytest.raises(RuntimeError, match="cannot run"):
        solution._EXT.forward(x, 1e-5, 2)


def test_kernelbench_style_harness(solution):
    """Reference first on the same tensors, then ModelNew, under no_grad, 5 seeds."""
    for seed in range(5):
        torch.manual_seed(seed)
        x = torch.rand(4, 64, 128, 128, device="cuda")
        with torch.no_grad():
            reference = nn.InstanceNorm2d(64).cuda()(x)
            out = solution.ModelNew(64).cuda()(x)
        assert out is not x
        assert torch.allclose(out, reference, atol=1e-4, rtol=1e-4)
