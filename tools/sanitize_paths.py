"""Run every forward and backward path once on small shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_paths.py

Shapes cover the warp path, the block path (CTAs of 128 threads, also for 640 fp32
slices of 16 KB, chosen from 4 slices per SM; 512; 256 for the misaligned view; 45 x
45 slices start at every alignment; one CTA per SM on 210 x 210 fp32 slices of 172 KB
and 300 x 300 and 301 x 301 bf16 ones of 176-177 KB; channels-last 24-channel tiles,
the last partial in bf16, CTAs of 128, 256 (24 x 24) and 512 threads), full and partly
filled clusters, a 16-CTA cluster, odd sizes, more slices than resident teams (150 of
25,600 values: the backward's resident teams go round twice with 6-13 dy vectors per
thread; the pipelined path's teams take 3 rounds, 10 on 1,200 slices of 1,024 values
and 12 with two CTAs a team on 792 slices of 16,400, more than its totals rotate
through; the channels-last cluster path's clusters take 96 images of 8 channels several
each, copying the next image's chunk while they write the current one), the split path
(contiguous and channels-last), eval with running statistics,
the running-statistics update and a misaligned view, in float32 and bfloat16, with a
per-channel weight; and the block paths' reflection-padded kernels (PAD_CASES: 1D and
2D, asymmetric pads, a 3-row slice whose middle row both pads reflect, 128-thread
and 512-thread backward CTAs, the latter with 64 KB of padded gradient in shared
memory, padded slices at every offset within 16 bytes, padded rows narrower than a
16-bit vector, which only the backward's kernel takes; the forward also with a
residual of the padded shape), checked against F.pad of the reference and the
generic path's gradient.
The block path's extra M2 sweep runs on the slices whose first value lies over 2
standard deviations from their mean, about 5% of these random ones. Exits 1 if any
output is wrong (so a tool run also checks results), 2 without a GPU."""
import itertools
import os
import sys

import torch

if {"-h", "--help"} & set(sys.argv[1:]):
    print(__doc__)
    sys.exit(0)
if not torch.cuda.is_available():  # exit status 2, as check.py and bench.py without a GPU
    print("sanitize_paths: needs a CUDA GPU (torch sees none)", file=sys.stderr)
    sys.exit(2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import solution  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from reference import BACKWARD_BLOCK, BACKWARD_GENERIC, BLOCK, PIPELINED, channels_last, float64_reference  # noqa: E402

SHAPES = [(1, 2, 512, 512), (1, 3, 300, 300), (2, 2, 33, 31), (2, 3, 45, 45), (2, 2, 128, 128), (1, 2, 301, 301),
          (1, 2, 724, 724), (3, 5, 7, 7), (1, 2, 1030, 1030), (3, 50, 160, 160),
          (1, 2, 210, 210), (2, 24, 20, 20), (1, 24, 24, 24), (1, 24, 48, 48), (4, 300, 32, 32), (2, 320, 64, 64),
          (96, 8, 24, 24)]


PAD_CASES = [((4, 8, 64, 64), (1, 1, 1, 1)), ((2, 3, 36, 50), (2, 0, 3, 1)), ((1, 2, 3, 520), (2, 2, 2, 2)),
             ((2, 4, 2048), (5, 3)), ((1, 2, 128, 128), (3, 3, 1, 1)), ((2, 3, 33, 40), (1, 2, 1, 1)),
             ((2, 3, 40, 3), (1, 1, 1, 1))]


def close(out, reference, dtype):
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return torch.allclose(out.double(), reference, atol=tolerance, rtol=tolerance)


def main():
    torch.manual_seed(0)
    failures = 0
    for shape, dtype, layout in itertools.product(SHAPES, (torch.float32, torch.bfloat16), ("contiguous", "cl")):
        x = torch.randn(shape, device="cuda").to(dtype)
        if layout == "cl":
            x = channels_last(x)
        weight = torch.randn(shape[1], device="cuda")
        reference = float64_reference(x, weight)
        for path in range(1, solution._EXT.num_forward_paths):
            if not solution._EXT.path_supported(x, path):
                continue
            y, stats = solution._EXT.forward_with_stats(x, weight=weight, path=path)
            ok = close(y, reference, dtype)
            dy = torch.randn_like(x)
            # Every backward path against the generic one (a different algorithm).
            dx_generic = solution._EXT.backward(dy, x, stats, weight, BACKWARD_GENERIC)[0].double()
            scale = dx_generic.abs().max().item()
            for backward_path in range(BACKWARD_GENERIC + 1, solution._EXT.num_backward_paths):
                if solution._EXT.backward_path_supported(x, backward_path):
                    dx = solution._EXT.backward(dy, x, stats, weight, backward_path)[0].double()
                    ok = ok and (dx - dx_generic).abs().max().item() <= (1e-4 if dtype == torch.float32 else 2e-2) * scale
            failures += not ok
            print(f"shape {shape} {dtype} {layout} path {path} (+ backward): {'ok' if ok else 'WRONG'}")
        running = [torch.randn(shape[1], device="cuda"), torch.rand(shape[1], device="cuda") + 0.5]
        eval_out = solution.instance_norm(x, *running, weight=weight, use_input_stats=False)
        ok = close(eval_out, float64_reference(x, weight, running_mean=running[0], running_var=running[1]), dtype)
        solution.instance_norm(x, *running, weight=weight)
        failures += not ok
        print(f"shape {shape} {dtype} {layout} eval + running update: {'ok' if ok else 'WRONG'}")
    # The pipelined path's multi-CTA teams over more rounds than its totals rotate
    # through (kTotalRounds = 8): 16,400 fp32 values give teams of two CTAs (the second
    # holds 16 values), 12 or more rounds on any GPU of up to 132 SMs.
    x = torch.randn(1, 792, 100, 164, device="cuda")
    if solution._EXT.path_supported(x, PIPELINED):
        ok = close(solution._EXT.forward(x, path=PIPELINED), float64_reference(x), torch.float32)
        failures += not ok
        print(f"pipelined, 2-CTA teams, 12+ rounds: {'ok' if ok else 'WRONG'}")
    for (shape, pad), dtype in itertools.product(PAD_CASES, (torch.float32, torch.bfloat16)):
        x, weight = torch.randn(shape, device="cuda").to(dtype), torch.randn(shape[1], device="cuda")
        y, stats = solution._EXT.forward_with_stats(x, weight=weight, path=BLOCK, activation="relu", reflection_pad=pad)
        ok = close(y, F.pad(float64_reference(x, weight).relu(), pad, mode="reflect"), dtype)
        dy = torch.randn_like(y)
        dx = solution._EXT.backward(dy, x, stats, weight, BACKWARD_BLOCK, activation="relu", reflection_pad=pad)[0]
        dx_generic = solution._EXT.backward(dy, x, stats, weight, BACKWARD_GENERIC, activation="relu",
                                            reflection_pad=pad)[0].double()
        scale = dx_generic.abs().max().item()
        ok = ok and (dx.double() - dx_generic).abs().max().item() <= (1e-4 if dtype == torch.float32 else 2e-2) * scale
        failures += not ok
        print(f"reflection pad {pad} of {shape} {dtype}, block paths: {'ok' if ok else 'WRONG'}")
        # A residual of the padded shape, added after the pad (no activation).
        residual = torch.randn(y.shape, device="cuda").to(dtype)
        y = solution._EXT.forward(x, weight=weight, path=BLOCK, residual=residual, reflection_pad=pad)
        ok = close(y, F.pad(float64_reference(x, weight), pad, mode="reflect") + residual.double(), dtype)
        failures += not ok
        print(f"reflection pad {pad} of {shape} {dtype} + padded residual, block path: {'ok' if ok else 'WRONG'}")
    misaligned = torch.randn(2 * 3 * 64 * 64 + 1, device="cuda")[1:].view(2, 3, 64, 64)
    ok = close(solution.ModelNew(3)(misaligned), float64_reference(misaligned), torch.float32)
    failures += not ok
    print(f"misaligned view: {'ok' if ok else 'WRONG'}")
    torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
