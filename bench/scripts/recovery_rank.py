"""The training script that torchrun restarts in the ``recovery`` figure (``bench/recovery.py``).

Run as ``python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 1
recovery_rank.py``. Every rank builds GPT-2 from ``GPT2Config(**json(BENCH_GPT2_CONFIG))``
wrapped per ``GPT2Block`` with ``fsdp_interactive.fsdp.FullyShardedDataParallel`` and AdamW.

* First launch (``TORCHELASTIC_RESTART_COUNT`` 0): one training step, a disk checkpoint
  with ``fsdp_interactive.checkpoint.save`` under ``BENCH_CHECKPOINT_DIR``, a barrier; then
  rank 1 prints ``KILLED <unix time>`` and sends itself SIGKILL (the fault). The other
  ranks wait in a barrier, which fails once the launcher tears the group down.
* Relaunch: build, ``fsdp_interactive.checkpoint.load`` of the newest checkpoint, one
  training step; rank 0 then prints ``STEPPED <unix time>`` (training again at the
  checkpoint's state) and every rank exits 0.
"""

import json
import os
import signal
import time

import torch
import torch.distributed as dist


def build():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    config = GPT2Config(**json.loads(os.environ.get("BENCH_GPT2_CONFIG", "{}")))
    torch.manual_seed(0)
    model = FSDP(GPT2LMHeadModel(config), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optim, config.vocab_size


def train_step(model, optim, vocab: int, step: int) -> None:
    # The same batch shape as the pool's cells: one sequence of 32 tokens per rank.
    generator = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    tokens = torch.randint(0, vocab, (1, 32), generator=generator)
    model(tokens, labels=tokens).loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def init_group() -> None:
    """Join the group through a store prefixed by the restart count.

    torch 2.13's gloo reads its peers' addresses from the launcher's store under keys that
    do not change between restarts, so a relaunched rank may read a dead rank's address
    (``Gloo connectFullMesh failed ... Connection refused``); a prefix per restart keeps
    each launch's keys apart.
    """
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_store and int(os.environ["RANK"]) == 0,
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"restart-{restart}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def main() -> None:
    import fsdp_interactive.checkpoint as ck

    init_group()
    folder = os.environ["BENCH_CHECKPOINT_DIR"]
    model, optim, vocab = build()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        train_step(model, optim, vocab, 0)
        ck.save(os.path.join(folder, "step-1"), model, optim, step=1)
        dist.barrier()
        if dist.get_rank() == 1:
            print(f"KILLED {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # fails when the launcher tears the group down
        raise SystemExit(1)
    latest = ck.latest_checkpoint(folder)
    if latest is None:
        raise SystemExit(f"no checkpoint under {folder} to restart from")
    ck.load(latest.path, model, optim)
    if dist.get_rank() == 0:
        print(f"LOADED {time.time():.6f}", flush=True)
    train_step(model, optim, vocab, 1)
    if dist.get_rank() == 0:
        print(f"STEPPED {time.time():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
