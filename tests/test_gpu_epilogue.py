"""GPU tests of the fused epilogues act(norm(x) * weight + bias + residual): every
activation, with and without a residual, in float32 and bfloat16, contiguous and
channels-last, on every forward and backward path that can run the input, against
the same composition in float64; then the functional's autograd, eval mode and
torch.compile."""
import copy

import pytest
import torch
import torch.nn.functional as F

from reference import (BACKWARD_BLOCK, BACKWARD_GENERIC, BACKWARD_PATHS, BLOCK, FORWARD_PATHS, HOPPER_BACKWARD_PATHS,
                       HOPPER_FORWARD_PATHS, SPLIT, TOLERANCE, WARP, channels_last, float64_reference, hopper,
                       run_poisoned)

pytestmark = pytest.mark.gpu

ACTIVATIONS = (None, "relu", "leaky_relu", "silu", "gelu", "gelu_tanh")
SLOPE = 0.2
DTYPES = (torch.float32, torch.bfloat16)
# Warp, block, split (aligned and not), cluster, cooperative and pipelined contiguous
# slices; channels-last tiles (block and split) and images (cluster: 64 images, more
# than the clusters resident at once, so each cluster takes several).
SHAPES = ((2, 8, 24, 24), (3, 5, 9, 9), (2, 4, 128, 128), (1, 2, 512, 512))
CHANNELS_LAST_SHAPES = ((2, 16, 20, 20), (2, 6, 9, 9), (64, 8, 12, 12))
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def activate64(v, activation):
    """The activation as torch.nn.functional computes it (float64 inputs here)."""
    return {None: lambda t: t, "relu": F.relu, "leaky_relu": lambda t: F.leaky_relu(t, SLOPE), "silu": F.silu,
            "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation](v)


def reference64(x, weight, bias, residual, activation):
    pre = float64_reference(x, weight, bias)
    if residual is not None:
        pre = pre + residual.double()
    return activate64(pre, activation)


def inputs(shape, dtype, layout, with_residual, seed):
    """x, weight, bias, residual (or None), with x moved off the pre-activation's kinks:
    where float64 puts a pre-activation within 1e-3 of 0 the kernels' float32 may put
    it on the other side, and relu's derivative there is 0 or 1."""
    torch.manual_seed(seed)
    x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype)
    weight, bias = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
    residual = torch.randn(shape, device="cuda").to(dtype) if with_residual else None
    for _ in range(3):
        pre = reference64(x, weight, bias, residual, None)
        x = torch.where(pre.abs() < 1e-3, x.double() + 0.05, x.double()).to(dtype)
    if layout == "channels_last":
        x = channels_last(x)
        residual = channels_last(residual) if with_residual else None
    return x, weight, bias, residual


def cases(dtype, with_residual, seed):
    for shape in SHAPES:
        yield inputs(shape, dtype, "contiguous", with_residual, seed)
    for shape in CHANNELS_LAST_SHAPES:
        yield inputs(shape, dtype, "channels_last", with_residual, seed)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_epilogue_matches_float64_on_every_path(solution, activation, with_residual, dtype):
    ran = set()
    for x, weight, bias, residual in cases(dtype, with_residual, 31):
        expected = reference64(x, weight, bias, residual, activation)
        for path in [p for p in FORWARD_PATHS if solution._EXT.path_supported(x, p)]:
            out, stats = run_poisoned(lambda: solution._EXT.forward_with_stats(
                x, weight, bias, path=path, activation=activation, negative_slope=SLOPE, residual=residual), x)
            assert out.stride() == x.stride() and out.dtype == x.dtype
            torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype],
                                       rtol=0 if dtype == torch.float32 else 1e-2,
                                       msg=lambda m: f"{tuple(x.shape)} path {path}: {m}")
            ran.add(path)
    if hopper(solution):
        assert ran == set(FORWARD_PATHS), ran
    else:  # the cooperative path where its CTA's staged copy fits this GPU's shared memory
        assert ran >= {BLOCK, WARP, SPLIT} and not ran & set(HOPPER_FORWARD_PATHS), ran


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_relu_keeps_nan_as_torch_relu(solution, dtype):
    """F.relu keeps NaN, and so does the fused ReLU on every forward path: a slice with
    a NaN comes out all NaN (its statistics are NaN), also where the 16-bit resident
    kernels fold ReLU into the conversion of their output (float16 included); the other
    slices match float64. Outputs are poisoned with a finite value, so each NaN seen
    was written."""
    for x, weight, bias, _ in cases(dtype, False, 53):
        x[(0, 0) + (1,) * (x.dim() - 2)] = float("nan")
        expected = reference64(x, weight, bias, None, "relu")
        for path in [p for p in FORWARD_PATHS if solution._EXT.path_supported(x, p)]:
            out, _ = run_poisoned(lambda: solution._EXT.forward_with_stats(x, weight, bias, path=path,
                                                                           activation="relu"), x, value=7.0)
            assert out[0, 0].isnan().all(), f"{tuple(x.shape)} path {path}"
            torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype],
                                       rtol=0 if dtype == torch.float32 else 1e-2, equal_nan=True,
                                       msg=lambda m: f"{tuple(x.shape)} path {path}: {m}")


@pytest.mark.parametrize("activation", ("relu", "gelu_tanh"), ids=str)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_forward_epilogue_reads_16bit_parameters(solution, activation, dtype):
    """Weight and bias of the input's 16-bit dtype, which the forward kernels read as
    they are: every path, with a residual, against float64 of the same parameters."""
    for x, weight, bias, residual in cases(dtype, True, 59):
        weight, bias = weight.to(dtype), bias.to(dtype)
        expected = reference64(x, weight, bias, residual, activation)
        for path in [p for p in FORWARD_PATHS if solution._EXT.path_supported(x, p)]:
            out, _ = run_poisoned(lambda: solution._EXT.forward_with_stats(
                x, weight, bias, path=path, activation=activation, residual=residual), x)
            torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=1e-2,
                                       msg=lambda m: f"{tuple(x.shape)} path {path}: {m}")


def gradients64(x, weight, bias, residual, activation, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    r64 = residual.detach().double().requires_grad_() if residual is not None else None
    y = reference64(*leaves, r64, activation)
    return torch.autograd.grad(y, leaves + ([r64] if r64 is not None else []), dy.double())


def assert_close_scaled(actual, expected, tolerance, what):
    scale = max(expected.abs().max().item(), 1e-6)
    error = (actual.double() - expected).abs().max().item() / scale
    assert error <= tolerance, f"{what}: max error {error:.3g} of the gradient's scale"


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_epilogue_matches_float64_on_every_path(solution, activation, with_residual, dtype):
    """dx, dweight, dbias (and the residual's gradient with an activation; without one
    it is dy itself, no kernel) on every backward path that takes the epilogue."""
    ran = set()
    for x, weight, bias, residual in cases(dtype, with_residual, 47):
        dy = torch.randn_like(x)
        expected = gradients64(x, weight, bias, residual, activation, dy)
        _, stats = solution._EXT.forward_with_stats(x, weight, bias)
        residual_gradient = with_residual and activation is not None
        paths = [p for p in BACKWARD_PATHS if solution._EXT.backward_path_supported(x, p, residual_gradient)]
        assert BACKWARD_GENERIC in paths
        for path in paths:
            dx, dweight, dbias, dresidual = run_poisoned(lambda: solution._EXT.backward(
                dy, x, stats, weight, path, True, bias, activation, SLOPE, residual), x)
            assert dx.stride() == x.stride() and torch.isfinite(dx).all()
            actual = [dx, dweight, dbias] + ([dresidual if residual_gradient else dy] if with_residual else [])
            assert residual_gradient or dresidual is None
            for got, want, what in zip(actual, expected, ("dx", "dweight", "dbias", "dresidual")):
                assert_close_scaled(got, want, GRAD_TOLERANCE[dtype], f"{tuple(x.shape)} path {path} {what}")
            ran.add(path)
    expected = set(BACKWARD_PATHS) if not (with_residual and activation) else {BACKWARD_GENERIC}
    assert ran == (expected if hopper(solution) else expected - set(HOPPER_BACKWARD_PATHS)), ran


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "gelu"])
@pytest.mark.parametrize("use_input_stats", [True, False], ids=["train", "eval"])
def test_functional_autograd_matches_the_pytorch_composition(solution, activation, use_input_stats):
    """instance_norm(..., activation, residual) and its gradients for every input,
    through the C++ autograd (training) and the eval-mode Function, against
    act(F.instance_norm(...) + residual) in float64."""
    x, weight, bias, residual = inputs((2, 4, 64, 64), torch.float32, "contiguous", True, 5)
    running = (torch.randn(4, device="cuda"), torch.rand(4, device="cuda") + 0.5)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias, residual)]
    out = solution.instance_norm(leaves[0], *running, leaves[1], leaves[2], use_input_stats=use_input_stats,
                                 activation=activation, negative_slope=SLOPE, residual=leaves[3])
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias, residual)]
    running64 = [t.double() for t in running]
    expected = activate64(F.instance_norm(leaves64[0], *running64, leaves64[1], leaves64[2],
                                          use_input_stats=use_input_stats) + leaves64[3], activation)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-4, rtol=0)
    for got, want, what in zip(grads, torch.autograd.grad(expected, leaves64, dy.double()),
                               ("x", "weight", "bias", "residual")):
        assert_close_scaled(got, want, 1e-4, what)


def test_module_activation_under_compile_fullgraph(solution):
    """A module with a fused activation compiles with fullgraph (no graph break) and
    matches eager, forward and gradients."""
    torch.manual_seed(9)
    module = solution.InstanceNorm2d(8, affine=True, activation="silu").cuda()
    x = torch.randn(2, 8, 32, 32, device="cuda")
    compiled = torch.compile(module, fullgraph=True)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager_out, compiled_out = module(xe), compiled(xc)
    torch.testing.assert_close(compiled_out, eager_out)
    dy = torch.randn_like(eager_out)
    eager_out.backward(dy)
    compiled_out.backward(dy)
    torch.testing.assert_close(xc.grad, xe.grad)


# The ops' activation codes (kActivationNames in kernels/instance_norm_entry.cpp).
RELU, LEAKY_RELU = 1, 2


def compiled_gradients(model, x, record):
    """model compiled by inductor (fullgraph, caches off) with record(graph) as the
    post-grad pass, run forward and backward (of the mean square) on x: (output, x's
    gradient, the parameters' gradients as autograd left them: some views of one zero
    buffer, _merge_zero_gradients)."""
    torch._dynamo.reset()
    x = x.clone().requires_grad_()
    with torch._inductor.config.patch(post_grad_custom_post_pass=record, force_disable_caches=True):
        out = torch.compile(model, fullgraph=True)(x)
        out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out, x.grad, grads


def compiled_with_epilogues(model, x):
    """model compiled by inductor (fullgraph, caches off), run forward and backward
    (of the mean square) on x: (output, x's gradient, the parameters' gradients,
    forward calls, backward calls, convolutions with a bias), each call of
    instance_norm_cuda::forward or ::backward in the compiled graphs given as
    (activation code, has residual)."""
    forward_op, backward_op = torch.ops.instance_norm_cuda.forward.default, torch.ops.instance_norm_cuda.backward.default
    calls = {forward_op: [], backward_op: []}
    biased = []

    def record(graph):
        for node in graph.nodes:
            if node.target is torch.ops.aten.convolution.default and node.args[2] is not None:
                biased.append(node)
            if node.target in calls:
                activation, residual = (4, 6) if node.target is forward_op else (5, 7)
                calls[node.target].append((node.args[activation], node.args[residual] is not None))

    out, grad_x, grads = compiled_gradients(model, x, record)
    return out, grad_x, grads, sorted(calls[forward_op]), sorted(calls[backward_op]), len(biased)


def eager_gradients(model, x):
    x = x.clone().requires_grad_()
    out = model(x)
    out.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out, x.grad, grads


def assert_near_eager(model, x, results, skip):
    """results (output, x's gradient, the parameters' gradients, each in model's dtype)
    within 1e-3 of the norm of the float32 eager model's (model in float32, on x in
    float32), plus twice the eager model's own distance from those in its dtype: in
    bf16 eager rounds each op's result, where inductor keeps float32 between the ops
    it fuses. Results whose skip is true are not compared: the gradients of biases
    dropped before a norm, zero compiled and eager's zero up to rounding, so with no
    scale to compare at."""
    own_out, own_grad_x, own_grads = eager_gradients(model, x)
    out, grad_x, grads = eager_gradients(copy.deepcopy(model).float(), x.float())
    for got, own, want, skipped in zip(results, (own_out, own_grad_x, *own_grads), (out, grad_x, *grads), skip):
        if not skipped:
            want = want.float()
            bound = 2 * (own.float() - want).norm() + 1e-3 * want.norm() + 1e-6
            assert (got.float() - want).norm() <= bound


@pytest.fixture
def no_tf32():
    """TF32 convolutions off for one test: the eager and compiled convolution algorithms
    would round differently."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


class ResidualBlock(torch.nn.Module):
    """F.relu(norm1(x)), then norm2(...) + x: what the fast-neural-style net does."""

    def __init__(self, solution, channels):
        super().__init__()
        self.norm1 = solution.InstanceNorm2d(channels, affine=True)
        self.norm2 = solution.InstanceNorm2d(channels, affine=True)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()

    def forward(self, x):
        return self.norm2(F.relu(self.norm1(x)) * 2) + x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_folds_activation_and_residual_forward_and_backward(solution, dtype):
    """Under torch.compile the ReLU and the residual add after our norms run inside
    their kernels, forward and backward, with eager's results."""
    torch.manual_seed(10)
    model = ResidualBlock(solution, 8).cuda()
    x = torch.randn(2, 8, 32, 32, device="cuda", dtype=dtype)
    out, grad_x, grads, forwards, backwards, _ = compiled_with_epilogues(model.to(dtype), x)
    assert forwards == [(0, True), (RELU, False)]
    assert sorted(activation for activation, _ in backwards) == [0, RELU]
    expected_out, expected_grad_x, expected_grads = eager_gradients(model, x)
    tolerance = GRAD_TOLERANCE[dtype]
    torch.testing.assert_close(out, expected_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(grad_x, expected_grad_x, atol=tolerance, rtol=tolerance)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, atol=tolerance, rtol=tolerance)


# net: (input, the compiled forward's calls: (activation code, has residual) -> count,
# convolutions that keep their bias: those not right before a norm)
NET_FOLDS = {"transformer": ((1, 3, 64, 64), {(RELU, False): 10, (0, True): 5}, 1),
             "cyclegan": ((1, 3, 64, 64), {(RELU, False): 14, (0, True): 9}, 1),
             "unet3d": ((1, 1, 32, 32, 32), {(LEAKY_RELU, False): 18}, 5)}


@pytest.mark.parametrize("net", sorted(NET_FOLDS))
def test_compile_folds_the_nets_epilogues(solution, nets, net, no_tf32):
    """Each real-network benchmark net with our norms, compiled: every activation and
    residual add after a norm folded into it (the transformer net's F.relu too), the
    bias of every convolution right before a norm dropped, and the same output and
    gradients as eager (relative to their norms; the dropped biases' gradients are
    zero, eager's zero up to rounding, and views of one buffer: _merge_zero_gradients)."""
    shape, folds, biased = NET_FOLDS[net]
    model = nets.build(net, "ours")
    torch.manual_seed(11)
    x = torch.randn(shape, device="cuda")
    out, grad_x, grads, forwards, _, with_bias = compiled_with_epilogues(model, x)
    assert {call: forwards.count(call) for call in set(forwards)} == folds
    assert with_bias == biased
    convolution_biases = [grad for (name, p), grad in zip(model.named_parameters(), grads) if name.endswith("bias")
                          and isinstance(model.get_submodule(name.rpartition(".")[0]), torch.nn.modules.conv._ConvNd)]
    zeros = [grad for grad in convolution_biases if torch.count_nonzero(grad) == 0]
    assert len(zeros) == len(convolution_biases) - biased > 1
    assert len({grad.untyped_storage().data_ptr() for grad in zeros}) == 1
    assert_near_eager(model, x, (out, grad_x, *grads), [False] * (2 + len(grads)))


def test_residual_view_at_an_odd_offset(solution):
    """A residual the kernels cannot read in 16-byte vectors (a view one element into
    its storage) gives the composition's output and gradients: the ops copy it."""
    torch.manual_seed(12)
    shape = (2, 8, 24, 24)
    x = torch.randn(shape, device="cuda", requires_grad=True)
    base = torch.randn(x.numel() + 1, device="cuda", requires_grad=True)
    residual = base[1:].view(shape)
    out = solution.instance_norm(x, activation="silu", residual=residual)
    x64, base64 = x.detach().double().requires_grad_(), base.detach().double().requires_grad_()
    expected = F.silu(F.instance_norm(x64) + base64[1:].view(shape))
    dy = torch.randn(shape, device="cuda")
    out.backward(dy)
    expected.backward(dy.double())
    torch.testing.assert_close(out, expected.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad, x64.grad.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(base.grad, base64.grad.float(), atol=1e-4, rtol=1e-4)


# (shape, reflection_pad in F.pad's order): 2D with a vector crossing rows (width 50),
# asymmetric pads, a height of 3 whose middle row both pads reflect (9 padded values
# hold one value at its corners), 1D; all on the block paths.
# Padded slices of every offset within 16 bytes: (2, 3, 33, 40) padded to 35 x 43 (odd).
# Padded rows narrower than a 16-bit vector (3 wide, padded to 5): the backward's vectors
# span three rows; the 16-bit forward pads by PyTorch's op (forward_pads), the fp32 one
# by the kernel (a block over two rows).
PAD_CASES = (((2, 8, 48, 40), (1, 1, 1, 1)), ((3, 4, 36, 50), (2, 0, 3, 1)), ((1, 2, 3, 520), (2, 2, 2, 2)),
             ((2, 4, 2048), (5, 3)), ((2, 3, 33, 40), (1, 2, 1, 1)), ((2, 3, 40, 3), (1, 1, 1, 1)))
PAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def padded64(x, weight, bias, activation, pad):
    return F.pad(reference64(x, weight, bias, None, activation), pad, mode="reflect")


@pytest.mark.parametrize("activation", (None, "relu", "gelu_tanh"), ids=str)
@pytest.mark.parametrize("dtype", PAD_DTYPES, ids=str)
def test_forward_reflection_pad_matches_float64(solution, activation, dtype):
    """The padded output, chosen, forced onto the block path and the split one, against
    float64. Where the block kernel writes the pad (padded rows of a 16-byte vector or
    more: forward_pads) its output is poisoned first, so every element must be written;
    elsewhere PyTorch's op pads y, into a block of its own."""
    for shape, pad in PAD_CASES:
        x, weight, bias, _ = inputs(shape, dtype, "contiguous", False, 53)
        expected = padded64(x, weight, bias, activation, pad)
        call = lambda path: solution._EXT.forward_with_stats(x, weight, bias, path=path, activation=activation,
                                                             negative_slope=SLOPE, reflection_pad=pad)
        kernel_pads = (shape[-1] + pad[0] + pad[1]) * x.element_size() >= 16
        for path in (0, BLOCK, SPLIT):
            poisoned = path == BLOCK and kernel_pads
            out, _ = run_poisoned(lambda: call(path), expected.to(dtype)) if poisoned else call(path)
            assert out.shape == expected.shape and out.is_contiguous() and out.dtype == dtype
            torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype],
                                       rtol=0 if dtype == torch.float32 else 1e-2,
                                       msg=lambda m: f"{shape} pad {pad} path {path}: {m}")


@pytest.mark.parametrize("activation", (None, "relu", "silu"), ids=str)
@pytest.mark.parametrize("dtype", PAD_DTYPES, ids=str)
def test_backward_reflection_pad_matches_float64(solution, activation, dtype):
    """dx, dweight and dbias from the padded gradient: gathered by the block kernel
    (every dx element written: poisoned first), and folded by PyTorch's pad backward
    before the generic path (whose folded gradient takes the poisoned block), against
    float64."""
    for shape, pad in PAD_CASES:
        x, weight, bias, _ = inputs(shape, dtype, "contiguous", False, 59)
        leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
        y64 = padded64(*leaves, activation, pad)
        dy = torch.randn(y64.shape, device="cuda").to(dtype)
        expected = torch.autograd.grad(y64, leaves, dy.double())
        _, stats = solution._EXT.forward_with_stats(x, weight, bias)
        assert solution._EXT.backward_path_supported(x, BACKWARD_BLOCK)
        for path in (0, BACKWARD_BLOCK, BACKWARD_GENERIC):
            call = lambda: solution._EXT.backward(dy, x, stats, weight, path, True, bias, activation, SLOPE, None, pad)
            dx, dweight, dbias, _ = call() if path == BACKWARD_GENERIC else run_poisoned(call, x)
            for got, want, what in zip((dx, dweight, dbias), expected, ("dx", "dweight", "dbias")):
                assert_close_scaled(got, want, GRAD_TOLERANCE[torch.bfloat16 if dtype != torch.float32 else dtype],
                                    f"{shape} pad {pad} path {path} {what}")


@pytest.mark.parametrize("dtype", PAD_DTYPES, ids=str)
def test_residual_after_the_pad_matches_float64(solution, dtype):
    """A residual of the padded shape, added after the pad: the forward op's output
    chosen and forced onto the block and split paths (poisoned first where the block
    kernel writes the pad), and the functional's output and gradients (the residual's
    is the padded gradient itself), against float64."""
    for shape, pad in PAD_CASES:
        x, weight, bias, _ = inputs(shape, dtype, "contiguous", False, 67)
        leaves64 = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
        plain64 = padded64(*leaves64, None, pad)
        residual = torch.randn(plain64.shape, device="cuda").to(dtype)
        leaves64.append(residual.double().requires_grad_())
        expected = plain64 + leaves64[3]
        kernel_pads = (shape[-1] + pad[0] + pad[1]) * x.element_size() >= 16
        for path in (0, BLOCK, SPLIT):
            call = lambda: solution._EXT.forward_with_stats(x, weight, bias, path=path, residual=residual,
                                                            reflection_pad=pad)
            out, _ = run_poisoned(call, expected.to(dtype)) if path == BLOCK and kernel_pads else call()
            assert out.shape == expected.shape and out.is_contiguous()
            torch.testing.assert_close(out.double(), expected, atol=2 * TOLERANCE[dtype],
                                       rtol=0 if dtype == torch.float32 else 1e-2,
                                       msg=lambda m: f"{shape} pad {pad} path {path}: {m}")
        leaves = [t.detach().requires_grad_() for t in (x, weight, bias, residual)]
        out = solution.instance_norm(leaves[0], weight=leaves[1], bias=leaves[2], residual=leaves[3],
                                     reflection_pad=pad)
        dy = torch.randn(expected.shape, device="cuda").to(dtype)
        grads, expected_grads = torch.autograd.grad(out, leaves, dy), torch.autograd.grad(expected, leaves64,
                                                                                         dy.double())
        for got, want, what in zip(grads, expected_grads, ("dx", "dweight", "dbias", "dresidual")):
            assert_close_scaled(got, want, GRAD_TOLERANCE[torch.bfloat16 if dtype != torch.float32 else dtype],
                                f"{shape} pad {pad} {what}")


@pytest.mark.parametrize("layout", ("contiguous", "channels_last"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_functional_reflection_pad_autograd_matches_the_pytorch_composition(solution, layout, dtype):
    """instance_norm(..., reflection_pad=) forward and gradients equal F.pad of the
    unpadded result's (the kernels' pad on contiguous input, PyTorch's on
    channels-last; with a residual, PyTorch's after the kernels)."""
    for with_residual in (False, True):
        x, weight, bias, residual = inputs((2, 8, 48, 40), dtype, layout, with_residual, 61)
        leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
        ours = solution.instance_norm(*leaves[:1], weight=leaves[1], bias=leaves[2], activation="relu",
                                      residual=residual, reflection_pad=(3, 1, 2, 2))
        plain = F.pad(solution.instance_norm(*leaves[:1], weight=leaves[1], bias=leaves[2], activation="relu",
                                             residual=residual), (3, 1, 2, 2), mode="reflect")
        assert ours.is_contiguous()
        torch.testing.assert_close(ours, plain, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)
        dy = torch.randn_like(plain)
        for got, want in zip(torch.autograd.grad(ours, leaves, dy), torch.autograd.grad(plain, leaves, dy)):
            torch.testing.assert_close(got, want, atol=GRAD_TOLERANCE[dtype], rtol=GRAD_TOLERANCE[dtype])


class PaddedBlock(torch.nn.Module):
    """CycleGAN's residual block: pad, conv, norm, ReLU, pad, conv, norm, + x."""

    def __init__(self, solution, channels):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.ReflectionPad2d(1), torch.nn.Conv2d(channels, channels, 3), solution.InstanceNorm2d(channels),
            torch.nn.ReLU(True), torch.nn.ReflectionPad2d(1), torch.nn.Conv2d(channels, channels, 3),
            solution.InstanceNorm2d(channels))

    def forward(self, x):
        return x + self.body(x)


class PaddedChain(torch.nn.Module):
    """A stem (conv, norm, ReLU) and three of CycleGAN's residual blocks: each sum but
    the last is padded by the next block and added to that block's sum."""

    def __init__(self, solution, channels):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, channels, 3, padding=1),
                                        solution.InstanceNorm2d(channels), torch.nn.ReLU(True))
        self.blocks = torch.nn.Sequential(*(PaddedBlock(solution, channels) for _ in range(3)))

    def forward(self, x):
        return self.blocks(self.stem(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_keeps_residual_sums_padded(solution, dtype, no_tf32):
    """Under torch.compile the residual sums that the next block pads stay padded: the
    stem's norm and each block's second norm but the last write the padded output,
    the second norms add the previous sum padded: our forward op writes all six pads
    of the model; output and gradients are eager's."""
    torch.manual_seed(13)
    model = PaddedChain(solution, 8).cuda().to(dtype)
    x = torch.randn(2, 3, 48, 48, device="cuda", dtype=dtype)
    forward_op = torch.ops.instance_norm_cuda.forward.default
    calls = []

    def record(graph):
        for node in graph.nodes:
            if node.target is forward_op:
                arguments = dict(zip(("input", "weight", "bias", "eps", "activation", "negative_slope", "residual",
                                      "reflection_pad"), node.args), **node.kwargs)
                residual = arguments["residual"]
                calls.append((list(arguments.get("reflection_pad", [])),
                              None if residual is None else list(residual.meta["val"].shape)))

    out, grad_x, grads = compiled_gradients(model, x, record)
    padded, unpadded = [1, 1, 1, 1], [2, 8, 48, 48]
    assert sorted(calls, key=str) == sorted([(padded, None)] * 4 + [(padded, [2, 8, 50, 50])] * 2
                                            + [([], unpadded)], key=str)
    biases = [name.endswith("bias") for name, _ in model.named_parameters()]
    assert_near_eager(model, x, (out, grad_x, *grads), (False, False, *biases))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_and_converter_fold_the_reflection_pad(solution, dtype, no_tf32):
    """Under torch.compile the pad after the first norm and ReLU runs in our kernels
    (the forward op writes the padded output), with eager's results; the converter
    folds the same pad in eager."""
    torch.manual_seed(12)
    model = PaddedBlock(solution, 8).cuda().to(dtype)
    x = torch.randn(2, 8, 48, 48, device="cuda", dtype=dtype)
    forward_op = torch.ops.instance_norm_cuda.forward.default
    pads = []

    def record(graph):
        pads.extend(node.kwargs.get("reflection_pad", node.args[7] if len(node.args) > 7 else [])
                    for node in graph.nodes if node.target is forward_op)

    out, grad_x, grads = compiled_gradients(model, x, record)
    assert sorted(map(list, pads)) == [[], [1, 1, 1, 1]]
    converted = solution.convert_instance_norm(copy.deepcopy(model))
    assert converted.body[2].reflection_pad == (1, 1, 1, 1) and isinstance(converted.body[4], torch.nn.Identity)
    converted_out, converted_grad_x, converted_grads = eager_gradients(converted, x)
    # Both convolutions feed a norm: compiled, their biases are dropped and get a zero
    # gradient, eager's zero up to rounding.
    biases = [name.endswith("bias") for name, _ in model.named_parameters()]
    assert all(torch.count_nonzero(grad) == 0 for grad, bias in zip(grads, biases) if bias)
    for result in ((out, grad_x, *grads), (converted_out, converted_grad_x, *converted_grads)):
        assert_near_eager(model, x, result, (False, False, *biases))
