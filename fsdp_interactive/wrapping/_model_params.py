"""``model_params(model)``: every original parameter of a wrapped model (rank side)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from fsdp_interactive._text import did_you_mean, first_few
from fsdp_interactive._torch_compat import (
    FlatParameter,
    is_fsdp1_managed,
    local_tensor,
    padded_shard_numels,
)
from fsdp_interactive.wrapping._fsdp1 import Fsdp1Index, Fsdp1Original, index_fsdp1
from fsdp_interactive.wrapping._param import (
    FlatShardParam,
    OriginalParam,
    ShardedParam,
    WholeParam,
    world,
)
from fsdp_interactive.wrapping._path_cleaner import (
    PathCleaner,
    peel,
    registered_parameters,
    wrapped_inner,
)
from fsdp_interactive.wrapping._refusal import (
    FOREIGN_PARTITION_MARKS,
    UnsupportedWrapping,
    overriding_class,
    owner_class,
)

logger = logging.getLogger(__name__)


class UnknownName(KeyError):
    """A name that is neither a parameter nor a module of the model (a ``KeyError``), its
    message naming the close matches; shown without ``KeyError``'s quotes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ModelParams(Mapping[str, OriginalParam]):
    """The original parameters of a model by clean FQN, in ``named_parameters()`` order.

    Built by :func:`model_params`; a snapshot of where the parameters are, not of their
    values (each :class:`OriginalParam` reads the live tensors when asked). ``wrappers``
    names the wrapper classes found, outermost first.
    """

    def __init__(
        self,
        cleaner: PathCleaner,
        prefix: str,
        params: list[OriginalParam],
        wrappers: tuple[str, ...],
    ):
        self._cleaner = cleaner
        self._prefix = prefix
        self._params = {p.fqn: p for p in params}
        self._wrapped = {p.wrapped_name: p.fqn for p in params}
        self.wrappers = wrappers

    def __getitem__(self, fqn: str) -> OriginalParam:
        return self._params[fqn]

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def resolve(self, name: str) -> str:
        """The clean FQN of the parameter called ``name``, clean or wrapped;
        :class:`UnknownName` (a ``KeyError``) naming close matches when there is none."""
        if name in self._params:
            return name
        if name in self._wrapped:
            return self._wrapped[name]
        raise UnknownName(self._unknown(name))

    def select(self, name: str) -> list[OriginalParam]:
        """The parameter called ``name``, or every parameter of the module called ``name``
        (``""``: the whole model), by clean or wrapped name, in order; :class:`UnknownName`
        naming close matches when there is neither."""
        if name in self._params or name in self._wrapped:
            return [self._params[self.resolve(name)]]
        prefix = self._module_prefix(name)
        chosen = (
            [] if prefix is None else [p for f, p in self._params.items() if f.startswith(prefix)]
        )
        if not chosen:
            raise UnknownName(self._unknown(name))
        return chosen

    def clean_name(self, name: str) -> str:
        """The clean FQN of the parameter or module called ``name`` (clean or wrapped)."""
        if name in self._params or name in self._wrapped:
            return self.resolve(name)
        self.select(name)
        prefix = self._module_prefix(name)
        return prefix[:-1] if prefix else ""

    def is_parameter(self, name: str) -> bool:
        """Whether ``name`` (clean or wrapped) names a parameter rather than a module."""
        return name in self._params or name in self._wrapped

    def _module_prefix(self, name: str) -> str | None:
        """``"clean.path."`` of the module called ``name`` (clean or wrapped), ``""`` for the
        root, ``None`` when no module has that name."""
        if not name:
            return ""
        if any(fqn.startswith(f"{name}.") for fqn in self._params):
            return f"{name}."
        path = name.removeprefix(self._prefix)
        try:
            clean = self._cleaner.clean(path)
        except AttributeError:
            return None
        return f"{clean}." if clean else ""

    def _unknown(self, name: str) -> str:
        text = f"no parameter or module named {name!r} in the model"
        modules = {fqn.rsplit(".", depth)[0] for fqn in self._params for depth in (1, 2)}
        hint = did_you_mean(name, [*self._params, *sorted(modules), *self._wrapped])
        if hint:
            return f"{text}; {hint}"
        return f"{text}; parameter names look like: {first_few(list(self._params), 4, ', ')}"

    def local_bytes(self) -> tuple[int, int]:
        """(parameter bytes, gradient bytes) this rank stores: shards with their padding
        (torch FSDP1's flat shards whole), plain tensors whole."""
        param_bytes = grad_bytes = 0
        flat_params: dict[int, FlatShardParam] = {}
        for p in self._params.values():
            if isinstance(p, FlatShardParam):
                flat_params.setdefault(id(p.shard.flat_param), p)
                continue
            param_bytes += p.stored_numel() * p.element_size
            grad = p.grad_piece()
            if grad is not None:
                grad_bytes += grad.numel() * grad.element_size()
        for p in flat_params.values():
            shard = p.shard.local_shard
            param_bytes += shard.numel() * shard.element_size()
            # Under use_orig_params the originals' gradients are views of the flat one.
            grad = p.shard.flat_param.grad
            if grad is not None:
                grad_bytes += grad.numel() * grad.element_size()
        return param_bytes, grad_bytes


def model_params(model: nn.Module) -> ModelParams:
    """Every original parameter of ``model``, however it is wrapped (no communication).

    Understands ``fully_shard`` and this package's ``FullyShardedDataParallel`` (DTensor
    parameters), torch's FSDP1 (flat parameters, ``use_orig_params`` False or True, every
    sharding strategy), DDP, ``torch.compile``, activation-checkpoint wrappers and
    Lightning's wrappers, nested in any order, and plain modules. Raises
    :class:`UnsupportedWrapping` naming the class that holds parameters in a way it does not
    understand (see :mod:`fsdp_interactive.wrapping._refusal`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    root, prefix, outer = peel(model)
    modules = list(root.named_modules())
    _check_data_parallel_groups(modules)
    cleaner = PathCleaner(root)
    fsdp1 = index_fsdp1(modules, cleaner)
    padded = padded_shard_numels(root)
    registered = {id(p): path for path, p in registered_parameters(root)}
    units = dtensor_units(modules, registered, cleaner)
    params: list[OriginalParam] = []
    seen: set[int] = set()
    for name, tensor in root.named_parameters():
        path = registered.get(id(tensor))
        if path is None:
            raise _renamed(root, name, "is not registered in any module")
        seen.add(id(tensor))
        params += _originals(cleaner, root, prefix, name, path, tensor, fsdp1, padded, units)
    hidden = [path for key, path in registered.items() if key not in seen]
    if hidden:
        raise _renamed(root, hidden[0], "is registered but not listed by named_parameters()")
    _check_views(root, modules, params, registered)
    inner = (type(m).__name__ for _, m in modules if wrapped_inner(m) is not None)
    result = ModelParams(cleaner, prefix, params, tuple(dict.fromkeys([*outer, *inner])))
    logger.debug(
        "model_params(%s): %d parameters, wrapped by %s",
        type(model).__name__,
        len(result),
        ", ".join(result.wrappers) or "nothing",
    )
    return result


def _originals(
    cleaner: PathCleaner,
    root: nn.Module,
    prefix: str,
    name: str,
    path: str,
    tensor: torch.Tensor,
    fsdp1: Fsdp1Index,
    padded: dict[int, int],
    units: dict[int, str],
) -> list[OriginalParam]:
    """The original parameters the registered ``tensor`` (``name`` by ``named_parameters``,
    registered at ``path``) stands for: one, or each of a flat parameter's."""
    if isinstance(tensor, FlatParameter):
        entries = fsdp1.by_flat_param.get(id(tensor))
        if entries is None or name != path:
            raise UnsupportedWrapping(
                owner_class(root, path),
                f"{name!r} is a torch FSDP1 flat parameter that no FSDP1 module of the model "
                "manages",
            )
        return [_flat_original(prefix, e, tensor.requires_grad) for e in entries]
    clean = _clean_name(cleaner, root, name, path)
    entry = fsdp1.by_original.get(id(tensor))
    if entry is not None:
        if entry.clean_name != clean:
            raise _renamed(root, name, f"is {entry.clean_name!r} in torch FSDP1's bookkeeping")
        return [_flat_original(prefix, entry, tensor.requires_grad)]
    common = (
        clean,
        prefix + name,
        tuple(int(s) for s in tensor.shape),
        tensor.dtype,
        tensor.requires_grad,
    )
    if isinstance(tensor, DTensor):
        partial = [p for p in tensor.placements if p.is_partial()]
        if partial:
            raise UnsupportedWrapping(
                owner_class(root, path),
                f"{name!r} is a DTensor with the placement {partial[0]} (pending reduction)",
            )
        return [
            ShardedParam(
                *common, units.get(id(tensor)), tensor, padded_numel=padded.get(id(tensor))
            )
        ]
    _check_plain(root, name, path, tensor)
    return [WholeParam(*common, None, tensor)]


def _flat_original(prefix: str, entry: Fsdp1Original, requires_grad: bool) -> FlatShardParam:
    return FlatShardParam(
        entry.clean_name,
        prefix + entry.wrapped_name,
        entry.shape,
        entry.shard.local_shard.dtype,
        requires_grad,
        entry.unit,
        entry.shard.original,
        shard=entry.shard,
    )


def _clean_name(cleaner: PathCleaner, root: nn.Module, name: str, path: str) -> str:
    """The clean name of the parameter ``named_parameters()`` calls ``name``, which must be
    the clean form of the path where it is registered."""
    try:
        clean = cleaner.clean(path)
        # named_parameters() names it where it is registered, or by that clean name (this
        # package's wrapper), or by another path that cleans to the same name.
        same = name in (path, clean) or cleaner.clean(name) == clean
    except AttributeError:
        same = False
    if not same:
        raise _renamed(root, name, f"is registered at {path!r}")
    return clean


def _renamed(root: nn.Module, name: str, what: str) -> UnsupportedWrapping:
    return UnsupportedWrapping(
        overriding_class(root),
        f"its named_parameters() does not name the parameters where they are registered: "
        f"{name!r} {what}",
    )


def _check_plain(root: nn.Module, name: str, path: str, tensor: torch.Tensor) -> None:
    """Refuse a parameter held whole that is not a plain tensor, or that a framework marks
    as its own piece of something larger."""
    if type(tensor) not in (nn.Parameter, torch.Tensor):
        raise UnsupportedWrapping(
            owner_class(root, path),
            f"{name!r} is a {type(tensor).__name__}, a tensor class the adapter does not read",
        )
    if is_fsdp1_managed(tensor):
        raise UnsupportedWrapping(
            owner_class(root, path),
            f"{name!r} is marked as flattened by torch FSDP1, but no FSDP1 module of the "
            "model manages it",
        )
    for mark, meaning in FOREIGN_PARTITION_MARKS.items():
        if getattr(tensor, mark, None) is not None:
            raise UnsupportedWrapping(owner_class(root, path), f"{name!r}: {meaning}")


def _check_data_parallel_groups(modules: list[tuple[str, nn.Module]]) -> None:
    """Refuse DDP over part of the default group: its replicas are counted over all of it."""
    world_size = world()[1]
    for _, module in modules:
        if isinstance(module, DistributedDataParallel) and world_size > 1:
            size = dist.get_world_size(module.process_group)
            if size != world_size:
                raise UnsupportedWrapping(
                    type(module).__name__,
                    f"it replicates over {size} of the {world_size} ranks of the default group",
                )


#: What ``nn.Module.__init__`` puts in every module's ``__dict__`` (never a tensor).
_MODULE_STATE = frozenset(vars(nn.Module()))


def _check_views(
    root: nn.Module,
    modules: list[tuple[str, nn.Module]],
    params: list[OriginalParam],
    paths: dict[int, str],
) -> None:
    """Refuse plain tensor attributes that view a registered parameter's storage
    (``paths``: id(parameter) -> where it is registered)."""
    storages: dict[int, OriginalParam] = {}
    for p in params:
        if p.tensor is None or isinstance(p, FlatShardParam):
            continue
        local = local_tensor(p.tensor)
        if local.numel() and local.device.type != "meta":
            storages[local.untyped_storage().data_ptr()] = p
    if not storages:
        return
    for module_path, module in modules:
        for attribute, value in vars(module).items():
            if attribute in _MODULE_STATE or not isinstance(value, torch.Tensor):
                continue
            if isinstance(value, nn.Parameter):
                continue
            if not value.numel() or value.device.type == "meta":
                continue
            viewed = storages.get(value.untyped_storage().data_ptr())
            if viewed is not None:
                where = f"{module_path}.{attribute}" if module_path else attribute
                raise UnsupportedWrapping(
                    owner_class(root, paths[id(viewed.tensor)]),
                    f"its parameter {viewed.fqn!r} is viewed by the plain tensor attribute "
                    f"{where!r} of {type(module).__name__}, a flattened-parameter scheme",
                )


def dtensor_units(
    modules: list[tuple[str, nn.Module]], registered: dict[int, str], cleaner: PathCleaner
) -> dict[int, str]:
    """id(parameter) -> clean FQN of the FSDP unit managing it (``""``: the root), for the
    parameters registered at ``registered``'s paths.

    A unit is a module ``fully_shard`` was applied to; it manages the parameters below it
    that no nested unit manages, so each parameter goes to its nearest unit above it (by
    the path where it is registered). Only DTensor parameters are given to units: plain
    tensors (ignored ones) and torch FSDP1's are left out here.
    """
    unit_paths = {path for path, m in modules if isinstance(m, FSDPModule)}
    if not unit_paths:
        return {}
    owner: dict[int, str] = {}
    for key, path in registered.items():
        above = path
        while above:
            above = above.rpartition(".")[0]
            if above in unit_paths:
                owner[key] = cleaner.clean(above)
                break
    return owner
