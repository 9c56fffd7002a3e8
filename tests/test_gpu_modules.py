"""GPU tests (marked `gpu`) of the Python front: modules and functional against
PyTorch's (outputs and running statistics), eval mode, dtype casts, devices,
streams and CUDA graphs, and the KernelBench protocol."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from reference import DTYPES, channels_last, float64_reference

pytestmark = pytest.mark.gpu

MODULES = [("InstanceNorm1d", nn.InstanceNorm1d, (4, 16, 4096)),
           ("InstanceNorm2d", nn.InstanceNorm2d, (4, 16, 128, 128)),
           ("InstanceNorm3d", nn.InstanceNorm3d, (2, 8, 32, 32, 32)),
           ("ModelNew", nn.InstanceNorm2d, (4, 16, 128, 128))]
HARNESS_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def module_pair(solution, name, reference, channels, **options):
    """(ours, PyTorch's) on the GPU with the same options and the same non-trivial affine parameters."""
    ours, theirs = getattr(solution, name)(channels, **options).cuda(), reference(channels, **options).cuda()
    if options.get("affine"):
        with torch.no_grad():
            for module in (ours, theirs):
                module.weight.copy_(torch.linspace(-2, 2, channels))
                module.bias.copy_(torch.linspace(1, -1, channels))
    return ours, theirs


@pytest.mark.parametrize("name, reference, shape", MODULES, ids=[m[0] for m in MODULES])
@pytest.mark.parametrize("affine", [False, True])
def test_modules_match_pytorch(solution, name, reference, shape, affine):
    torch.manual_seed(5)
    ours, theirs = module_pair(solution, name, reference, shape[1], affine=affine)
    x = torch.rand(shape, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours(x[0]), theirs(x[0]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name, reference, shape", MODULES, ids=[m[0] for m in MODULES])
@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_running_stats_match_pytorch(solution, name, reference, shape, momentum, dtype):
    """track_running_stats=True: three training steps update running_mean/var as
    PyTorch does (momentum=None: no update, as PyTorch passes momentum 0), then
    eval normalizes with them; module and inputs cast to `dtype` as a harness does."""
    torch.manual_seed(11)
    ours, theirs = module_pair(solution, name, reference, shape[1], affine=True, track_running_stats=True,
                               momentum=momentum)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    tolerance = HARNESS_TOLERANCE[dtype]
    with torch.no_grad():
        for step in range(3):
            x = (torch.randn(shape, device="cuda") * (step + 1) + step).to(dtype)
            torch.testing.assert_close(ours(x), theirs(x), atol=tolerance, rtol=tolerance)
            for buffer in ("running_mean", "running_var"):
                torch.testing.assert_close(getattr(ours, buffer), getattr(theirs, buffer), atol=tolerance,
                                           rtol=tolerance, msg=buffer)
        ours.eval(), theirs.eval()
        x = (torch.randn(shape, device="cuda") * 2).to(dtype)
        torch.testing.assert_close(ours(x), theirs(x), atol=tolerance * 10, rtol=tolerance)
        torch.testing.assert_close(ours(x[0]), theirs(x[0]), atol=tolerance * 10, rtol=tolerance)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_functional_eval_matches_float64(solution, layout):
    torch.manual_seed(12)
    x = torch.randn(4, 24, 40, 40, device="cuda") * 3 + 2
    if layout == "channels_last":
        x = channels_last(x)
    running_mean, running_var = torch.randn(24, device="cuda"), torch.rand(24, device="cuda") + 0.5
    weight, bias = torch.randn(24, device="cuda"), torch.randn(24, device="cuda")
    out = solution.instance_norm(x, running_mean, running_var, weight, bias, use_input_stats=False)
    reference = float64_reference(x, weight, bias, running_mean=running_mean, running_var=running_var)
    assert out.stride() == x.stride()
    assert (out.double() - reference).abs().max().item() < 1e-4
    torch.testing.assert_close(out, F.instance_norm(x, running_mean, running_var, weight, bias,
                                                    use_input_stats=False), atol=1e-4, rtol=1e-4)


def test_functional_training_update_matches_pytorch(solution):
    torch.manual_seed(13)
    x = channels_last(torch.randn(6, 10, 30, 30, device="cuda") * 2 + 1)
    ours = [torch.randn(10, device="cuda"), torch.rand(10, device="cuda") + 1]
    theirs = [t.clone() for t in ours]
    out = solution.instance_norm(x, *ours, momentum=0.3)
    expected = F.instance_norm(x, *theirs, momentum=0.3)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-5)


def test_bad_running_buffers_are_named(solution):
    x = torch.rand(2, 3, 8, 8, device="cuda")
    with pytest.raises(ValueError, match="running_mean must have C = 3"):
        solution.instance_norm(x, torch.zeros(4, device="cuda"), torch.ones(4, device="cuda"))
    with pytest.raises(ValueError, match="running_var must be on the input's device"):
        solution.instance_norm(x, torch.zeros(3, device="cuda"), torch.ones(3))
    with pytest.raises(ValueError, match="together"):
        solution.instance_norm(x, torch.zeros(3, device="cuda"))
    with pytest.raises(ValueError, match="use_input_stats=False"):
        solution.instance_norm(x, use_input_stats=False)


def test_weight_on_another_device_is_refused(solution):
    x = torch.rand(2, 3, 8, 8, device="cuda")
    with pytest.raises(ValueError, match="weight must be on the input's device"):
        solution.instance_norm(x, weight=torch.ones(3))


def test_entry_check_with_a_number_in_its_message_raises(solution):
    """Checks that stream integers into messages crashed torch 2.11 once (docs/perf-notes.md)."""
    x = torch.rand(2, 3, 8, 8, device="cuda")
    with pytest.raises(RuntimeError, match="C = 3"):
        solution._EXT.forward(x, weight=torch.ones(4, device="cuda"))


@pytest.mark.parametrize("shape", [(8, 16, 512, 512), (2, 1280, 16, 16), (1, 4, 128, 128, 128)])
def test_cuda_graph_replays_with_new_data(solution, shape):
    """Every launch is on the current stream: a captured forward replays correctly on new input."""
    torch.manual_seed(15)
    model = (solution.InstanceNorm3d if len(shape) == 5 else solution.InstanceNorm2d)(shape[1], affine=True).cuda()
    static_x = torch.randn(shape, device="cuda")
    stream = torch.cuda.current_stream()
    with torch.no_grad():
        model(static_x)  # warm-up: path choice and cluster queries happen outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = model(static_x)
    for _ in range(2):
        static_x.copy_(torch.randn(shape, device="cuda") * 3 + 1)
        graph.replay()
        stream.synchronize()
        torch.testing.assert_close(static_y, float64_reference(static_x).float(), atol=1e-4, rtol=1e-4)


def test_nonzero_current_stream_is_used(solution):
    torch.manual_seed(16)
    x = torch.randn(4, 8, 256, 256, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        out = solution.ModelNew(8)(x)
    side.synchronize()
    torch.testing.assert_close(out, float64_reference(x).float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernelbench_style_harness(solution, dtype):
    """As a harness does: seed, build under no_grad, .to(device, dtype), reference first on the same
    tensors, then ModelNew, compare with allclose at the harness tolerance; 5 seeds."""
    tolerance = HARNESS_TOLERANCE[dtype]
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
