"""Time ModelNew against eager nn.InstanceNorm2d, torch.compile of it, and a
plain device copy of the same tensor (the speed limit), in one process.

    python bench.py [--shape N,C,H,W] [--dtype float32] [--runs 30] [--paths] [--no-compile] [--json PATH]

Input: torch.rand of the shape (default (112, 64, 512, 512), 7.5 GB in fp32) in
--dtype (default float32). Checks ModelNew against nn.InstanceNorm2d first
(allclose at the harness tolerance: 1e-4 fp32, 1e-2 fp16/bf16) and refuses to
report a speed for wrong output. Every timed run is preceded by a 256 MB write
that flushes L2 and is bracketed by CUDA events; after warm-up, reports median
and mean ms, GB/s counting one read and one write of the tensor, the time over
the copy's, and the speedup over eager and over torch.compile. --paths also
times every forced kernel path that can run the shape.
"""
import argparse
import json
import statistics
import sys

import torch

from check import parse_shape

FLUSH_BYTES = 256 * 1024 * 1024
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The harness tolerances (atol = rtol): fp32 1e-4, 16-bit types 1e-2.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2}


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, default=(112, 64, 512, 512), help="N,C,H,W (default 112,64,512,512)")
    parser.add_argument("--runs", type=int, default=30, help="timed runs per row (default 30, at least 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="input dtype (default float32)")
    parser.add_argument("--paths", action="store_true", help="also time every forced kernel path that can run the shape")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    parser.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    args = parser.parse_args(argv)
    if args.runs < 20:
        parser.error("--runs must be at least 20")
    if not torch.cuda.is_available():
        print("bench.py needs a CUDA GPU and none is visible.", file=sys.stderr)
        return 2
    import solution  # builds the extension on first use

    n, c, h, w = args.shape
    torch.manual_seed(0)
    x = torch.rand(args.shape, device="cuda").to(DTYPES[args.dtype])
    tolerance = TOLERANCE[args.dtype]
    copy_out = torch.empty_like(x)
    flush = torch.empty(FLUSH_BYTES // 4, device="cuda")
    model = solution.ModelNew(c).cuda()
    eager = torch.nn.InstanceNorm2d(c).cuda()
    bytes_moved = 2 * x.numel() * x.element_size()
    chosen = solution._EXT.chosen_path(x)

    with torch.no_grad():
        if not torch.allclose(model(x), eager(x), atol=tolerance, rtol=tolerance):
            print(f"bench.py: ModelNew output differs from nn.InstanceNorm2d (allclose {tolerance}); "
                  "no speed reported.", file=sys.stderr)
            return 1
        rows = [("copy_ (limit)", lambda: copy_out.copy_(x)),
                (f"ModelNew (path {chosen})", lambda: model(x)),
                ("eager nn.InstanceNorm2d", lambda: eager(x))]
        if not args.no_compile:
            compiled = torch.compile(eager)
            rows.append(("torch.compile(eager)", lambda: compiled(x)))
        if args.paths:
            for path in (1, 2):
                if not solution._EXT.path_supported(x, path):
                    continue
                out = solution._EXT.forward(x, eps=model.eps, path=path)
                if torch.allclose(out, eager(x), atol=tolerance, rtol=tolerance):
                    rows.append((f"path {path}", lambda path=path: solution._EXT.forward(x, eps=model.eps, path=path)))
                else:
                    print(f"bench.py: path {path} output differs from nn.InstanceNorm2d; not timed", file=sys.stderr)
        times = {name: time_ms(fn, args.runs, args.warmup, flush) for name, fn in rows}

    median = {name: statistics.median(t) for name, t in times.items()}
    copy_ms = median["copy_ (limit)"]
    eager_ms = median["eager nn.InstanceNorm2d"]
    compile_ms = median.get("torch.compile(eager)")
    gpu = torch.cuda.get_device_name()
    print(f"bench: shape {args.shape} {args.dtype} ({x.numel() * x.element_size() / 1e9:.2f} GB), {gpu}, torch {torch.__version__}, "
          f"{args.runs} runs after L2 flush")
    header = f"{'':28s} {'median ms':>10s} {'mean ms':>9s} {'GB/s':>7s} {'x copy':>7s} {'vs eager':>9s} {'vs compile':>10s}"
    print(header)
    results = []
    for name, t in times.items():
        m = median[name]
        row = {"name": name, "median_ms": m, "mean_ms": statistics.fmean(t), "gb_per_s": bytes_moved / m / 1e6,
               "x_copy": m / copy_ms, "speedup_vs_eager": eager_ms / m,
               "speedup_vs_compile": compile_ms / m if compile_ms else None, "times_ms": t}
        results.append(row)
        vs_compile = f"{row['speedup_vs_compile']:9.2f}x" if compile_ms else f"{'-':>10s}"
        print(f"{name:28s} {m:10.3f} {row['mean_ms']:9.3f} {row['gb_per_s']:7.0f} {row['x_copy']:6.2f}x "
              f"{row['speedup_vs_eager']:8.2f}x {vs_compile}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "shape": list(args.shape), "dtype": args.dtype,
                       "runs": args.runs, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
