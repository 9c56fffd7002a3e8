"""GPU time of instance_norm's forward kernels per case, with and without weight and bias.

    python tools/kernel_times.py OUT.json [--shape N,C,H,W[:cl] ...] [--dtypes float32,bfloat16] [--calls 20]
    python tools/kernel_times.py --compare A.json[,A2.json ...] B.json[,B2.json ...]

The first form times, for each shape (":cl" for channels-last) and dtype, the forward
with no parameters ("none"), float32 ones ("fp32") and, for 16-bit input, ones of the
input's dtype ("same"): the sum of the CUDA kernels of one call (torch.profiler over
--calls calls), once with a 256 MB L2 flush before each call ("flushed", the flush's own
kernels taken out as bench.py --kernels does) and once without ("hot"). Each output is
first checked against float64 (1e-4 in fp32, 3e-2 of the largest value in 16-bit) and a
case that fails stops the run. It writes {case: {"flushed": us, "hot": us, "kernels":
[names]}} to OUT.json. The kernels are those of $INSTANCE_NORM_KERNELS (solution.py's
rule), so two versions of kernels/ are timed in alternating processes, e.g.

    for r in 1 2; do for v in a b; do
      INSTANCE_NORM_KERNELS=ab/$v python tools/kernel_times.py out/$v-$r.json; done; done
    python tools/kernel_times.py --compare out/a-1.json,out/a-2.json out/b-1.json,out/b-2.json

--compare prints, per case, the mean over each side's files, flushed and hot, and the
change in percent. The first form needs a CUDA GPU and exits with status 2 without one;
bad arguments exit with status 2 and a message naming them.
"""
import argparse
import json
import os
import statistics
import sys

# The channels-last tile cells and the contiguous warp-path cells of docs/perf-notes.md #189.
DEFAULT_SHAPES = ["1,64,16,16:cl", "8,64,32,32:cl", "128,64,16,16:cl", "4,64,64,64:cl", "32,256,16,16:cl",
                  "128,64,16,16", "256,64,10,10", "512,64,6,6", "1,64,16,16", "1,1,16,16", "8,64,7,7"]
FLUSH_BYTES = 256 * 2**20


def parse_shape(text):
    """'N,C,*spatial[:cl]' -> (shape tuple, channels_last); ValueError naming the text."""
    dims, _, layout = text.partition(":")
    if layout not in ("", "cl"):
        raise ValueError(f"--shape {text!r}: the suffix must be ':cl' (channels-last) or nothing")
    parts = dims.split(",")
    if not all(d.strip().isdigit() for d in parts) or not 3 <= len(parts) <= 5:
        raise ValueError(f"--shape {text!r}: expected 3 to 5 positive integers N,C,*spatial")
    shape = tuple(int(d) for d in parts)
    if min(shape) < 1:
        raise ValueError(f"--shape {text!r}: every dimension must be at least 1")
    if layout == "cl" and len(shape) != 4:
        raise ValueError(f"--shape {text!r}: ':cl' needs a 4-d shape N,C,H,W")
    return shape, layout == "cl"


def case_key(shape, channels_last, dtype_name, parameters):
    return f"{shape}|{'cl' if channels_last else 'c'}|{dtype_name}|{parameters}"


def compare(a_files, b_files):
    """Lines of the per-case mean of a_files against b_files (flushed | hot, us and %)."""
    def mean_of(files):
        runs = [json.load(open(path)) for path in files]
        return {key: (statistics.mean(run[key]["flushed"] for run in runs),
                      statistics.mean(run[key]["hot"] for run in runs))
                for key in runs[0] if all(key in run for run in runs)}
    a, b = mean_of(a_files), mean_of(b_files)
    lines = [f"kernel us, mean of {len(a_files)} against {len(b_files)} files: flushed | hot"]
    for key in a:
        if key not in b:
            continue
        (fa, ha), (fb, hb) = a[key], b[key]
        lines.append(f"{key:40s} {fa:8.2f} -> {fb:8.2f} ({100 * (fb / fa - 1):+5.1f}%) | "
                     f"{ha:8.2f} -> {hb:8.2f} ({100 * (hb / ha - 1):+5.1f}%)")
    return lines


def time_cases(shapes, dtype_names, calls):
    """{case_key: {"flushed", "hot", "kernels"}} for every shape x dtype x parameters."""
    import torch
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.path.insert(0, root)
    import bench
    import solution

    flush = torch.empty(FLUSH_BYTES // 4, device="cuda")
    results = {}
    for shape, channels_last in shapes:
        for dtype_name in dtype_names:
            dtype = getattr(torch, dtype_name)
            x = bench.make_input(shape, dtype, channels_last) * 3 - 1  # values of either sign
            generator = torch.Generator(device="cuda").manual_seed(1)
            weight = torch.randn(shape[1], device="cuda", generator=generator) * 0.5 + 1
            bias = torch.randn(shape[1], device="cuda", generator=generator)
            choices = {"none": (None, None), "fp32": (weight, bias)}
            if dtype != torch.float32:
                choices["same"] = (weight.to(dtype), bias.to(dtype))
            for parameters, (w, b) in choices.items():
                def forward():
                    return solution.instance_norm(x, weight=w, bias=b)
                expected = torch.nn.functional.instance_norm(
                    x.double(), weight=None if w is None else w.double(), bias=None if b is None else b.double())
                error = (forward().double() - expected).abs().max().item()
                tolerance = 1e-4 if dtype == torch.float32 else 3e-2 * max(1.0, expected.abs().max().item())
                key = case_key(shape, channels_last, dtype_name, parameters)
                if not error <= tolerance:
                    raise SystemExit(f"kernel_times: {key} differs from float64 by {error:.3g} "
                                     f"(tolerance {tolerance:.3g}); no times written")
                flushed = bench.row_kernels(forward, flush, calls)
                hot = bench.kernels_beyond(bench.profiled_kernels(forward, calls), {}, calls)
                results[key] = {"flushed": sum(n * us for _, n, us in flushed),
                                "hot": sum(n * us for _, n, us in hot),
                                "kernels": [name for name, _, _ in flushed]}
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="JSON file the times are written to")
    parser.add_argument("--shape", action="append", help="N,C,*spatial[:cl]; repeatable (default: 5 small channels-last and 6 small contiguous shapes)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--calls", type=int, default=20, help="profiled calls per case and mode (default 20)")
    parser.add_argument("--compare", nargs=2, metavar=("A_FILES", "B_FILES"),
                        help="comma-separated JSON files of each side: print the table instead of timing")
    args = parser.parse_args(argv)
    if args.compare:
        a_files, b_files = (side.split(",") for side in args.compare)
        missing = [path for path in a_files + b_files if not os.path.isfile(path)]
        if missing:
            parser.error("--compare: no such file: " + ", ".join(missing))
        print("\n".join(compare(a_files, b_files)))
        return 0
    if not args.out:
        parser.error("OUT.json is required unless --compare is given")
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    dtype_names = args.dtypes.split(",")
    bad = [name for name in dtype_names if name not in ("float32", "float16", "bfloat16")]
    if bad:
        parser.error(f"--dtypes: expected float32, float16 or bfloat16, got {', '.join(bad)}")
    shapes = []
    for text in args.shape or DEFAULT_SHAPES:
        try:
            shapes.append(parse_shape(text))
        except ValueError as error:
            parser.error(str(error))
    import torch
    if not torch.cuda.is_available():
        print("kernel_times: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    results = time_cases(shapes, dtype_names, args.calls)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1)
    print(f"kernel_times: {len(results)} cases written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
