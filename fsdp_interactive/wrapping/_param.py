"""One original parameter of a model, as this rank holds it, whatever wraps the model.

Three ways a rank can hold an original parameter, one class each:

* :class:`ShardedParam`: a DTensor (``fully_shard``, this package's
  ``FullyShardedDataParallel``, any DTensor-parallel model): its local block;
* :class:`FlatShardParam`: a run of elements of torch FSDP1's ``FlatParameter`` (with
  ``use_orig_params`` False or True, any sharding strategy), read from the flat
  parameter's own bookkeeping;
* :class:`WholeParam`: a plain tensor every rank holds whole (DDP, plain modules, what
  FSDP ignores).

Each says which process groups split it (ranks of such a group hold different pieces),
how many ranks of the default group hold each piece, and gives this rank's piece of the
parameter and of its gradient, and the full tensor (a collective).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from fsdp_interactive._torch_compat import local_tensor
from fsdp_interactive.fsdp._comm_device import comm_device, gather_full


def world() -> tuple[int, int]:
    """(rank, world size) of the default group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@dataclass(frozen=True)
class Piece:
    """What this rank holds of one tensor (a parameter or its gradient).

    ``values``: the elements, detached, never a copy (empty when the rank holds none);
    ``offset``: the index of the first element in the full tensor, per dimension. ``flat``
    False: ``values`` is the block of its own shape at ``offset``; True: ``values`` is 1-D,
    ``values.numel()`` consecutive elements of the flattened (row-major) full tensor from
    ``offset`` on (torch FSDP1 stores the original parameters so).
    """

    values: torch.Tensor
    offset: tuple[int, ...]
    flat: bool


@dataclass(eq=False, repr=False)
class OriginalParam:
    """A parameter of the model as its author named it, and how this rank holds it.

    ``fqn``: the clean name (``torch.distributed.checkpoint.state_dict``'s); ``wrapped_name``:
    the name under the wrappers, as ``model.named_parameters()`` says it (for an original
    of a torch FSDP1 flat parameter: its name in the wrapped module tree, as FSDP1 with
    ``use_orig_params=True`` would register it). ``unit``: the clean name of the FSDP unit
    managing it (``""``: the root), ``None`` when none does. ``split_groups``: the groups
    along which ranks hold different pieces (empty: every rank holds all of it);
    ``copies``: how many ranks of the default group hold each piece. ``placements`` and
    ``mesh_shape`` describe the arrangement in DTensor's words (torch FSDP1's flat shards
    are ``FlatShard()``). ``tensor``: the registered parameter when it is this original
    parameter (``None`` for an original inside a flat parameter).
    """

    fqn: str
    wrapped_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    unit: str | None
    tensor: torch.Tensor | None
    split_groups: tuple[dist.ProcessGroup, ...] = field(default=(), init=False)
    copies: int = field(default=1, init=False)
    placements: tuple[str, ...] = field(default=(), init=False)
    mesh_shape: tuple[int, ...] = field(default=(), init=False)
    kind: ClassVar[str] = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fqn!r}, shape={self.shape}, unit={self.unit!r})"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def comm_device(self) -> torch.device:
        """Where collectives over :attr:`split_groups` take their tensors."""
        return comm_device(self.split_groups[0] if self.split_groups else None)

    def piece(self) -> Piece:
        """This rank's piece of the parameter (no communication)."""
        raise NotImplementedError

    def grad_piece(self) -> torch.Tensor | None:
        """This rank's piece of the gradient, laid out as :meth:`piece`'s values; ``None``
        when this rank has no gradient for it. ``RuntimeError`` when the gradient is not
        reduced to the piece (inside ``no_sync()``)."""
        raise NotImplementedError

    def stored_numel(self) -> int:
        """Elements this rank stores for the parameter (``fully_shard``'s padding included)."""
        return self.piece().values.numel()

    def full_tensor(self, to_cpu: bool = False) -> torch.Tensor:
        """The whole parameter, a new plain tensor (on the CPU with ``to_cpu``). A collective
        over :attr:`split_groups`: every rank of them calls it."""
        raise NotImplementedError


@dataclass(eq=False, repr=False)
class WholeParam(OriginalParam):
    """A plain tensor that every rank of the default group holds whole."""

    kind: ClassVar[str] = "whole"

    def __post_init__(self) -> None:
        self.copies = world()[1]
        self.placements = ("Replicate(world)",)
        self.mesh_shape = (self.copies,)

    def piece(self) -> Piece:
        assert self.tensor is not None
        return Piece(self.tensor.detach(), (0,) * len(self.shape), False)

    def grad_piece(self) -> torch.Tensor | None:
        assert self.tensor is not None
        grad = self.tensor.grad
        return None if grad is None else grad.detach()

    def full_tensor(self, to_cpu: bool = False) -> torch.Tensor:
        assert self.tensor is not None
        full = self.tensor.detach().clone()
        return full.cpu() if to_cpu else full


@dataclass(eq=False, repr=False)
class ShardedParam(OriginalParam):
    """A DTensor parameter: this rank holds its local block (``fully_shard`` pads it to
    ``padded_numel`` elements in storage)."""

    padded_numel: int | None = None
    kind: ClassVar[str] = "dtensor"

    def __post_init__(self) -> None:
        tensor = self.tensor
        assert isinstance(tensor, DTensor)
        facts = _mesh_facts(tensor.device_mesh, tuple(tensor.placements))
        self.split_groups, self.copies, self.placements, self.mesh_shape = facts

    @property
    def comm_device(self) -> torch.device:
        assert isinstance(self.tensor, DTensor)
        return comm_device(self.tensor.device_mesh)

    def piece(self) -> Piece:
        from fsdp_interactive._torch_compat import local_shape_and_offset

        tensor = self.tensor
        assert isinstance(tensor, DTensor)
        _, offset = local_shape_and_offset(self.shape, tensor.device_mesh, tensor.placements)
        return Piece(local_tensor(tensor).detach(), offset, False)

    def grad_piece(self) -> torch.Tensor | None:
        assert self.tensor is not None
        grad = self.tensor.grad
        return None if grad is None else local_tensor(grad).detach()

    def stored_numel(self) -> int:
        assert self.tensor is not None
        local = local_tensor(self.tensor).numel()
        return local if self.padded_numel is None else max(local, self.padded_numel)

    def full_tensor(self, to_cpu: bool = False) -> torch.Tensor:
        tensor = self.tensor
        assert isinstance(tensor, DTensor)
        home = local_tensor(tensor).device
        full = gather_full(tensor, to_cpu=to_cpu or home.type == "cpu")
        return full if to_cpu else full.to(home)


@functools.lru_cache(maxsize=256)
def _mesh_facts(
    mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[tuple[dist.ProcessGroup, ...], int, tuple[str, ...], tuple[int, ...]]:
    """(groups that split the tensor, ranks per piece: the sizes of the Replicate mesh
    dimensions, placements as text, mesh shape) of a DTensor on ``mesh``; models repeat
    the same few, so each is worked out once."""
    groups = tuple(mesh.get_group(dim) for dim, p in enumerate(placements) if not p.is_replicate())
    shape = tuple(int(s) for s in mesh.shape)
    copies = math.prod(size for size, p in zip(shape, placements, strict=True) if p.is_replicate())
    return groups, copies, tuple(repr(p) for p in placements), shape


@dataclass(frozen=True)
class FlatShard:
    """Where torch FSDP1 keeps one original parameter on this rank (from the flat
    parameter's bookkeeping): the FSDP1 module managing it, its flat parameter, this rank's
    shard of it, the piece's start
    in that shard and in the flattened original, its length, the registered original
    parameter (``use_orig_params=True``) or ``None``, the group the unit shards over (``None``
    under ``NO_SHARD``) and how many ranks hold each piece."""

    unit_module: nn.Module
    flat_param: nn.Parameter
    local_shard: torch.Tensor
    offset_in_shard: int
    start: int
    length: int
    original: nn.Parameter | None
    shard_group: dist.ProcessGroup | None
    replicas: int


@dataclass(eq=False, repr=False)
class FlatShardParam(OriginalParam):
    """An original parameter inside torch FSDP1's ``FlatParameter``: this rank holds a run
    of its flattened elements (possibly none), the same run as the other ranks of its
    replica group (``HYBRID_SHARD``), all of it under ``NO_SHARD``."""

    shard: FlatShard | None = None
    kind: ClassVar[str] = "fsdp1"

    def __post_init__(self) -> None:
        shard = self.shard
        assert shard is not None
        group = shard.shard_group
        self.split_groups = () if group is None else (group,)
        shard_size = 1 if group is None else dist.get_world_size(group)
        self.copies = shard.replicas
        flat_shard = ("FlatShard()",) if group is not None else ()
        replicated = ("Replicate()",) if shard.replicas > 1 else ()
        self.placements = replicated + flat_shard or ("Replicate()",)
        self.mesh_shape = tuple(
            size for size, on in ((shard.replicas, replicated), (shard_size, flat_shard)) if on
        ) or (1,)

    def piece(self) -> Piece:
        shard = self.shard
        values = shard.local_shard.detach()[
            shard.offset_in_shard : shard.offset_in_shard + shard.length
        ]
        return Piece(values, _unravel(shard.start if shard.length else 0, self.shape), True)

    def grad_piece(self) -> torch.Tensor | None:
        shard = self.shard
        if shard.original is not None:
            grad = shard.original.grad
            if grad is None:
                return None
            grad = grad.detach().reshape(-1)
        else:
            flat_grad = shard.flat_param.grad
            if flat_grad is None:
                return None
            if flat_grad.numel() != shard.local_shard.numel():
                raise RuntimeError(self._unreduced(flat_grad.numel()))
            grad = flat_grad.detach()[shard.offset_in_shard : shard.offset_in_shard + shard.length]
        if grad.numel() != shard.length:
            raise RuntimeError(self._unreduced(grad.numel()))
        return grad

    def _unreduced(self, numel: int) -> str:
        return (
            f"the gradient of {self.fqn!r} holds {numel} elements on this rank where torch "
            f"FSDP1 keeps {self.shard.length}: it is not reduced to the shard (inside "
            "no_sync(), or during backward); read gradient norms after the backward that "
            "synchronizes"
        )

    def full_tensor(self, to_cpu: bool = False) -> torch.Tensor:
        piece = self.piece().values
        if not self.split_groups:
            full = piece.clone().reshape(self.shape)
        else:
            full = gather_flat_pieces(
                piece, self.shard.start, self.numel, self.split_groups[0], self.comm_device
            ).reshape(self.shape)
            full = full.to(piece.device)
        return full.cpu() if to_cpu else full


def gather_flat_pieces(
    piece: torch.Tensor,
    start: int,
    numel: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor:
    """The flattened tensor of ``numel`` elements whose run ``[start, start + len(piece))``
    this rank holds, the other runs being held by the other ranks of ``group`` (a collective
    over ``group``, on ``device``). ``RuntimeError`` unless the runs cover the tensor once."""
    size = dist.get_world_size(group)
    extent = torch.tensor([start, piece.numel()], dtype=torch.int64, device=device)
    extents = [torch.empty_like(extent) for _ in range(size)]
    dist.all_gather(extents, extent, group=group)
    runs = [tuple(int(v) for v in e.tolist()) for e in extents]
    width = max(length for _, length in runs)
    sent = torch.zeros(width, dtype=piece.dtype, device=device)
    sent[: piece.numel()] = piece
    received = [torch.empty_like(sent) for _ in range(size)]
    dist.all_gather(received, sent, group=group)
    full = torch.empty(numel, dtype=piece.dtype, device=device)
    covered = torch.zeros(numel, dtype=torch.int32)
    for (begin, length), chunk in zip(runs, received, strict=True):
        full[begin : begin + length] = chunk[:length]
        covered[begin : begin + length] += 1
    if numel and not bool((covered == 1).all()):
        raise RuntimeError(
            f"the ranks' pieces {runs} do not cover the {numel} elements exactly once"
        )
    return full


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The per-dimension index of element ``index`` of a row-major tensor of ``shape``."""
    out = []
    for size in reversed(shape):
        out.append(index % size if size else 0)
        index = index // size if size else 0
    return tuple(reversed(out))
