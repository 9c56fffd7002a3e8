"""GPU tests (marked `gpu`) that load the single-file bundle the way KernelBench
does and run its correctness protocol, and a build with no GPU visible."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from conftest import ROOT

pytestmark = pytest.mark.gpu

# The reference problem file's names: the solution must not define them.
REFERENCE_SOURCE = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, num_features):
        super().__init__()
        self.inorm = nn.InstanceNorm2d(num_features=num_features)

    def forward(self, x):
        return self.inorm(x)

batch_size = 16
features = 64
dim1 = 256
dim2 = 256

def get_inputs():
    return [torch.rand(batch_size, features, dim1, dim2)]

def get_init_inputs():
    return [features]
"""


@pytest.fixture(scope="module")
def bundle_source(solution, tmp_path_factory):
    path = tmp_path_factory.mktemp("bundle") / "solution_bundle.py"
    subprocess.run([sys.executable, os.path.join(ROOT, "solution.py"), "--bundle", str(path)], check=True, cwd=ROOT)
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "fp16", "bf16"])
def test_bundle_passes_kernelbench_protocol(bundle_source, dtype, tolerance, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no kernels/ here
    reference_context, solution_context = {}, {}
    exec(compile(REFERENCE_SOURCE, "<reference>", "exec"), reference_context)
    exec(compile(bundle_source, "<solution>", "exec"), solution_context)
    init_inputs = reference_context["get_init_inputs"]()
    for seed in range(5):
        torch.manual_seed(seed)
        inputs = [x.to("cuda", dtype) for x in reference_context["get_inputs"]()]
        with torch.no_grad():
            torch.manual_seed(seed)
            reference = reference_context["Model"](*init_inputs).to("cuda", dtype)
            torch.manual_seed(seed)
            model = solution_context["ModelNew"](*init_inputs).to("cuda", dtype)
            inputs_before = [x.clone() for x in inputs]
            expected = reference(*inputs)
            out = model(*inputs)
        torch.cuda.synchronize()
        assert out.shape == expected.shape and out.dtype == expected.dtype
        assert out.data_ptr() != inputs[0].data_ptr()
        assert all(torch.equal(a, b) for a, b in zip(inputs, inputs_before)), "input modified"
        assert torch.allclose(out, expected, atol=tolerance, rtol=tolerance), f"seed {seed}"


def test_build_with_no_gpu_visible_and_another_arch_list_runs_on_the_gpu(solution, tmp_path):
    """Built with CUDA_VISIBLE_DEVICES hiding the GPU and TORCH_CUDA_ARCH_LIST naming another
    GPU (sm_90a fallback), then loaded with the GPU visible: same build, correct output."""
    if os.environ.get("INSTANCE_NORM_EMULATE"):
        pytest.skip("tests the no-GPU fallback build for Hopper; an emulated GPU builds compute_80 PTX")
    env = dict(os.environ, INSTANCE_NORM_BUILD_ROOT=str(tmp_path), PYTHONPATH=ROOT)
    hidden = dict(env, CUDA_VISIBLE_DEVICES="", TORCH_CUDA_ARCH_LIST="7.5", INSTANCE_NORM_BUILD="1")
    # A cold build of every kernel: over 200 s on a 16-core host while other tests run.
    build = subprocess.run([sys.executable, "-c", "import solution"], env=hidden, cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "building CUDA extension" in build.stderr
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the no-GPU fallback build targets Hopper (sm_90a)")
    run = subprocess.run([sys.executable, "-c", (
        "import torch, solution\n"
        "x = torch.randn(2, 8, 256, 256, device='cuda')\n"
        "torch.testing.assert_close(solution.ModelNew(8)(x), torch.nn.InstanceNorm2d(8)(x), atol=1e-4, rtol=1e-4)\n"
        "assert solution._EXT.chosen_path(x) == 2\n")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "building CUDA extension" not in run.stderr, "the GPU-visible load rebuilt instead of reusing the build"
