"""Host and wall time per eager forward + backward call (torch.autograd.grad of the
module's output), ModelNew against nn.InstanceNorm2d, on small shapes where the host
side decides the speed of a training loop (docs/perf-notes.md #63, #64).

    python tools/host_time.py [--calls 200] [--frozen-affine]

--frozen-affine: both modules affine, with weight and bias frozen (requires_grad=False).

Host time: the loop's time before the final synchronize (what the Python side and the
launches cost per call); wall: after it. Needs a CUDA GPU.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = ((2, 1280, 16, 16), (2, 640, 32, 32), (2, 320, 128, 128))


def per_call_ms(module, x, dy, calls):
    """(host, wall) ms per call of autograd.grad(module(x), x, dy), after 10 warm-up calls."""
    for _ in range(10):
        torch.autograd.grad(module(x), x, dy)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(calls):
        torch.autograd.grad(module(x), x, dy)
    host = (time.perf_counter() - begin) / calls * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - begin) / calls * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per shape and module")
    parser.add_argument("--frozen-affine", action="store_true", help="affine modules with frozen weight and bias")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tools/host_time.py needs a CUDA GPU and none is visible.", file=sys.stderr)
        return 2
    import solution  # builds the extension on first use

    for shape in SHAPES:
        x = torch.randn(shape, device="cuda", requires_grad=True)
        dy = torch.randn(shape, device="cuda")
        modules = [solution.ModelNew(shape[1], affine=args.frozen_affine).cuda(),
                   torch.nn.InstanceNorm2d(shape[1], affine=args.frozen_affine).cuda()]
        for module in modules:
            module.requires_grad_(False)
        ours, eager = (per_call_ms(module, x, dy, args.calls) for module in modules)
        print(f"{shape}: ours host {ours[0]:.4f} wall {ours[1]:.4f} ms; "
              f"eager host {eager[0]:.4f} wall {eager[1]:.4f} ms")


if __name__ == "__main__":
    sys.exit(main())
