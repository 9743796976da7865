"""A small FSDP training script, for the script-run figure: every rank joins the group
(unguarded, as scripts do), builds a model with torch's FSDP on the CPU and trains; right
after the first optimizer step rank 0 prints ``FIRST_STEP <unix time>``. The same file
runs under torchrun and with ``%fsdp run``."""

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = FSDP(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)),
        device_id=torch.device("cpu"),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        model(torch.randn(16, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and dist.get_rank() == 0:
            print(f"FIRST_STEP {time.time():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
