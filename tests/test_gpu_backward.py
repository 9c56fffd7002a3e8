"""GPU tests (marked `gpu`) of the backward: every path, dtype, layout and size
against float64 autograd, PyTorch's autograd of nn.InstanceNorm*, gradcheck,
determinism, torch.compile (fullgraph) and CUDA-graph capture of a training step."""
import pytest
import torch
import torch.nn as nn

from reference import (BACKWARD_BLOCK, BACKWARD_CLUSTER, BACKWARD_GENERIC, BACKWARD_PATHS, DTYPES, backward_capacity,
                       channels_last, float64_reference, hopper, run_poisoned)

pytestmark = pytest.mark.gpu
# Max abs error of gradients relative to the float64 gradient's largest magnitude.
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def float64_gradients(x, dy, weight, bias):
    """(dx, dweight, dbias) of float64_reference by float64 autograd."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    y = float64_reference(x64, w64, b64)
    return torch.autograd.grad(y, (x64, w64, b64), dy.double())


def assert_close_scaled(actual, expected, tolerance, what):
    scale = max(expected.abs().max().item(), 1e-6)
    error = (actual.double() - expected).abs().max().item() / scale
    assert error <= tolerance, f"{what}: max error {error:.3g} of the gradient's scale"


SHAPES = [(4, 8, 128, 128), (2, 3, 512, 512), (3, 5, 7, 7), (2, 3, 33, 31), (2, 2, 1024, 1024), (2, 16, 1000),
          (1, 4, 24, 24, 24), (3, 11, 300, 300), (70000 // 64 + 1, 64, 4, 4),
          # Several rounds per team with several dy vectors per thread (the dy ring and
          # the x staging carry over from slice to slice), a partly filled last CTA.
          (6, 40, 200, 200)]


def backward_paths(solution, x):
    return [p for p in BACKWARD_PATHS if solution._EXT.backward_path_supported(x, p)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_backward_matches_float64(solution, shape, dtype, layout):
    torch.manual_seed(hash((shape, layout)) % 2**31)
    x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype)
    dy = torch.randn(shape, device="cuda").to(dtype)
    if layout == "channels_last":
        x, dy = channels_last(x), channels_last(dy)
    weight, bias = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
    expected = float64_gradients(x, dy, weight, bias)
    _, stats = solution._EXT.forward_with_stats(x, weight, bias)
    paths = backward_paths(solution, x)
    assert BACKWARD_GENERIC in paths
    if layout == "channels_last":
        assert paths == [BACKWARD_GENERIC]
    for path in paths:
        dx, dweight, dbias, _ = run_poisoned(lambda: solution._EXT.backward(dy, x, stats, weight, path), x)
        assert dx.stride() == x.stride() and dx.dtype == x.dtype
        assert torch.isfinite(dx).all(), f"path {path}: unwritten or non-finite elements"
        for actual, reference, what in zip((dx, dweight, dbias), expected, ("dx", "dweight", "dbias")):
            assert_close_scaled(actual, reference, GRAD_TOLERANCE[dtype], f"path {path} {what}")
        again = solution._EXT.backward(dy, x, stats, weight, path)
        assert all(torch.equal(a, b) for a, b in zip((dx, dweight, dbias), again)), f"path {path}: not deterministic"


@pytest.mark.parametrize("activation", [None, "silu"], ids=str)
@pytest.mark.parametrize("parameter_dtype", [torch.float16, torch.bfloat16, torch.float64, "strided"], ids=str)
@pytest.mark.parametrize("shape", [(2, 16, 64, 64), (3, 5, 33, 31)], ids=lambda s: "x".join(map(str, s)))
def test_backward_with_parameters_of_any_float_dtype(solution, shape, parameter_dtype, activation):
    """weight and bias of float16, bfloat16, float64 or strided float32 (the backward
    reads float32 copies) give the float64 gradients on every backward path;
    with an activation the backward also reads the bias (the pre-activation)."""
    torch.manual_seed(27)
    x = torch.randn(shape, device="cuda") * 2 + 1
    dy = torch.randn(shape, device="cuda")
    if parameter_dtype == "strided":
        weight, bias = torch.randn(2 * shape[1], device="cuda")[::2], torch.randn(2 * shape[1], device="cuda")[1::2]
    else:
        weight, bias = (torch.randn(shape[1], device="cuda").to(parameter_dtype) for _ in range(2))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    y64 = float64_reference(x64, w64, b64)
    if activation == "silu":
        y64 = torch.nn.functional.silu(y64)
    expected = torch.autograd.grad(y64, (x64, w64), dy.double())
    _, stats = solution._EXT.forward_with_stats(x, weight, bias)
    paths = backward_paths(solution, x)
    assert BACKWARD_GENERIC in paths
    for path in paths:
        dx, dweight, _, _ = run_poisoned(
            lambda: solution._EXT.backward(dy, x, stats, weight, path, bias=bias, activation=activation), x)
        assert_close_scaled(dx, expected[0], 1e-4, f"path {path} dx")
        assert_close_scaled(dweight, expected[1], 1e-4, f"path {path} dweight")


def test_backward_of_values_near_1e30(solution):
    """The saved statistics of values near 1e30 (mean 1e30, rstd 1e-30) give finite,
    correct gradients on every backward path."""
    torch.manual_seed(26)
    for shape in ((2, 3, 256, 256), (3, 4, 9, 9)):
        x = torch.randn(shape, device="cuda") * 1e30
        dy = torch.randn(shape, device="cuda")
        weight, bias = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
        expected = float64_gradients(x, dy, weight, bias)
        _, stats = solution._EXT.forward_with_stats(x, weight, bias)
        for path in backward_paths(solution, x):
            for actual, reference, what in zip(solution._EXT.backward(dy, x, stats, weight, path), expected,
                                               ("dx", "dweight", "dbias")):
                assert torch.isfinite(actual).all(), f"path {path} {what}"
                assert_close_scaled(actual, reference, 1e-4, f"path {path} {what}")


def test_seed_shape_backward_takes_the_cluster_path(solution):
    if not hopper(solution):
        pytest.skip("the cluster path needs Hopper (sm_90)")
    x = torch.empty(112, 64, 512, 512, device="cuda")
    assert BACKWARD_CLUSTER in backward_paths(solution, x)


@pytest.mark.parametrize("name, reference, shape", [
    ("InstanceNorm1d", nn.InstanceNorm1d, (4, 16, 4096)),
    ("InstanceNorm2d", nn.InstanceNorm2d, (4, 16, 128, 128)),
    ("InstanceNorm3d", nn.InstanceNorm3d, (2, 8, 16, 32, 32)),
    ("ModelNew", nn.InstanceNorm2d, (4, 16, 64, 64))])
@pytest.mark.parametrize("options", [{}, {"affine": True}, {"affine": True, "track_running_stats": True}],
                         ids=["plain", "affine", "running_stats"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_matches_pytorch(solution, name, reference, shape, options, dtype):
    torch.manual_seed(21)
    ours = getattr(solution, name)(shape[1], **options).to("cuda", dtype)
    theirs = reference(shape[1], **options).to("cuda", dtype)
    if options.get("affine"):
        with torch.no_grad():
            for module in (ours, theirs):
                module.weight.copy_(torch.linspace(-2, 2, shape[1]))
                module.bias.copy_(torch.linspace(1, -1, shape[1]))
    x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype)
    dy = torch.randn(shape, device="cuda").to(dtype)
    results = []
    for module in (ours, theirs):
        xg = x.clone().requires_grad_()
        y = module(xg)
        y.backward(dy)
        grads = [xg.grad] + ([module.weight.grad, module.bias.grad] if options.get("affine") else [])
        results.append((y.detach(), grads))
    tolerance = GRAD_TOLERANCE[dtype] if dtype != torch.float32 else 1e-4
    torch.testing.assert_close(results[0][0], results[1][0], atol=tolerance, rtol=tolerance)
    for actual, expected, what in zip(results[0][1], results[1][1], ("dx", "dweight", "dbias")):
        assert_close_scaled(actual, expected.double(), tolerance * 2 if dtype != torch.float32 else 1e-4, what)
    if options.get("track_running_stats"):
        torch.testing.assert_close(ours.running_mean, theirs.running_mean, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(ours.running_var, theirs.running_var, atol=tolerance, rtol=tolerance)


def test_eval_mode_gradient_matches_pytorch(solution):
    torch.manual_seed(22)
    ours = solution.InstanceNorm2d(6, affine=True, track_running_stats=True).cuda()
    theirs = nn.InstanceNorm2d(6, affine=True, track_running_stats=True).cuda()
    with torch.no_grad():
        for module in (ours, theirs):
            module.running_mean.copy_(torch.linspace(-1, 1, 6))
            module.running_var.copy_(torch.linspace(0.5, 2, 6))
            module.weight.copy_(torch.linspace(-2, 2, 6))
    ours.eval(), theirs.eval()
    x, dy = torch.randn(3, 6, 20, 20, device="cuda"), torch.randn(3, 6, 20, 20, device="cuda")
    grads = []
    for module in (ours, theirs):
        xg = x.clone().requires_grad_()
        module(xg).backward(dy)
        grads.append((xg.grad, module.weight.grad, module.bias.grad))
    for actual, expected in zip(*grads):
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_gradcheck_against_finite_differences(solution):
    """torch.autograd.gradcheck of the fp32 kernels through float64 in and out (fp32
    rounding sets the tolerances), weight and bias included."""
    torch.manual_seed(23)
    for shape in ((2, 3, 5, 6), (1, 2, 40, 40)):
        x = torch.randn(shape, device="cuda", dtype=torch.float64, requires_grad=True)
        w = torch.randn(shape[1], device="cuda", dtype=torch.float64, requires_grad=True)
        b = torch.randn(shape[1], device="cuda", dtype=torch.float64, requires_grad=True)

        def fn(x, w, b):
            return solution.instance_norm(x.float(), weight=w.float(), bias=b.float()).double()

        assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-3, atol=5e-3, rtol=1e-2, nondet_tol=0.0)


def test_double_backward_raises(solution):
    x = torch.randn(2, 3, 8, 8, device="cuda", requires_grad=True)
    y = solution.instance_norm(x)
    (grad,) = torch.autograd.grad(y, x, torch.randn_like(y), create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


@pytest.mark.parametrize("shape", [(4, 16, 128, 128), (2, 1280, 16, 16)])
def test_compile_fullgraph_forward_and_backward(solution, shape):
    torch.manual_seed(24)
    torch._dynamo.reset()
    model = solution.InstanceNorm2d(shape[1], affine=True, track_running_stats=True).cuda()
    compiled = torch.compile(model, fullgraph=True)
    reference = nn.InstanceNorm2d(shape[1], affine=True, track_running_stats=True).cuda()
    for step in range(2):
        x = torch.randn(shape, device="cuda") * (step + 1)
        dy = torch.randn(shape, device="cuda")
        xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled(xg).backward(dy)
        reference(xr).backward(dy)
        torch.testing.assert_close(xg.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.weight.grad, reference.weight.grad, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(model.running_var, reference.running_var, atol=1e-5, rtol=1e-5)


def test_cuda_graph_captures_a_training_step(solution):
    torch.manual_seed(25)
    shape = (4, 8, 128, 128)
    model = solution.InstanceNorm2d(8, affine=True).cuda()
    static_x = torch.randn(shape, device="cuda", requires_grad=True)
    static_dy = torch.randn(shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            static_x.grad = None
            model(static_x).backward(static_dy)
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(static_x).backward(static_dy)
    for _ in range(2):
        with torch.no_grad():
            static_x.copy_(torch.randn(shape, device="cuda") * 2 + 1)
            static_dy.copy_(torch.randn(shape, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        expected = float64_gradients(static_x, static_dy, model.weight, model.bias)
        assert_close_scaled(static_x.grad, expected[0], 1e-4, "dx")
        assert_close_scaled(model.weight.grad, expected[1], 1e-4, "dweight")


def test_eager_backward_fills_no_zero_gradients(solution):
    """The eager autograd Function does not materialize zero gradients for its saved
    statistics (mean, rstd), nor, without affine parameters, reduce the per-channel
    sums: no fill or sum kernel runs in the backward (host time per call on small
    shapes, perf notes #63)."""
    x = torch.randn(2, 64, 32, 32, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    model = solution.ModelNew(64).cuda()
    y = model(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        (grad,) = torch.autograd.grad(y, x, dy)
    names = {event.key for event in profile.key_averages()}
    assert not names & {"aten::fill_", "aten::zero_", "aten::zeros", "aten::zeros_like"}, sorted(names)
    assert "aten::sum" not in names, "no parameter needs the per-channel sums"
    expected = torch.autograd.grad(nn.InstanceNorm2d(64).cuda()(x), x, dy)[0]
    assert torch.allclose(grad, expected, atol=1e-4, rtol=1e-4)


def test_frozen_affine_parameters_skip_the_channel_sums(solution):
    """weight and bias given but frozen (requires_grad=False): the eager backward
    reduces no per-channel sums, and grad_input is still that of the affine
    normalization (weight scales it)."""
    torch.manual_seed(17)
    x = torch.randn(2, 16, 24, 24, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    model = solution.ModelNew(16, affine=True).cuda()
    with torch.no_grad():
        model.weight.uniform_(0.5, 1.5)
        model.bias.uniform_(-1.0, 1.0)
    model.requires_grad_(False)
    y = model(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        (grad,) = torch.autograd.grad(y, x, dy)
    assert "aten::sum" not in {event.key for event in profile.key_averages()}
    expected = float64_gradients(x, dy, model.weight, model.bias)[0]
    assert_close_scaled(grad, expected, 1e-4, "dx")


@pytest.mark.parametrize("shape, dtype", [((1, 256, 64, 64), torch.bfloat16), ((2, 1280, 16, 16), torch.float32),
                                          ((4, 128, 128, 128), torch.float32)])
def test_small_slices_can_take_the_block_path(solution, shape, dtype):
    """Slices of whole vectors up to 16,384 fp32 / 32,768 16-bit values fit the block
    path (one CTA per slice); one more vector does not."""
    x = torch.empty(shape, device="cuda", dtype=dtype)
    assert BACKWARD_BLOCK in backward_paths(solution, x)
    per_vector = 16 // x.element_size()
    too_large = torch.empty(2, 3, backward_capacity("block_spatial")[dtype] + per_vector, device="cuda", dtype=dtype)
    assert BACKWARD_BLOCK not in backward_paths(solution, too_large)
