"""Training steps of real networks with this project's InstanceNorm, PyTorch's, and none.

    python benchmarks/nets.py [--nets transformer,cyclegan,unet3d] [--modes fp32,bf16,compile]
                              [--steps 10] [--rounds 3] [--warmup 3] [--settle 0] [--host-calls 100] [--no-host | --host-only] [--json PATH]
    python benchmarks/nets.py --profile
    python benchmarks/nets.py --kernels [--nets ...] [--modes ...]

Three networks, written from their published designs:
- transformer: the fast-neural-style transformer net (Johnson et al. 2016): reflection
  padded 9x9 conv to 32, stride-2 convs to 64 and 128, five residual blocks of 128,
  two nearest-upsample convs back to 64 and 32, a 9x9 conv to 3; every conv but the
  last followed by InstanceNorm2d(affine=True) and F.relu (15 norms); input (4, 3, 256, 256).
- cyclegan: the CycleGAN ResNet generator (Zhu et al. 2017): 7x7 conv to 64, two
  stride-2 convs to 128 and 256, nine residual blocks of 256, two transposed convs
  back, a 7x7 conv to 3 and tanh; InstanceNorm2d without affine after every conv but
  the last (23 norms), nn.ReLU modules in nn.Sequential; input (1, 3, 256, 256).
- unet3d: an nnU-Net-style 3D U-Net (Isensee et al. 2021): five levels of 32, 64,
  128, 256 and 320 channels, two 3x3x3 convs per level each followed by
  InstanceNorm3d(affine=True) and LeakyReLU(0.01), stride-2 convs down, transposed
  convs up with skip concatenation (18 norms); input (2, 1, 128, 128, 128).

Each net is built four times from one seed (same conv weights): with PyTorch's
norms ("pytorch"), with ours ("ours"), PyTorch's net through
solution.convert_instance_norm ("fused": our norms with the activation modules and
reflection pads that follow them in an nn.Sequential folded in; the transformer net
calls F.relu and pads inside its conv modules, so it gets none), and with nn.Identity
in their place ("identity", the floor). One step is zero_grad, forward, an MSE loss,
backward and an SGD step. Modes: fp32 eager; bf16 autocast eager; bf16 autocast with
torch.compile(mode="reduce-overhead") of the net. Each variant takes --rounds x --steps
timed steps, one step of each variant in turn (with --settle N, each timed step right
after N untimed steps of its own variant, so that it is not the first step after a
switch between models), each step's wall time taken on the host
with a synchronize after it (host time included: what a user waits for); the table
gives medians in ms and the norm cost ratios
(ours - identity) / (pytorch - identity), and the same for fused, from those medians
and ("paired") from the medians of the differences within each turn, which a drift
of the host's speed between turns does not move (norm_cost_ratios), with a 95%
bootstrap interval over the turns (paired_ratio_interval).

Before timing, each net's output and parameter gradients in fp32 (TF32 off, cuDNN
deterministic), with our norms and with PyTorch's, are compared with the same net
in float64: each parameter's gradient error relative to its own norm plus 1e-3 of
the whole gradient's norm (a conv bias right before a norm has a true gradient of
zero). A net passes where ours is within twice PyTorch's own fp32 error: deep nets
amplify rounding, so fp32 gradients are themselves far from float64's
(docs/perf-notes.md, "Real networks").

The host section times one layer per call on the host (a loop of calls, timed before
the final synchronize), ours against PyTorch's: forward alone (--host-calls calls in
one no_grad), and forward + backward per layer of a chain of CHAIN layers under one
torch.autograd.grad; ours and PyTorch's take HOST_ROUNDS turns each and a row gives
its medians; a chain of NegLayer (one torch.neg each way, the cheapest layer with a
backward) takes turns with them as the yardstick. --host-only runs that section alone;
--profile splits one layer's host time into its pieces.
Needs a CUDA GPU; exits with status 2 without one.
"""
import argparse
import json
import math
import os
import random
import re
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench  # noqa: E402  (bench.py: the profiler's kernel totals)

VARIANTS = ("pytorch", "ours", "fused", "identity")
MODES = ("fp32", "bf16", "compile")


def norm_factory(variant, dims):
    """variant -> callable(channels, affine) making that variant's norm of `dims` spatial dims."""
    if variant == "identity":
        return lambda channels, affine: nn.Identity()
    if variant == "ours":
        import solution
        cls = getattr(solution, f"InstanceNorm{dims}d")
    else:
        cls = getattr(nn, f"InstanceNorm{dims}d")
    return lambda channels, affine: cls(channels, affine=affine)


class TransformerNet(nn.Module):
    """Johnson et al. 2016, as in pytorch/examples fast_neural_style (F.relu after each norm)."""

    class Conv(nn.Module):
        def __init__(self, cin, cout, kernel, stride=1, upsample=None):
            super().__init__()
            self.upsample = upsample
            self.pad = nn.ReflectionPad2d(kernel // 2)
            self.conv = nn.Conv2d(cin, cout, kernel, stride)

        def forward(self, x):
            if self.upsample:
                x = F.interpolate(x, mode="nearest", scale_factor=self.upsample)
            return self.conv(self.pad(x))

    class Residual(nn.Module):
        def __init__(self, channels, norm):
            super().__init__()
            self.conv1, self.in1 = TransformerNet.Conv(channels, channels, 3), norm(channels, True)
            self.conv2, self.in2 = TransformerNet.Conv(channels, channels, 3), norm(channels, True)

        def forward(self, x):
            y = F.relu(self.in1(self.conv1(x)))
            return self.in2(self.conv2(y)) + x

    def __init__(self, norm):
        super().__init__()
        self.conv1, self.in1 = self.Conv(3, 32, 9), norm(32, True)
        self.conv2, self.in2 = self.Conv(32, 64, 3, 2), norm(64, True)
        self.conv3, self.in3 = self.Conv(64, 128, 3, 2), norm(128, True)
        self.res = nn.Sequential(*[self.Residual(128, norm) for _ in range(5)])
        self.deconv1, self.in4 = self.Conv(128, 64, 3, upsample=2), norm(64, True)
        self.deconv2, self.in5 = self.Conv(64, 32, 3, upsample=2), norm(32, True)
        self.deconv3 = self.Conv(32, 3, 9)

    def forward(self, x):
        y = F.relu(self.in1(self.conv1(x)))
        y = F.relu(self.in2(self.conv2(y)))
        y = F.relu(self.in3(self.conv3(y)))
        y = self.res(y)
        y = F.relu(self.in4(self.deconv1(y)))
        y = F.relu(self.in5(self.deconv2(y)))
        return self.deconv3(y)


def cyclegan_generator(norm):
    """CycleGAN's ResnetGenerator (ngf 64, 9 blocks, reflection padding, InstanceNorm2d
    without affine, so every conv has a bias), as nn.Sequential with nn.ReLU modules."""

    class ResnetBlock(nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.block = nn.Sequential(
                nn.ReflectionPad2d(1), nn.Conv2d(channels, channels, 3), norm(channels, False), nn.ReLU(True),
                nn.ReflectionPad2d(1), nn.Conv2d(channels, channels, 3), norm(channels, False))

        def forward(self, x):
            return x + self.block(x)

    layers = [nn.ReflectionPad2d(3), nn.Conv2d(3, 64, 7), norm(64, False), nn.ReLU(True)]
    for cin in (64, 128):
        layers += [nn.Conv2d(cin, cin * 2, 3, stride=2, padding=1), norm(cin * 2, False), nn.ReLU(True)]
    layers += [ResnetBlock(256) for _ in range(9)]
    for cin in (256, 128):
        layers += [nn.ConvTranspose2d(cin, cin // 2, 3, stride=2, padding=1, output_padding=1), norm(cin // 2, False),
                   nn.ReLU(True)]
    layers += [nn.ReflectionPad2d(3), nn.Conv2d(64, 3, 7), nn.Tanh()]
    return nn.Sequential(*layers)


class UNet3d(nn.Module):
    """nnU-Net-style 3D U-Net: per level two (conv 3x3x3, InstanceNorm3d affine,
    LeakyReLU 0.01); the first conv of each lower level has stride 2; decoder levels
    take a transposed conv (kernel 2, stride 2) of the level below, concatenated with
    the encoder's output of that level; a 1x1x1 conv to 3 classes."""

    CHANNELS = (32, 64, 128, 256, 320)

    @staticmethod
    def stage(cin, cout, stride, norm):
        return nn.Sequential(nn.Conv3d(cin, cout, 3, stride, 1), norm(cout, True), nn.LeakyReLU(0.01, True),
                             nn.Conv3d(cout, cout, 3, 1, 1), norm(cout, True), nn.LeakyReLU(0.01, True))

    def __init__(self, norm):
        super().__init__()
        channels = self.CHANNELS
        self.encoder = nn.ModuleList(
            [self.stage(cin, cout, 1 if i == 0 else 2, norm) for i, (cin, cout) in enumerate(zip((1, *channels), channels))])
        self.up = nn.ModuleList([nn.ConvTranspose3d(channels[i + 1], channels[i], 2, 2) for i in range(4)])
        self.decoder = nn.ModuleList([self.stage(2 * channels[i], channels[i], 1, norm) for i in range(4)])
        self.head = nn.Conv3d(channels[0], 3, 1)

    def forward(self, x):
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        for i in reversed(range(4)):
            x = self.decoder[i](torch.cat([self.up[i](x), skips[i]], 1))
        return self.head(x)


# name: (constructor taking the norm factory, spatial dims, input shape, output shape)
NETS = {
    "transformer": (lambda norm: TransformerNet(norm), 2, (4, 3, 256, 256), (4, 3, 256, 256)),
    "cyclegan": (cyclegan_generator, 2, (1, 3, 256, 256), (1, 3, 256, 256)),
    "unet3d": (lambda norm: UNet3d(norm), 3, (2, 1, 128, 128, 128), (2, 3, 128, 128, 128)),
}


def build(net, variant, device="cuda"):
    """The net with `variant` norms; "fused": PyTorch's net through convert_instance_norm
    (our norms, activations and reflection pads in an nn.Sequential right after a norm
    folded into it)."""
    make, dims, _, _ = NETS[net]
    torch.manual_seed(0)
    if variant == "fused":
        import solution
        return solution.convert_instance_norm(make(norm_factory("pytorch", dims))).to(device)
    return make(norm_factory(variant, dims)).to(device)


def count_norms(model):
    return sum(type(m).__name__.startswith("InstanceNorm") for m in model.modules())


def output_and_gradients(model, x):
    """(output, {parameter name: gradient}) of one forward and backward of mean(out^2), in float64."""
    out = model(x)
    out.square().mean().backward()
    return out.detach().double(), {name: p.grad.detach().double() for name, p in model.named_parameters()}


def errors_against(result, reference):
    """(output error, worst parameter-gradient error, its parameter): norms of the
    difference relative to the reference's, each gradient's relative to its own norm
    plus 1e-3 of the whole gradient's norm (a conv bias right before a norm has a
    true gradient of zero)."""
    (out, grads), (out_ref, grads_ref) = result, reference
    total = torch.sqrt(sum(g.square().sum() for g in grads_ref.values())).item()
    errors = {name: ((grads[name] - r).norm() / (r.norm() + 1e-3 * total)).item() for name, r in grads_ref.items()}
    worst = max(errors, key=errors.get)
    return ((out - out_ref).norm() / out_ref.norm()).item(), errors[worst], worst


def check_against_pytorch(net):
    """{variant: errors_against the float64 net} for PyTorch's norms and ours, both in
    fp32 (TF32 off, deterministic cuDNN), same weights and input. The float64 net runs
    PyTorch's norms (ours take float64 to PyTorch's op too)."""
    shape = NETS[net][2]
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.manual_seed(1)
    x = torch.randn(shape, device="cuda")
    reference = output_and_gradients(build(net, "pytorch").double(), x.double())
    errors = {variant: errors_against(output_and_gradients(build(net, variant), x), reference)
              for variant in ("pytorch", "ours")}
    (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.deterministic,
     torch.backends.cudnn.benchmark) = saved
    return errors


def accurate_as_pytorch(errors):
    """Ours within twice PyTorch's own fp32 error (plus 1e-6) of the float64 net, output and gradients."""
    (out_ours, grad_ours, _), (out_theirs, grad_theirs, _) = errors["ours"], errors["pytorch"]
    return out_ours <= 2 * out_theirs + 1e-6 and grad_ours <= 2 * grad_theirs + 1e-6


def make_step(net, variant, mode):
    """A closure running one SGD training step of a fresh `net` with `variant` norms in
    `mode`; given a list `clock`, it appends time.perf_counter() after the forward, the
    loss + backward and the optimizer step (host time per phase: step_phases.py)."""
    _, _, in_shape, out_shape = NETS[net]
    model = build(net, variant)
    torch.manual_seed(2)
    x, target = torch.randn(in_shape, device="cuda"), torch.randn(out_shape, device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    forward = torch.compile(model, mode="reduce-overhead") if mode == "compile" else model
    autocast = mode != "fp32"

    def step(clock=None):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = forward(x)
        if clock is not None:
            clock.append(time.perf_counter())
        F.mse_loss(out.float(), target).backward()
        if clock is not None:
            clock.append(time.perf_counter())
        optimizer.step()
        if clock is not None:
            clock.append(time.perf_counter())

    return step


def step_times_ms(step, steps):
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def time_in_turn(steppers, turns, settle):
    """{variant: [step ms]} of `turns` turns, each turn one timed step of every variant
    of `steppers` ({variant: step}) in order, each right after `settle` untimed steps of
    the same variant: the host's speed drifts by tens of percent within a minute on the
    H200 machine (docs/perf-notes.md #125), and a drift then falls on every variant
    alike instead of on the block of steps that one variant ran in. With settle 0 each
    timed step is the first after the other variants' steps and carries what the
    switch between models costs (CUDA graph trees under compile, #167), which a user
    training one model does not pay."""
    times = {variant: [] for variant in steppers}
    for _ in range(turns):
        for variant, step in steppers.items():
            step_times_ms(step, settle)
            times[variant] += step_times_ms(step, 1)
    return times


def time_net(net, mode, steps, rounds, warmup, settle):
    """time_in_turn over rounds * steps turns of the net's four variants in `mode`,
    after `warmup` untimed steps of each."""
    stepper = {variant: make_step(net, variant, mode) for variant in VARIANTS}
    for step in stepper.values():
        step_times_ms(step, warmup)
    return time_in_turn(stepper, rounds * steps, settle)


def paired_cost(times, variant, turns):
    """The median over `turns` (indices into time_net's step times, repeats allowed) of
    each turn's step of `variant` less its step of the floor ("identity")."""
    return statistics.median(times[variant][i] - times["identity"][i] for i in turns)


def norm_cost_ratios(times):
    """The norm cost ratios (ours - identity) / (pytorch - identity), and fused's, of
    time_net's step times: "ratio" and "fused_ratio" from the variants' median steps;
    "paired_ratio" and "paired_fused_ratio" from the medians of each turn's differences
    (its steps ran back to back, so a drift of the host's speed within the run falls
    on both steps of a difference alike)."""
    medians = {variant: statistics.median(t) for variant, t in times.items()}

    def paired(variant):
        return paired_cost(times, variant, range(len(times["identity"])))

    return {"ratio": (medians["ours"] - medians["identity"]) / (medians["pytorch"] - medians["identity"]),
            "fused_ratio": (medians["fused"] - medians["identity"]) / (medians["pytorch"] - medians["identity"]),
            "paired_ratio": paired("ours") / paired("pytorch"),
            "paired_fused_ratio": paired("fused") / paired("pytorch")}


def paired_ratio_interval(times, variant, level=0.95, resamples=2000, seed=0):
    """(low, high): a percentile bootstrap interval at `level` of norm_cost_ratios's
    paired ratio of `variant` ("ours" or "fused"): the turns of time_net's step times
    drawn with replacement `resamples` times (a fixed seed: the same times give the
    same interval), the paired ratio of each draw, and the (1 - level) / 2 and
    (1 + level) / 2 quantiles of those (Efron & Tibshirani, "An Introduction to the
    Bootstrap", 1993, ch. 13). A cell is judged against a bound by its interval, not
    by the ratio alone, where the norm's cost is a small part of a step."""
    generator = random.Random(seed)
    turns = len(times["identity"])
    ratios = []
    for _ in range(resamples):
        draw = [generator.randrange(turns) for _ in range(turns)]
        ours, theirs = paired_cost(times, variant, draw), paired_cost(times, "pytorch", draw)
        ratios.append(ours / theirs if theirs != 0 else math.copysign(math.inf, ours))
    ratios.sort()
    return (ratios[round((1 - level) / 2 * (resamples - 1))], ratios[round((1 + level) / 2 * (resamples - 1))])


def host_us(fn, calls):
    """(host, wall) microseconds per call of fn over `calls` calls, after 10 warm-up calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - begin) / calls * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - begin) / calls * 1e6


# One layer of each 2d net: (shape, affine).
HOST_LAYERS = (((1, 256, 64, 64), False), ((4, 128, 64, 64), True))
# Turns of ours and PyTorch's in host_rows: the host's speed drifts by up to 1.8x
# between runs minutes apart (docs/perf-notes.md #135), so the two alternate and a
# row is the median of its turns.
HOST_ROUNDS = 5
# Forward + backward is timed through a chain of this many layers and one
# torch.autograd.grad, as in a network (the engine's fixed cost per call, about
# 100 us on the H200 machine, is shared by the chain), and reported per layer.
CHAIN = 16


class NegLayer(nn.Module):
    """The cheapest layer with a backward, a host-time yardstick: one ATen op
    (torch.neg) each way, nothing saved, no parameters; built as the norms are."""

    def __init__(self, num_features, affine):
        super().__init__()

    def forward(self, x):
        return torch.neg(x)


def host_rows(calls, rounds=HOST_ROUNDS):
    """Per HOST_LAYERS entry, ours, PyTorch's and NegLayer's: host and wall us of a
    forward call and of forward + backward per layer of a chain of CHAIN, each the
    median of `rounds` turns, the three layers' turns alternating."""
    import solution
    rows = []
    for shape, affine in HOST_LAYERS:
        torch.manual_seed(3)
        x = torch.randn(shape, device="cuda", requires_grad=True)
        dy = torch.randn(shape, device="cuda")
        chains = {name: nn.Sequential(*[cls(shape[1], affine=affine) for _ in range(CHAIN)]).cuda()
                  for name, cls in (("ours", solution.InstanceNorm2d), ("pytorch", nn.InstanceNorm2d),
                                    ("neg", NegLayer))}
        turns = {name: {"forward": [], "both": []} for name in chains}
        for _ in range(rounds):
            for name, chain in chains.items():
                inputs = (x, *chain.parameters())
                # One no_grad around the loop, as an inference loop has it: entering
                # torch.no_grad() costs microseconds of its own per call.
                with torch.no_grad():
                    turns[name]["forward"].append(host_us(lambda: chain[0](x), calls))
                turns[name]["both"].append(
                    host_us(lambda: torch.autograd.grad(chain(x), inputs, dy), max(calls // CHAIN, 10)))
        for name, times in turns.items():
            forward_host, forward_wall = (statistics.median(t) for t in zip(*times["forward"]))
            both_host, both_wall = (statistics.median(t) / CHAIN for t in zip(*times["both"]))
            rows.append({"shape": list(shape), "affine": affine, "norm": name, "forward_host_us": forward_host,
                         "forward_wall_us": forward_wall, "forward_backward_host_us": both_host,
                         "forward_backward_wall_us": both_wall})
    return rows


def profile_layer(calls):
    """The profiler's CPU table (self time) of `calls` forward + backward calls of a
    chain of CHAIN layers of each HOST_LAYERS entry, ours, PyTorch's and NegLayer's:
    where the host time goes."""
    import solution
    for shape, affine in HOST_LAYERS:
        x = torch.randn(shape, device="cuda", requires_grad=True)
        dy = torch.randn(shape, device="cuda")
        for name, cls in (("ours", solution.InstanceNorm2d), ("pytorch", nn.InstanceNorm2d), ("neg", NegLayer)):
            chain = nn.Sequential(*[cls(shape[1], affine=affine) for _ in range(CHAIN)]).cuda()
            inputs = (x, *chain.parameters())
            host_us(lambda: torch.autograd.grad(chain(x), inputs, dy), 10)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                for _ in range(calls):
                    torch.autograd.grad(chain(x), inputs, dy)
                torch.cuda.synchronize()
            print(f"\n{name}: {shape}, affine={affine}, {calls} forward + backward calls of a chain of {CHAIN}")
            print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def kernel_family(name):
    """A kernel's name without the number inductor appends to it in each graph
    (triton_poi_fused_relu_12 -> triton_poi_fused_relu), so that the same fused
    kernel in two variants' graphs, or in two graphs of one variant, is one row."""
    return re.sub(r"_[0-9]+$", "", name) if name.startswith("triton_") else name


def per_family(kernels, steps):
    """{kernel family: (calls, us)} per step from (name, calls, us) over `steps` steps."""
    families = {}
    for name, calls, us in kernels:
        if us > 0:
            family = kernel_family(name)
            previous_calls, previous_us = families.get(family, (0.0, 0.0))
            families[family] = (previous_calls + calls / steps, previous_us + us / steps)
    return families


def kernel_times(step, steps):
    """{kernel family (kernel_family): (calls, us)} per training step: the profiler's
    CUDA kernels over `steps` steps of `step` (bench.profiled_kernels), after 3 untimed ones."""
    step_times_ms(step, 3)
    return per_family([(name, calls, us) for name, (calls, us) in bench.profiled_kernels(step, steps).items()], steps)


def kernel_tables(nets, mode, steps=5):
    """Where the GPU time of the norm cost goes, per training step of each net in
    `mode`: the profiler's CUDA kernel time per step with PyTorch's norms, ours and
    none (the floor), then each kernel family (kernel_family) whose time per step
    differs from the floor's by more than 1 us, with its calls and us per step in every
    variant (under compile, which kernels inductor made around each norm and which ours
    replace)."""
    variants = ("pytorch", "ours", "identity")
    for net in nets:
        times = {variant: kernel_times(make_step(net, variant, mode), steps) for variant in variants}
        totals = {variant: sum(us for _, us in kernels.values()) for variant, kernels in times.items()}
        print(f"\n{net} {mode}: GPU kernel time per step (us), over {steps} steps: " +
              ", ".join(f"{variant} {total:.1f}" for variant, total in totals.items()) +
              f"; norm cost: pytorch {totals['pytorch'] - totals['identity']:.1f}, "
              f"ours {totals['ours'] - totals['identity']:.1f}")
        names = set().union(*times.values())
        delta = {name: max(abs(times[v].get(name, (0, 0.0))[1] - times["identity"].get(name, (0, 0.0))[1])
                           for v in variants) for name in names}
        print(f"{'kernel':<72} " + " ".join(f"{v + ' calls, us':>22}" for v in variants))
        for name in sorted((n for n in names if delta[n] > 1.0), key=lambda n: -delta[n]):
            print(f"{name[:72]:<72} " + " ".join(
                f"{times[v].get(name, (0, 0.0))[0]:9.1f} {times[v].get(name, (0, 0.0))[1]:12.1f}" for v in variants))
        torch._dynamo.reset()


def host_breakdown(calls):
    """Host us per call of the pieces of one layer (the first host layer, fp32):
    what the module, the front, autograd and the kernel launch each add, against
    one ATen op, and forward + backward per layer of chains of CHAIN under one
    torch.autograd.grad, ours by each entry point against PyTorch's and against a
    chain of one-launch ATen ops (the engine's own cost per node)."""
    import solution
    ext, op = solution._EXT, torch.ops.instance_norm_cuda
    shape, _ = HOST_LAYERS[0]
    torch.manual_seed(3)
    x = torch.randn(shape, device="cuda")
    xg = x.clone().requires_grad_()
    dy = torch.randn(shape, device="cuda")
    ours, theirs, identity = (solution.InstanceNorm2d(shape[1]).cuda(), nn.InstanceNorm2d(shape[1]).cuda(),
                              nn.Identity())
    _, stats = ext.forward_with_stats(x)
    front = (None, None, None, None, True, 0.1, 1e-5, None, 0.01, None)
    rows = []
    with torch.no_grad():
        rows += [("torch.empty_like", host_us(lambda: torch.empty_like(x), calls)),
                 ("torch.neg (one ATen launch)", host_us(lambda: torch.neg(x), calls)),
                 ("nn.Identity module", host_us(lambda: identity(x), calls)),
                 ("pytorch module", host_us(lambda: theirs(x), calls)),
                 ("ours: module", host_us(lambda: ours(x), calls)),
                 ("ours: front (one C++ call)", host_us(lambda: ext.instance_norm(x, *front), calls)),
                 ("ours: op forward (dispatcher)", host_us(lambda: op.forward(x, None, None, 1e-5, 0, 0.01, None), calls)),
                 ("ours: plan alone (chosen_path)", host_us(lambda: ext.chosen_path(x), calls)),
                 ("ours: forward, automatic path", host_us(lambda: ext.forward(x), calls)),
                 ("ours: forward with stats", host_us(lambda: ext.forward_with_stats(x), calls)),
                 ("ours: backward, automatic path", host_us(lambda: ext.backward(dy, x, stats, None, 0, False),
                                                            calls))]
        for path in range(1, ext.num_forward_paths):
            if ext.path_supported(x, path):
                rows.append((f"ours: forward path {path}", host_us(lambda: ext.forward(x, path=path), calls)))
    rows += [("grad mode: torch.neg", host_us(lambda: torch.neg(xg), calls)),
             ("grad mode: ours module", host_us(lambda: ours(xg), calls)),
             ("grad mode: ours front", host_us(lambda: ext.instance_norm(xg, *front), calls)),
             ("grad mode: ours op forward", host_us(lambda: op.forward(xg, None, None, 1e-5, 0, 0.01, None), calls)),
             ("grad mode: pytorch module", host_us(lambda: theirs(xg), calls))]
    chains = (("torch.neg", lambda t: torch.neg(t)), ("pytorch module", theirs), ("ours: module", ours),
              ("ours: front", lambda t: ext.instance_norm(t, *front)),
              ("ours: op forward", lambda t: op.forward(t, None, None, 1e-5, 0, 0.01, None)[0]))
    for name, layer in chains:
        def step(layer=layer):
            t = xg
            for _ in range(CHAIN):
                t = layer(t)
            torch.autograd.grad(t, xg, dy)
        host, wall = host_us(step, max(calls // CHAIN, 10))
        rows.append((f"chain per layer: {name}", (host / CHAIN, wall / CHAIN)))
    print(f"\nhost us per call (wall), {shape} fp32, no affine; chosen forward path {ext.chosen_path(x)}")
    for name, (host, wall) in rows:
        print(f"  {name:<36} {host:7.1f} ({wall:7.1f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nets", default=",".join(NETS), help="comma-separated: " + ", ".join(NETS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (rounds x steps in all)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each variant takes rounds x steps steps, one step of each in turn")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (compile included)")
    parser.add_argument("--settle", type=int, default=0, help="untimed steps of a variant right before each of its "
                        "timed steps (default 0: each timed step is the first after the other variants')")
    parser.add_argument("--host-calls", type=int, default=100, help="calls per host-time row")
    parser.add_argument("--no-host", action="store_true", help="skip the per-layer host times")
    parser.add_argument("--host-only", action="store_true", help="only the per-layer host times")
    parser.add_argument("--profile", action="store_true", help="only print the host time of the pieces of one layer and the profiler's table of a chain of layers")
    parser.add_argument("--kernels", action="store_true", help="only print the GPU kernel time per step of each net in each mode (PyTorch's norms, ours, none) and the kernels where they differ")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    nets, modes = args.nets.split(","), args.modes.split(",")
    unknown = sorted(set(nets) - set(NETS)) + sorted(set(modes) - set(MODES))
    if args.host_only and args.no_host:
        parser.error("--host-only and --no-host exclude each other")
    if unknown:
        parser.error(f"unknown nets or modes: {', '.join(unknown)}")
    if not torch.cuda.is_available():
        print("benchmarks/nets.py needs a CUDA GPU and none is visible.", file=sys.stderr)
        return 2
    import solution  # builds the extension on first use

    if args.profile:
        host_breakdown(args.host_calls)
        profile_layer(5)
        return 0
    if args.kernels:
        for mode in modes:
            kernel_tables(nets, mode)
        return 0

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, settle {args.settle}")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "settle": args.settle,
               "checks": {}, "steps": [], "host": []}
    failed = False
    if args.host_only:
        nets = []
    for net in nets:
        errors = check_against_pytorch(net)
        ok = accurate_as_pytorch(errors)
        failed |= not ok
        results["checks"][net] = {"errors": errors, "ok": ok}
        print(f"check {net}, {count_norms(build(net, 'ours'))} norms, fp32 against the float64 net: " + "; ".join(
            f"{variant} output {out:.2e}, worst gradient {grad:.2e} ({name})"
            for variant, (out, grad, name) in errors.items()) + f" ({'ok' if ok else 'FAILED'})", flush=True)
    if nets:
        print(f"\n{'net':<12} {'mode':<8} {'pytorch':>9} {'ours':>9} {'fused':>9} {'identity':>9}  "
              f"norm cost / pytorch's: ours, fused (median step ms); paired: ours, fused [95% interval]")
    for net in nets:
        for mode in modes:
            times = time_net(net, mode, args.steps, args.rounds, args.warmup, args.settle)
            medians = {variant: statistics.median(t) for variant, t in times.items()}
            ratios = norm_cost_ratios(times)
            intervals = {f"paired_{variant}_interval": paired_ratio_interval(times, variant)
                         for variant in ("ours", "fused")}
            results["steps"].append({"net": net, "mode": mode, **medians, **ratios, **intervals, "times_ms": times})
            print(f"{net:<12} {mode:<8} {medians['pytorch']:9.2f} {medians['ours']:9.2f} {medians['fused']:9.2f} "
                  f"{medians['identity']:9.2f}  {ratios['ratio']:.2f}, {ratios['fused_ratio']:.2f}; paired: "
                  f"{ratios['paired_ratio']:.2f} [{intervals['paired_ours_interval'][0]:.2f}, "
                  f"{intervals['paired_ours_interval'][1]:.2f}], {ratios['paired_fused_ratio']:.2f} "
                  f"[{intervals['paired_fused_interval'][0]:.2f}, {intervals['paired_fused_interval'][1]:.2f}]",
                  flush=True)
            torch._dynamo.reset()
    if not args.no_host:
        print(f"\nhost us per call (wall) {'':<22} forward          forward+backward per layer of {CHAIN}")
        rows = host_rows(args.host_calls)
        for row in rows:
            results["host"].append(row)
            print(f"{str(tuple(row['shape'])):<18} affine={row['affine']!s:<5} {row['norm']:<8} "
                  f"{row['forward_host_us']:6.1f} ({row['forward_wall_us']:6.1f})  "
                  f"{row['forward_backward_host_us']:6.1f} ({row['forward_backward_wall_us']:6.1f})")
        for shape, affine in HOST_LAYERS:
            host = {row["norm"]: row for row in rows if tuple(row["shape"]) == shape and row["affine"] == affine}
            print(f"{str(shape):<18} affine={affine!s:<5} host time over PyTorch's, forward / forward+backward: " +
                  ", ".join(f"{name} {host[name]['forward_host_us'] / host['pytorch']['forward_host_us']:.2f} / "
                            f"{host[name]['forward_backward_host_us'] / host['pytorch']['forward_backward_host_us']:.2f}"
                            for name in ("ours", "neg")))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
