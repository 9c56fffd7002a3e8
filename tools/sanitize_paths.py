"""Run every forward path once on small shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_paths.py

Shapes cover full and partly filled clusters, a 16-CTA cluster, odd sizes and a
misaligned view, in float32 and bfloat16, with a per-channel weight. Exits 1 if any output is wrong (so a tool run also checks results)."""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import solution  # noqa: E402

SHAPES = [(1, 2, 512, 512), (1, 3, 300, 300), (2, 2, 33, 31), (1, 2, 724, 724)]


def main():
    torch.manual_seed(0)
    failures = 0
    for shape, dtype in itertools.product(SHAPES, (torch.float32, torch.bfloat16)):
        x = torch.randn(shape, device="cuda").to(dtype)
        weight = torch.randn(shape[1], device="cuda")
        reference = torch.nn.functional.instance_norm(x.double(), weight=weight.double()).to(dtype)
        tolerance = 1e-4 if dtype == torch.float32 else 5e-2
        for path in (1, 2):
            if not solution._EXT.path_supported(x, path):
                continue
            out = solution._EXT.forward(x, weight=weight, path=path)
            ok = torch.allclose(out, reference, atol=tolerance, rtol=tolerance)
            failures += not ok
            print(f"shape {shape} {dtype} path {path}: {'ok' if ok else 'WRONG'}")
    misaligned = torch.randn(2 * 3 * 64 * 64 + 1, device="cuda")[1:].view(2, 3, 64, 64)
    ok = torch.allclose(solution.ModelNew(3)(misaligned),
                        torch.nn.functional.instance_norm(misaligned.double()).float(), atol=1e-4, rtol=1e-4)
    failures += not ok
    print(f"misaligned view: {'ok' if ok else 'WRONG'}")
    torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
