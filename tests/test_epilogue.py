"""CPU tests of the fused epilogues' interface: the functional's CPU and float64
fallback (the same composition with PyTorch ops), its errors, the modules'
activation option, and convert_instance_norm on the real-network benchmark's nets."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

COMPOSITIONS = {"relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, 0.2), "silu": F.silu, "gelu": F.gelu,
                "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.mark.parametrize("activation", sorted(COMPOSITIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fallback_is_the_pytorch_composition(solution, activation, dtype):
    torch.manual_seed(2)
    x, r = torch.randn(2, 3, 8, 8, dtype=dtype), torch.randn(2, 3, 8, 8, dtype=dtype)
    weight, bias = torch.randn(3, dtype=dtype), torch.randn(3, dtype=dtype)
    out = solution.instance_norm(x, weight=weight, bias=bias, activation=activation, negative_slope=0.2, residual=r)
    expected = COMPOSITIONS[activation](F.instance_norm(x, weight=weight, bias=bias) + r)
    torch.testing.assert_close(out, expected)


def test_epilogue_errors_name_the_argument(solution):
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="activation must be None, 'relu'.*got 'tanh'"):
        solution.instance_norm(x, activation="tanh")
    with pytest.raises(TypeError, match="activation must be None or one of"):
        solution.instance_norm(x, activation=1)
    with pytest.raises(ValueError, match=r"residual must have the input's shape \[2, 3, 8, 8\], got \[2, 3, 8, 7\]"):
        solution.instance_norm(x, residual=torch.randn(2, 3, 8, 7))
    with pytest.raises(TypeError, match="residual must have the input's dtype"):
        solution.instance_norm(x, residual=torch.randn(2, 3, 8, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor or None"):
        solution.instance_norm(x, residual=1.0)
    with pytest.raises(ValueError, match="activation must be one of"):
        solution.InstanceNorm2d(3, activation="tanh")


def test_module_activation_and_repr(solution):
    torch.manual_seed(3)
    module = solution.InstanceNorm2d(3, affine=True, activation="leaky_relu", negative_slope=0.3)
    assert "activation='leaky_relu', negative_slope=0.3" in repr(module)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(module(x), F.leaky_relu(F.instance_norm(x, weight=module.weight, bias=module.bias), 0.3))
    assert "activation" not in repr(solution.InstanceNorm2d(3))


# net: (norms, activations the converter folds: those in an nn.Sequential right after a
# norm; the transformer net calls F.relu, which no module converter can see), input.
CONVERSIONS = {"transformer": (15, 0, (1, 3, 32, 32)), "cyclegan": (23, 14, (1, 3, 32, 32)),
               "unet3d": (18, 18, (1, 1, 32, 32, 32))}


@pytest.mark.parametrize("net", sorted(CONVERSIONS))
def test_converter_keeps_outputs_gradients_and_parameters(solution, nets, net):
    norms, fused, shape = CONVERSIONS[net]
    torch.manual_seed(4)
    model = nets.build(net, "pytorch", "cpu").double()
    x = torch.randn(shape, dtype=torch.float64)
    reference_out, reference_grads = nets.output_and_gradients(model, x)
    parameters = {name: p for name, p in model.named_parameters()}
    converted = solution.convert_instance_norm(model)
    ours = [m for m in converted.modules() if isinstance(m, solution._InstanceNorm)]
    assert len(ours) == norms and not any(isinstance(m, nn.modules.instancenorm._InstanceNorm)
                                          for m in converted.modules())
    assert sum(m.activation is not None for m in ours) == fused
    assert all(p is parameters[name] for name, p in converted.named_parameters())  # the same Parameter objects
    for p in converted.parameters():
        p.grad = None
    out, grads = nets.output_and_gradients(converted, x)
    torch.testing.assert_close(out, reference_out)
    for name in reference_grads:
        torch.testing.assert_close(grads[name], reference_grads[name], msg=name)


def test_converter_replaces_a_bare_norm_and_keeps_its_state(solution):
    norm = nn.InstanceNorm3d(4, affine=True, track_running_stats=True).eval()
    converted = solution.convert_instance_norm(norm)
    assert isinstance(converted, solution.InstanceNorm3d) and not converted.training
    assert converted.running_mean is norm.running_mean and converted.weight is norm.weight
    unfused = solution.convert_instance_norm(nn.Sequential(nn.InstanceNorm2d(2), nn.ReLU()), fuse_activations=False)
    assert isinstance(unfused[1], nn.ReLU) and unfused[0].activation is None
