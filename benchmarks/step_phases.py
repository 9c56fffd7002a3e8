"""Where a compiled CycleGAN training step spends its time, on a CUDA GPU.

    OUT=DIR python benchmarks/step_phases.py [--in-turn [--settle N]]

For PyTorch's norms, ours and nn.Identity (benchmarks/nets.py's "pytorch", "ours" and
"identity" variants), the step of benchmarks/nets.py's compile mode (nets.make_step: bf16
autocast, torch.compile(mode="reduce-overhead"), SGD with momentum), its phases timed apart: the
host time of the forward call, of the loss and backward, and of the optimizer step,
then the wait for the GPU (the synchronize after them). Medians over 20 steps after 6
untimed ones, in ms; then torch.profiler's table (3 steps, CPU and CUDA) and its trace
as DIR/<variant>.json. A step whose host phases take the same time for every variant
and whose wait differs is host-bound, and its wait is the GPU work left after the host.

With --in-turn the variants run as benchmarks/nets.py times them: all compiled first,
then 20 turns of one step of each in turn (so CUDA graph trees switch between models
at every step); the phases are printed per variant and one profile of 3 turns is
written as DIR/in_turn.json. --settle N runs N untimed steps of a variant right before
each of its timed steps in a turn, as nets.py --settle N does.
"""
import argparse
import os
import statistics
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


def medians(marks):
    """Per-phase medians (ms) of a list of phase_times_ms results."""
    return [statistics.median(m[i] for m in marks) for i in range(4)]


def print_phases(variant, median):
    print(f"{variant:9s} host ms: forward {median[0]:.3f} backward {median[1]:.3f} "
          f"optimizer {median[2]:.3f}; wait for GPU {median[3]:.3f}; step {sum(median):.3f}", flush=True)


def profiled(run, path):
    """Runs run() under torch.profiler (CPU and CUDA), writes its trace to path and
    prints its table."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)


def each_alone(out_dir):
    for variant in VARIANTS:
        step = nets.make_step(NET, variant, "compile")
        for _ in range(6):
            phase_times_ms(step)
        print_phases(variant, medians([phase_times_ms(step) for _ in range(20)]))
        profiled(lambda: [phase_times_ms(step) for _ in range(3)], f"{out_dir}/{variant}.json")
        torch._dynamo.reset()


def in_turn(out_dir, settle):
    steps = {variant: nets.make_step(NET, variant, "compile") for variant in nets.VARIANTS}
    for step in steps.values():
        for _ in range(6):
            phase_times_ms(step)

    def turn(marks):
        for variant, step in steps.items():
            for _ in range(settle):
                phase_times_ms(step)
            marks[variant].append(phase_times_ms(step))

    marks = {variant: [] for variant in steps}
    for _ in range(20):
        turn(marks)
    print(f"settle {settle}")
    for variant in steps:
        print_phases(variant, medians(marks[variant]))
    profiled(lambda: [turn({variant: [] for variant in steps}) for _ in range(3)], f"{out_dir}/in_turn.json")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-turn", action="store_true", help="run the variants in turn, as nets.py times them")
    parser.add_argument("--settle", type=int, default=0, help="with --in-turn: untimed steps of a variant right "
                        "before each of its timed steps (as nets.py --settle)")
    args = parser.parse_args()
    if args.settle and not args.in_turn:
        parser.error("--settle needs --in-turn")
    if not torch.cuda.is_available():
        print("benchmarks/step_phases.py needs a CUDA GPU and none is visible.", file=sys.stderr)
        return 2
    if args.in_turn:
        in_turn(os.environ["OUT"], args.settle)
    else:
        each_alone(os.environ["OUT"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
