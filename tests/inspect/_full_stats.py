"""What the summon-statistics tests compare with and record (shared by the CPU and CUDA tests).

* :func:`full_tensor_stats`: the statistics of whole tensors in one process, as the probe
  computed them before it worked on shards; :func:`assert_equal_stats` compares.
* :func:`recorded_collectives`: the all-gathers a probe issues (device, size, group size),
  and a refusal of any full-tensor gather.
* :func:`poisoned_model`: uneven shapes with NaN and Inf; :data:`CASES` its names.
* :func:`stats_of_kept_and_offloaded_shards`: the check of CUDA ranks (shards on the GPU,
  offloaded by ``fully_shard`` and by the wrapper), which gloo ranks run as a dry run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from torch import nn

NAN, INF = math.nan, math.inf


def full_tensor_stats(tensors: list[torch.Tensor], bins: int) -> dict:
    """The statistics of ``tensors`` taken together, from the whole tensors in one process."""
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    finite = flat[torch.isfinite(flat)]
    out = {
        "numel": flat.numel(),
        "nan_count": int(flat.isnan().sum()),
        "inf_count": int(flat.isinf().sum()),
    }
    if not finite.numel():
        return {**out, "min": NAN, "max": NAN, "mean": NAN, "std": NAN, "norm": NAN,
                "hist_counts": (0,) * bins, "hist_edges": (0.0,) * (bins + 1)}  # fmt: skip
    lo, hi = float(finite.min()), float(finite.max())
    top = hi if hi > lo else lo + 1.0
    return {
        **out,
        "min": lo,
        "max": hi,
        "mean": float(finite.mean()),
        "std": float(finite.std()) if finite.numel() > 1 else 0.0,
        "norm": float(torch.linalg.vector_norm(finite)),
        "hist_counts": tuple(int(c) for c in torch.histc(finite, bins, lo, top).tolist()),
        "hist_edges": tuple(torch.linspace(lo, top, bins + 1).tolist()),
    }


def assert_equal_stats(stats, reference: dict, scale: float) -> None:
    """Exact where the result is exact, float64 rounding (relative to ``scale``) elsewhere."""
    label = stats.fqn
    for key in ("numel", "nan_count", "inf_count", "hist_counts", "hist_edges"):
        assert getattr(stats, key) == reference[key], (label, key)
    for key in ("min", "max"):
        got, want = getattr(stats, key), reference[key]
        assert got == want or (math.isnan(got) and math.isnan(want)), (label, key, got, want)
    for key in ("mean", "std", "norm"):
        got, want = getattr(stats, key), reference[key]
        if math.isnan(want):
            assert math.isnan(got), (label, key, got)
        else:
            assert got == pytest.approx(want, rel=1e-12, abs=1e-13 * scale), (label, key, got)


@contextlib.contextmanager
def recorded_collectives() -> Iterator[list[SimpleNamespace]]:
    """Record every all_gather (device, numel, group size); refuse full-tensor gathers."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    calls: list[SimpleNamespace] = []
    real_all_gather, real_full_tensor = dist.all_gather, DTensor.full_tensor

    def all_gather(outputs, tensor, group=None, async_op=False):
        calls.append(
            SimpleNamespace(
                device=tensor.device,
                numel=tensor.numel(),
                group_size=dist.get_world_size(group),
                output_devices={t.device for t in outputs},
            )
        )
        return real_all_gather(outputs, tensor, group=group, async_op=async_op)

    def full_tensor(self, *args, **kwargs):
        raise AssertionError("summon_stats gathered a full tensor")

    dist.all_gather, DTensor.full_tensor = all_gather, full_tensor
    try:
        yield calls
    finally:
        dist.all_gather, DTensor.full_tensor = real_all_gather, real_full_tensor


@contextlib.contextmanager
def chunk_size(elements: int) -> Iterator[None]:
    """Let the probe convert ``elements`` at a time, so that small tensors span chunks."""
    from fsdp_interactive.inspect import _shard_stats

    real = _shard_stats._CHUNK
    _shard_stats._CHUNK = elements
    try:
        yield
    finally:
        _shard_stats._CHUNK = real


class Uneven(nn.Module):
    """Shapes that 2 ranks do not divide evenly (and one that leaves rank 1 empty)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 3)  # 6 + 5 rows
        self.proj = nn.Linear(3, 5)  # 3 + 2 rows; bias 3 + 2
        self.gain = nn.Parameter(torch.randn(1, 4))  # 1 + 0 rows
        self.dead = nn.Parameter(torch.full((3, 2), NAN))  # no finite value


def poisoned_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = Uneven().to(dtype)
    with torch.no_grad():
        model.embed.weight[1, 2] = NAN
        model.embed.weight[7, 0] = INF
        model.embed.weight[9, 1] = -INF
        model.proj.weight[4, 1] = NAN  # on rank 1
        model.proj.bias[0] = 7.0  # an outlier: the range comes from one rank
    return model


CASES = ("embed.weight", "proj.weight", "proj.bias", "gain", "dead", "proj", "")


def members(model: nn.Module, fqn: str) -> list[torch.Tensor]:
    """The parameter ``fqn``, or those of module ``fqn``, in ``named_parameters`` order."""
    return [
        p for n, p in model.named_parameters() if not fqn or n == fqn or n.startswith(f"{fqn}.")
    ]


def stats_of_kept_and_offloaded_shards() -> dict[str, int]:
    """summon_stats and edit_param on shards kept on the mesh's device and offloaded to the
    CPU, by ``fully_shard``'s policy and by the wrapper's ``CPUOffload``; every rank of the
    default group calls it. On NCCL ranks the mesh is CUDA; on gloo ranks (a dry run of the
    same code) everything is on the CPU. Raises on a wrong value; returns the number of
    all-gathers per case."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from fsdp_interactive.fsdp import CPUOffload
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp._comm_device import gather_full
    from fsdp_interactive.inspect import edit_param, summon_stats

    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    out = {}
    for label in ("kept", "offloaded", "wrapper offloaded"):
        reference = poisoned_model(torch.float32)
        if label == "wrapper offloaded":
            model = FSDP(
                copy.deepcopy(reference),
                device_id=device if nccl else None,
                cpu_offload=CPUOffload(offload_params=True),
                use_orig_params=True,
            )
        else:
            model = copy.deepcopy(reference).to(device)
            offload = {"offload_policy": CPUOffloadPolicy(pin_memory=nccl)}
            fully_shard(model, mesh=mesh, **(offload if label == "offloaded" else {}))
        shard_device = model.embed.weight.to_local().device
        assert shard_device.type == (device.type if label == "kept" else "cpu"), label
        # The reference runs where the probe's data is (CUDA's histc on the GPU).
        reference.to(shard_device)
        with recorded_collectives() as calls:
            for fqn in CASES:
                stats = summon_stats(model, fqn, bins=7)
                assert_equal_stats(stats, full_tensor_stats(members(reference, fqn), 7), 8.0)
        assert calls and all(c.device == device and c.numel <= 8 for c in calls), (label, calls)
        before = members(reference, "proj.weight")[0].detach().cpu()
        edit_param(model, "proj.weight", "x * 2")
        weight = model.proj.weight
        doubled = gather_full(weight, to_cpu=True)
        assert torch.allclose(doubled, before * 2, rtol=0, atol=0, equal_nan=True), label
        assert weight.to_local().device == shard_device, label  # the shard stays where it was
        out[label] = len(calls)
    return out
