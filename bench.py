"""Time ModelNew (this project's InstanceNorm) against eager PyTorch, torch.compile
of it, and a plain device copy of the same tensor (the speed limit), in one process.

    python bench.py [--shape 112,64,512,512] [--dtype float32] [--channels-last] [--paths]
    python bench.py --suite [--dtypes float32,bfloat16]
    python bench.py --backward [--suite]
    python bench.py [--backward] --activation relu
    python bench.py [--backward] --affine
    python bench.py [--backward] --reflection-pad 1,1,1,1
    python bench.py --sweep [--quick] [--budget-gb 2] [--compile-mode dynamic] [--plot PATH]
    common: [--runs 30] [--warmup 3] [--no-compile] [--kernels] [--json PATH]

Input: torch.rand of the shape ((N, C, *spatial), 1d to 3d; default the seed shape
(112, 64, 512, 512), 7.5 GB in fp32). Each row first checks our output against
PyTorch's nn.InstanceNorm{1,2,3}d (allclose at the harness tolerance: 1e-4 fp32,
1e-2 fp16/bf16) and refuses to report a speed for wrong output. Every timed run
is preceded by a 256 MB write that flushes L2 and is bracketed by CUDA events;
after warm-up, the median of --runs is reported with the time over the copy's
and the speedup over eager and over torch.compile.

--paths also times every forced kernel path that can run the shape (with
--backward: the backward kernels alone, called directly). --suite runs
the list of real shapes in SUITE (style transfer, diffusion U-Nets, 3d
segmentation, a channels-last layer) in each of --dtypes and prints one table.
--backward times, instead of the forward, the backward alone (autograd.grad of a
retained graph) and forward + backward, whose limit is 1.5x the copy (read x and
dy, write dx) plus, for forward + backward, the forward's copy.
--activation NAME adds ours with that activation fused (the layer's activation=)
against the same module's plain rows and PyTorch's norm followed by the activation
(checked against it first).
--affine adds ours and PyTorch's with affine=True (the same random weight and bias, in
the input's dtype), checked against each other first; affine's cost is that row over
ours.
--reflection-pad P (F.pad's order) adds, on the block path (forced), the padded
kernel that writes the padded output (reads the padded gradient) against the plain
kernel followed by PyTorch's pad (preceded by its pad backward), both checked against
PyTorch's norm and pad first.
--kernels also prints, under each shape's table, every row's CUDA kernels per call
(torch.profiler over 20 calls, each after the flush; the flush's own kernels,
profiled alone as often, taken out): where a row's time goes, kernel by kernel.
--sweep times forward and forward + backward over a grid of slice count x slice size
x dtype x layout x affine against the copy, eager, torch.compile and FlagGems (where
installed), and reports the worst cells (benchmarks/sweep.py describes it).
"""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

FLUSH_BYTES = 256 * 1024 * 1024
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The harness tolerances (atol = rtol): fp32 1e-4, 16-bit types 1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
SEED_SHAPE = (112, 64, 512, 512)
# Real shapes (style transfer, diffusion U-Nets, 3d segmentation, a channels-last
# layer): (shape, channels_last).
SUITE = [((112, 64, 512, 512), False), ((2, 320, 128, 128), False), ((2, 1280, 16, 16), False),
         ((4, 128, 256, 256), False), ((2, 640, 32, 32), False), ((16, 64, 256, 256), False),
         ((1, 32, 128, 128, 128), False), ((8, 256, 56, 56), True)]


def parse_shape(text):
    """'N,C,L' / 'N,C,H,W' / 'N,C,D,H,W' -> tuple of ints."""
    shape = tuple(int(v) for v in text.split(","))
    if not 3 <= len(shape) <= 5 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected 3 to 5 positive integers N,C,*spatial, got {text!r}")
    return shape


def time_ms(fn, runs, warmup, flush):
    """CUDA-event times (ms) of `runs` calls of fn, each after an L2 flush."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def make_input(shape, dtype, channels_last):
    torch.manual_seed(0)
    x = torch.rand(shape, device="cuda").to(dtype)
    if channels_last:
        order = (0, *range(2, x.dim()), 1)
        x = x.permute(order).contiguous().permute(sorted(range(x.dim()), key=order.__getitem__))
    return x


# The activations of --activation, as PyTorch applies them after its norm.
ACTIVATION_FUNCTIONS = {"relu": torch.relu, "leaky_relu": torch.nn.functional.leaky_relu,
                        "silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
                        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


def fused_modules(solution, x, args):
    """[(name, ours with the activation fused, PyTorch's norm then the activation)]
    for --activation (empty without it)."""
    if not args.activation:
        return []
    ours, eager = modules(solution, x.shape, x.dtype)
    ours.activation = args.activation
    act = ACTIVATION_FUNCTIONS[args.activation]
    return [(f"ours + {args.activation} fused", ours, lambda t: act(eager(t)), f"eager + {args.activation}")]


def affine_modules(solution, x, args):
    """[(name, ours with affine=True, PyTorch's with affine=True, its name)] for
    --affine (empty without it): the same weight and bias in both, drawn at random, in
    the input's dtype as a module moved with .to(dtype) has them."""
    if not args.affine:
        return []
    ours, eager = modules(solution, x.shape, x.dtype, affine=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name in ("weight", "bias"):
            value = torch.randn(x.shape[1], device="cuda", generator=generator) * 0.5 + (1.0 if name == "weight" else 0.0)
            getattr(ours, name).copy_(value)
            getattr(eager, name).copy_(value)
    return [("ours affine", ours, eager, "eager affine")]


def modules(solution, shape, dtype, affine=False):
    """(ours, PyTorch's) InstanceNorm of the input's rank, affine=False as in the harness
    unless asked."""
    name = {3: "InstanceNorm1d", 4: "InstanceNorm2d", 5: "InstanceNorm3d"}[len(shape)]
    return (getattr(solution, name)(shape[1], affine=affine).to("cuda", dtype),
            getattr(torch.nn, name)(shape[1], affine=affine).to("cuda", dtype))


def forward_rows(solution, x, args):
    """[(name, fn)] timing rows of the forward, after checking ours against PyTorch's."""
    ours, eager = modules(solution, x.shape, x.dtype)
    tolerance = TOLERANCE[x.dtype]
    copy_out = torch.empty_like(x)
    with torch.no_grad():
        if not torch.allclose(ours(x), eager(x), atol=tolerance, rtol=tolerance):
            raise SystemExit(f"bench.py: ours differs from PyTorch on {tuple(x.shape)} {x.dtype}; no speed reported")
    rows = [("copy_ (limit)", lambda: copy_out.copy_(x)), (f"ours (path {solution._EXT.chosen_path(x)})", lambda: ours(x)),
            ("eager", lambda: eager(x))]
    if not args.no_compile:
        torch._dynamo.reset()  # a fresh cache per shape: past the recompile limit dynamo falls back to eager
        compiled = torch.compile(eager)
        rows.append(("torch.compile", lambda: compiled(x)))
    if args.paths:
        for path in range(1, solution._EXT.num_forward_paths):
            if not solution._EXT.path_supported(x, path):
                continue
            with torch.no_grad():
                good = torch.allclose(solution._EXT.forward(x, path=path), eager(x), atol=tolerance, rtol=tolerance)
            if not good:
                raise SystemExit(f"bench.py: path {path} differs from PyTorch; no speed reported")
            rows.append((f"path {path}", lambda path=path: solution._EXT.forward(x, path=path)))
    for name, fused, composed, composed_name in fused_modules(solution, x, args) + affine_modules(solution, x, args):
        with torch.no_grad():
            if not torch.allclose(fused(x), composed(x), atol=tolerance, rtol=tolerance):
                raise SystemExit(f"bench.py: {name} differs from PyTorch; no speed reported")
        rows += [(name, lambda fused=fused: fused(x)), (composed_name, lambda composed=composed: composed(x))]
    if args.reflection_pad:
        pad, block = args.reflection_pad, solution._EXT.forward_paths["block"]
        with torch.no_grad():
            expected = F.pad(eager(x), pad, mode="reflect")
        candidates = [("block, padded kernel", lambda: solution._EXT.forward(x, path=block, reflection_pad=pad)),
                      ("block + F.pad", lambda: F.pad(solution._EXT.forward(x, path=block), pad, mode="reflect"))]
        for name, fn in candidates:
            if not torch.allclose(fn(), expected, atol=tolerance, rtol=tolerance):
                raise SystemExit(f"bench.py: {name} differs from PyTorch's norm and pad; no speed reported")
        rows += candidates
    return rows


def backward_rows(solution, x, args):
    """[(name, fn)] timing rows of the backward alone and forward + backward, after
    checking our gradient against PyTorch's."""
    ours, eager = modules(solution, x.shape, x.dtype)
    tolerance = TOLERANCE[x.dtype]
    dy = torch.rand_like(x) - 0.5
    copy_out = torch.empty_like(x)
    candidates = [("ours", ours), ("eager", eager)]
    for name, fused, composed, composed_name in fused_modules(solution, x, args) + affine_modules(solution, x, args):
        xc = x.detach().requires_grad_()
        want = torch.autograd.grad(composed(xc), xc, dy)[0]
        got = torch.autograd.grad(fused(xc), xc, dy)[0]
        # Compared away from the activation's kink: where the norm's output is within
        # 1e-3 of 0, our recomputed pre-activation and PyTorch's stored one may round
        # to opposite sides, and relu's derivative there is 0 or 1.
        with torch.no_grad():
            away = eager(x).abs() > 1e-3
        if (got.float() - want.float())[away].abs().max().item() > tolerance * max(want.abs().max().item(), 1.0):
            raise SystemExit(f"bench.py: {name} gradient differs from PyTorch's; no speed reported")
        del want, got, away
        candidates += [(name, fused), (composed_name, composed)]
    if not args.no_compile:
        torch._dynamo.reset()
        candidates.append(("torch.compile", torch.compile(eager)))
    xg = x.detach().requires_grad_()
    expected = torch.autograd.grad(eager(xg), xg, dy)[0]
    limit = tolerance * max(expected.abs().max().item(), 1.0)

    def check(got, what):
        if (got.float() - expected.float()).abs().max().item() > limit:
            raise SystemExit(f"bench.py: {what} differs from PyTorch's gradient on {tuple(x.shape)} {x.dtype}; "
                             "no speed reported")

    check(torch.autograd.grad(ours(xg), xg, dy)[0], "our gradient")
    rows = [("copy_ (limit)", lambda: copy_out.copy_(x))]
    if args.paths:
        _, stats = solution._EXT.forward_with_stats(x)
        for path in range(1, solution._EXT.num_backward_paths):
            if solution._EXT.backward_path_supported(x, path):
                check(solution._EXT.backward(dy, x, stats, None, path)[0], f"backward path {path}")
                rows.append((f"backward path {path}",
                             lambda path=path: solution._EXT.backward(dy, x, stats, None, path)))
    del expected
    if args.reflection_pad:
        rows += padded_backward_rows(solution, x, args.reflection_pad, tolerance)
    for name, module in candidates:
        y = module(xg)
        rows.append((f"{name} backward", lambda y=y: torch.autograd.grad(y, xg, dy, retain_graph=True)))
        rows.append((f"{name} fwd+bwd", lambda module=module: torch.autograd.grad(module(xg), xg, dy)))
    return rows


def padded_backward_rows(solution, x, pad, tolerance):
    """The block path's backward from the gradient of the output padded by `pad`: the
    padded kernel, and PyTorch's pad backward then the plain kernel, each checked
    against autograd through PyTorch's norm and pad first."""
    block = solution._EXT.backward_paths["block"]
    _, stats = solution._EXT.forward_with_stats(x)
    dy = torch.rand(F.pad(x, pad, mode="reflect").shape, device=x.device, dtype=x.dtype) - 0.5
    xg = x.detach().requires_grad_()
    expected = torch.autograd.grad(F.pad(F.instance_norm(xg), pad, mode="reflect"), xg, dy)[0]
    pad_backward = getattr(torch.ops.aten, f"reflection_pad{len(pad) // 2}d_backward")
    rows = [("backward block, padded kernel", lambda: solution._EXT.backward(dy, x, stats, None, block,
                                                                            reflection_pad=pad)),
            ("pad backward + backward block", lambda: solution._EXT.backward(pad_backward(dy, x, pad), x, stats,
                                                                            None, block))]
    for name, fn in rows:
        if (fn()[0].float() - expected.float()).abs().max().item() > tolerance * max(expected.abs().max().item(), 1.0):
            raise SystemExit(f"bench.py: {name} differs from PyTorch's gradient; no speed reported")
    return rows


def kernels_beyond(both, alone, calls):
    """[(kernel, launches per call, us per launch)], most time per call first: the
    profiler's totals `both` ({kernel: (launches, us)} over `calls` calls of a row,
    each after the flush) less `alone` (the flush's own, profiled as many times)."""
    rows = []
    for name, (launches, us) in both.items():
        flush_launches, flush_us = alone.get(name, (0, 0.0))
        if launches > flush_launches:
            rows.append((name, (launches - flush_launches) / calls, (us - flush_us) / (launches - flush_launches)))
    return sorted(rows, key=lambda row: -row[1] * row[2])


def profiled_kernels(fn, calls):
    """{kernel: (launches, us)} of `calls` calls of fn under torch.profiler (CUDA only),
    after one untimed call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    found = {}
    for event in profile.key_averages():
        us = event.self_device_time_total if hasattr(event, "self_device_time_total") else event.self_cuda_time_total
        if us > 0:
            found[event.key] = (event.count, us)
    return found


def row_kernels(fn, flush, calls=20):
    """kernels_beyond for fn, each call after the L2 flush as when timed."""
    def flushed():
        flush.zero_()
        fn()
    return kernels_beyond(profiled_kernels(flushed, calls), profiled_kernels(flush.zero_, calls), calls)


def bench_shape(solution, shape, dtype, channels_last, args, flush):
    """Times one shape; returns {name: median ms} and prints a table."""
    x = make_input(shape, dtype, channels_last)
    rows = backward_rows(solution, x, args) if args.backward else forward_rows(solution, x, args)
    times = {name: time_ms(fn, args.runs, args.warmup, flush) for name, fn in rows}
    median = {name: statistics.median(t) for name, t in times.items()}
    copy_ms = median["copy_ (limit)"]
    layout = " channels_last" if channels_last else ""
    print(f"\n{tuple(shape)} {str(dtype).replace('torch.', '')}{layout} ({x.numel() * x.element_size() / 1e9:.3f} GB): "
          f"median of {args.runs} ms, x copy")
    for name, m in median.items():
        print(f"  {name:24s} {m:9.4f} {m / copy_ms:6.2f}x")
    kernels = {}
    if args.kernels:
        print("  CUDA kernels per call: launches, us each (torch.profiler)")
        for name, fn in rows:
            kernels[name] = row_kernels(fn, flush)
            for kernel, launches, us in kernels[name]:
                print(f"  {name:24s} {launches:5.2f} {us:8.2f}  {kernel[:100]}")
    del x, rows
    torch.cuda.empty_cache()
    return {"shape": list(shape), "dtype": str(dtype), "channels_last": channels_last, "median_ms": median,
            "times_ms": times, **({"kernels": kernels} if args.kernels else {})}


def summary(results, backward):
    """One line per shape: ours against the limit, eager and compile (speedup > 1 means faster)."""
    print("\nsummary (median ms; speedup = their time / ours)")
    if backward:
        print(f"{'shape':34s} {'bwd':>8s} {'bwd/floor':>9s} {'vs eager':>8s} {'vs comp':>8s} "
              f"{'fwd+bwd':>8s} {'vs eager':>8s} {'vs comp':>8s}")
    else:
        print(f"{'shape':34s} {'ours':>8s} {'x copy':>7s} {'vs eager':>8s} {'vs comp':>8s}")
    for r in results:
        m = r["median_ms"]
        label = f"{tuple(r['shape'])} {r['dtype'].replace('torch.', '')}{' CL' if r['channels_last'] else ''}"
        copy_ms = m["copy_ (limit)"]
        if backward:
            line = (f"{label:34s} {m['ours backward']:8.4f} {m['ours backward'] / (1.5 * copy_ms):9.2f} "
                    f"{m['eager backward'] / m['ours backward']:8.2f} ")
            line += f"{m['torch.compile backward'] / m['ours backward']:8.2f} " if "torch.compile backward" in m else f"{'-':>8s} "
            line += f"{m['ours fwd+bwd']:8.4f} {m['eager fwd+bwd'] / m['ours fwd+bwd']:8.2f} "
            line += f"{m['torch.compile fwd+bwd'] / m['ours fwd+bwd']:8.2f}" if "torch.compile fwd+bwd" in m else f"{'-':>8s}"
        else:
            ours = next(v for k, v in m.items() if k.startswith("ours"))
            line = f"{label:34s} {ours:8.4f} {ours / copy_ms:7.2f} {m['eager'] / ours:8.2f} "
            line += f"{m['torch.compile'] / ours:8.2f}" if "torch.compile" in m else f"{'-':>8s}"
        print(line)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=parse_shape, default=SEED_SHAPE, help="N,C,*spatial (default 112,64,512,512)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="input dtype (default float32)")
    parser.add_argument("--channels-last", action="store_true", help="channels-last input")
    parser.add_argument("--suite", action="store_true", help="time the SUITE list of real shapes instead of --shape")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of --suite (default float32,bfloat16)")
    parser.add_argument("--backward", action="store_true", help="time the backward and forward + backward")
    parser.add_argument("--runs", type=int, default=30, help="timed runs per row (default 30, at least 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.add_argument("--paths", action="store_true", help="also time every forced kernel path that can run the shape")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--activation", choices=sorted(ACTIVATION_FUNCTIONS),
                        help="also time ours with this activation fused, against PyTorch's norm then it")
    parser.add_argument("--affine", action="store_true",
                        help="also time ours and PyTorch's with affine=True (random weight and bias in the input's dtype)")
    parser.add_argument("--reflection-pad", type=lambda text: tuple(int(v) for v in text.split(",")), metavar="P",
                        help="also time the block path's padded kernels against PyTorch's pad (F.pad order)")
    parser.add_argument("--sweep", action="store_true", help="time the grid of benchmarks/sweep.py instead")
    parser.add_argument("--quick", action="store_true", help="with --sweep: its QUICK subset of the grid")
    parser.add_argument("--budget-gb", type=float, default=2.0, help="with --sweep: the largest input, GB (default 2)")
    parser.add_argument("--compile-mode", choices=("dynamic", "static", "none"), default="dynamic",
                        help="with --sweep: torch.compile peer with dynamic shapes (default), per cell, or none")
    parser.add_argument("--plot", metavar="PATH", help="with --sweep: heat maps as a PNG (needs matplotlib)")
    parser.add_argument("--kernels", action="store_true",
                        help="also print each row's CUDA kernels per call (torch.profiler, the flush's own taken out)")
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args(argv)
    if args.runs < 20:
        parser.error("--runs must be at least 20")
    if args.kernels and args.sweep:
        parser.error("--kernels lists the rows of --shape or --suite, not of --sweep")
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU and none is visible.", file=sys.stderr)
        return 2
    import solution  # builds the extension on first use

    if args.sweep:
        return run_sweep(solution, args)
    if args.suite:
        cases = [(shape, DTYPES[d], cl) for d in args.dtypes.split(",") for shape, cl in SUITE]
    else:
        cases = [(args.shape, DTYPES[args.dtype], args.channels_last)]
    flush = torch.empty(FLUSH_BYTES // 4, device="cuda")
    gpu = torch.cuda.get_device_name()
    print(f"bench: {gpu}, torch {torch.__version__}, {args.runs} runs after a {FLUSH_BYTES >> 20} MB L2 flush, "
          f"{'backward' if args.backward else 'forward'}")
    results = [bench_shape(solution, shape, dtype, cl, args, flush) for shape, dtype, cl in cases]
    summary(results, args.backward)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "runs": args.runs, "backward": args.backward,
                       "results": results}, f, indent=1)
    return 0


def run_sweep(solution, args):
    """--sweep: benchmarks/sweep.py with this module's timing, checks and options."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmarks"))
    import sweep

    flush = torch.empty(FLUSH_BYTES // 4, device="cuda")
    gpu = torch.cuda.get_device_name()
    print(f"bench: {gpu}, torch {torch.__version__}, {args.runs} runs after a {FLUSH_BYTES >> 20} MB L2 flush, sweep")
    results = sweep.main(sys.modules[__name__], solution, args, flush)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "runs": args.runs, "compile_mode": args.compile_mode,
                       "results": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
