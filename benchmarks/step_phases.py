"""Where a compiled CycleGAN training step spends its time, on a CUDA GPU.

    OUT=DIR python benchmarks/step_phases.py

For PyTorch's norms, ours and nn.Identity (benchmarks/nets.py's "pytorch", "ours" and
"identity" variants), the step of benchmarks/nets.py's compile mode (nets.make_step: bf16
autocast, torch.compile(mode="reduce-overhead"), SGD with momentum), its phases timed apart: the
host time of the forward call, of the loss and backward, and of the optimizer step,
then the wait for the GPU (the synchronize after them). Medians over 20 steps after 6
untimed ones, in ms; then torch.profiler's table (3 steps, CPU and CUDA) and its trace
as DIR/<variant>.json. A step whose host phases take the same time for every variant
and whose wait differs is host-bound, and its wait is the GPU work left after the host.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nets  # noqa: E402  (benchmarks/nets.py)

NET = "cyclegan"
VARIANTS = ("pytorch", "ours", "identity")


def phase_times_ms(step):
    """One step of nets.make_step's closure: host ms of [forward, loss + backward,
    optimizer, wait for the GPU]."""
    clock = [time.perf_counter()]
    step(clock)
    torch.cuda.synchronize()
    clock.append(time.perf_counter())
    return [1e3 * (b - a) for a, b in zip(clock, clock[1:])]


def main():
    if not torch.cuda.is_available():
        print("benchmarks/step_phases.py needs a CUDA GPU and none is visible.", file=sys.stderr)
        return 2
    out_dir = os.environ["OUT"]
    for variant in VARIANTS:
        step = nets.make_step(NET, variant, "compile")
        for _ in range(6):
            phase_times_ms(step)
        marks = [phase_times_ms(step) for _ in range(20)]
        median = [sorted(m[i] for m in marks)[10] for i in range(4)]
        print(f"{variant:9s} host ms: forward {median[0]:.3f} backward {median[1]:.3f} "
              f"optimizer {median[2]:.3f}; wait for GPU {median[3]:.3f}; step {sum(median):.3f}", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                phase_times_ms(step)
        prof.export_chrome_trace(f"{out_dir}/{variant}.json")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
