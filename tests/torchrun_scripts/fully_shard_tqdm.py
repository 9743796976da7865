"""A torchrun training script with ``fully_shard`` (FSDP2) on a CPU mesh and a tqdm bar.

Run with ``torchrun --nproc-per-node 2 fully_shard_tqdm.py --steps 8 --save DIR``.
"""

import argparse
import os

import torch
import torch.distributed as dist
from save_state import save_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm


def build_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8)
    )
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(rank)
    for step in tqdm(range(args.steps), disable=rank != 0, desc="train"):  # noqa: B007
        x = torch.randn(4, 16)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if args.save:
        save_state(args.save, rank, model, optimizer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
