"""Sharding strategy -> device mesh and ``reshard_after_forward`` for ``fully_shard``.

FSDP1 strategies map onto ``fully_shard`` like this:

================== ============================================ =======================
strategy           mesh                                         reshard_after_forward
================== ============================================ =======================
FULL_SHARD         1-D over ``process_group`` (default: world)  True
SHARD_GRAD_OP      1-D over ``process_group`` (default: world)  False
NO_SHARD           2-D ``(world, 1)`` named (replicate, shard)  True (a no-op: shard
                                                                size 1 holds full params)
HYBRID_SHARD       2-D ``(replicas, shard size)``               True
_HYBRID_SHARD_ZERO2 2-D ``(replicas, shard size)``              False
================== ============================================ =======================

``True`` here means "free after forward"; the unit config hands ``fully_shard`` ``None`` for
it, which frees every unit's parameters after forward except the root's (kept for the
backward that follows), FSDP1's own schedule.

Dimension 0 of a 2-D mesh replicates and dimension 1 shards (``fully_shard``'s HSDP layout,
which is also FSDP1's: intra-node shard group, inter-node replicate group). The hybrid mesh
comes from ``device_mesh`` when given, from a ``process_group=(intra, inter)`` tuple (built as
``(inter, intra)``), or from the world size and the ``LOCAL_WORLD_SIZE`` environment variable
(one replica per node; without the variable the whole world is one shard group). Every rank
must have the same ``LOCAL_WORLD_SIZE``, dividing the world size: hosts with different
numbers of ranks get a ``ValueError`` on every rank that names the hosts and what to pass
instead.

NO_SHARD uses a shard dimension of size one because ``fully_shard`` rejects ``Replicate()``
placements: each rank keeps whole parameters and gradients are all-reduced across dim 0.

Meshes built here over the default group are made once per (device type, shape) and
default group, so wrapping many units, or many models in one long-lived process, creates
each sub-group once.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp.api import ShardingStrategy

from fsdp_interactive._background_groups import once_per_default_group
from fsdp_interactive._torch_compat import HYBRID_SHARD_ZERO2

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, HYBRID_SHARD_ZERO2)
MESH_DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class ShardingLayout:
    """What one FSDP unit hands to ``fully_shard``: the mesh and the reshard flag."""

    strategy: ShardingStrategy
    mesh: DeviceMesh
    reshard_after_forward: bool

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The group a parameter is sharded over (size 1 for NO_SHARD)."""
        return self.mesh.get_group(self.mesh.ndim - 1)


def _world_mesh(device_type: str, shape: tuple[int, ...]) -> DeviceMesh:
    """A mesh over the default group, created once per (device type, shape)."""
    names = ("shard",) if len(shape) == 1 else MESH_DIM_NAMES
    return once_per_default_group(
        ("fsdp-mesh", device_type, shape),
        lambda: init_device_mesh(device_type, shape, mesh_dim_names=names),
    )


def _mesh_from_group_pair(
    device_type: str, intra: dist.ProcessGroup, inter: dist.ProcessGroup
) -> DeviceMesh:
    """A (replicate, shard) mesh from FSDP1's ``(intra_node, inter_node)`` group pair.

    Collective over the default group: every rank tells the others its coordinates.
    """
    coords = (dist.get_rank(inter), dist.get_rank(intra), dist.get_rank())
    gathered: list[tuple[int, int, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, coords)
    rows, cols = dist.get_world_size(inter), dist.get_world_size(intra)
    layout = [[-1] * cols for _ in range(rows)]
    for item in gathered:
        assert item is not None
        row, col, rank = item
        layout[row][col] = rank
    if any(rank < 0 for row in layout for rank in row):
        raise ValueError(
            "process_group=(intra, inter) must tile the default group: the intra-node groups "
            f"(size {cols}) times the inter-node groups (size {rows}) must cover all "
            f"{dist.get_world_size()} ranks exactly once"
        )
    return DeviceMesh.from_group(
        [inter, intra],
        device_type,
        mesh=torch.tensor(layout, dtype=torch.int),
        mesh_dim_names=MESH_DIM_NAMES,
    )


def _ranks_text(ranks: list[int]) -> str:
    """``"rank 2"``, ``"ranks 0-1"``, ``"ranks 0, 3"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def describe_hosts(layout: list[tuple[str, str | None]]) -> str:
    """``"hosta: 2 ranks (ranks 0-1, LOCAL_WORLD_SIZE=2); hostb: 1 rank (rank 2, ...)"``
    from every rank's ``(host, LOCAL_WORLD_SIZE)`` in rank order."""
    by_host: dict[str, dict[str | None, list[int]]] = {}
    for rank, (host, local) in enumerate(layout):
        by_host.setdefault(host, {}).setdefault(local, []).append(rank)
    parts = []
    for host, by_local in by_host.items():
        count = sum(len(ranks) for ranks in by_local.values())
        detail = "; ".join(
            f"{_ranks_text(ranks)}, LOCAL_WORLD_SIZE={'unset' if local is None else local}"
            for local, ranks in by_local.items()
        )
        parts.append(f"{host}: {count} rank{'s' if count != 1 else ''} ({detail})")
    return "; ".join(parts)


def _host_layout() -> list[tuple[str, str | None]]:
    """Every rank's ``(host name, LOCAL_WORLD_SIZE)``, in rank order (collective over the
    default group)."""
    gathered: list[tuple[str, str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (socket.gethostname(), os.environ.get("LOCAL_WORLD_SIZE")))
    return [item for item in gathered if item is not None]


def _hybrid_shape(strategy: ShardingStrategy) -> tuple[int, int]:
    """``(replicas, shard size)`` of the default hybrid mesh: one replica per host of
    ``LOCAL_WORLD_SIZE`` ranks (the whole world when no rank sets it).

    Collective: every rank checks the same gathered layout, so a layout that cannot make
    the mesh fails on every rank with the same ``ValueError`` instead of leaving some
    ranks waiting for the others in the mesh's collectives. A shape that passed is kept
    per default group and ``LOCAL_WORLD_SIZE`` value, so wrapping many units gathers once;
    an error keeps nothing, so every rank gathers again after the variable is fixed
    (changing it on some ranks only, after a shape was built, is not supported: those
    ranks would gather alone).
    """
    return once_per_default_group(
        ("fsdp-hybrid-shape", os.environ.get("LOCAL_WORLD_SIZE")),
        lambda: _checked_hybrid_shape(strategy),
    )


def _checked_hybrid_shape(strategy: ShardingStrategy) -> tuple[int, int]:
    world = dist.get_world_size()
    layout = _host_layout()
    values = {local for _, local in layout}
    remedy = (
        "pass device_mesh=init_device_mesh(device_type, (replicas, shard_size), "
        "mesh_dim_names=('replicate', 'shard')) with the shape you want, or "
        "sharding_strategy=ShardingStrategy.FULL_SHARD to shard over all ranks"
    )
    if len(values) > 1:
        raise ValueError(
            f"{strategy.name} needs the same number of ranks on every host: its default mesh "
            "has one replica per host, LOCAL_WORLD_SIZE ranks each, and LOCAL_WORLD_SIZE must "
            f"be the same on every rank and divide the world size {world}; this job has "
            f"{describe_hosts(layout)}. To shard anyway, {remedy}"
        )
    (raw,) = values
    if raw is None:
        return 1, world
    try:
        local = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {raw!r}") from None
    if local < 1 or world % local:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local} must be a positive divisor of the world size {world} "
            f"to build a {strategy.name} mesh (one replica per host, LOCAL_WORLD_SIZE ranks "
            f"each); this job has {describe_hosts(layout)}. To shard anyway, {remedy}"
        )
    return world // local, local


def _ranks_sharded_over(
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | None,
) -> int:
    """How many ranks the unit's mesh spans (no communication)."""
    if device_mesh is not None:
        return device_mesh.size()
    if isinstance(process_group, tuple):
        return dist.get_world_size(process_group[0]) * dist.get_world_size(process_group[1])
    return dist.get_world_size(process_group)


def resolve_layout(
    strategy: ShardingStrategy,
    device_type: str,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | None,
) -> ShardingLayout:
    """Build the mesh for ``strategy`` (arguments already type-checked).

    Over a single rank every strategy becomes ``NO_SHARD``, with FSDP1's ``UserWarning``
    (they do the same there). FSDP1 also switches a hybrid strategy whose shard group has
    one rank while several replicas exist, and then never reduces across the replicas;
    here such a mesh stays hybrid (each rank holds whole parameters, gradients are averaged
    over the replicas).
    """
    if (
        strategy != ShardingStrategy.NO_SHARD
        and _ranks_sharded_over(process_group, device_mesh) == 1
    ):
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
            UserWarning,
            stacklevel=4,
        )
        if strategy in HYBRID_STRATEGIES:
            # A (1, 1) (replicate, shard) mesh: the layout NO_SHARD has over one rank.
            hybrid = _resolve_layout(strategy, device_type, process_group, device_mesh)
            return ShardingLayout(ShardingStrategy.NO_SHARD, hybrid.mesh, True)
        strategy = ShardingStrategy.NO_SHARD
    return _resolve_layout(strategy, device_type, process_group, device_mesh)


def _resolve_layout(
    strategy: ShardingStrategy,
    device_type: str,
    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None,
    device_mesh: DeviceMesh | None,
) -> ShardingLayout:
    reshard = strategy in (
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy.NO_SHARD,
    )
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        want = 2 if hybrid else 1
        if strategy == ShardingStrategy.NO_SHARD:
            if device_mesh.ndim != 1:
                raise ValueError(
                    f"device_mesh must be 1-D for NO_SHARD, got a {device_mesh.ndim}-D mesh"
                )
            mesh = DeviceMesh.from_group(
                [device_mesh.get_group(0), _singleton_group()],
                device_mesh.device_type,
                mesh=device_mesh.mesh.reshape(-1, 1),
                mesh_dim_names=MESH_DIM_NAMES,
            )
            return ShardingLayout(strategy, mesh, reshard)
        if device_mesh.ndim != want:
            raise ValueError(
                f"device_mesh must be {want}-D for {strategy.name} "
                f"({'dim 0 replicates, dim 1 shards' if hybrid else 'the shard group'}), "
                f"got a {device_mesh.ndim}-D mesh"
            )
        if hybrid and device_mesh.mesh_dim_names is None:
            raise ValueError(
                f"device_mesh for {strategy.name} needs mesh_dim_names, e.g. "
                "init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
            )
        return ShardingLayout(strategy, device_mesh, reshard)

    if hybrid:
        if isinstance(process_group, tuple):
            intra, inter = process_group
            return ShardingLayout(
                strategy, _mesh_from_group_pair(device_type, intra, inter), reshard
            )
        if process_group is not None:
            raise ValueError(
                f"process_group for {strategy.name} must be an (intra_node, inter_node) tuple of "
                f"process groups or None, got a single {type(process_group).__name__}"
            )
        mesh = _world_mesh(device_type, _hybrid_shape(strategy))
        return ShardingLayout(strategy, mesh, reshard)

    if isinstance(process_group, tuple):
        raise ValueError(
            f"process_group may be an (intra_node, inter_node) tuple only for hybrid strategies, "
            f"not {strategy.name}"
        )
    group = process_group
    if group is None or group == dist.group.WORLD:
        world = dist.get_world_size()
        if strategy == ShardingStrategy.NO_SHARD:
            return ShardingLayout(strategy, _world_mesh(device_type, (world, 1)), reshard)
        return ShardingLayout(strategy, _world_mesh(device_type, (world,)), reshard)
    flat = DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))
    if strategy == ShardingStrategy.NO_SHARD:
        mesh = DeviceMesh.from_group(
            [group, _singleton_group()],
            device_type,
            mesh=flat.mesh.reshape(-1, 1),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        return ShardingLayout(strategy, mesh, reshard)
    return ShardingLayout(strategy, flat, reshard)


def _singleton_group() -> dist.ProcessGroup:
    """This rank's one-member group (the shard dim of a NO_SHARD mesh over a sub-group).

    ``new_subgroups`` is collective over the *default* group, so every rank of the job must
    build such a unit; the group is created once per default group and reused.
    """
    return once_per_default_group(
        "fsdp-one-rank-group", lambda: dist.new_subgroups(group_size=1)[0]
    )
