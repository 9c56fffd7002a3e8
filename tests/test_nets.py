"""CPU tests of the real-network benchmark's nets (benchmarks/nets.py): the published
architectures' norm and parameter counts, the same conv weights for every norm
variant, the accuracy comparison, the norm cost ratios and their intervals, and how
--kernels groups kernels."""
import pytest
import torch

# net: (norms, parameters of the published design, a small input)
DESIGNS = {"transformer": (15, 1_679_235, (1, 3, 32, 32)), "cyclegan": (23, 11_378_179, (1, 3, 32, 32)),
           "unet3d": (18, 16_546_723, (1, 1, 32, 32, 32))}


@pytest.mark.parametrize("net", sorted(DESIGNS))
def test_nets_follow_their_designs(nets, net):
    norms, parameters, shape = DESIGNS[net]
    output_shape = nets.NETS[net][3]
    models = {variant: nets.build(net, variant, "cpu") for variant in nets.VARIANTS}
    assert nets.count_norms(models["pytorch"]) == nets.count_norms(models["ours"]) == norms
    assert nets.count_norms(models["identity"]) == 0
    assert sum(p.numel() for p in models["pytorch"].parameters()) == parameters
    out = models["ours"](torch.randn(shape))
    assert out.shape[1] == output_shape[1] and out.shape[2:] == shape[2:]
    # One seed, the same conv weights in every variant (norms draw no random numbers).
    convs = {variant: [p for name, p in m.named_parameters() if p.dim() > 1] for variant, m in models.items()}
    for theirs in (convs["ours"], convs["identity"]):
        assert all(torch.equal(a, b) for a, b in zip(convs["pytorch"], theirs))


def test_accuracy_comparison(nets):
    model = nets.build("transformer", "pytorch", "cpu")
    x = torch.randn(1, 3, 32, 32)
    reference = nets.output_and_gradients(model.double(), x.double())
    assert nets.errors_against(reference, reference)[:2] == (0.0, 0.0)
    noisy = (reference[0] * (1 + 1e-3), {name: g * (1 + 1e-3) for name, g in reference[1].items()})
    output_error, grad_error, _ = nets.errors_against(noisy, reference)
    assert output_error == pytest.approx(1e-3) and grad_error <= 1e-3
    errors = {"pytorch": (1e-6, 1e-3, "a"), "ours": (1.5e-6, 1.9e-3, "b")}
    assert nets.accurate_as_pytorch(errors)
    errors["ours"] = (1.5e-6, 2.5e-3, "b")
    assert not nets.accurate_as_pytorch(errors)


def test_kernel_table_groups_inductor_kernels_by_family(nets):
    """--kernels matches a fused kernel across variants by its name without the number
    inductor appends per graph; other kernels keep their names."""
    assert nets.kernel_family("triton_poi_fused_relu_12") == "triton_poi_fused_relu"
    assert nets.kernel_family("triton_red_fused__to_copy_convolution_backward_11") == \
        "triton_red_fused__to_copy_convolution_backward"
    assert nets.kernel_family("void cudnn::kernel<float, 2>") == "void cudnn::kernel<float, 2>"
    assert nets.kernel_family("sm90_xmma_fprop_nhwc_128x64_2") == "sm90_xmma_fprop_nhwc_128x64_2"
    kernels = [("triton_poi_fused_zeros_5", 10, 8.0), ("triton_poi_fused_zeros_9", 95, 72.0),
               ("memset32", 30, 37.0), ("idle", 5, 0.0)]
    assert nets.per_family(kernels, 5) == {"triton_poi_fused_zeros": (21.0, 16.0), "memset32": (6.0, 7.4)}


def test_paired_ratios_cancel_a_drift_between_turns(nets):
    """Each turn's steps share the host's speed of that moment. With one turn in three
    2 ms slower for every variant and up to 0.2 ms of noise on the floor's steps (median
    0), the paired ratios are the true 0.5 and 0.25, where the ratios of the medians
    come out 0 and -0.5 (the floor's median moves by the noise, the others' not)."""
    turns = 9
    drift = [2.0 if turn % 3 == 0 else 0.0 for turn in range(turns)]
    noise = [0.1 * ((turn * 7) % 5 - 2) for turn in range(turns)]  # -0.2 .. 0.2, median 0
    cost = {"identity": 0.0, "pytorch": 0.4, "ours": 0.2, "fused": 0.1}
    times = {variant: [3.0 + c + d + (n if variant == "identity" else 0.0) for d, n in zip(drift, noise)]
             for variant, c in cost.items()}
    assert nets.norm_cost_ratios(times) == pytest.approx(
        {"ratio": 0.0, "fused_ratio": -0.5, "paired_ratio": 0.5, "paired_fused_ratio": 0.25})


def test_paired_ratio_interval_brackets_the_cost_and_narrows_with_less_noise(nets):
    """The bootstrap interval of the paired ratio: exact where every turn has the same
    differences; around the true ratio otherwise, and wider for noisier steps; the
    same times give the same interval."""
    turns = 48
    cost = {"identity": 0.0, "pytorch": 0.4, "ours": 0.2, "fused": 0.1}
    exact = {variant: [3.0 + c] * turns for variant, c in cost.items()}
    assert nets.paired_ratio_interval(exact, "ours") == pytest.approx((0.5, 0.5))
    assert nets.paired_ratio_interval(exact, "fused") == pytest.approx((0.25, 0.25))
    generator = torch.Generator().manual_seed(1)

    def noisy(spread):
        return {variant: [3.0 + c + spread * float(torch.randn(1, generator=generator)) for _ in range(turns)]
                for variant, c in cost.items()}

    widths = []
    for spread in (0.02, 0.1):
        times = noisy(spread)
        low, high = nets.paired_ratio_interval(times, "ours")
        assert low <= nets.norm_cost_ratios(times)["paired_ratio"] <= high
        assert low < 0.5 < high
        assert nets.paired_ratio_interval(times, "ours") == (low, high)
        widths.append(high - low)
    assert 0 < widths[0] < widths[1]


@pytest.mark.parametrize("settle", [0, 2])
def test_time_in_turn_settles_each_variant_before_its_timed_step(nets, monkeypatch, settle):
    """Every turn runs the variants in order, each with `settle` untimed steps right
    before its one timed step; each variant gets one time per turn."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ran = []
    steppers = {variant: (lambda variant=variant: ran.append(variant)) for variant in ("pytorch", "ours", "identity")}
    times = nets.time_in_turn(steppers, turns=3, settle=settle)
    assert ran == [variant for _ in range(3) for variant in steppers for _ in range(settle + 1)]
    assert {variant: len(t) for variant, t in times.items()} == {"pytorch": 3, "ours": 3, "identity": 3}
    assert all(ms >= 0 for t in times.values() for ms in t)
