"""GPU tests (marked `gpu`) of the C++ ops and their autograd as a training loop
meets them: the backward runs in C++, torch.compile of a conv net's training step
(fullgraph, bf16 autocast) inserts no copies around our ops, compiled autograd,
torch.export, and the user-facing errors raised from C++."""
import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.gpu


def conv_net(norm):
    torch.manual_seed(31)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), norm(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), norm(16), nn.ReLU()).cuda()


def test_backward_node_is_the_cpp_node_and_frees_what_it_saved(solution):
    x = torch.randn(2, 8, 16, 16, device="cuda", requires_grad=True)
    y = solution.InstanceNorm2d(8, affine=True).cuda()(x)
    assert y.grad_fn.name() == "InstanceNormBackward"
    assert not isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_forward_mode_ad_raises(solution):
    import torch.autograd.forward_ad as fwAD
    x = torch.randn(2, 8, 16, 16, device="cuda")
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.randn_like(x))
        with pytest.raises(RuntimeError, match="forward-mode AD is not supported on CUDA"):
            solution.instance_norm(dual)


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        torch.cuda.synchronize()
    return [event.key for event in profile.key_averages() if event.device_type == torch.autograd.DeviceType.CUDA]


def test_compiled_training_step_matches_eager_and_copies_nothing(solution):
    """fullgraph under bf16 autocast: gradients as close to the float64 step's as the
    eager bf16 step's (the compiled step drops the conv biases, so it rounds
    differently from eager), and the compiled step runs no more copy or clone
    kernels than the same net with nn.Identity in place of the norms."""
    x = torch.randn(4, 3, 32, 32, device="cuda")
    copies, grads = {}, {}
    for name, norm, compiled in (("ours", lambda c: solution.InstanceNorm2d(c, affine=True), True),
                                 ("identity", lambda c: nn.Identity(), True),
                                 ("eager", lambda c: solution.InstanceNorm2d(c, affine=True), False)):
        model = conv_net(norm)
        step_model = torch.compile(model, fullgraph=True) if compiled else model

        def step():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = step_model(x)
            out.float().square().mean().backward()

        step()
        copies[name] = [k for k in kernel_names(step) if "copy" in k.lower() or "clone" in k.lower()]
        grads[name] = [p.grad.float() for p in model.parameters()]
        torch._dynamo.reset()
    assert len(copies["ours"]) <= len(copies["identity"]), copies
    reference = conv_net(lambda c: solution.InstanceNorm2d(c, affine=True)).double()
    reference(x.double()).square().mean().backward()
    exact = [p.grad for p in reference.parameters()]
    total = sum(g.norm() for g in exact)
    errors = {name: max(((g.double() - r).norm() / (r.norm() + 1e-3 * total)).item() for g, r in zip(grads[name], exact))
              for name in ("ours", "eager")}
    assert errors["ours"] <= 2 * errors["eager"], errors


def test_compiled_autograd_traces_the_backward(solution):
    model = conv_net(lambda c: solution.InstanceNorm2d(c, affine=True))
    reference = conv_net(lambda c: nn.InstanceNorm2d(c, affine=True))
    x = torch.randn(2, 3, 16, 16, device="cuda")

    @torch.compile(backend="aot_eager")
    def step(x):
        model(x).square().mean().backward()

    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True):
        step(x)
    reference(x).square().mean().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-4, rtol=1e-3)
    torch._dynamo.reset()


def test_compiled_autograd_of_an_eager_forward(solution):
    """An eager forward, its backward under compiled autograd: every norm's node
    (with and without an activation and weight) becomes a call in the compiled
    graph, and the gradients are eager's."""
    from torch._dynamo import compiled_autograd

    def net(norm):
        torch.manual_seed(32)
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), norm(16, affine=True, activation="relu"),
                             nn.Conv2d(16, 16, 3, padding=1), norm(16)).cuda()

    x = torch.randn(2, 3, 16, 16, device="cuda")
    model = net(solution.InstanceNorm2d)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    graphs = []

    def compiler(graph):
        graphs.append(graph)
        return torch.compile(graph, backend="aot_eager")

    torch._dynamo.reset()
    loss = model(x).square().mean()
    with compiled_autograd._enable(compiler):
        loss.backward()
    calls = [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert sum("InstanceNormBackward" in call for call in calls) == 2, calls
    for ours, eager in zip(model.parameters(), expected):
        torch.testing.assert_close(ours.grad, eager, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


def test_export_runs_and_keeps_the_ops(solution):
    model = solution.InstanceNorm2d(8, affine=True, track_running_stats=True).cuda()
    x = torch.randn(2, 8, 16, 16, device="cuda")
    program = torch.export.export(model, (x,))
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any(target.startswith("instance_norm_cuda.") for target in targets), targets
    reference = nn.InstanceNorm2d(8, affine=True, track_running_stats=True).cuda()
    torch.testing.assert_close(program.module()(x), reference(x), atol=1e-4, rtol=1e-4)


def test_value_errors_from_cpp_name_the_argument(solution):
    """The front's checks raise from C++ with numbers in their messages (which once
    crashed torch 2.11 when streamed as integers: docs/perf-notes.md)."""
    x = torch.rand(2, 3, 1, 1, device="cuda")
    with pytest.raises(ValueError, match=r"more than 1 spatial element when training, got input size \[2, 3, 1, 1\]"):
        solution.instance_norm(x)
    with pytest.raises(ValueError, match="must have shape \\(N, C, \\*spatial\\), got 2 dims"):
        solution.instance_norm(torch.rand(2, 3, device="cuda"))
    with pytest.raises(RuntimeError, match="eps must be >= 0"):
        solution.instance_norm(torch.rand(2, 3, 4, 4, device="cuda"), eps=-1.0)


def plans_made(solution):
    made = solution._EXT.plans_made()
    return made["forward"], made["backward"]


# (shape, memory format) with the automatic path an H200 takes (tests/test_gpu.py,
# test_automatic_path_per_size_on_hopper): warp, block (contiguous and channels-last),
# cluster, cooperative, pipelined, split.
PLANNED_SHAPES = [((2, 3, 33, 31), torch.contiguous_format), ((2, 3, 45, 45), torch.contiguous_format),
                  ((2, 16, 64, 64), torch.channels_last), ((2, 4, 256, 256), torch.contiguous_format),
                  ((1, 2, 1024, 1024), torch.contiguous_format), ((2, 3, 1024, 1024), torch.contiguous_format),
                  ((2, 3, 301, 301), torch.contiguous_format)]


def test_each_call_plans_once(solution):
    """One call of the forward (training and eval) plans its launch once, one call of
    the backward once: the entry plans, allocates and launches the plan, and no step
    chooses or derives again (kernels/instance_norm_entry.cpp, run_forward)."""
    from reference import FORWARD_PATHS, hopper
    chosen = set()
    for shape, memory_format in PLANNED_SHAPES:
        x = torch.randn(shape, device="cuda").contiguous(memory_format=memory_format).requires_grad_()
        weight = torch.rand(shape[1], device="cuda", requires_grad=True)
        bias = torch.rand(shape[1], device="cuda", requires_grad=True)
        chosen.add(solution._EXT.chosen_path(x))
        forward, backward = plans_made(solution)
        y = solution.instance_norm(x, weight=weight, bias=bias)
        assert plans_made(solution) == (forward + 1, backward), shape
        y.backward(torch.randn_like(y))
        assert plans_made(solution) == (forward + 1, backward + 1), shape
        mean, var = torch.zeros(shape[1], device="cuda"), torch.ones(shape[1], device="cuda")
        with torch.no_grad():
            solution.instance_norm(x, mean, var, weight, bias, use_input_stats=False)
        assert plans_made(solution) == (forward + 2, backward + 1), shape
    if hopper(solution):
        assert chosen == set(FORWARD_PATHS), chosen
