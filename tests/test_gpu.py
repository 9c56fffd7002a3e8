"""GPU tests (marked `gpu`) of the forward kernels: every path, layout, dtype and
size against a float64 reference on fresh random input, with poisoned outputs;
numerics PyTorch gets wrong; determinism; limits."""
import pytest
import torch

import math

from reference import (BLOCK, CLUSTER, COOPERATIVE, DTYPES, FORWARD_PATHS, PIPELINED, SPLIT, TOLERANCE, WARP, hopper,
                       channels_last, float64_reference, float64_stats, forward_capacity, run_poisoned)

pytestmark = pytest.mark.gpu


def paths_for(solution, x):
    return [p for p in FORWARD_PATHS if solution._EXT.path_supported(x, p)]


def check_paths(solution, x, weight=None, bias=None, expect_paths=None):
    """Every path that can run x matches float64 (output, mean and rstd) within the dtype's
    tolerance, keeps x's layout and leaves x unchanged; returns the paths."""
    x_before = x.clone()
    reference = float64_reference(x, weight, bias)
    mean64, var64 = float64_stats(x)
    paths = paths_for(solution, x)
    assert SPLIT in paths
    if expect_paths is not None:
        assert set(paths) == set(expect_paths), paths
    for path in paths:
        out, (mean, rstd) = run_poisoned(
            lambda: solution._EXT.forward_with_stats(x, weight=weight, bias=bias, path=path), x)
        assert out.shape == x.shape and out.dtype == x.dtype and out.stride() == x.stride()
        assert torch.isfinite(out).all(), f"path {path}: unwritten or non-finite elements"
        error = (out.double() - reference).abs().max().item()
        assert error <= TOLERANCE[x.dtype], f"path {path} {x.dtype}: max abs error {error:.3g} against float64"
        torch.testing.assert_close(mean.double().view_as(mean64), mean64, atol=1e-5 * max(1.0, mean64.abs().max().item()),
                                   rtol=1e-5, msg=f"path {path}: mean")
        torch.testing.assert_close(rstd.double().view_as(var64), torch.rsqrt(var64 + 1e-5), rtol=1e-4, atol=0,
                                   msg=f"path {path}: rstd")
    assert torch.equal(x, x_before), "input was modified"
    return paths


# Largest slice each path holds (kernels/instance_norm.h, ForwardCapacities); the
# cluster path also needs spatial to be a multiple of the 16-byte vector (4 fp32, 8
# fp16/bf16 values).
WARP_MAX = forward_capacity("warp_spatial")[torch.float32]
CTA_CAPACITY = forward_capacity("resident_cta")
MAX_CLUSTER_SIZE = forward_capacity("max_cluster_size")[torch.float32]
# The pipelined path's part of a slice per CTA.
PIPELINED_CTA_CAPACITY = forward_capacity("pipelined_cta")


def block_fits(solution, spatial, dtype):
    """Whether a block-path CTA fits one SM: the slice's copy in shared memory (rounded
    up to 16 bytes) and the kernel's static shared memory (under 256 bytes) within one
    CTA's opt-in limit. Test shapes keep clear of that limit."""
    slice_bytes = -(-spatial * torch.finfo(dtype).bits // 8 // 16) * 16
    optin = shared_per_cta(solution)
    assert not slice_bytes <= optin < slice_bytes + 256, f"spatial {spatial} is too close to the block path's limit"
    return slice_bytes <= optin


def shared_per_cta(solution):
    """Shared memory a CTA may opt in to, as the path choice sees it (an emulated GPU's)."""
    emulated = solution.emulated_device()
    return emulated["shared_per_cta"] if emulated else torch.cuda.get_device_properties(0).shared_memory_per_block_optin


def expected_paths(solution, shape, dtype):
    """The forward paths that can run a contiguous, aligned input of this shape: on a
    Hopper GPU, or on the GPU INSTANCE_NORM_EMULATE names (no clusters, no pipelined
    path; a cooperative team where its CTA's staged copy fits)."""
    spatial = math.prod(shape[2:])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    paths = {SPLIT}
    if spatial <= WARP_MAX:
        paths.add(WARP)
    if spatial % (4 if dtype == torch.float32 else 8) == 0:
        ctas = -(-spatial // CTA_CAPACITY[dtype])
        if ctas <= MAX_CLUSTER_SIZE and hopper(solution):
            paths.add(CLUSTER)
        if ctas <= sms and CTA_CAPACITY[dtype] * torch.finfo(dtype).bits // 8 < shared_per_cta(solution):
            paths.add(COOPERATIVE)
        if -(-spatial // PIPELINED_CTA_CAPACITY[dtype]) <= sms and hopper(solution):
            paths.add(PIPELINED)
    if block_fits(solution, spatial, dtype):
        paths.add(BLOCK)
    return paths


# Tiny slices (warp path; with 400 and 1,000 slices its CTAs have 4 and 8 warps
# on a GPU of 132 SMs, warp_path_warps_per_cta; 12 x 12: 18 whole 16-bit vectors, fewer
# than a warp's lanes, on the 16-bit vector kernel), CTA-sized ones (block path), full and partly filled
# clusters, one-CTA clusters, odd sizes, beyond cluster capacity in fp32 or in all
# dtypes, slices of 172-177 KB (the block path with one CTA per SM; 301 x 301 in
# 16-bit is not made of whole vectors), 1d and 3d, 70,016 slices (KB: 1,024 bytes);
# pipelined teams over more rounds than their totals rotate through (8): 797 slices of
# 20,000 (fp32: two CTAs per slice, the second partly filled, 66 teams of up to 13
# rounds) and 192 slices of 64^3 (fp32: 8 teams of 16 CTAs, 24 rounds; 16-bit: 16
# teams of 8, 12 rounds); 640 slices of 4,096 values (the block path's 128-thread CTAs
# for 16 KB fp32 slices, chosen from 4 slices per SM).
SHAPES = [(5, 7, 7, 7), (2, 13, 16, 16), (3, 5, 32, 32), (2, 2, 2, 2), (2, 4, 64, 64), (2, 3, 33, 31), (2, 3, 45, 45),
          (2, 3, 127, 129), (4, 8, 100, 100), (3, 5, 300, 300), (2, 3, 210, 210), (2, 3, 301, 301), (2, 3, 512, 512),
          (1, 3, 724, 724), (1, 2, 1024, 1024), (1, 2, 1030, 1030), (2, 3, 1000), (2, 3, 5000), (1, 2, 80, 96, 96),
          (1, 2, 64, 64, 64), (1, 5, 128, 128, 128), (4, 9, 400, 400), (70000 // 64 + 1, 64, 4, 4), (1, 797, 100, 200),
          (3, 64, 64, 64, 64), (2, 320, 64, 64), (4, 100, 16, 16), (8, 125, 5, 5), (3, 5, 12, 12)]


def shape_id(shape):
    return "x".join(map(str, shape))


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_path_matches_float64(solution, shape, dtype):
    torch.manual_seed(hash(shape) % 2**31)
    x = (torch.randn(shape, device="cuda") * 3 + 1).to(dtype)
    check_paths(solution, x, expect_paths=expected_paths(solution, shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 128, 128), (3, 5, 9, 11), (4, 6, 24, 40), (2, 5, 1500, 1500)],
                         ids=shape_id)
def test_affine_matches_float64(solution, dtype, shape):
    """weight and bias of the input's dtype (read as they are), both, the bias alone and
    the weight alone, on every path; (4, 6, 24, 40) takes the warp path's widest kernel."""
    torch.manual_seed(4)
    x = torch.randn(shape, device="cuda").to(dtype)
    weight = torch.randn(shape[1], device="cuda").to(dtype)
    bias = torch.randn(shape[1], device="cuda").to(dtype)
    check_paths(solution, x, weight, bias)
    check_paths(solution, x, weight=None, bias=bias)
    check_paths(solution, x, weight=weight, bias=None)


# weight and bias of another dtype than x, or strided: the forward kernels read
# contiguous parameters of float32 or of the input's dtype as they are (the input's
# dtype: test_affine_matches_float64); other dtypes, mixed ones and strides go through
# a float32 copy.
PARAMETER_CASES = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float16),
                   (torch.float16, torch.float32), (torch.float32, torch.float64), (torch.bfloat16, "strided"),
                   (torch.float16, "mixed")]


@pytest.mark.parametrize("dtype, parameter_dtype", PARAMETER_CASES, ids=str)
@pytest.mark.parametrize("shape, layout", [((2, 16, 64, 64), "contiguous"), ((3, 24, 9, 11), "contiguous"),
                                           ((2, 16, 20, 20), "channels_last")], ids=str)
def test_parameters_of_any_float_dtype_match_float64(solution, dtype, parameter_dtype, shape, layout):
    torch.manual_seed(5)
    x = torch.randn(shape, device="cuda").to(dtype)
    if layout == "channels_last":
        x = channels_last(x)
    if parameter_dtype == "strided":
        weight = torch.randn(2 * shape[1], device="cuda").to(dtype)[::2]
        bias = torch.randn(2 * shape[1], device="cuda").to(dtype)[1::2]
        assert not weight.is_contiguous()
    elif parameter_dtype == "mixed":  # weight of the input's dtype, bias float32
        weight = torch.randn(shape[1], device="cuda").to(dtype)
        bias = torch.randn(shape[1], device="cuda")
    else:
        weight = torch.randn(shape[1], device="cuda").to(parameter_dtype)
        bias = torch.randn(shape[1], device="cuda").to(parameter_dtype)
    weight_before, bias_before = weight.clone(), bias.clone()
    paths = check_paths(solution, x, weight, bias)
    assert len(paths) >= 2
    assert torch.equal(weight, weight_before) and torch.equal(bias, bias_before), "parameters were modified"


# Channels-last inputs (torch.channels_last, channels_last_3d, and the 1d order):
# the block path (tiles of 8 fp32 or 16 16-bit channels; 40 channels end in a
# partial tile) runs them where num_channels is a multiple of the 16-byte vector and
# a tile of every position fits a CTA (the chooser takes it up to 128 KB tiles:
# test_automatic_path_per_size); the cluster path (an image per cluster, all
# channels of a position per thread column; 3 x 3 images leave the last ranks of 8
# without positions, 2,048 fp32 channels are one column per thread) where an image
# fits a cluster on Hopper; the split path always; read in place, output in the same
# layout.
CHANNELS_LAST_SHAPES = [(8, 256, 56, 56), (2, 3, 7, 7), (2, 40, 9, 9), (3, 64, 1000), (1, 32, 16, 16, 16),
                        (2, 8, 300, 300), (2, 24, 84, 84), (2, 2048, 5, 5), (4, 16, 3, 3)]


def channels_last_block_fits(solution, shape, dtype):
    """Whether the block path reads this channels-last shape: whole 16-byte vectors
    of channels, and a tile of 32 bytes per position plus the kernel's static shared
    memory (at most 1,088 bytes) within one CTA's shared memory; None where the tile
    lies within those 1,088 bytes of the limit (the model cannot tell)."""
    tile_bytes = 32 * math.prod(shape[2:])
    optin = shared_per_cta(solution)
    if tile_bytes <= optin < tile_bytes + 1088:
        return None
    return shape[1] % (4 if dtype == torch.float32 else 8) == 0 and tile_bytes <= optin


def channels_last_cluster_fits(solution, shape, dtype):
    """Whether the channels-last cluster path reads this shape (Hopper only): whole
    16-byte vectors of channels, at most 512 of them per position (one per thread of a
    512-thread CTA), and an image in 16 CTAs, each with a chunk of ceil(positions / 16)
    positions, the per-thread sums (rows x C floats, rows = 512 // vectors per position)
    and 8 floats per channel, within one CTA's shared memory."""
    per_vector = 4 if dtype == torch.float32 else 8
    if not hopper(solution) or shape[1] % per_vector or shape[1] // per_vector > 512:
        return False
    vectors = shape[1] // per_vector
    chunk = -(-math.prod(shape[2:]) // 16)
    return chunk * vectors * 16 + (512 // vectors * shape[1] + 8 * shape[1]) * 4 <= shared_per_cta(solution)


@pytest.mark.parametrize("shape", CHANNELS_LAST_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channels_last_is_read_in_place(solution, shape, dtype):
    torch.manual_seed(6)
    x = channels_last(torch.randn(shape, device="cuda") * 2 - 1).to(dtype)
    assert not x.is_contiguous()
    weight = torch.randn(shape[1], device="cuda")
    bias = torch.randn(shape[1], device="cuda")
    fits = channels_last_block_fits(solution, shape, dtype)
    if fits is None:
        pytest.skip(f"{shape}: a tile within the kernel's static shared memory of this GPU's CTA limit")
    expected = [BLOCK] * fits + [CLUSTER] * channels_last_cluster_fits(solution, shape, dtype) + [SPLIT]
    assert check_paths(solution, x, weight, bias) == expected
    if x.dim() == 4:
        out = solution.InstanceNorm2d(shape[1])(x)
        assert out.is_contiguous(memory_format=torch.channels_last)


def test_other_strides_are_copied_to_contiguous(solution):
    torch.manual_seed(3)
    x = torch.randn(2, 3, 64, 48, device="cuda").transpose(2, 3)
    out = solution.ModelNew(3)(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, float64_reference(x).float(), atol=1e-4, rtol=1e-4)


def test_misaligned_view_is_correct(solution):
    torch.manual_seed(2)
    for spatial, dtype in (((64, 64), torch.float32), ((40, 40), torch.bfloat16), ((600, 600), torch.float16)):
        storage = torch.randn(2 * 3 * spatial[0] * spatial[1] + 1, device="cuda").to(dtype)
        x = storage[1:].view(2, 3, *spatial)
        assert x.data_ptr() % 16 != 0 and not {CLUSTER, COOPERATIVE, PIPELINED} & set(paths_for(solution, x))
        check_paths(solution, x)


def test_misaligned_channels_last_view_takes_the_split_path(solution):
    """A channels-last view starting one element into its storage: the block path
    (16-byte vectors of channels) must refuse it; the split path is correct."""
    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        storage = torch.randn(2 * 20 * 20 * 16 + 1, device="cuda").to(dtype)
        x = storage[1:].view(2, 20, 20, 16).permute(0, 3, 1, 2)
        assert x.is_contiguous(memory_format=torch.channels_last) and x.data_ptr() % 16 != 0
        assert check_paths(solution, x) == [SPLIT]
        assert solution._EXT.chosen_path(x) == SPLIT


@pytest.mark.parametrize("rounds", [4, 2, 1])
def test_split_path_at_every_chunk_size(solution, rounds):
    """The split path's chunks of 4, 2 and 1 rounds of loads (split_chunk_rounds in
    kernels/instance_norm_split.cu: fewer rounds while the partial statistics would run
    fewer than 8 CTAs per SM). fp32 slices of 512 x 512 are 65,536 16-byte vectors: 8,
    16 or 32 chunks each, so on this GPU's SM count these channel counts give each
    chunk size; the slices' chunks are combined and normalized as on one chunk."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    channels = {4: sms, 2: 3 * sms // 4, 1: sms // 4}[rounds]
    torch.manual_seed(rounds)
    x = torch.randn(1, channels, 512, 512, device="cuda") * 2 + 3
    reference = float64_reference(x)
    out = run_poisoned(lambda: solution._EXT.forward(x, path=SPLIT), x)
    error = (out.double() - reference).abs().max().item()
    assert error <= TOLERANCE[x.dtype], f"{channels} channels: max abs error {error:.3g} against float64"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_path_combines_slices_of_many_chunks(solution, dtype):
    """Slices of 16 M values take hundreds of chunks on the split path, which a whole
    CTA per slice combines (slice_stats_kernel's CTA_PER_SLICE; slices of fewer chunks
    take a group of lanes each, the tests around this one); output, mean and rstd
    match float64."""
    torch.manual_seed(13)
    x = (torch.randn(1, 2, 4096, 4096, device="cuda") * 2 + 3).to(dtype)
    out, stats = run_poisoned(lambda: solution._EXT.forward_with_stats(x, path=SPLIT), x)
    error = (out.double() - float64_reference(x)).abs().max().item()
    assert error <= TOLERANCE[dtype], f"max abs error {error:.3g} against float64"
    mean, var = float64_stats(x)
    torch.testing.assert_close(stats[0].double(), mean.flatten(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats[1].double(), (var.flatten() + 1e-5).rsqrt(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("shape", [(1, 64, 100, 100), (128, 64, 100, 100)], ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_path_channels_last_small_and_large(solution, shape, dtype):
    """Channels-last input on the split path: a small tensor, whose partials take
    one-round chunks so they still spread over the SMs, and a large one of 4-round
    chunks; both match float64 and keep their layout."""
    torch.manual_seed(11)
    x = channels_last(torch.randn(shape, device="cuda") * 2 - 1).to(dtype)
    reference = float64_reference(x)
    out = run_poisoned(lambda: solution._EXT.forward(x, path=SPLIT), x)
    assert out.stride() == x.stride()
    error = (out.double() - reference).abs().max().item()
    assert error <= TOLERANCE[x.dtype], f"{dtype}: max abs error {error:.3g} against float64"


@pytest.mark.parametrize("shape", [(2, 3, 512, 512), (2, 3, 37, 37), (2, 3, 6, 6), (1, 2, 1024, 1024), (2, 16, 37, 37)],
                         ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_slices_give_exact_zero(solution, shape, dtype):
    x = torch.full(shape, 1e10 if dtype != torch.float16 else 6e4, device="cuda").to(dtype)
    x[0, 1] = -3.75
    x[-1] = 0.1
    for layout in (x, channels_last(x)):
        for path in paths_for(solution, layout):
            assert torch.count_nonzero(solution._EXT.forward(layout, path=path)).item() == 0, f"path {path}"


def test_fp16_values_whose_squares_overflow_fp16(solution):
    """A +-512 checkerboard: squares (262,144) overflow fp16; statistics in fp32 give +-1."""
    i = torch.arange(64, device="cuda")
    board = ((i.view(-1, 1) + i.view(1, -1)) % 2 * 2 - 1).to(torch.float16) * 512
    x = board.expand(2, 3, 64, 64).contiguous()
    for layout in (x, channels_last(x)):
        for path in paths_for(solution, layout):
            out = solution._EXT.forward(layout, path=path)
            torch.testing.assert_close(out.float(), (board / 512).float().expand_as(out), atol=1e-3, rtol=0,
                                       msg=f"path {path}")


def test_large_offset_small_spread_keeps_precision(solution):
    """1e4 + 0.1 * randn in fp32: shifted statistics stay within 2e-2 of float64."""
    torch.manual_seed(8)
    for shape in ((2, 3, 512, 512), (4, 5, 20, 20), (1, 2, 1024, 1024)):
        x = 1e4 + 0.1 * torch.randn(shape, device="cuda")
        reference = float64_reference(x)
        for layout in (x, channels_last(x)):
            for path in paths_for(solution, layout):
                error = (solution._EXT.forward(layout, path=path).double() - reference).abs().max().item()
                assert error < 2e-2, f"{shape} path {path}: {error}"


def test_fp32_spread_of_two_ulps_keeps_rstd(solution):
    """1e4 + 0.002 * randn in fp32 (a spread of about two float32 ulps of the offset):
    the resident paths (cluster, cooperative, pipelined) take M2 about the mean of
    exact differences from the slice's first value, so rstd stays within 1e-4 of
    float64's. The pipelined path's first version centred float32 values by one FMA,
    offset - mean rounded at 1e4's ulp: 2.5e-3 to 8.9e-3 off (spreads 0.004 to 0.002)
    in a numpy emulation."""
    torch.manual_seed(12)
    for shape in ((2, 3, 512, 512), (1, 2, 1024, 1024)):
        x = 1e4 + 0.002 * torch.randn(shape, device="cuda")
        expected = torch.rsqrt(float64_stats(x)[1] + 1e-5)
        paths = [p for p in paths_for(solution, x) if p in (CLUSTER, COOPERATIVE, PIPELINED)]
        assert set(paths) == expected_paths(solution, shape, torch.float32) & {CLUSTER, COOPERATIVE, PIPELINED}
        for path in paths:
            rstd = solution._EXT.forward_with_stats(x, path=path)[1][1]
            torch.testing.assert_close(rstd.double().view_as(expected), expected, rtol=1e-4, atol=0,
                                       msg=f"{shape} path {path}: rstd")


# (path, layout, shapes) for the first-value test: slices of whole vectors and not
# (unaligned); channels-last tiles need whole vectors of channels and fit 64 x 64; the
# channels-last cluster path spreads each image over up to 16 CTAs.
FIRST_VALUE_CASES = {
    "block": (BLOCK, False, ((2, 8, 64, 64), (2, 8, 99, 99))),
    "block-channels-last": (BLOCK, True, ((2, 8, 64, 64),)),
    "cluster-channels-last": (CLUSTER, True, ((2, 8, 64, 64), (2, 8, 99, 99))),
    "warp": (WARP, False, ((2, 8, 16, 16), (2, 8, 23, 23))),
}


@pytest.mark.parametrize("case", FIRST_VALUE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_first_value_far_from_the_mean(solution, dtype, case):
    """The statistics of d = x - the slice's first value (SliceShift) stay accurate
    however far that first value lies from the slice's mean: where a path takes M2
    from the sums of d and d^2, it takes another sweep about the mean once the shift
    is more than 2 standard deviations out (shifted_sums_m2_is_accurate in
    kernels/instance_norm_forward.cu). With the first value 0 to 1e4 standard
    deviations of the other values out on either side (at most sqrt(n - 1), 16 to 99
    here, of the slice's own), across that bound, rstd stays within 1e-5 of
    float64's and the output within the dtype's tolerance (relative for the outliers,
    which normalize to |y| up to about 100)."""
    path, as_channels_last, shapes = FIRST_VALUE_CASES[case]
    torch.manual_seed(23)
    offsets = torch.tensor([0.0, 1.0, 1.9, 2.1, 3.0, 10.0, 100.0, 1e4], device="cuda")
    for shape in shapes:
        x = torch.randn(shape, device="cuda")
        rest = x.flatten(2)[..., 1:]
        sign = torch.tensor([1.0, -1.0], device="cuda").view(2, 1)
        x[..., 0, 0] = rest.mean(2) + sign * offsets * rest.std(2)
        x = x.to(dtype)
        if as_channels_last:
            x = channels_last(x)
            fits = channels_last_block_fits if path == BLOCK else channels_last_cluster_fits
            if not fits(solution, shape, dtype):
                pytest.skip(f"{shape}: path {path} does not run channels-last input of this shape on this GPU")
        assert path in paths_for(solution, x)
        reference = float64_reference(x)
        mean64, var64 = float64_stats(x)
        out, (mean, rstd) = run_poisoned(lambda: solution._EXT.forward_with_stats(x, path=path), x)
        # The outliers normalize to |y| up to about 100: their error is relative.
        torch.testing.assert_close(out.double(), reference, atol=TOLERANCE[dtype],
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, msg=f"{shape}: output")
        torch.testing.assert_close(rstd.double().view_as(var64), torch.rsqrt(var64 + 1e-5), rtol=1e-5, atol=0,
                                   msg=f"{shape}: rstd")
        # The mean is a sum of d, about 1e4 each beside the 1e4 outlier: its error, in the
        # slice's standard deviations.
        mean_error = ((mean.double().view_as(mean64) - mean64).abs() / var64.sqrt()).max().item()
        assert mean_error <= 1e-4, f"{shape}: mean off by {mean_error:.3g} standard deviations"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_channels_last_cluster_path_with_more_images_than_clusters(solution, dtype):
    """The channels-last cluster path's clusters are persistent: each normalizes image
    k, k + clusters, ..., copying the next image's chunk while it writes the current
    one. 600 images of 16 channels and 20 x 20 positions (clusters of 8 CTAs of 512
    threads, one CTA per SM, so at most SMs / 8 clusters: several images each) match
    float64 with weight and bias. A random third of the images have their first value
    1e4 standard deviations out, so those take the M2 sweep about the mean and the
    others do not, in no pattern a cluster count could line up with (every third image,
    with 15 clusters, gave each cluster all or none)."""
    if not hopper(solution):
        pytest.skip("the cluster path needs Hopper (sm_90)")
    shape = (600, 16, 20, 20)
    assert shape[0] >= 4 * (torch.cuda.get_device_properties(0).multi_processor_count // 8)
    torch.manual_seed(29)
    x = torch.randn(shape, device="cuda")
    far = torch.rand(shape[0], device="cuda") < 1 / 3
    rest = x[far].flatten(2)[..., 1:]
    x[far, :, 0, 0] = rest.mean(2) + 1e4 * rest.std(2)
    x = channels_last(x.to(dtype))
    weight = torch.randn(shape[1], device="cuda")
    bias = torch.randn(shape[1], device="cuda")
    assert CLUSTER in paths_for(solution, x)
    reference = float64_reference(x, weight, bias)
    mean64, var64 = float64_stats(x)
    out, (mean, rstd) = run_poisoned(
        lambda: solution._EXT.forward_with_stats(x, weight=weight, bias=bias, path=CLUSTER), x)
    assert out.stride() == x.stride()
    torch.testing.assert_close(out.double(), reference, atol=TOLERANCE[dtype],
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, msg="output")
    torch.testing.assert_close(rstd.double().view_as(var64), torch.rsqrt(var64 + 1e-5), rtol=1e-5, atol=0,
                               msg="rstd")
    mean_error = ((mean.double().view_as(mean64) - mean64).abs() / var64.sqrt()).max().item()
    assert mean_error <= 1e-4, f"mean off by {mean_error:.3g} standard deviations"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_squares_about_the_first_value_overflowing_fp32(solution, dtype):
    """2.5e17 * (1 + randn) after a first value of 0: the squares of d = x - x[0] sum to
    about 5e38, past fp32's range, while the M2 about the mean (about 2.6e38) is not.
    Every path and layout stays finite and matches float64; the block paths' shifted
    sums (contiguous and channels-last) see S2 = Inf and take the sweep about the mean
    (shifted_sums_m2_is_accurate)."""
    torch.manual_seed(29)
    x = 2.5e17 * (1 + torch.randn(2, 8, 64, 64, device="cuda"))
    x[..., 0, 0] = 0
    x = x.to(dtype)
    reference = float64_reference(x)
    for layout in (x, channels_last(x)):
        paths = paths_for(solution, layout)
        assert (BLOCK in paths) == (layout is x or channels_last_block_fits(solution, x.shape, dtype))
        for path in paths:
            out = solution._EXT.forward(layout, path=path)
            assert torch.isfinite(out).all(), f"path {path}"
            error = (out.double() - reference).abs().max().item()
            assert error <= TOLERANCE[dtype], f"path {path}: max abs error {error:.3g}"


def test_empty_input_runs_on_every_path(solution):
    """No slices or no values: every forced path accepts the input and returns an
    empty output of its shape (no kernel runs, no workspace is sized)."""
    for shape in ((0, 3, 8, 8), (2, 3, 0, 4)):
        x = torch.randn(shape, device="cuda")
        for path in FORWARD_PATHS:
            assert solution._EXT.path_supported(x, path), f"{shape} path {path}"
            assert solution._EXT.forward(x, path=path).shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_values_near_1e30_stay_finite_and_correct(solution, dtype):
    """Squares of values near 1e30 overflow fp32 (PyTorch gives NaN): every path and
    layout stays finite and matches float64, output and saved statistics."""
    torch.manual_seed(17)
    for shape in ((2, 3, 512, 512), (4, 5, 20, 20), (2, 3, 45, 45), (1, 2, 1030, 1030), (2, 16, 20, 20)):
        noise = torch.randn(shape, device="cuda")
        for x in ((noise * 1e30).to(dtype), ((1 + 0.1 * noise) * 1e30).to(dtype)):
            reference = float64_reference(x)
            mean64, var64 = float64_stats(x)
            for layout in (x, channels_last(x)):
                for path in paths_for(solution, layout):
                    out, (mean, rstd) = solution._EXT.forward_with_stats(layout, path=path)
                    assert torch.isfinite(out).all(), f"{shape} path {path}"
                    error = (out.double() - reference).abs().max().item()
                    assert error <= TOLERANCE[dtype], f"{shape} path {path}: {error}"
                    torch.testing.assert_close(rstd.double().view_as(var64), torch.rsqrt(var64 + 1e-5), rtol=1e-4,
                                               atol=0, msg=f"{shape} path {path}: rstd")
                    torch.testing.assert_close(mean.double().view_as(mean64), mean64, rtol=1e-4,
                                               atol=1e-5 * var64.sqrt().max().item(), msg=f"{shape} path {path}: mean")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_inf_stay_in_their_slice(solution, value):
    for shape in ((2, 3, 256, 256), (2, 3, 9, 9), (1, 3, 1024, 1024), (2, 16, 9, 9)):
        x = torch.randn(shape, device="cuda")
        x[1 if shape[0] > 1 else 0, 2, 5, 7] = value
        bad = torch.zeros(shape[:2], dtype=torch.bool)
        bad[1 if shape[0] > 1 else 0, 2] = True
        for layout in (x, channels_last(x)):
            for path in paths_for(solution, layout):
                out = solution._EXT.forward(layout, path=path)
                assert torch.isfinite(out[~bad]).all(), f"{shape} path {path}"
                assert torch.isnan(out[bad]).any(), f"{shape} path {path}"


def test_same_input_gives_identical_bits(solution):
    for shape in ((8, 16, 512, 512), (4, 64, 24, 24), (1, 4, 1024, 1024)):
        x = torch.randn(shape, device="cuda")
        for layout in (x, channels_last(x)):
            for path in paths_for(solution, layout):
                first = solution._EXT.forward_with_stats(layout, path=path)
                second = solution._EXT.forward_with_stats(layout, path=path)
                assert all(torch.equal(a, b) for a, b in zip(first, second)), f"{shape} path {path}"


def test_automatic_path_per_size(solution):
    def chosen(*shape, **kwargs):
        return solution._EXT.chosen_path(torch.empty(shape, device="cuda", **kwargs))

    # Without clusters: a cooperative team where its CTA's staged copy fits, else the split path.
    seed_paths = expected_paths(solution, (112, 64, 512, 512), torch.float32)
    assert chosen(112, 64, 512, 512) == (CLUSTER if hopper(solution) else COOPERATIVE if COOPERATIVE in seed_paths
                                         else SPLIT)
    assert chosen(2, 1280, 16, 16) == WARP
    assert chosen(2, 3, 33, 31) == WARP
    assert chosen(2, 3, 45, 45) == BLOCK
    assert chosen(2, 320, 128, 128) == BLOCK


def test_automatic_path_per_size_on_hopper(solution):
    """The choices that follow from an H200's resources (227 KB per CTA, clusters,
    bulk copies, 132 SMs)."""
    if not hopper(solution):
        pytest.skip("these choices follow from a Hopper GPU's resources")

    def chosen(*shape, **kwargs):
        return solution._EXT.chosen_path(torch.empty(shape, device="cuda", **kwargs))

    assert chosen(8, 64, 160, 160) == BLOCK  # 100 KB: two CTAs per SM
    assert chosen(8, 64, 160, 160, dtype=torch.bfloat16) == BLOCK
    assert chosen(8, 64, 224, 224) == BLOCK  # 196 KB: one CTA per SM
    assert chosen(8, 64, 224, 224, dtype=torch.bfloat16) == BLOCK  # 98 KB
    assert chosen(4, 128, 256, 256, dtype=torch.bfloat16) == CLUSTER  # 128 KB, 512 slices: the cluster wins
    assert chosen(1, 64, 256, 256, dtype=torch.bfloat16) == BLOCK  # 64 slices: one round, where one CTA per SM wins
    assert chosen(4, 128, 256, 256) == CLUSTER  # 256 KB: no block-path CTA fits
    assert chosen(8, 64, 176, 176) == CLUSTER  # 121 KB fp32: a one-CTA cluster
    assert chosen(2, 3, 301, 301, dtype=torch.bfloat16) == BLOCK  # 177 KB, not whole vectors: one CTA per SM
    assert chosen(2, 3, 301, 301) == SPLIT  # 354 KB
    assert chosen(1, 2, 1024, 1024) == COOPERATIVE  # 32 CTAs
    assert chosen(1, 2, 1024, 1024, dtype=torch.bfloat16) == CLUSTER
    assert chosen(1, 32, 128, 128, 128) == PIPELINED  # one team of 128 CTAs, 32 rounds
    assert chosen(4, 16, 1024, 1024) == PIPELINED  # two teams of 64, 32 rounds
    assert chosen(1, 32, 128, 128, 128, dtype=torch.bfloat16) == COOPERATIVE  # 16-bit: the cooperative path
    assert chosen(1, 2, 128, 128, 128) == COOPERATIVE  # 2 rounds: fewer than kPipelinedMinRounds
    assert chosen(1, 3, 128, 128, 128) == PIPELINED  # one team of 128, 3 rounds; cooperative: 2 of 64
    assert chosen(2, 3, 1024, 1024) == PIPELINED  # two teams of 64, 3 rounds; cooperative: 4 of 32
    assert chosen(2, 8, 1024, 1024) == PIPELINED  # two teams of 64, 8 rounds; cooperative: 4 of 32
    assert chosen(1, 32, 768, 1024) == COOPERATIVE  # pipelined: 2 teams of 48 CTAs busy, cooperative: 5 of 24
    assert chosen(1, 2, 4096, 4096) == SPLIT  # 512 CTAs: more than are resident
    assert chosen(1, 8, 2048, 2048) == COOPERATIVE  # one team of 128 CTAs, 8 rounds: the team leads
    assert chosen(1, 16, 2048, 2048) == SPLIT  # one team, 16 rounds: kSplitOverOneTeamMinRounds or more
    assert chosen(1, 16, 2048, 2048, dtype=torch.bfloat16) == COOPERATIVE  # 16-bit keeps its teams
    assert chosen(1, 2, 1031, 1031) == SPLIT  # not a multiple of the vector
    assert chosen(8, 256, 56, 56, memory_format=torch.channels_last) == BLOCK  # 98 KB tiles
    assert chosen(1, 32, 16, 16, 16, memory_format=torch.channels_last_3d) == BLOCK  # 128 KB tiles
    assert chosen(2, 16, 64, 64, memory_format=torch.channels_last) == BLOCK  # 4,096 positions: 128 KB tiles
    assert chosen(2, 16, 65, 65, memory_format=torch.channels_last) == CLUSTER  # tiles above 128 KB: a cluster
    assert chosen(2, 24, 84, 84, memory_format=torch.channels_last, dtype=torch.bfloat16) == CLUSTER  # 220 KB tiles
    assert chosen(2, 3, 56, 56, memory_format=torch.channels_last) == SPLIT  # not whole vectors
    assert chosen(2, 8, 128, 128, memory_format=torch.channels_last) == CLUSTER  # 512 KB tiles
    # Tiles above 128 KB that hold all the channels: whole images, read as a copy reads them.
    assert chosen(256, 8, 80, 80, memory_format=torch.channels_last) == BLOCK  # 200 KB
    assert chosen(16, 8, 80, 80, memory_format=torch.channels_last) == BLOCK
    assert chosen(128, 16, 72, 72, memory_format=torch.channels_last, dtype=torch.bfloat16) == BLOCK  # 162 KB
    assert chosen(128, 64, 100, 100, memory_format=torch.channels_last) == CLUSTER  # 2.4 MB images
    assert chosen(1, 64, 2048, 2048, memory_format=torch.channels_last) == SPLIT  # a 1 GB image fits no cluster


def test_forced_path_that_cannot_run_is_refused(solution):
    x = torch.rand(1, 1, 1024, 1024, device="cuda")
    with pytest.raises(RuntimeError, match="cannot run"):
        solution._EXT.forward(x, path=CLUSTER)
    with pytest.raises(RuntimeError, match="cannot run"):
        solution._EXT.forward(torch.rand(1, 1, 4096, 4096, device="cuda"), path=COOPERATIVE)
    with pytest.raises(RuntimeError, match="cannot run"):
        solution._EXT.forward(torch.rand(1, 1, 4096, 4096, device="cuda"), path=PIPELINED)
    with pytest.raises(RuntimeError, match="cannot run"):
        solution._EXT.forward(x, path=WARP)
    with pytest.raises(RuntimeError, match="cannot run"):
        solution._EXT.forward(channels_last(torch.rand(2, 3, 8, 8, device="cuda")), path=BLOCK)


def test_more_than_2_pow_31_elements(solution):
    """64-bit offsets: (2, 4, 16384, 16400) fp16 (2.15e9 values, split path); slices at
    both ends match float64."""
    torch.manual_seed(9)
    x = torch.randn(2, 4, 16384, 16400, device="cuda", dtype=torch.float16)
    assert x.numel() > 2**31
    out = solution._EXT.forward(x)
    for n, c in ((0, 0), (1, 3)):
        reference = float64_reference(x[n:n + 1, c:c + 1])
        assert (out[n:n + 1, c:c + 1].double() - reference).abs().max().item() < 1e-2
    del out, x
    torch.cuda.empty_cache()


def test_more_than_2_pow_31_elements_cluster_and_pipelined_paths(solution):
    """(130, 64, 512, 512) fp32, 8.7 GB: the last slices match float64 on the cluster path
    (chosen) and on the pipelined path (forced: teams of 16 CTAs, over 1,000 rounds)."""
    if not hopper(solution):
        pytest.skip("the cluster and pipelined paths need Hopper (sm_90)")
    torch.manual_seed(10)
    x = torch.randn(130, 64, 512, 512, device="cuda")
    assert x.numel() > 2**31 and solution._EXT.chosen_path(x) == CLUSTER
    reference = float64_reference(x[-1:, -4:])
    for path in (0, PIPELINED):  # 0: the chosen path
        out = solution._EXT.forward(x, path=path)
        assert (out[-1:, -4:].double() - reference).abs().max().item() < 1e-4, path
        del out
    del x
    torch.cuda.empty_cache()
