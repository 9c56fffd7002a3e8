"""A DDP training run with this project's InstanceNorm2d, started by
tests/test_gpu_multi.py as `python -m torch.distributed.run --nproc_per_node 2
tests/ddp_step.py RESULT.json`.

Each rank trains a small conv net (affine norms with running statistics) under
DistributedDataParallel over NCCL on its half of one fixed batch for STEPS SGD steps.
Rank 0 then trains the same net in one process on the whole batch and writes to
RESULT.json the largest differences of the losses and the parameters. Instance
statistics are per sample, so the two runs must agree without any synchronization
of the norms: the gradients are DDP's average of per-half mean losses, which equals
the whole batch's mean loss.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import solution  # noqa: E402

STEPS = 3
BATCH = 8


def make_net(device):
    torch.manual_seed(40)
    norm = lambda c: solution.InstanceNorm2d(c, affine=True, track_running_stats=True)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), norm(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), norm(16), nn.ReLU(), nn.Conv2d(16, 3, 1)).to(device)


def train(model, x, target, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    generator = torch.Generator().manual_seed(41)
    x = torch.randn(BATCH, 3, 32, 32, generator=generator).to(device)
    target = torch.randn(BATCH, 3, 32, 32, generator=generator).to(device)
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ddp = nn.parallel.DistributedDataParallel(make_net(device), device_ids=[device.index])
    losses = train(ddp, x[shard], target[shard], STEPS)
    dist.all_reduce(losses)
    losses /= world
    if rank == 0:
        reference = make_net(device)
        reference_losses = train(reference, x, target, STEPS)
        parameter_error = max((a - b).abs().max().item()
                              for a, b in zip(ddp.module.parameters(), reference.parameters()))
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump({"loss_error": (losses - reference_losses).abs().max().item(),
                       "parameter_error": parameter_error, "losses": losses.tolist()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
