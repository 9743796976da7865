"""Cells the recovery tests run on a real pool: a small sharded model with AdamW, training
steps that snapshot, and exact fingerprints of each rank's state to compare across a
recovery.

The fingerprint hashes every rank's local shards, optimizer state and CPU random state as
bytes, so two fingerprints are equal only when the state is bit-for-bit the same. Before
each snapshot, every rank writes its fingerprint to a file (a rank killed later in the same
call has already recorded it); ``train`` can kill a rank with SIGKILL at a chosen step and
phase (``forward``, ``backward``, ``step``, ``snapshot``: just before it, ``writing``: while
a background snapshot is written).
"""

from __future__ import annotations

import ast

import pytest

from fsdp_interactive.pool import RankDied

#: A cell that SIGKILLs rank 1.
KILL_RANK_1 = "import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"

SETUP = """
import torch
from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy
from fsdp_interactive.examples import TinyTransformer, TransformerBlock, synthetic_batch
torch.manual_seed(0)
model = FSDP(TinyTransformer(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
"""

HELPERS = """
import hashlib, os, signal
import fsdp_interactive

def fingerprint():
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        local = param.to_local() if hasattr(param, "to_local") else param
        digest.update(name.encode())
        digest.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for name, param in sorted(model.named_parameters()):
        state = optim.state.get(param, {})
        digest.update(name.encode())
        for key in sorted(state):
            value = state[key]
            value = value.to_local() if hasattr(value, "to_local") else value
            digest.update(key.encode())
            digest.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(torch.get_rng_state().numpy().tobytes())
    return digest.hexdigest()

def die_at(kill, where):
    if kill is not None and tuple(kill) == (rank, *where):
        os.kill(os.getpid(), signal.SIGKILL)

def train(first, steps, every, kill=None, background=False):
    for step in range(first, first + steps):
        die_at(kill, (step, "forward"))
        x, y = synthetic_batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        die_at(kill, (step, "backward"))
        loss.backward()
        die_at(kill, (step, "step"))
        optim.step()
        optim.zero_grad()
        if (step + 1) % every == 0:
            with open(os.path.join(TRUTH, f"{step + 1}-{rank}"), "w") as record:
                record.write(fingerprint())
            die_at(kill, (step, "snapshot"))
            handle = fsdp_interactive.snapshot(
                model=model, optimizer=optim, step=step + 1, background=background
            )
            die_at(kill, (step, "writing"))
            if background:
                handle.wait()
    return first + steps
"""


def fingerprints(pool) -> dict[int, str]:
    """Each rank's fingerprint of its current state."""
    results = pool.run("fingerprint()", stream=False, journal=False).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


def helpers(truth: str) -> str:
    """The helper cell, recording fingerprints under the folder ``truth``."""
    return f"TRUTH = {truth!r}\n" + HELPERS


def taken_at(truth, step: int, world_size: int) -> dict[int, str]:
    """Each rank's fingerprint, recorded just before the snapshot of ``step`` was taken."""
    return {rank: (truth / f"{step}-{rank}").read_text() for rank in range(world_size)}


def values(pool, expression: str) -> dict[int, object]:
    """Each rank's value of ``expression`` (a Python literal), not journaled."""
    results = pool.run(expression, stream=False, journal=False).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


def kill_rank_1(pool, cell: int) -> None:
    """Run :data:`KILL_RANK_1` as notebook cell ``cell``; it raises ``RankDied``."""
    with pytest.raises(RankDied):
        pool.run(KILL_RANK_1, cell=cell, stream=False)
