"""CPU tests of the import without a GPU: with INSTANCE_NORM_BUILD unset and no GPU
visible, importing solution builds nothing, warns once, and the layers run
PyTorch's ops (solution._front_python) with the results, gradients and errors of
the extension's front. Also the package instance_norm_cuda (pyproject.toml)."""
import fnmatch
import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import ROOT

SOLUTION_PATH = os.path.join(ROOT, "solution.py")
WARNING = "INSTANCE_NORM_BUILD=1"

# Run in a subprocess with CUDA hidden: import solution and use it, then the package.
IMPORT_SCRIPT = """
import json, time, warnings
start = time.perf_counter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import solution
    seconds = time.perf_counter() - start
    import torch
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    solution.ModelNew(3, affine=True)(x).sum().backward()
    solution.instance_norm(x.detach(), activation="relu", residual=x.detach())
    net = torch.nn.Sequential(torch.nn.InstanceNorm2d(3), torch.nn.ReLU())
    solution.convert_instance_norm(net)(x)
import instance_norm_cuda
print(json.dumps({
    "seconds": seconds, "gpu": torch.cuda.is_available(), "built": solution._EXT is not None,
    "warnings": [str(w.message) for w in caught if str(w.message).startswith("instance_norm")],
    "package": sorted(instance_norm_cuda.__all__), "package_built": instance_norm_cuda.solution._EXT is not None,
    "package_kernels": instance_norm_cuda.solution._kernels_dir(),
}))
"""


def test_import_without_gpu_builds_nothing_and_warns_once(tmp_path):
    """CUDA hidden, a bogus CUDA_HOME, no kernels in the working directory: the
    import is quick, builds nothing (the build roots stay empty) and warns once."""
    builds, extensions = tmp_path / "builds", tmp_path / "torch_extensions"
    builds.mkdir()
    extensions.mkdir()
    env = {name: value for name, value in os.environ.items()
           if name not in ("INSTANCE_NORM_BUILD", "INSTANCE_NORM_KERNELS", "INSTANCE_NORM_EMULATE")}
    env.update(CUDA_VISIBLE_DEVICES="", CUDA_HOME=str(tmp_path / "no_cuda"), INSTANCE_NORM_BUILD_ROOT=str(builds),
               TORCH_EXTENSIONS_DIR=str(extensions), PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["gpu"] is False, "CUDA_VISIBLE_DEVICES='' should hide every GPU"
    assert not report["built"] and not report["package_built"]
    assert report["seconds"] < 30, f"import took {report['seconds']:.1f} s"
    assert len(report["warnings"]) == 1 and WARNING in report["warnings"][0], report["warnings"]
    assert os.listdir(builds) == [] and os.listdir(extensions) == []
    assert "building CUDA extension" not in result.stderr
    import solution

    assert set(report["package"]) == {"solution", *solution.__all__}
    assert os.path.samefile(report["package_kernels"], os.path.join(ROOT, "kernels"))


def test_package_links_solution_and_ships_every_kernel():
    """instance_norm_cuda/ holds links to solution.py and kernels/; pyproject.toml's
    package data covers every kernel file solution.py reads."""
    import solution

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package = os.path.join(ROOT, "instance_norm_cuda")
    assert os.path.samefile(os.path.join(package, "solution.py"), SOLUTION_PATH)
    assert os.path.samefile(os.path.join(package, "kernels"), os.path.join(ROOT, "kernels"))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    patterns = project["tool"]["setuptools"]["package-data"]["instance_norm_cuda"]
    for name in solution._KERNEL_FILES:
        assert any(fnmatch.fnmatch(f"kernels/{name}", pattern) for pattern in patterns), name
    assert project["tool"]["setuptools"]["packages"] == ["instance_norm_cuda"]


@pytest.fixture(scope="module")
def fallback():
    """solution.py exec'd as where no GPU is visible and INSTANCE_NORM_BUILD is
    unset: a module without the extension."""
    module = types.ModuleType("solution_without_extension")
    module.__file__ = SOLUTION_PATH
    with open(SOLUTION_PATH, encoding="utf-8") as f:
        code = compile(f.read(), SOLUTION_PATH, "exec")
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch.delenv("INSTANCE_NORM_BUILD", raising=False)
        patch.setattr(torch.cuda, "is_available", lambda: False)
        exec(code, module.__dict__)
    assert module._EXT is None
    assert [WARNING in str(w.message) for w in caught].count(True) == 1
    return module


def test_build_variable(fallback, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for value, wanted in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv("INSTANCE_NORM_BUILD", value)
        assert fallback._build_wanted() is wanted
    monkeypatch.setenv("INSTANCE_NORM_BUILD", "yes")
    with pytest.raises(ValueError, match="INSTANCE_NORM_BUILD must be empty, 0 or 1, got 'yes'"):
        fallback._build_wanted()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("INSTANCE_NORM_BUILD")
    assert fallback._build_wanted() is True


ACTIVATIONS = {None: lambda y: y, "relu": F.relu, "leaky_relu": lambda y: F.leaky_relu(y, 0.2), "silu": F.silu,
               "gelu": F.gelu, "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}


def leaves(dtype, running, residual):
    """(x, weight, bias, residual or None, running_mean, running_var or None, None) for a (2, 3, 4, 5) input."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5, dtype=dtype, requires_grad=True)
    weight = torch.randn(3, dtype=dtype, requires_grad=True)
    bias = torch.randn(3, dtype=dtype, requires_grad=True)
    r = torch.randn(2, 3, 4, 5, dtype=dtype, requires_grad=True) if residual else None
    stats = (torch.randn(3, dtype=dtype), torch.rand(3, dtype=dtype) + 0.5) if running else (None, None)
    return x, weight, bias, r, *stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", ["batch", "update", "eval"])
@pytest.mark.parametrize("residual", [False, True], ids=["no_residual", "residual"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=str)
def test_fallback_functional_matches_pytorch(fallback, dtype, mode, residual, activation):
    """act(F.instance_norm(x, ...) * w + b + residual): output, running statistics and gradients."""
    ours = leaves(dtype, mode != "batch", residual)
    theirs = tuple(None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in ours)
    results = []
    for (x, weight, bias, r, mean, var), function in ((ours, fallback.instance_norm), (theirs, None)):
        arguments = dict(running_mean=mean, running_var=var, weight=weight, bias=bias,
                         use_input_stats=mode != "eval", momentum=0.3, eps=1e-3)
        if function is None:
            y = F.instance_norm(x, **arguments)
            y = ACTIVATIONS[activation](y if r is None else y + r)
        else:
            y = function(x, **arguments, activation=activation, negative_slope=0.2, residual=r)
        inputs = [t for t in (x, weight, bias, r) if t is not None]
        torch.manual_seed(1)
        grads = torch.autograd.grad(y, inputs, torch.randn_like(y))
        results.append((y, grads, mean, var))
    (y, grads, mean, var), (y_ref, grads_ref, mean_ref, var_ref) = results
    assert y.dtype == dtype
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(grads, grads_ref)
    torch.testing.assert_close((mean, var), (mean_ref, var_ref))


MODULES = [("InstanceNorm1d", nn.InstanceNorm1d, (2, 3, 10)), ("InstanceNorm2d", nn.InstanceNorm2d, (2, 3, 5, 7)),
           ("InstanceNorm3d", nn.InstanceNorm3d, (2, 3, 4, 5, 6)), ("ModelNew", nn.InstanceNorm2d, (2, 3, 5, 7))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("options", [{}, {"affine": True}, {"affine": True, "track_running_stats": True}],
                         ids=["plain", "affine", "running"])
@pytest.mark.parametrize("name, reference, shape", MODULES, ids=[m[0] for m in MODULES])
def test_fallback_modules_match_pytorch(fallback, name, reference, shape, options, dtype):
    """Train then eval, batched and unbatched: outputs, gradients and buffers as PyTorch's module."""
    torch.manual_seed(0)
    ours = getattr(fallback, name)(3, momentum=0.2, dtype=dtype, **options)
    theirs = reference(3, momentum=0.2, dtype=dtype, **options)
    theirs.load_state_dict(ours.state_dict())
    for training in (True, False):
        ours.train(training)
        theirs.train(training)
        for x in (torch.randn(shape, dtype=dtype), torch.randn(shape[1:], dtype=dtype)):
            outputs = []
            for module in (ours, theirs):
                leaf = x.clone().requires_grad_()
                y = module(leaf)
                torch.manual_seed(1)
                y.backward(torch.randn_like(y))
                outputs.append((y, leaf.grad, [p.grad for p in module.parameters()]))
            torch.testing.assert_close(outputs[0], outputs[1])
            torch.testing.assert_close(ours.state_dict(), theirs.state_dict())


@pytest.mark.parametrize("activation", [a for a in ACTIVATIONS if a is not None])
def test_fallback_module_activation_and_converter(fallback, activation):
    """A layer's activation= and convert_instance_norm's fusion give act(norm(x)), gradients too."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    ours = fallback.InstanceNorm2d(3, affine=True, dtype=torch.float64, activation=activation, negative_slope=0.2)
    theirs = nn.InstanceNorm2d(3, affine=True, dtype=torch.float64)
    y, expected = ours(x), ACTIVATIONS[activation](theirs(x))
    torch.testing.assert_close(y, expected)
    gradient = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, [x, *ours.parameters()], gradient),
                               torch.autograd.grad(expected, [x, *theirs.parameters()], gradient))
    net = nn.Sequential(nn.InstanceNorm2d(3, affine=True), nn.ReLU())
    expected = net(x.float())
    converted = fallback.convert_instance_norm(net)
    assert isinstance(converted[0], fallback.InstanceNorm2d) and isinstance(converted[1], nn.Identity)
    torch.testing.assert_close(converted(x.float()), expected)


# Bad calls of instance_norm (given the module), each raising in the extension's front.
BAD_CALLS = {
    "integer input": lambda m: m.instance_norm(torch.ones(2, 3, 4, 4, dtype=torch.int64)),
    "two dims": lambda m: m.instance_norm(torch.rand(3, 4)),
    "weight size": lambda m: m.instance_norm(torch.rand(2, 3, 4), weight=torch.ones(4)),
    "bias dtype": lambda m: m.instance_norm(torch.rand(2, 3, 4), bias=torch.ones(3, dtype=torch.int32)),
    "weight device": lambda m: m.instance_norm(torch.rand(2, 3, 4), weight=torch.ones(3, device="meta")),
    "running_var size": lambda m: m.instance_norm(torch.rand(2, 3, 4), torch.zeros(3), torch.ones(2)),
    "running_mean alone": lambda m: m.instance_norm(torch.rand(2, 3, 4), running_mean=torch.zeros(3)),
    "one spatial element": lambda m: m.instance_norm(torch.rand(2, 3, 1, 1)),
    "eval without statistics": lambda m: m.instance_norm(torch.rand(2, 3, 4), use_input_stats=False),
    "unknown activation": lambda m: m.instance_norm(torch.rand(2, 3, 4), activation="tanh"),
    "residual dtype": lambda m: m.instance_norm(torch.rand(2, 3, 4), residual=torch.rand(2, 3, 4).double()),
    "residual shape": lambda m: m.instance_norm(torch.rand(2, 3, 4), residual=torch.rand(2, 3, 1)),
    "residual device": lambda m: m.instance_norm(torch.rand(2, 3, 4), residual=torch.rand(2, 3, 4, device="meta")),
    "reflection_pad length": lambda m: m.instance_norm(torch.rand(2, 3, 4), reflection_pad=(1, 1, 1, 1)),
    "reflection_pad value": lambda m: m.instance_norm(torch.rand(2, 3, 4, 5), reflection_pad=(1, 1, 4, 0)),
    "residual neither shape": lambda m: m.instance_norm(torch.rand(2, 3, 4), residual=torch.rand(2, 3, 5),
                                                        reflection_pad=(1, 1)),
    "residual padded, activation": lambda m: m.instance_norm(torch.rand(2, 3, 4), residual=torch.rand(2, 3, 6),
                                                             reflection_pad=(1, 1), activation="relu"),
    "reflection_pad before residual": lambda m: m.instance_norm(torch.rand(2, 3, 4), residual=torch.rand(2, 3, 1),
                                                                reflection_pad=(4, 0)),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_fallback_raises_as_the_extension(solution, fallback, case):
    """The same exception type and message as the extension's front on the same call."""
    raised = []
    for module in (solution, fallback):
        with pytest.raises((TypeError, ValueError)) as info:
            BAD_CALLS[case](module)
        raised.append((type(info.value), str(info.value)))
    assert raised[0] == raised[1]


def test_fallback_takes_none_as_an_activation_name(solution, fallback):
    """The front takes activation="none" for no activation (its name for code 0)."""
    x = torch.rand(2, 3, 4)
    for module in (solution, fallback):
        torch.testing.assert_close(module.instance_norm(x, activation="none"), F.instance_norm(x))


# Direct calls of the extension's front with arguments instance_norm would have refused
# (its own checks: a wrong value must raise, not reach C++ as another type).
FRONT = (None, None, None, None, True, 0.1, 1e-5, None, 0.01, None, None)
BAD_FRONT_CALLS = {
    "too few arguments": (lambda ext, x: ext.instance_norm(x), "12 positional arguments"),
    "input not a tensor": (lambda ext, x: ext.instance_norm(1.0, *FRONT), "input must be a torch.Tensor, got float"),
    "weight not a tensor": (lambda ext, x: ext.instance_norm(x, None, None, 3, *FRONT[3:]),
                            "weight must be a torch.Tensor or None, got int"),
    "residual not a tensor": (lambda ext, x: ext.instance_norm(x, *FRONT[:-2], [1], None),
                              "residual must be a torch.Tensor or None, got list"),
    "reflection_pad not a tuple": (lambda ext, x: ext.instance_norm(x, *FRONT[:-1], 1),
                                   "reflection_pad must be None or a tuple of ints, got int"),
    "reflection_pad of floats": (lambda ext, x: ext.instance_norm(x, *FRONT[:-1], (1.0, 1)),
                                 "reflection_pad must be None or a tuple of ints, got an item of type float"),
    "activation not a str": (lambda ext, x: ext.instance_norm(x, *FRONT[:7], 5, *FRONT[8:]),
                             "activation must be None or a str, got int"),
    "eps not a number": (lambda ext, x: ext.instance_norm(x, *FRONT[:6], "1e-5", *FRONT[7:]), "must be real number"),
}


@pytest.mark.parametrize("case", list(BAD_FRONT_CALLS))
def test_extension_front_checks_its_arguments(solution, case):
    """The METH_FASTCALL front raises TypeError naming the argument; a good call still runs."""
    call, message = BAD_FRONT_CALLS[case]
    x = torch.rand(2, 3, 4)
    with pytest.raises(TypeError, match=message):
        call(solution._EXT, x)
    torch.testing.assert_close(solution._EXT.instance_norm(x, *FRONT), F.instance_norm(x))
