"""CPU tests of the Python front and the C++ entry's argument checks."""
import pytest
import torch
import torch.nn as nn


def test_unsupported_options_raise_not_implemented(solution):
    with pytest.raises(NotImplementedError, match="affine"):
        solution.ModelNew(8, affine=True)
    with pytest.raises(NotImplementedError, match="track_running_stats"):
        solution.ModelNew(8, track_running_stats=True)
    x = torch.rand(2, 3, 4, 4)
    for option in ("running_mean", "running_var", "weight", "bias"):
        with pytest.raises(NotImplementedError, match=option):
            solution.instance_norm(x, **{option: torch.ones(3)})
    with pytest.raises(NotImplementedError, match="use_input_stats"):
        solution.instance_norm(x, use_input_stats=False)


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4, 5, 6)])
def test_model_rejects_other_ranks_like_pytorch(solution, shape):
    with pytest.raises(ValueError, match=f"expected 3D or 4D input \\(got {len(shape)}D input\\)"):
        solution.ModelNew(3)(torch.rand(shape))


def test_single_spatial_element_raises_value_error(solution):
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        solution.ModelNew(3)(torch.rand(2, 3, 1, 1))


def test_non_tensor_input_raises_type_error(solution):
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        solution.instance_norm([1.0, 2.0])


def test_channel_mismatch_warns_like_pytorch(solution):
    with pytest.warns(UserWarning, match="does not match num_features"):
        solution.ModelNew(4)(torch.rand(2, 3, 4, 4))


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (3, 6, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_input_runs_pytorch_op(solution, shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    torch.testing.assert_close(solution.ModelNew(shape[-3])(x), nn.InstanceNorm2d(shape[-3])(x))


def test_entry_rejects_cpu_tensor_naming_the_device(solution):
    with pytest.raises(RuntimeError, match="input must be a CUDA tensor, got a tensor on cpu"):
        solution._EXT.forward(torch.rand(2, 3, 4, 4), 1e-5)


def test_repr_matches_pytorch_fields(solution):
    assert repr(solution.ModelNew(64)) == "ModelNew(64, eps=1e-05, momentum=0.1, affine=False, track_running_stats=False)"
