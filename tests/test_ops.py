"""CPU tests of the C++ ops (TORCH_LIBRARY instance_norm_cuda): their registration,
the front's CPU fallback, and what torch.compile traces from the front on fake CUDA
tensors (no GPU needed to trace)."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

OPS = ("forward", "backward", "forward_eval", "update_running_stats")


def test_ops_have_cuda_fake_and_autograd_kernels(solution):
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in OPS:
        qualname = f"instance_norm_cuda::{name}"
        assert has(qualname, "CUDA") and has(qualname, "Meta") and has(qualname, "Autograd"), name
    assert has("instance_norm_cuda::instance_norm", "CompositeImplicitAutograd")
    schema = str(torch.ops.instance_norm_cuda.update_running_stats.default._schema)
    assert "Tensor(a!) running_mean" in schema and "Tensor(b!) running_var" in schema


def test_front_op_runs_pytorch_on_cpu(solution):
    torch.manual_seed(4)
    x, weight, bias = torch.randn(2, 3, 6, 6), torch.randn(3), torch.randn(3)
    ours = [torch.zeros(3), torch.ones(3)]
    theirs = [t.clone() for t in ours]
    out = torch.ops.instance_norm_cuda.instance_norm(x, *ours, weight, bias, True, 0.2, 1e-5)
    torch.testing.assert_close(out, F.instance_norm(x, *theirs, weight, bias, True, 0.2, 1e-5))
    torch.testing.assert_close(ours, theirs)


def fake_cuda(*tensors):
    """Fake CUDA tensors of the given (shape, memory_format) pairs."""
    with FakeTensorMode():
        return [torch.empty(shape, device="cuda").to(memory_format=layout) for shape, layout in tensors]


def traced_ops(fn, *args):
    graph = make_fx(fn, tracing_mode="fake")(*args)
    return [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]


def test_training_forward_traces_to_forward_and_the_running_update(solution):
    x, weight, mean, var = fake_cuda(((2, 3, 8, 8), torch.channels_last), ((3,), torch.contiguous_format),
                                     ((3,), torch.contiguous_format), ((3,), torch.contiguous_format))

    def fn(x, weight, mean, var):
        return solution.instance_norm(x, mean, var, weight, momentum=0.3)

    ops = traced_ops(fn, x, weight, mean, var)
    assert "instance_norm_cuda.forward.default" in ops and "instance_norm_cuda.update_running_stats.default" in ops
    assert not any("clone" in op or "copy" in op for op in ops), ops  # channels-last is read in place
    # The fake output keeps the input's layout, as the CUDA kernel's does.
    with FakeTensorMode(allow_non_fake_inputs=True):
        y, stats = torch.ops.instance_norm_cuda.forward(x, weight, None, 1e-5, 0, 0.01, None)
    assert y.stride() == x.stride() and stats.shape == (2, 2 * 3) and stats.dtype == torch.float32


def test_eval_traces_to_forward_eval_and_other_strides_to_a_copy(solution):
    x, mean, var = fake_cuda(((2, 3, 8, 8), torch.contiguous_format), ((3,), torch.contiguous_format),
                             ((3,), torch.contiguous_format))

    def fn(x, mean, var):
        return solution.instance_norm(x.transpose(2, 3), mean, var, use_input_stats=False)

    ops = traced_ops(fn, x, mean, var)
    assert "instance_norm_cuda.forward_eval.default" in ops and "instance_norm_cuda.forward.default" not in ops
    assert "aten.clone.default" in ops, ops


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_eager_calls_on_fake_tensors_reach_the_fake_kernels(solution, grad):
    """An eager call (no torch.compile) under FakeTensorMode goes through the
    dispatcher to the ops' fake kernels: the front calls the CUDA kernels itself only
    for plain CUDA tensors with no dispatch mode on. (The backward of fake CUDA
    tensors needs a GPU for the autograd engine; torch.compile's GPU tests trace it.)"""
    with FakeTensorMode():
        x = torch.empty(2, 3, 8, 8, device="cuda").to(memory_format=torch.channels_last)
        weight = torch.empty(3, device="cuda", requires_grad=True)
        with torch.set_grad_enabled(grad):
            y = solution.instance_norm(x, weight=weight, activation="relu")
        assert y.shape == x.shape and y.stride() == x.stride() and y.device.type == "cuda"
        assert (y.grad_fn is not None) == grad


def test_errors_are_raised_while_tracing(solution):
    x, weight, column = fake_cuda(((2, 3, 8, 8), torch.contiguous_format), ((4,), torch.contiguous_format),
                                  ((3, 1), torch.contiguous_format))
    with pytest.raises(ValueError, match="weight must have C = 3 elements, got 4"):
        traced_ops(lambda x, weight: solution.instance_norm(x, weight=weight), x, weight)
    with pytest.raises(ValueError, match="weight must be a 1-D tensor of C = 3 elements, got 2 dimensions"):
        traced_ops(lambda x, weight: solution.instance_norm(x, weight=weight), x, column)


def test_path_ids_and_capacities_are_exported(solution):
    """The tables the GPU tests and tools read (tests/reference.py): every path by
    name with ids 0 .. n - 1 (0: automatic), and per kernel dtype the capacities the
    paths' limits in kernels/instance_norm.h state."""
    ext = solution._EXT
    assert set(ext.forward_paths) == {"auto", "block", "cluster", "warp", "split", "cooperative", "pipelined"}
    assert set(ext.backward_paths) == {"auto", "generic", "cluster", "cooperative", "block"}
    for paths, count in ((ext.forward_paths, ext.num_forward_paths), (ext.backward_paths, ext.num_backward_paths)):
        assert paths["auto"] == 0 and sorted(paths.values()) == list(range(count))
    for dtype, per_cta in (("float32", 32768), ("float16", 65536), ("bfloat16", 65536)):
        assert ext.forward_capacities[dtype] == {"warp_spatial": 1024, "resident_cta": per_cta, "max_cluster_size": 16,
                                                 "pipelined_cta": per_cta // 2}
        assert ext.backward_capacities[dtype] == {"block_spatial": per_cta // 2}


def test_front_traces_with_symbolic_shapes(solution):
    """Dynamic shapes (torch.compile after a shape change): the front's checks and
    the fakes take symbolic sizes."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    mode = FakeTensorMode(shape_env=ShapeEnv())
    sizes = mode.from_tensor(torch.empty(2, 3, 8, 8, device="meta"),
                             symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)).shape
    with mode:
        x = torch.empty(sizes, device="cuda")
        weight, mean, var = (torch.empty(sizes[1], device="cuda") for _ in range(3))
    assert not isinstance(x.shape[0], int)
    ops = traced_ops(lambda x, weight, mean, var: solution.instance_norm(x, mean, var, weight), x, weight, mean, var)
    assert "instance_norm_cuda.forward.default" in ops and "instance_norm_cuda.update_running_stats.default" in ops
