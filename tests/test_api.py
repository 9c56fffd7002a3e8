"""CPU tests of the Python front (modules, functional, argument checks) and of
the C++ entry's checks that fire before any CUDA call."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

MODULES = [("InstanceNorm1d", nn.InstanceNorm1d, (2, 3, 10)),
           ("InstanceNorm2d", nn.InstanceNorm2d, (2, 3, 5, 7)),
           ("InstanceNorm3d", nn.InstanceNorm3d, (2, 3, 4, 5, 6)),
           ("ModelNew", nn.InstanceNorm2d, (2, 3, 5, 7))]


@pytest.mark.parametrize("name, reference, shape", MODULES, ids=[m[0] for m in MODULES])
@pytest.mark.parametrize("affine", [False, True])
def test_modules_match_pytorch_on_cpu(solution, name, reference, shape, affine):
    """CPU input runs PyTorch's op; parameters, state dict and results match PyTorch's module."""
    torch.manual_seed(0)
    ours, theirs = getattr(solution, name)(3, affine=affine), reference(3, affine=affine)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    if affine:
        with torch.no_grad():
            for module in (ours, theirs):
                module.weight.copy_(torch.tensor([0.5, -2.0, 3.0]))
                module.bias.copy_(torch.tensor([1.0, 0.0, -1.0]))
    x = torch.randn(shape)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x[0]), theirs(x[0]))


def test_to_casts_affine_parameters(solution):
    model = solution.ModelNew(4, affine=True).to(dtype=torch.float16)
    assert model.weight.dtype == torch.float16 and model.bias.dtype == torch.float16
    assert isinstance(model.weight, nn.Parameter)


@pytest.mark.parametrize("name, shape", [("InstanceNorm1d", (5,)), ("InstanceNorm1d", (2, 3, 4, 5)),
                                         ("ModelNew", (2, 3)), ("ModelNew", (2, 3, 4, 5, 6)),
                                         ("InstanceNorm3d", (2, 3, 4))])
def test_modules_reject_other_ranks_like_pytorch(solution, name, shape):
    dims = {"InstanceNorm1d": 1, "ModelNew": 2, "InstanceNorm3d": 3}[name]
    with pytest.raises(ValueError, match=f"expected {dims + 1}D or {dims + 2}D input \\(got {len(shape)}D input\\)"):
        getattr(solution, name)(3)(torch.rand(shape))


def test_single_spatial_element_raises_value_error(solution):
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        solution.ModelNew(3)(torch.rand(2, 3, 1, 1))


def test_non_tensor_and_integer_input_raise_type_error(solution):
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        solution.instance_norm([1.0, 2.0])
    with pytest.raises(TypeError, match="input must be a floating-point tensor, got Long"):
        solution.instance_norm(torch.ones(2, 3, 4, 4, dtype=torch.int64))


def test_channel_mismatch_warns_without_affine_and_raises_with(solution):
    with pytest.warns(UserWarning, match="does not match num_features"):
        solution.ModelNew(4)(torch.rand(2, 3, 4, 4))
    with pytest.raises(ValueError, match="to match num_features \\(4\\), but got: 3"):
        solution.ModelNew(4, affine=True)(torch.rand(2, 3, 4, 4))


@pytest.mark.parametrize("option", ["weight", "bias"])
def test_wrong_weight_or_bias_names_it(solution, option):
    x = torch.rand(2, 3, 4, 4)
    with pytest.raises(ValueError, match=f"{option} must have C = 3 elements, got 4"):
        solution.instance_norm(x, **{option: torch.ones(4)})
    with pytest.raises(ValueError, match=f"{option} must be a 1-D tensor of C = 3 elements, got 2 dimensions"):
        solution.instance_norm(x, **{option: torch.ones(3, 1)})
    with pytest.raises(TypeError, match=f"{option} must be a torch.Tensor or None"):
        solution.instance_norm(x, **{option: [1.0, 1.0, 1.0]})


def test_float_options_take_what_pytorch_takes_and_name_the_argument(solution):
    """momentum and eps: what F.instance_norm's float arguments take (numbers, bools,
    one-element tensors), and a TypeError naming the argument otherwise."""
    x = torch.randn(2, 3, 4, 4)
    mean, var = torch.zeros(3), torch.ones(3)
    for value in (0.2, 1, True, torch.tensor(0.2)):
        expected_mean, expected_var = mean.clone(), var.clone()
        expected = F.instance_norm(x, expected_mean, expected_var, use_input_stats=True, momentum=value, eps=value)
        ours_mean, ours_var = mean.clone(), var.clone()
        out = solution.instance_norm(x, ours_mean, ours_var, use_input_stats=True, momentum=value, eps=value)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close((ours_mean, ours_var), (expected_mean, expected_var))
    for name in ("momentum", "eps"):
        for bad in ("0.1", None, [0.1]):
            with pytest.raises(TypeError, match=f"{name} must be a real number, got {type(bad).__name__}"):
                solution.instance_norm(x, **{name: bad})
    # The modules check them when built, as the functional does per call; momentum may be None.
    for name, bads in (("momentum", ("0.1", [0.1])), ("eps", ("0.1", None, [0.1]))):
        for bad in bads:
            with pytest.raises(TypeError, match=f"InstanceNorm2d: {name} must be a real number, got "
                                                f"{type(bad).__name__}"):
                solution.InstanceNorm2d(3, **{name: bad})
    assert solution.InstanceNorm2d(3, momentum=None, eps=torch.tensor(1e-3)).momentum is None


def test_functional_matches_pytorch_on_cpu(solution):
    torch.manual_seed(1)
    x, weight, bias = torch.randn(2, 3, 6, 6), torch.randn(3), torch.randn(3)
    torch.testing.assert_close(solution.instance_norm(x, weight=weight, bias=bias, eps=1e-3),
                               F.instance_norm(x, weight=weight, bias=bias, eps=1e-3))


def test_entry_rejects_cpu_tensor_naming_the_device(solution):
    with pytest.raises(RuntimeError, match="input must be a CUDA tensor, got a tensor on cpu"):
        solution._EXT.forward(torch.rand(2, 3, 4, 4))


def test_repr_matches_pytorch_fields(solution):
    for ours, theirs in ((solution.ModelNew(64), nn.InstanceNorm2d(64)),
                         (solution.InstanceNorm3d(8, affine=True), nn.InstanceNorm3d(8, affine=True))):
        assert repr(ours) == repr(theirs).replace("InstanceNorm2d", "ModelNew", isinstance(ours, solution.ModelNew))
    assert repr(solution.InstanceNorm1d(4)).startswith("InstanceNorm1d(4, eps=1e-05, momentum=0.1, affine=False, ")


def test_affine_without_bias(solution):
    model = solution.InstanceNorm2d(3, affine=True, bias=False)
    assert model.bias is None and list(model.state_dict()) == ["weight"]


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_modules_match_pytorch_on_cpu(solution, momentum):
    """track_running_stats: same buffers and state dict keys as PyTorch's, same update
    in training (momentum=None: none, as PyTorch), same eval output (CPU runs PyTorch's op)."""
    torch.manual_seed(2)
    ours = solution.InstanceNorm2d(3, affine=True, track_running_stats=True, momentum=momentum)
    theirs = nn.InstanceNorm2d(3, affine=True, track_running_stats=True, momentum=momentum)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert repr(ours) == repr(theirs)
    for _ in range(2):
        x = torch.randn(4, 3, 5, 5) * 3 + 1
        torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    torch.testing.assert_close(ours.running_var, theirs.running_var)
    ours.eval(), theirs.eval()
    x = torch.randn(4, 3, 5, 5)
    torch.testing.assert_close(ours(x), theirs(x))
    ours.load_state_dict(theirs.state_dict())
    ours.reset_parameters()
    assert torch.equal(ours.running_var, torch.ones(3)) and torch.equal(ours.weight, torch.ones(3))


def test_running_buffer_errors_name_the_argument(solution):
    x = torch.rand(2, 3, 4, 4)
    with pytest.raises(ValueError, match="running_mean must have C = 3 elements, got 2"):
        solution.instance_norm(x, torch.zeros(2), torch.ones(2))
    with pytest.raises(ValueError, match="given together"):
        solution.instance_norm(x, running_var=torch.ones(3))
    with pytest.raises(ValueError, match="use_input_stats=False needs running_mean"):
        solution.instance_norm(x, use_input_stats=False)
    with pytest.raises(TypeError, match="running_var must be a floating-point tensor"):
        solution.instance_norm(x, torch.zeros(3), torch.ones(3, dtype=torch.int64))


def test_eval_with_single_spatial_element_is_allowed(solution):
    """As in PyTorch, only use_input_stats needs more than one spatial element."""
    x = torch.rand(2, 3, 1, 1)
    out = solution.instance_norm(x, torch.zeros(3), torch.ones(3), use_input_stats=False)
    torch.testing.assert_close(out, F.instance_norm(x, torch.zeros(3), torch.ones(3), use_input_stats=False))
