"""A small FSDP2 training job (torchrun, gloo, CPU) for the tests of attaching to a job.

    torchrun --nproc-per-node 2 [-m fsdp_interactive.attachable ...] attach_train.py \\
        --steps 12 [--step-sleep S] [--hold-at STEP --hold-rank R --release FILE] \\
        [--stop-file FILE] [--out FILE]

Each step: forward, backward, the loss summed over the ranks for the log (an
``all_reduce``, which also tells every rank whether one is done), ``optimizer.step()``,
``zero_grad()``. ``--hold-at``: in that step, rank ``--hold-rank`` waits before the
loss's ``all_reduce`` until the file ``--release`` exists (the other ranks wait inside
the ``all_reduce``): a hang the tests diagnose and end. ``--stop-file``: run until a rank
sees that file (every rank stops after the same step) instead of ``--steps``. ``--out``:
rank 0 saves every parameter's full tensor there at the end.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--hold-at", type=int, default=None)
    parser.add_argument("--hold-rank", type=int, default=1)
    parser.add_argument("--release", default=None)
    parser.add_argument("--stop-file", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(100 + rank)

    step, stopping = 0, False
    while not stopping:
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step + 1 == args.hold_at and rank == args.hold_rank:
            while not os.path.exists(args.release):
                time.sleep(0.05)
        # The log's all_reduce also carries whether a rank is done, so that every rank
        # stops after the same step (each one looking at the stop file for itself could
        # see it a step apart: then the ranks' last collectives differ).
        done = step + 1 >= args.steps if args.stop_file is None else os.path.exists(args.stop_file)
        logged = torch.stack([loss.detach(), torch.tensor(float(done))])
        dist.all_reduce(logged)
        stopping = bool(logged[1] > 0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        time.sleep(args.step_sleep)

    final = {name: param.full_tensor() for name, param in model.named_parameters()}
    if rank == 0 and args.out:
        torch.save(final, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
