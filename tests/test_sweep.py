"""CPU tests of the shape sweep's grid and report (benchmarks/sweep.py); the timing
itself needs a GPU (python bench.py --sweep)."""
import importlib.util
import math
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("sweep", os.path.join(ROOT, "benchmarks", "sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cell_shapes_hold_the_slices_and_the_spatial_size(sweep):
    assert sweep.cell_shape(1, 64) == (1, 1, 8, 8)
    assert sweep.cell_shape(8192, 100) == (128, 64, 10, 10)
    assert sweep.cell_shape(4, 1000) == (1, 4, 25, 40)
    assert sweep.cell_shape(16, 67108864) == (1, 16, 8192, 8192)
    for slices in sweep.SLICES:
        for spatial in sweep.SPATIAL:
            n, c, h, w = sweep.cell_shape(slices, spatial)
            assert (n * c, h * w) == (slices, spatial) and h <= w


def test_the_grid_spans_what_the_sweep_promises(sweep):
    assert (min(sweep.SLICES), max(sweep.SLICES)) == (1, 8192)
    assert (min(sweep.SPATIAL), max(sweep.SPATIAL)) == (2 ** 6, 2 ** 26)
    assert any(s & (s - 1) for s in sweep.SPATIAL)  # non-powers of two
    assert set(sweep.GRID["dtypes"]) == {torch.float32, torch.bfloat16, torch.float16}
    assert set(sweep.GRID["channels_last"]) == set(sweep.GRID["affine"]) == {False, True}


@pytest.mark.parametrize("grid", ["GRID", "QUICK"])
def test_cells_keep_to_the_budget(sweep, grid):
    budget = 2 * 10 ** 9
    selected = sweep.cells(getattr(sweep, grid), budget)
    assert selected and all(cell["bytes"] <= budget for cell in selected)
    assert any(cell["bytes"] >= sweep.LARGE_BYTES for cell in selected)
    for cell in selected:
        assert cell["bytes"] == math.prod(cell["shape"]) * torch.finfo(cell["dtype"]).bits // 8
    assert len(sweep.cells(getattr(sweep, grid), 10 ** 6)) < len(selected)


def fake_result(sweep, ours_forward, ours_both, bytes_=2 ** 30):
    cell = {"shape": (16, 64, 512, 512), "dtype": torch.float32, "channels_last": False, "affine": False,
            "bytes": bytes_}
    forward = {"copy": 1.0, "ours": ours_forward, "eager": 2.0, "torch.compile": 1.5}
    both = {"copy": 1.0, "ours": ours_both, "eager": 6.0, "torch.compile": 2.0}
    return dict(cell, peer_failures={}, forward={"median_ms": forward, **sweep.measures(forward, 1.0)},
                forward_backward={"median_ms": both, **sweep.measures(both, 2.5)})


def test_measures_and_report(sweep, capsys):
    result = fake_result(sweep, 1.1, 3.0)
    assert result["forward"]["x_copy"] == pytest.approx(1.1)
    assert result["forward"]["best_peer"] == "torch.compile"
    assert result["forward"]["vs_best_peer"] == pytest.approx(1.1 / 1.5)
    assert result["forward_backward"]["x_floor"] == pytest.approx(3.0 / 2.5)
    assert result["forward_backward"]["vs_best_peer"] == pytest.approx(1.5)
    slow = fake_result(sweep, 1.7, 1.9)
    failed = dict(result, failed="ours: output differs from float64 beyond 0.0001")
    del failed["forward"], failed["forward_backward"]
    sweep.report([result, slow, failed])
    out = capsys.readouterr().out
    assert "2 cells timed, 1 failed the check" in out
    assert "forward over 1.25x the copy: 1, over 1.6x: 1" in out
    assert "cells where a peer is faster: forward 1, forward + backward 1" in out
    assert out.index("1.70") < out.index("1.10")  # worst first


@pytest.mark.parametrize("compile_mode", ["none", "dynamic"])
def test_peers_apply_weight_and_bias(sweep, compile_mode):
    peers = sweep.Peers(compile_mode)
    cell = {"shape": (2, 3, 4, 5), "dtype": torch.float32, "channels_last": False, "affine": True}
    x, weight, bias = torch.randn(2, 3, 4, 5), torch.randn(3), torch.randn(3)
    mean = x.mean(dim=(2, 3), keepdim=True)
    var = x.var(dim=(2, 3), unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * weight.view(1, 3, 1, 1) + bias.view(1, 3, 1, 1)
    functions = peers.for_cell(cell)
    assert set(functions) == ({"eager"} if compile_mode == "none" else {"eager", "torch.compile"})
    for name, function in functions.items():
        torch.testing.assert_close(function(x, weight, bias), expected, msg=name)
    if compile_mode == "dynamic":
        assert peers.for_cell(cell)["torch.compile"] is functions["torch.compile"]
        assert peers.for_cell(dict(cell, affine=False))["torch.compile"] is not functions["torch.compile"]


def test_failure_of_reports_an_exception_as_the_reason(sweep):
    assert sweep.failure_of(lambda: None) is None
    assert sweep.failure_of(lambda: "output differs") == "output differs"

    def compile_error():
        raise RuntimeError("Dynamo failed to run FX node\nmore detail")

    assert sweep.failure_of(compile_error) == "raised RuntimeError: Dynamo failed to run FX node"
    assert sweep.failure_of(lambda: {}[0]) == "raised KeyError: 0"
