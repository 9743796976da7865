"""A small torchrun training script (tutorial 11): a causal language model that learns
sequences counting up by a stride, sharded with ``fully_shard``.

    torchrun --nproc-per-node 2 train_lm.py --steps 12
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class CountingLM(torch.nn.Module):
    def __init__(self, vocab=64, width=64, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids, targets):
        x = self.embed(ids)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def batch(step, rank, size=8, length=16, vocab=64):
    """This rank's batch of ``step``: sequences counting up from a random start."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    stride = torch.randint(1, 4, (size, 1), generator=generator)
    ids = (start + stride * torch.arange(length)) % vocab
    return ids[:, :-1], ids[:, 1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = CountingLM().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for step in range(1, args.steps + 1):
        inputs, targets = (t.to(device) for t in batch(step, rank))
        loss = model(inputs, targets)
        loss.backward()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.1f}")
        optimizer.step()
        optimizer.zero_grad()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
