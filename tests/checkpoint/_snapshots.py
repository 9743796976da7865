"""Rank-side pieces of the snapshot tests (module-level, so they pickle into the ranks).

* :func:`place`: the snapshot folder and the (simulated) host of this rank;
* :func:`cell_namespace`: a namespace as a notebook cell's code sees it, holding a
  :class:`tests.models.TinyLM` wrapped per block with this package's
  ``FullyShardedDataParallel``, AdamW, a StepLR scheduler and a step counter;
* :func:`run_cell`: code executed in that namespace, as the engines run a cell;
* :func:`take` / :func:`restore_into_fresh_objects` / :func:`check_resharded`: a snapshot
  after some training, restored into objects built with other weights, compared;
* :func:`exact_state` / :func:`differences`: every value a snapshot promises to restore,
  gathered to full tensors with DTensor's own ``full_tensor`` (independent of the code
  under test), and the names of those that differ (``torch.equal``, not a tolerance).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import fsdp_interactive
from tests.models import VOCAB, Block, TinyLM

#: A cell that snapshots the namespace of :func:`cell_namespace`, and one that restores it.
SNAPSHOT = (
    "result = fsdp_interactive.snapshot("
    "model=model, optimizer=optim, step=counter.step, sched=sched, counter=counter)"
)
RESTORE = (
    "from fsdp_interactive.checkpoint import restore_snapshot\n"
    "result = restore_snapshot(snapshot_id, globals())"
)

ROOT_ENV = "FSDPI_SNAPSHOT_ROOT"
HOST_ENV = "FSDPI_SNAPSHOT_HOST"
KEY_ENV = "FSDPI_SNAPSHOT_KEY"
#: The snapshot key every rank of these tests holds, as a pool gives one key to all its
#: ranks (the simulated hosts' roots would otherwise each make their own).
TEST_KEY = "5e" * 32
WRAPPED = "_fsdp_wrapped_module."


def place(root: str, host: str | None = None) -> None:
    """Put this rank's snapshots under ``root``, on the simulated host ``host`` (``None``:
    the machine's host name), sealed with :data:`TEST_KEY`."""
    os.environ[ROOT_ENV] = str(root)
    os.environ[KEY_ENV] = TEST_KEY
    if host is None:
        os.environ.pop(HOST_ENV, None)
    else:
        os.environ[HOST_ENV] = host


def place_on_hosts(base: str, hosts: Sequence[str]) -> None:
    """Rank ``r`` on simulated host ``hosts[r]``, whose snapshot folder is ``base/<host>``."""
    host = hosts[dist.get_rank()]
    place(os.path.join(base, host), host)


class StepCounter:
    """A global stateful object (the same on every rank)."""

    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def cell_namespace(seed: int = 0, lr: float = 0.01) -> dict[str, Any]:
    """What the setup cells of a notebook define: ``model``, ``optim``, ``sched``,
    ``counter`` (and the package, as ``fsdp_interactive``)."""
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(seed)
    model = FSDP(TinyLM(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {
        "fsdp_interactive": fsdp_interactive,
        "model": model,
        "optim": optim,
        "sched": sched,
        "counter": StepCounter(),
    }


def train(ns: dict[str, Any], steps: int) -> None:
    """``steps`` AdamW steps with a scheduler step each; the counter counts them."""
    model, optim, sched, counter = ns["model"], ns["optim"], ns["sched"], ns["counter"]
    for _ in range(steps):
        gen = torch.Generator().manual_seed(100 * counter.step + dist.get_rank())
        tokens = torch.randint(0, VOCAB, (2, 7), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        sched.step()
        counter.step += 1


def seed_per_rank(seed: int) -> None:
    """Different random streams on every rank (torch, Python, NumPy)."""
    value = seed + 17 * dist.get_rank()
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def run_cell(ns: dict[str, Any], code: str) -> Any:
    """Execute ``code`` with ``ns`` as its globals (as an engine runs a cell); the value
    bound to ``result``."""
    exec(code, ns)
    return ns.get("result")


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def exact_state(ns: dict[str, Any]) -> dict[str, Any]:
    """Every restored value (collective: full tensors are gathered), flat by name."""
    model, optim = ns["model"], ns["optim"]
    out: dict[str, Any] = {}
    names = {}
    for name, param in nn.Module.named_parameters(model):
        clean = name.replace(WRAPPED, "")
        names[param] = clean
        out[f"param:{clean}"] = _full(param)
    for param, clean in names.items():
        for key, value in sorted(optim.state.get(param, {}).items()):
            out[f"optim:{clean}:{key}"] = _full(value)
    for index, group in enumerate(optim.param_groups):
        for key, value in group.items():
            if key != "params":
                out[f"group:{index}:{key}"] = value
    out["sched"] = ns["sched"].state_dict()
    out["counter"] = ns["counter"].state_dict()
    out["rng:torch"] = torch.get_rng_state()
    out["rng:python"] = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["rng:numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Names whose values differ (or exist on one side only)."""
    return sorted(k for k in expected.keys() | got.keys() if not _same(expected.get(k), got.get(k)))


def without_rng(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if not k.startswith("rng:")}


def _place_for(root: str, hosts: Sequence[str] | None) -> None:
    if hosts is None:
        place(root)
    else:
        place_on_hosts(root, hosts)


def take(root: str, hosts: Sequence[str] | None = None) -> tuple[dict[str, Any], Any]:
    """Three steps, per-rank random streams, then :data:`SNAPSHOT`: (the state at the
    snapshot, its record). ``hosts``: rank ``r`` on simulated host ``hosts[r]``."""
    _place_for(root, hosts)
    ns = cell_namespace(seed=0)
    train(ns, 3)
    seed_per_rank(5)
    expected = exact_state(ns)
    return expected, run_cell(ns, SNAPSHOT)


def restore_into_fresh_objects(
    root: str, snapshot_id: str, hosts: Sequence[str] | None = None
) -> dict[str, Any]:
    """The setup cells run again (other weights, another lr, one step, other random
    streams), then :data:`RESTORE`: the state and the report."""
    _place_for(root, hosts)
    ns = cell_namespace(seed=dist.get_world_size() + 40, lr=0.5)
    train(ns, 1)
    seed_per_rank(99)
    ns["snapshot_id"] = snapshot_id
    report = run_cell(ns, RESTORE)
    return {"state": exact_state(ns), "report": report}


def check_resharded(saved: list[tuple[dict, Any]], restored: list[dict[str, Any]]) -> None:
    """Every restored rank holds the saved global state exactly, and rank ``r`` the random
    streams saved rank ``r`` had."""
    expected_global = without_rng(saved[0][0])
    for rank, got in enumerate(restored):
        assert got["report"].resharded and got["report"].saved_world_size == len(saved)
        assert differences(expected_global, without_rng(got["state"])) == [], rank
        saved_rng = {k: v for k, v in saved[rank][0].items() if k.startswith("rng:")}
        got_rng = {k: v for k, v in got["state"].items() if k.startswith("rng:")}
        assert differences(saved_rng, got_rng) == [], rank
