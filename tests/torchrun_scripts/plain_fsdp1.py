"""A plain torchrun training script: torch's own FullyShardedDataParallel on CPU ranks.

Run with ``torchrun --nproc-per-node 2 plain_fsdp1.py --steps 8 --save DIR``. It calls
``init_process_group`` and ``destroy_process_group`` without guards, as scripts do.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from save_state import save_state
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = FSDP(Net(), device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(100 + rank)  # each rank its own data
    for step in range(args.steps):
        x = torch.randn(8, 16)
        target = torch.randn(8, 4)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.5f}")
    if args.save:
        save_state(args.save, rank, model, optimizer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
