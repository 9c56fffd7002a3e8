"""GPU tests (marked `gpu`) that need two GPUs: a tensor on cuda:1 while the current
device is 0 (forward, backward, running statistics, eval, CUDA-graph capture, nothing
launched or allocated on device 0), and a DDP training run over NCCL against one
process on the whole batch (tests/ddp_step.py). Skipped with fewer than two GPUs.
NVLink multicast stays off in every process (NCCL_NVLS_ENABLE=0 and its kin)."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from conftest import ROOT
from reference import float64_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def pair_on(solution, device):
    """(ours, PyTorch's): a conv and an affine norm with running statistics, same weights, on `device`."""
    torch.manual_seed(42)
    ours = torch.nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), solution.InstanceNorm2d(
        8, affine=True, track_running_stats=True)).to(device)
    theirs = torch.nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.InstanceNorm2d(
        8, affine=True, track_running_stats=True)).to(device)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def test_second_gpu_training_eval_and_graph_stay_there(solution):
    device = torch.device("cuda:1")
    torch.cuda.set_device(0)
    ours, theirs = pair_on(solution, device)
    torch.cuda.synchronize(0)
    allocated = torch.cuda.memory_allocated(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for step in range(2):
            x = torch.randn(2, 4, 32, 32, device=device) * (step + 1) + step
            outputs = []
            for model in (ours, theirs):
                model.zero_grad(set_to_none=True)
                y = model(x)
                y.square().mean().backward()
                outputs.append((y.detach(), [p.grad for p in model.parameters()]))
            assert outputs[0][0].device == device
            torch.testing.assert_close(outputs[0][0], outputs[1][0], atol=1e-4, rtol=1e-4)
            for a, b in zip(outputs[0][1], outputs[1][1]):
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(ours[1].running_var, theirs[1].running_var, atol=1e-5, rtol=1e-5)
        ours.eval(), theirs.eval()
        x = torch.randn(2, 4, 32, 32, device=device)
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)
        torch.cuda.synchronize(1)
    ours_kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA
                    and "instance_norm" in e.name]
    assert ours_kernels and all(e.device_index == 1 for e in ours_kernels)
    assert torch.cuda.memory_allocated(0) == allocated

    # CUDA-graph capture of the training-mode forward on cuda:1.
    ours.train()
    static_x = torch.randn(2, 4, 32, 32, device=device)
    with torch.cuda.device(1), torch.no_grad():
        ours(static_x)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = ours[1](static_x)
    static_x.copy_(torch.randn(2, 4, 32, 32, device=device) * 3 + 1)
    graph.replay()
    torch.cuda.synchronize(1)
    expected = float64_reference(static_x, ours[1].weight, ours[1].bias).float()
    torch.testing.assert_close(static_y, expected, atol=1e-4, rtol=1e-4)
    assert torch.cuda.memory_allocated(0) == allocated


def test_ddp_training_matches_one_process(tmp_path):
    result = tmp_path / "ddp.json"
    env = dict(os.environ, PYTHONPATH=ROOT, **NO_MULTICAST)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          os.path.join(ROOT, "tests", "ddp_step.py"), str(result)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    numbers = json.loads(result.read_text())
    assert numbers["loss_error"] < 1e-5 and numbers["parameter_error"] < 1e-4, numbers
