"""The shape sweep behind `python bench.py --sweep`: forward and forward + backward over
slice count x slice size x dtype x layout x affine, against the copy, eager PyTorch,
torch.compile and FlagGems.

    python bench.py --sweep [--quick] [--budget-gb 2] [--compile-mode dynamic|static|none]
                            [--runs 20] [--json PATH] [--plot PATH]

Grid (GRID, or QUICK with --quick): slices N * C from 1 to 8,192; spatial sizes from
2^6 to 2^26 values, non-powers of two among them; float32, bfloat16, float16;
contiguous and channels-last; affine off, and on with weight and bias of the input's
dtype (random). A cell is (N, C, H, W): C = 64 where the slice count is a multiple
of 64, else C = the slice count and N = 1; H the largest divisor of the spatial
size at most its square root. Cells whose input exceeds --budget-gb (default 2 GB)
are left out.

Each cell is timed as bench.py times a shape (an L2 flush before each run, CUDA
events, the median of --runs, all in one process), after ours was checked against
PyTorch's forward and gradients at the harness tolerance; a cell that fails the
check is reported failed, with no times. Rows: the copy of the input (the limit),
ours, and the peers: eager, torch.compile of F.instance_norm (--compile-mode
dynamic: one compile per dtype, layout and affine, with dynamic shapes; static: a
fresh compile per cell; none), and FlagGems (its F.instance_norm under
flag_gems.use_gems()) where `flag_gems` is installed. Forward, and forward +
backward (torch.autograd.grad of a fresh forward for the input and parameters).

Measures per cell and phase: "x copy", ours over the copy (forward + backward moves
at least 2.5 copies: x read twice, y and dx written, dy read); "vs best peer", ours
over the fastest peer (above 1 a peer is faster). Printed: a line per cell as it
runs, then the worst cells by each measure and the counts against the targets;
--json writes every cell, --plot heat maps of both measures (matplotlib, where
installed). Needs a CUDA GPU.
"""
import math
import statistics

import torch
import torch.nn.functional as F

SLICES = (1, 4, 16, 64, 256, 1024, 8192)
SPATIAL = (64, 100, 256, 1000, 1024, 4096, 10000, 16384, 65536, 100000, 262144, 1000000, 1048576, 4194304,
           16777216, 67108864)
GRID = {"slices": SLICES, "spatial": SPATIAL, "dtypes": (torch.float32, torch.bfloat16, torch.float16),
        "channels_last": (False, True), "affine": (False, True)}
QUICK = {"slices": (1, 64, 8192), "spatial": (256, 10000, 262144, 4194304, 16777216),
         "dtypes": (torch.float32, torch.bfloat16), "channels_last": (False, True), "affine": (False, True)}
# Cells of at least this many bytes are judged against the copy (the targets).
LARGE_BYTES = 256 * 1024 * 1024


def cell_shape(slices, spatial):
    """(N, C, H, W) of a cell (see the module docstring)."""
    channels = 64 if slices % 64 == 0 else slices
    height = max(d for d in range(1, math.isqrt(spatial) + 1) if spatial % d == 0)
    return slices // channels, channels, height, spatial // height


def cells(grid, budget_bytes):
    """The grid's cells whose input fits budget_bytes: dicts of shape, dtype,
    channels_last, affine and bytes (of the input)."""
    out = []
    for dtype in grid["dtypes"]:
        size = torch.finfo(dtype).bits // 8
        for channels_last in grid["channels_last"]:
            for affine in grid["affine"]:
                for slices in grid["slices"]:
                    for spatial in grid["spatial"]:
                        if slices * spatial * size <= budget_bytes:
                            out.append({"shape": cell_shape(slices, spatial), "dtype": dtype,
                                        "channels_last": channels_last, "affine": affine,
                                        "bytes": slices * spatial * size})
    return out


def label(cell):
    return (f"{tuple(cell['shape'])} {str(cell['dtype']).replace('torch.', '')}"
            f"{' CL' if cell['channels_last'] else ''}{' affine' if cell['affine'] else ''}")


def measures(median, floor_copies):
    """{"x_copy", "vs_best_peer", "best_peer"} from one phase's {row: median ms}."""
    ours, copy = median["ours"], median["copy"]
    peer_times = {name: t for name, t in median.items() if name not in ("ours", "copy")}
    best = min(peer_times, key=peer_times.get)
    return {"x_copy": ours / copy, "x_floor": ours / (floor_copies * copy), "vs_best_peer": ours / peer_times[best],
            "best_peer": best}


def _instance_norm(x, weight, bias):
    """PyTorch's F.instance_norm with the parameters by keyword: positionally its
    second and third arguments are running_mean and running_var."""
    return F.instance_norm(x, weight=weight, bias=bias)


class Peers:
    """The peers' forward functions f(x, weight, bias) -> y, built once per sweep
    (compiled ones once per dtype, layout and affine in dynamic mode)."""

    def __init__(self, compile_mode):
        self.compile_mode = compile_mode
        self.compiled_key, self.compiled = None, None
        self.flag_gems = _flag_gems()

    def for_cell(self, cell):
        found = {"eager": _instance_norm}
        if self.compile_mode == "static":
            torch._dynamo.reset()  # past the recompile limit Dynamo would fall back to eager
            found["torch.compile"] = torch.compile(_instance_norm)
        elif self.compile_mode == "dynamic":
            # cells() yields each dtype, layout and affine's cells together, so one
            # reset per key keeps every key's recompiles under Dynamo's limit.
            key = (cell["dtype"], cell["channels_last"], cell["affine"])
            if key != self.compiled_key:
                torch._dynamo.reset()
                self.compiled_key, self.compiled = key, torch.compile(_instance_norm, dynamic=True)
            found["torch.compile"] = self.compiled
        if self.flag_gems is not None:
            def gems(x, w, b, use_gems=self.flag_gems.use_gems):
                with use_gems():
                    return _instance_norm(x, w, b)
            found["flag_gems"] = gems
        return found


def _flag_gems():
    """The flag_gems module where it is installed, else None (it is no dependency)."""
    import importlib.util
    if importlib.util.find_spec("flag_gems") is None:
        return None
    import flag_gems
    return flag_gems


def run_cell(bench, solution, cell, peers, args, flush):
    """Checks and times one cell. Returns the cell with "forward" and
    "forward_backward" ({"median_ms": {row: ms}} and the measures), or with "failed"
    (ours differs from float64: the output beyond the harness tolerance, a gradient
    beyond both that tolerance of its scale and twice eager's own error). A peer that fails the same
    check is left out of the cell and named in "peer_failures"."""
    dtype, (n, c, h, w) = cell["dtype"], cell["shape"]
    tolerance = bench.TOLERANCE[dtype]
    x = bench.make_input((n, c, h, w), dtype, cell["channels_last"])
    xg = x.detach().requires_grad_()
    dy = torch.rand_like(x) - 0.5
    ours_norm = solution.InstanceNorm2d(c, affine=cell["affine"]).to("cuda", dtype)
    weight = bias = None
    if cell["affine"]:
        with torch.no_grad():
            ours_norm.weight.copy_(torch.rand(c, device="cuda") + 0.5)
            ours_norm.bias.copy_(torch.rand(c, device="cuda") - 0.5)
        weight, bias = (p.detach().clone().requires_grad_() for p in (ours_norm.weight, ours_norm.bias))
    functions = {"ours": lambda x, w, b: ours_norm(x), **peers.for_cell(cell)}
    grad_inputs = {name: [xg] + ([weight, bias] if cell["affine"] else []) for name in functions}
    grad_inputs["ours"] = [xg, *ours_norm.parameters()]
    # Gradients are judged against float64's, not eager's: summed over slices of
    # millions of 16-bit values, eager's parameter gradients are themselves off by
    # several times the harness tolerance (docs/perf-notes.md #109).
    inputs64 = [t.detach().double().requires_grad_() for t in grad_inputs["eager"]]
    reference = F.instance_norm(inputs64[0], weight=inputs64[1] if cell["affine"] else None,
                                bias=inputs64[2] if cell["affine"] else None)
    expected = torch.autograd.grad(reference, inputs64, dy.double())
    reference = reference.detach()
    del inputs64

    def gradient_errors(name):
        y = functions[name](xg, weight, bias)
        return y, [(got.double() - want).abs().max().item()
                   for got, want in zip(torch.autograd.grad(y, grad_inputs[name], dy), expected)]

    eager_errors = gradient_errors("eager")[1]

    def check(name):
        y, errors = gradient_errors(name)
        if not torch.allclose(y.double(), reference, atol=tolerance, rtol=tolerance):
            return f"output differs from float64 beyond {tolerance}"
        for error, eager_error, want in zip(errors, eager_errors, expected):
            if error > max(tolerance * max(want.abs().max().item(), 1.0), 2 * eager_error):
                return f"gradient differs from float64 beyond {tolerance} of its scale and twice eager's error"
        return None

    failures = {name: reason for name in functions if (reason := failure_of(lambda name=name: check(name))) is not None}
    del reference, expected
    if "ours" in failures:
        return dict(cell, failed=failures["ours"])
    functions = {name: f for name, f in functions.items() if name not in failures}
    copy_out = torch.empty_like(x)
    forward_rows = {"copy": lambda: copy_out.copy_(x)}
    both_rows = {"copy": forward_rows["copy"]}
    for name, f in functions.items():
        forward_rows[name] = lambda f=f: f(x, weight, bias)
        both_rows[name] = lambda f=f, name=name: torch.autograd.grad(f(xg, weight, bias), grad_inputs[name], dy)
    with torch.no_grad():
        forward = {name: statistics.median(bench.time_ms(fn, args.runs, args.warmup, flush))
                   for name, fn in forward_rows.items()}
    both = {name: statistics.median(bench.time_ms(fn, args.runs, args.warmup, flush)) for name, fn in both_rows.items()}
    return dict(cell, peer_failures=failures, forward={"median_ms": forward, **measures(forward, 1.0)},
                forward_backward={"median_ms": both, **measures(both, 2.5)})


def failure_of(check):
    """check()'s failure reason, or None; an exception it raises becomes the reason
    (its type and first line), so a peer that cannot run a cell (a compile error, an
    op FlagGems lacks) is left out of that cell and the sweep goes on."""
    try:
        return check()
    except Exception as error:  # noqa: BLE001  (any failure of a peer is reported, not fatal)
        lines = str(error).strip().splitlines()
        return f"raised {type(error).__name__}" + (f": {lines[0][:200]}" if lines else "")


def worst(results, key, count=12):
    """(value, phase, cell) of the `count` timed cells with the largest `key` measure."""
    rows = [(r[phase][key], phase, r) for r in results if "failed" not in r for phase in ("forward", "forward_backward")]
    return sorted(rows, key=lambda row: -row[0])[:count]


def report(results):
    """Prints the worst cells by each measure and the counts against the targets."""
    failed = [r for r in results if "failed" in r]
    timed = [r for r in results if "failed" not in r]
    for key, what in (("x_copy", "x copy"), ("vs_best_peer", "ours / best peer")):
        print(f"\nworst cells by {what}:")
        for value, phase, r in worst(timed, key):
            print(f"  {value:6.2f}  {phase:16s} {label(r)}  (best peer {r[phase]['best_peer']})")
    large = [r for r in timed if r["bytes"] >= LARGE_BYTES]
    print(f"\n{len(timed)} cells timed, {len(failed)} failed the check; of {len(large)} cells of at least 256 MB, "
          f"forward over 1.25x the copy: {sum(r['forward']['x_copy'] > 1.25 for r in large)}, over 1.6x: "
          f"{sum(r['forward']['x_copy'] > 1.6 for r in large)}; cells where a peer is faster: forward "
          f"{sum(r['forward']['vs_best_peer'] > 1 for r in timed)}, forward + backward "
          f"{sum(r['forward_backward']['vs_best_peer'] > 1 for r in timed)}")
    for r in failed:
        print(f"  failed: {label(r)}: {r['failed']}")


def plot(results, path):
    """Heat maps (slices x spatial size) of x copy and ours / best peer, forward and
    forward + backward, one column per dtype, layout and affine; nothing without
    matplotlib."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot")
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if "failed" not in r]
    groups = sorted({(str(r["dtype"]), r["channels_last"], r["affine"]) for r in timed})
    panels = [("forward", "x_copy"), ("forward_backward", "x_copy"), ("forward", "vs_best_peer"),
              ("forward_backward", "vs_best_peer")]
    figure, axes = plt.subplots(len(panels), len(groups), figsize=(3.2 * len(groups), 2.8 * len(panels)),
                                squeeze=False)
    for column, group in enumerate(groups):
        cells_here = [r for r in timed if (str(r["dtype"]), r["channels_last"], r["affine"]) == group]
        slices = sorted({r["shape"][0] * r["shape"][1] for r in cells_here})
        spatial = sorted({r["shape"][2] * r["shape"][3] for r in cells_here})
        for row, (phase, key) in enumerate(panels):
            grid = [[math.nan] * len(spatial) for _ in slices]
            for r in cells_here:
                grid[slices.index(r["shape"][0] * r["shape"][1])][spatial.index(r["shape"][2] * r["shape"][3])] = \
                    r[phase][key]
            axis = axes[row][column]
            image = axis.imshow(grid, origin="lower", aspect="auto", cmap="RdYlGn_r",
                                vmin=1.0 if key == "x_copy" else 0.5, vmax=2.0 if key == "x_copy" else 1.5)
            axis.set_xticks(range(len(spatial)), [f"2^{math.log2(s):.1f}" for s in spatial], rotation=90, fontsize=6)
            axis.set_yticks(range(len(slices)), slices, fontsize=6)
            axis.set_title(f"{group[0].replace('torch.', '')}{' CL' if group[1] else ''}{' affine' if group[2] else ''}"
                           f"\n{phase} {key}", fontsize=7)
            figure.colorbar(image, ax=axis)
    figure.supxlabel("spatial size (values per slice)")
    figure.supylabel("slices (N * C)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(bench, solution, args, flush):
    """Runs the sweep with bench.py's options; returns the results (also written to
    --json and plotted to --plot)."""
    selected = cells(QUICK if args.quick else GRID, int(args.budget_gb * 1e9))
    peers = Peers(args.compile_mode)
    print(f"sweep: {len(selected)} cells, compile {args.compile_mode}, flag_gems "
          f"{'present' if peers.flag_gems is not None else 'absent'}")
    results = []
    for index, cell in enumerate(selected):
        result = run_cell(bench, solution, cell, peers, args, flush)
        results.append(result)
        if "failed" in result:
            print(f"[{index + 1}/{len(selected)}] {label(cell)}: FAILED {result['failed']}")
        else:
            print(f"[{index + 1}/{len(selected)}] {label(cell)}: forward {result['forward']['x_copy']:.2f}x copy, "
                  f"{result['forward']['vs_best_peer']:.2f} of {result['forward']['best_peer']}; forward + backward "
                  f"{result['forward_backward']['x_copy']:.2f}x copy, {result['forward_backward']['vs_best_peer']:.2f}"
                  f" of {result['forward_backward']['best_peer']}")
            for name, reason in result["peer_failures"].items():
                print(f"    {name} left out: {reason}")
        torch.cuda.empty_cache()
    report(results)
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    raise SystemExit("benchmarks/sweep.py is the grid behind `python bench.py --sweep`; run that "
                     "(`python bench.py --help`)")
