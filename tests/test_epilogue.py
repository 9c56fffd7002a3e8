"""CPU tests of the fused epilogues' interface: the functional's CPU and float64
fallback (the same composition with PyTorch ops), its errors, the modules'
activation and reflection_pad options, convert_instance_norm on the real-network
benchmark's nets, and the torch.compile rewrite."""
import copy
import pickle

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_residual_after_the_pad_is_the_pytorch_composition(solution, dtype):
    """With reflection_pad, a residual of the padded shape is added after the pad,
    output and gradients (the residual's is the padded gradient itself)."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 8, 6, dtype=dtype, requires_grad=True)
    r = torch.randn(2, 3, 11, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(3, dtype=dtype, requires_grad=True)
    out = solution.instance_norm(x, weight=weight, residual=r, reflection_pad=(1, 1, 2, 1))
    expected = F.pad(F.instance_norm(x, weight=weight), (1, 1, 2, 1), mode="reflect") + r
    torch.testing.assert_close(out, expected)
    dy = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (x, weight, r), dy),
                               torch.autograd.grad(expected, (x, weight, r), dy))


def test_epilogue_errors_name_the_argument(solution):
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(ValueError, match="activation must be None, 'relu'.*got 'tanh'"):
        solution.instance_norm(x, activation="tanh")
    with pytest.raises(TypeError, match="activation must be None, 'relu'.*got int"):
        solution.instance_norm(x, activation=1)
    with pytest.raises(ValueError, match=r"residual must have the input's shape \[2, 3, 8, 8\], got \[2, 3, 8, 7\]"):
        solution.instance_norm(x, residual=torch.randn(2, 3, 8, 7))
    with pytest.raises(ValueError, match=r"residual must have the input's shape \[2, 3, 8, 8\] or the padded shape "
                                         r"\[2, 3, 10, 9\], got \[2, 3, 8, 9\]"):
        solution.instance_norm(x, residual=torch.randn(2, 3, 8, 9), reflection_pad=(1, 0, 1, 1))
    with pytest.raises(ValueError, match="residual of the padded shape is added after the pad and takes no "
                                         "activation, got activation 'silu'"):
        solution.instance_norm(x, residual=torch.randn(2, 3, 10, 9), reflection_pad=(1, 0, 1, 1), activation="silu")
    with pytest.raises(TypeError, match="residual must have the input's dtype"):
        solution.instance_norm(x, residual=torch.randn(2, 3, 8, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor or None"):
        solution.instance_norm(x, residual=1.0)
    with pytest.raises(ValueError, match="InstanceNorm2d: activation must be None, 'relu', 'leaky_relu', 'silu', "
                                         "'gelu' or 'gelu_tanh', got 'tanh'"):
        solution.InstanceNorm2d(3, activation="tanh")
    with pytest.raises(TypeError, match="InstanceNorm2d: activation must be None, 'relu'.*, got int"):
        solution.InstanceNorm2d(3, activation=3)
    with pytest.raises(TypeError, match="enabled must be a bool, got str"):
        solution.set_compile_fusion("no")
    for bad in ("a", None, True):
        with pytest.raises(TypeError, match=f"negative_slope must be a real number, got {type(bad).__name__}"):
            solution.instance_norm(x, activation="leaky_relu", negative_slope=bad)
        with pytest.raises(TypeError, match=f"InstanceNorm2d: negative_slope must be a real number, got "
                                            f"{type(bad).__name__}"):
            solution.InstanceNorm2d(3, activation="leaky_relu", negative_slope=bad)


def test_converter_errors_name_the_argument(solution):
    with pytest.raises(TypeError, match="module must be an nn.Module, got int"):
        solution.convert_instance_norm(3)
    for option in ("fuse_activations", "fuse_padding"):
        with pytest.raises(TypeError, match=f"{option} must be a bool, got str"):
            solution.convert_instance_norm(nn.Sequential(), **{option: "yes"})


@pytest.mark.parametrize("shape,pad", [((2, 3, 9), (2, 3)), ((2, 3, 6, 7), (1, 2, 3, 0)),
                                       ((1, 2, 4, 5, 6), (1, 1, 2, 0, 3, 3))], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fallback_reflection_pad_is_the_pytorch_composition(solution, shape, pad, dtype):
    """act(norm(x) + r) padded as F.pad(..., mode="reflect") pads it, forward and
    gradients (the functional and the module)."""
    torch.manual_seed(8)
    x, r = torch.randn(shape, dtype=dtype, requires_grad=True), torch.randn(shape, dtype=dtype, requires_grad=True)
    weight = torch.randn(shape[1], dtype=dtype, requires_grad=True)
    out = solution.instance_norm(x, weight=weight, activation="silu", residual=r, reflection_pad=list(pad))
    expected = F.pad(F.silu(F.instance_norm(x, weight=weight) + r), pad, mode="reflect")
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(out, (x, r, weight), g),
                               torch.autograd.grad(expected, (x, r, weight), g))
    module = getattr(solution, f"InstanceNorm{len(shape) - 2}d")(shape[1], activation="relu", reflection_pad=pad)
    assert f"reflection_pad={pad}" in repr(module)
    torch.testing.assert_close(module(x.detach()), F.pad(F.relu(F.instance_norm(x.detach())), pad, mode="reflect"))


def test_reflection_pad_errors_name_the_argument(solution):
    x = torch.randn(2, 3, 6, 7)
    with pytest.raises(ValueError, match=r"reflection_pad must have 4 values \(2 per spatial dim\), got 2"):
        solution.instance_norm(x, reflection_pad=(1, 1))
    with pytest.raises(ValueError, match="reflection_pad values must be >= 0 and less than the size of the dim they "
                                         "pad, got 6 for dim 2 of size 6"):
        solution.instance_norm(x, reflection_pad=(1, 1, 0, 6))
    with pytest.raises(ValueError, match="got -1 for dim 3 of size 7"):
        solution.instance_norm(x, reflection_pad=(-1, 1, 0, 0))
    with pytest.raises(TypeError, match="reflection_pad must be None or a sequence of ints"):
        solution.instance_norm(x, reflection_pad=(1.0, 1, 1, 1))
    with pytest.raises(TypeError, match="reflection_pad must be None or a sequence of ints"):
        solution.instance_norm(x, reflection_pad=1)
    with pytest.raises(ValueError, match=r"InstanceNorm3d: reflection_pad must be 6 values >= 0 .*got \(1, 1, 1, 1\)"):
        solution.InstanceNorm3d(3, reflection_pad=(1, 1, 1, 1))
    with pytest.raises(ValueError, match=r"InstanceNorm2d: reflection_pad must be 4 values >= 0 .*got \(1, -1, 0, 0\)"):
        solution.InstanceNorm2d(3, reflection_pad=(1, -1, 0, 0))


def test_module_activation_and_repr(solution):
    torch.manual_seed(3)
    module = solution.InstanceNorm2d(3, affine=True, activation="leaky_relu", negative_slope=0.3)
    assert "activation='leaky_relu', negative_slope=0.3" in repr(module)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(module(x), F.leaky_relu(F.instance_norm(x, weight=module.weight, bias=module.bias), 0.3))
    assert "activation" not in repr(solution.InstanceNorm2d(3))


# net: (norms, activations the converter folds: those in an nn.Sequential right after a
# norm; the transformer net calls F.relu, which no module converter can see, reflection
# pads it folds: CycleGAN's after each block's first norm and before its last conv), input.
CONVERSIONS = {"transformer": (15, 0, 0, (1, 3, 32, 32)), "cyclegan": (23, 14, 10, (1, 3, 32, 32)),
               "unet3d": (18, 18, 0, (1, 1, 32, 32, 32))}


@pytest.mark.parametrize("net", sorted(CONVERSIONS))
def test_converter_keeps_outputs_gradients_and_parameters(solution, nets, net):
    norms, fused, padded, shape = CONVERSIONS[net]
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
    assert sum(m.reflection_pad is not None for m in ours) == padded
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
    # The modules put in place of a fused activation and pad keep eval mode.
    model = nn.Sequential(nn.InstanceNorm2d(2), nn.ReLU(), nn.ReflectionPad2d(1)).eval()
    fused = solution.convert_instance_norm(model)
    assert isinstance(fused[1], nn.Identity) and isinstance(fused[2], nn.Identity)
    assert not any(module.training for module in fused.modules())


def test_converter_folds_only_a_reflection_pad_of_the_norms_dims_after_it(solution):
    padded = solution.convert_instance_norm(
        nn.Sequential(nn.InstanceNorm2d(2), nn.ReLU(), nn.ReflectionPad2d((1, 2, 0, 1))))
    assert padded[0].reflection_pad == (1, 2, 0, 1) and isinstance(padded[2], nn.Identity)
    kept = solution.convert_instance_norm(nn.Sequential(nn.InstanceNorm2d(2), nn.ReflectionPad1d(1)))
    assert kept[0].reflection_pad is None and isinstance(kept[1], nn.ReflectionPad1d)
    kept = solution.convert_instance_norm(nn.Sequential(nn.InstanceNorm2d(2), nn.ReLU(), nn.ReflectionPad2d(1)),
                                          fuse_activations=False)
    assert kept[0].reflection_pad is None and isinstance(kept[2], nn.ReflectionPad2d)
    kept = solution.convert_instance_norm(nn.Sequential(nn.InstanceNorm2d(2), nn.ReflectionPad2d(1)),
                                          fuse_padding=False)
    assert kept[0].reflection_pad is None and isinstance(kept[1], nn.ReflectionPad2d)


def captured_and_rewritten(solution, fn, *inputs):
    """fn captured by Dynamo (fullgraph) and its graph rewritten by the compile
    fusion: (fn's output through the rewritten graph, activations and folds) where
    each instance_norm call of the rewritten graph gives (activation, negative_slope,
    has residual)."""
    record = {}

    def backend(gm, example_inputs):
        record["folded"] = solution._fuse_epilogues(gm.graph)
        gm.recompile()
        record["calls"] = [(n.args[8], n.args[9], n.args[10] is not None) for n in gm.graph.nodes
                           if n.target is solution._instance_norm_op]
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return out, record


def _mutating_between(norm):
    def fn(x, r):
        y = norm(x)
        r.mul_(2)
        return y + r
    return fn


def _running_mean_read_between(norm, fused):
    def fn(x, r):
        y = fused(x)
        seen = fused.running_mean * 1
        return F.relu(y) + seen.sum()
    return fn


def _two_users(norm):
    def fn(x, r):
        y = norm(x)
        return F.relu(y) + y
    return fn


# case: (fn of (norm, fused norm) -> fn of (x, r), folds, the rewritten graph's instance_norm calls)
FUSION_CASES = {
    "relu": (lambda n, f: lambda x, r: F.relu(n(x)), 1, [("relu", 0.01, False)]),
    "relu method in place": (lambda n, f: lambda x, r: n(x).relu_(), 1, [("relu", 0.01, False)]),
    "relu module in place": (lambda n, f: lambda x, r: nn.ReLU(True)(n(x)), 1, [("relu", 0.01, False)]),
    "leaky_relu": (lambda n, f: lambda x, r: F.leaky_relu(n(x), 0.2), 1, [("leaky_relu", 0.2, False)]),
    "gelu tanh": (lambda n, f: lambda x, r: F.gelu(n(x), approximate="tanh"), 1, [("gelu_tanh", 0.01, False)]),
    "silu of residual add": (lambda n, f: lambda x, r: F.silu(n(x) + r), 2, [("silu", 0.01, True)]),
    "residual first": (lambda n, f: lambda x, r: torch.add(r, n(x)), 1, [(None, 0.01, True)]),
    "add after the activation": (lambda n, f: lambda x, r: F.relu(n(x)) + r, 1, [("relu", 0.01, False)]),
    "fused norm then add": (lambda n, f: lambda x, r: f(x) + r, 0, [("relu", 0.01, False)]),
    "two users": (lambda n, f: _two_users(n), 0, [(None, 0.01, False)]),
    "broadcast add": (lambda n, f: lambda x, r: n(x) + r[:, :1], 0, [(None, 0.01, False)]),
    "promoting add": (lambda n, f: lambda x, r: n(x) + r.double(), 0, [(None, 0.01, False)]),
    "scaled add": (lambda n, f: lambda x, r: torch.add(n(x), r, alpha=2), 0, [(None, 0.01, False)]),
    "mutation in between": (lambda n, f: _mutating_between(n), 0, [(None, 0.01, False)]),
    "other activation": (lambda n, f: lambda x, r: torch.tanh(n(x)), 0, [(None, 0.01, False)]),
    "running statistics, relu": (lambda n, f: lambda x, r: F.relu(f(x)), 1, [("relu", 0.01, False)]),
    "running statistics read in between": (lambda n, f: _running_mean_read_between(n, f), 0, [(None, 0.01, False)]),
}


@pytest.mark.parametrize("case", sorted(FUSION_CASES))
def test_compile_fusion_rewrites_only_what_it_can_fold(solution, case):
    """The rewrite of Dynamo graphs folds an activation and a residual add that follow
    a norm, and nothing else: the rewritten graph computes what fn computes."""
    make, folds, calls = FUSION_CASES[case]
    torch.manual_seed(5)
    norm = solution.InstanceNorm2d(3, affine=True)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    fused = solution.InstanceNorm2d(3, activation="relu")
    if case.startswith("running statistics"):  # f: a norm that updates running statistics, no activation
        fused = solution.InstanceNorm2d(3, track_running_stats=True)
    x, r = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)
    expected = make(copy.deepcopy(norm), copy.deepcopy(fused))(x, r.clone())  # copies: running statistics
    out, record = captured_and_rewritten(solution, make(norm, fused), x, r.clone())
    assert (record["folded"], record["calls"]) == (folds, calls)
    torch.testing.assert_close(out, expected)


def _pad_of_sum(norm):
    def fn(x, r):
        return F.pad(norm(x) + r, (1, 1, 1, 1), mode="reflect")
    return fn


def _padded_sums(norm):
    """Two residual sums, each padded by the next step and added to the next sum: the
    first norm writes its output padded, the second adds that padded residual after
    its own pad; the last reads its residual through a crop."""
    def fn(x, r):
        s = F.relu(norm(x))
        t = norm(F.pad(s, (1, 1, 1, 1), mode="reflect")[:, :, 2:, 2:]) + s
        return norm(F.pad(t, (1, 1, 1, 1), mode="reflect")[:, :, :-2, :-2]) + t
    return fn


def _pad_and(other):
    """norm(x) both padded and taken by other(crop of the padded output, norm(x))."""
    def make(norm):
        def fn(x, r):
            y = norm(x)
            return other(F.pad(y, (1, 1, 1, 1), mode="reflect")[:, :, 1:-1, 1:-1], y)
        return fn
    return make


# case: (fn of a norm -> fn of (x, r), input size (H, W), folds, the rewritten graph's
# instance_norm calls as (activation, reflection_pad, has residual))
PAD_FUSION_CASES = {
    "relu then pad": (lambda n: lambda x, r: F.pad(F.relu(n(x)), (1, 1, 1, 1), mode="reflect"), (40, 40), 2,
                      [("relu", [1, 1, 1, 1], False)]),
    "pad module": (lambda n: lambda x, r: nn.ReflectionPad2d((2, 1, 0, 3))(n(x)), (40, 40), 1,
                   [(None, [2, 1, 0, 3], False)]),
    "pad then relu": (lambda n: lambda x, r: F.relu(F.pad(n(x), (1, 1, 1, 1), "reflect")), (40, 40), 1,
                      [(None, [1, 1, 1, 1], False)]),
    "constant pad": (lambda n: lambda x, r: F.pad(n(x), (1, 1, 1, 1)), (40, 40), 0, [(None, None, False)]),
    "pad of a residual add": (lambda n: _pad_of_sum(n), (40, 40), 1, [(None, None, True)]),
    "warp-path slices": (lambda n: lambda x, r: F.pad(n(x), (1, 1, 1, 1), mode="reflect"), (16, 16), 0,
                         [(None, None, False)]),
    "slices past the backward block path": (lambda n: lambda x, r: F.pad(n(x), (1, 1, 1, 1), mode="reflect"),
                                            (128, 160), 0, [(None, None, False)]),
    "padded residual sums": (_padded_sums, (40, 40), 5, [("relu", [1, 1, 1, 1], False),
                                                        (None, [1, 1, 1, 1], True), (None, None, True)]),
    "pad and an add": (_pad_and(torch.add), (40, 40), 1, [(None, [1, 1, 1, 1], False)]),
    "pad and another use": (_pad_and(lambda a, b: a * torch.tanh(b)), (40, 40), 0, [(None, None, False)]),
    "padded rows narrower than a vector": (lambda n: lambda x, r: F.pad(n(x), (1, 0, 1, 1), mode="reflect"),
                                           (600, 2), 0, [(None, None, False)]),
}


@pytest.mark.parametrize("case", sorted(PAD_FUSION_CASES))
def test_compile_fusion_folds_a_reflection_pad_where_the_kernels_take_it(solution, case):
    """A reflection pad after a norm (and its activation) folds where the block paths
    would write and read it (float32 slices of 1,025 to 16,384 values, no residual);
    the rewritten graph computes what fn computes (on CPU, PyTorch's composition)."""
    make, size, folds, calls = PAD_FUSION_CASES[case]
    torch.manual_seed(9)
    norm = solution.InstanceNorm2d(3)
    x, r = torch.randn(2, 3, *size), torch.randn(2, 3, *size)
    record = {}

    def backend(gm, example_inputs):
        record["folded"] = solution._fuse_epilogues(gm.graph)
        gm.recompile()
        arguments = solution._FRONT_ARGUMENTS
        record["calls"] = [(n.args[8], n.args[11], n.args[10] is not None) if len(n.args) == len(arguments)
                           else (None, None, False) for n in gm.graph.nodes if n.target in solution._FRONT_TARGETS]
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(make(norm), backend=backend, fullgraph=True)(x, r)
    assert (record["folded"], record["calls"]) == (folds, calls)
    torch.testing.assert_close(out, make(norm)(x, r))


def through_aot_autograd(solution, module, x):
    """module captured by Dynamo (fullgraph), its graph rewritten by the compile
    fusion and traced by AOTAutograd into forward and backward graphs (run eagerly,
    as inductor would compile them, the backward graph after _merge_zero_gradients),
    then run forward and backward (of the mean square) on x: (output, x's gradient,
    {parameter name: gradient}, folds, biases dropped (_DroppedBias calls in the
    rewritten graph), the traced forward graph's convolutions with a bias, zero
    gradients merged into one buffer)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    record = {}

    def forward_compiler(gm, example_inputs):
        record["convolutions with bias"] = sum(node.target is torch.ops.aten.convolution.default
                                               and node.args[2] is not None for node in gm.graph.nodes)
        return make_boxed_func(gm.forward)

    def backward_compiler(gm, example_inputs):
        record["merged"] = solution._merge_zero_gradients(gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        record["folded"] = solution._fuse_epilogues(gm.graph)
        record["dropped"] = sum(node.target == solution._DroppedBias.apply for node in gm.graph.nodes)
        gm.recompile()
        return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)(gm, example_inputs)

    torch._dynamo.reset()
    x = x.clone().requires_grad_()
    out = torch.compile(module, backend=backend, fullgraph=True)(x)
    out.square().mean().backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    return (out, x.grad, grads, record["folded"], record["dropped"], record["convolutions with bias"],
            record["merged"])


def assert_matches_eager(reference, x, out, grad_x, grads, zero=lambda name: False):
    """out, grad_x and grads ({parameter name: gradient}) are those of the eager module
    reference on x (backward of the mean square), but the gradients of the parameters
    zero(name) picks (biases dropped before a norm): zero, and kept, not None. The
    reference's gradients are left in its parameters."""
    xe = x.clone().requires_grad_()
    expected = reference(xe)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad_x, xe.grad)
    for name, p in reference.named_parameters():
        if zero(name):
            assert grads[name] is not None and torch.count_nonzero(grads[name]) == 0, name
        else:
            torch.testing.assert_close(grads[name], p.grad, msg=name)


class _PaddedSums(nn.Module):
    """_padded_sums with three affine norms of their own."""

    def __init__(self, solution):
        super().__init__()
        self.norms = nn.ModuleList(solution.InstanceNorm2d(3, affine=True) for _ in range(3))

    def forward(self, x):
        s = F.relu(self.norms[0](x))
        t = self.norms[1](F.pad(s, (1, 1, 1, 1), mode="reflect")[:, :, 2:, 2:]) + s
        return self.norms[2](F.pad(t, (1, 1, 1, 1), mode="reflect")[:, :, :-2, :-2]) + t


def test_compile_fusion_keeps_padded_sums_through_autograd(solution):
    """The padded residual sums (_pad_kept_for_users) traced through AOTAutograd: the
    rewritten graph's output and gradients, the crops' included, are eager's."""
    torch.manual_seed(8)
    module = _PaddedSums(solution)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = torch.randn(2, 3, 40, 40)
    reference = copy.deepcopy(module)
    out, grad_x, grads, folded, *_ = through_aot_autograd(solution, module, x)
    assert folded == 5
    assert_matches_eager(reference, x, out, grad_x, grads)


class _PaddedConvSums(nn.Module):
    """CycleGAN's pattern on CPU: a stem (conv, norm, ReLU), then two sums of
    norm(conv(reflection pad of the previous sum)) and that sum."""

    def __init__(self, solution):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3, 3, 3, padding=p) for p in (1, 0, 0))
        self.norms = nn.ModuleList(solution.InstanceNorm2d(3) for _ in range(3))

    def forward(self, x):
        s = F.relu(self.norms[0](self.convs[0](x)))
        t = self.norms[1](self.convs[1](F.pad(s, (1, 1, 1, 1), mode="reflect"))) + s
        return self.norms[2](self.convs[2](F.pad(t, (1, 1, 1, 1), mode="reflect"))) + t


def test_compile_fusion_keeps_padded_sums_and_drops_their_biases(solution):
    """The padded sums of _PaddedConvSums with the biases before their norms dropped:
    every bias keeps its place in the backward (a zero gradient, not None) and the
    other gradients are eager's."""
    torch.manual_seed(4)
    module = _PaddedConvSums(solution)
    x = torch.randn(2, 3, 40, 40)
    reference = copy.deepcopy(module)
    out, grad_x, grads, folded, dropped, with_bias, merged = through_aot_autograd(solution, module, x)
    assert (folded, dropped, with_bias, merged) == (8, 3, 0, 3)
    assert_matches_eager(reference, x, out, grad_x, grads, zero=lambda name: name.endswith("bias"))


class _TwoUses(nn.Module):
    """norm(conv(x)) + conv(x): the convolution's output has a use besides the norm."""

    def __init__(self, conv, norm):
        super().__init__()
        self.conv, self.norm = conv, norm

    def forward(self, x):
        y = self.conv(x)
        return self.norm(y) + y


# case: (the model from (solution, a Conv2d with bias), input shape, folds, dropped biases, traced
# convolutions with a bias)
BIAS_CASES = {
    "conv2d, norm": (lambda s, c: nn.Sequential(c, s.InstanceNorm2d(4)), (2, 3, 8, 8), 1, 1, 0),
    "conv2d, affine norm, relu": (lambda s, c: nn.Sequential(c, s.InstanceNorm2d(4, affine=True), nn.ReLU()),
                                  (2, 3, 8, 8), 2, 1, 0),
    # The module unsqueezes an unbatched input: the norm's input is not the convolution's output.
    "unbatched": (lambda s, c: nn.Sequential(c, s.InstanceNorm2d(4)), (3, 8, 8), 0, 0, 1),
    "conv_transpose2d": (lambda s, c: nn.Sequential(nn.ConvTranspose2d(3, 4, 3, stride=2), s.InstanceNorm2d(4)),
                         (2, 3, 5, 5), 1, 1, 0),
    "conv3d": (lambda s, c: nn.Sequential(nn.Conv3d(3, 4, 3), s.InstanceNorm3d(4)), (2, 3, 6, 6, 6), 1, 1, 0),
    "bias as a keyword": (lambda s, c: nn.Sequential(_KeywordBias(c), s.InstanceNorm2d(4)), (2, 3, 8, 8), 1, 1, 0),
    "no bias": (lambda s, c: nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), s.InstanceNorm2d(4)), (2, 3, 8, 8), 0, 0, 0),
    "output used twice": (lambda s, c: _TwoUses(c, s.InstanceNorm2d(4)), (2, 3, 8, 8), 1, 0, 1),
    "running statistics": (lambda s, c: nn.Sequential(c, s.InstanceNorm2d(4, track_running_stats=True)),
                           (2, 3, 8, 8), 0, 0, 1),
    "eval, running statistics": (lambda s, c: nn.Sequential(c, s.InstanceNorm2d(4, track_running_stats=True)).eval(),
                                 (2, 3, 8, 8), 0, 0, 1),
    "another op between": (lambda s, c: nn.Sequential(c, nn.Tanh(), s.InstanceNorm2d(4)), (2, 3, 8, 8), 0, 0, 1),
}


class _KeywordBias(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        return F.conv2d(x, self.conv.weight, bias=self.conv.bias)


@pytest.mark.parametrize("case", sorted(BIAS_CASES))
def test_compile_fusion_drops_a_convolution_bias_only_where_the_norm_removes_it(solution, case):
    """Under the compile fusion a convolution's bias that only feeds a norm using the
    input's statistics (no running statistics) is dropped from the traced
    convolution and gets a zero gradient; the output and every other gradient are
    eager's (float64). Elsewhere the bias stays and its gradient is eager's."""
    make, shape, folds, dropped, traced_biases = BIAS_CASES[case]
    torch.manual_seed(6)
    module = make(solution, nn.Conv2d(3, 4, 3)).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = torch.randn(shape, dtype=torch.float64)
    reference = copy.deepcopy(module)
    out, grad_x, grads, folded, dropped_here, with_bias, merged = through_aot_autograd(solution, module, x)
    assert (folded, dropped_here, with_bias, merged) == (folds, dropped, traced_biases, 0)  # one zero: nothing to merge

    def dropped_bias(name):
        owner = reference.get_submodule(name.rpartition(".")[0])
        return dropped and name.endswith("bias") and isinstance(owner, nn.modules.conv._ConvNd)

    assert_matches_eager(reference, x, out, grad_x, grads, zero=dropped_bias)
    for name, p in reference.named_parameters():
        if dropped_bias(name):
            assert p.grad.abs().max() < 1e-12  # eager's is zero up to rounding


# net: (activations and adds folded, convolution biases dropped, traced convolutions that keep a bias)
NET_REWRITES = {"transformer": (15, 15, 1), "cyclegan": (23, 23, 1), "unet3d": (18, 18, 5)}


@pytest.mark.parametrize("net", sorted(NET_REWRITES))
def test_compile_fusion_on_the_nets_keeps_outputs_and_gradients(solution, nets, net):
    """The real-network benchmark's nets with our norms, captured, rewritten and traced
    through AOTAutograd in float64: every activation and add after a norm folded, the
    bias of every convolution right before a norm dropped, and eager's output and
    gradients (a dropped bias's gradient is zero, eager's zero up to rounding); the
    dropped biases' zero gradients are views of one buffer (_merge_zero_gradients)."""
    folds, dropped, traced_biases = NET_REWRITES[net]
    torch.manual_seed(7)
    model = nets.build(net, "ours", "cpu").double()
    x = torch.randn(CONVERSIONS[net][3], dtype=torch.float64)
    expected_out, expected_grads = nets.output_and_gradients(copy.deepcopy(model), x)
    out, _, grads, folded, dropped_here, with_bias, merged = through_aot_autograd(solution, model, x)
    assert (folded, dropped_here, with_bias, merged) == (folds + dropped, dropped, traced_biases, dropped)
    torch.testing.assert_close(out, expected_out)
    zero_biases = [grad for name, grad in grads.items() if name.endswith("bias") and torch.count_nonzero(grad) == 0]
    assert len(zero_biases) == dropped
    assert len({grad.untyped_storage().data_ptr() for grad in zero_biases}) == 1
    for name, expected in expected_grads.items():
        torch.testing.assert_close(grads[name], expected, atol=1e-12, rtol=1e-7, msg=name)


def test_zero_gradient_merge_takes_1d_calls_of_one_dtype(solution):
    """_merge_zero_gradients on a graph of zero_gradient calls: the 1-d float32 ones
    (sizes 4 and 5) become slices of one buffer; a 2-d one and the only float64 one
    stay calls of their own. Run, every result is zeros of its call's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    likes = [torch.randn(4), torch.randn(2, 3), torch.randn(5), torch.randn(3, dtype=torch.float64)]
    graph = torch.fx.Graph()
    placeholders = [graph.placeholder(f"like{i}") for i in range(len(likes))]
    calls = [graph.call_function(solution._ZERO_GRADIENT_OP, (p,)) for p in placeholders]
    graph.output(tuple(calls))
    with FakeTensorMode():
        for call, like in zip(calls, likes):
            call.meta["val"] = torch.zeros(like.shape, dtype=like.dtype)
    assert solution._merge_zero_gradients(graph) == 2
    assert sum(node.target is solution._ZERO_GRADIENT_OP for node in graph.nodes) == 2
    outputs = torch.fx.GraphModule({}, graph)(*likes)
    for out, like in zip(outputs, likes):
        assert out.shape == like.shape and out.dtype == like.dtype and torch.count_nonzero(out) == 0
    assert outputs[0].untyped_storage().data_ptr() == outputs[2].untyped_storage().data_ptr()


@pytest.mark.parametrize("hook, name", [("pre_grad_custom_pass", "epilogue fusion"),
                                        ("post_grad_custom_post_pass", "zero gradients")])
def test_compile_fusion_installs_once_and_keeps_a_hook_set_before(solution, hook, name):
    import torch._inductor.config as config

    seen = []
    with config.patch({hook: seen.append}):
        solution._install_compile_fusion()
        installed = getattr(config, hook)
        assert installed.instance_norm_pass == name
        solution._install_compile_fusion()
        assert getattr(config, hook) is installed
        graph = torch.fx.Graph()
        installed(graph)
        assert seen == [graph]
        assert installed.uuid() is None  # the earlier hook has no uuid: inductor must not cache
        assert name in pickle.loads(pickle.dumps(installed))  # inductor pickles its config
    with config.patch({hook: None}):
        solution._install_compile_fusion()
        first = getattr(config, hook).uuid()
        solution.set_compile_fusion(False)
        assert isinstance(first, str) and getattr(config, hook).uuid() != first
        solution.set_compile_fusion(True)
