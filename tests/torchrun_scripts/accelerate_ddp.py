"""A torchrun training script with an accelerate ``Accelerator`` loop on CPU ranks.

Run with ``torchrun --nproc-per-node 2 accelerate_ddp.py --steps 6 --save DIR``.
"""

import argparse

import torch
from accelerate import Accelerator
from save_state import save_state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    features = torch.randn(96, 12, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(2))
    dataset = torch.utils.data.TensorDataset(features, labels)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            accelerator.print(f"step {step}: loss {loss.item():.5f}")
            if step == args.steps:
                break
    if args.save:
        save_state(args.save, accelerator.process_index, accelerator.unwrap_model(model), optimizer)
    accelerator.end_training()


if __name__ == "__main__":
    main()
