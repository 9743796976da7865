"""Plain CPU copies of values bound for the notebook kernel (rank side, before pickling).

The notebook kernel never creates a CUDA context, and a kernel host may have no GPU at
all; a CUDA tensor that reaches it creates one when unpickled (or fails to). Whatever a
rank sends to the kernel goes through :func:`cpu_copy` on the rank first.

:func:`cpu_copy` returns a deep copy of a value in which every tensor is a plain
``torch.Tensor`` on the CPU:

* Containers looked into, nested to any depth: lists, tuples (namedtuples and other tuple
  subclasses keep their type), dicts (keys too; subclasses keep their type), dataclass
  instances (each field; the instance is copied with ``copy.copy`` and its fields
  replaced, frozen ones included), sets and frozensets. A container is rebuilt only when it
  holds a tensor somewhere; otherwise it comes back as it is.
* A tensor becomes a detached CPU copy that shares no memory with it (also when it is on
  the CPU already). A tensor subclass becomes a plain ``torch.Tensor``: ``nn.Parameter``
  and subclasses with storage of their own through their data, wrapper subclasses through
  what their ``.to("cpu")`` returns, which must then be a plain tensor or one with storage
  (``TypeError`` naming where otherwise). One tensor reached twice is copied once, so tied
  tensors stay tied.
* A ``DTensor`` becomes this rank's local shard, with no communication: the copy runs on
  whichever ranks a call reaches, which need not be all ranks of the DTensor's mesh. To
  get the whole tensor instead, pass ``dtensor=`` (``fsdp_interactive.inspect.plain_copy``
  gathers, a collective); such a function is called once per DTensor in the value's
  order, which is the same on every rank, and a DTensor inside a set (an order that
  differs between processes) is then refused with ``TypeError``.
* A ``meta`` tensor has no data to copy: ``ValueError`` naming where. A module is refused
  (``TypeError``): send its ``state_dict()`` or a parameter; with ``cpu_modules=True`` a
  module whose parameters and buffers are all on the CPU comes back as it is.
* Everything else comes back as it is, not looked into. A non-CPU tensor held in such an
  object (an attribute of an instance of another class) is not moved but refused
  (``TypeError``): the value is pickled once, bytes discarded, by a pickler that refuses
  it. Containers that contain themselves are not supported (``RecursionError``).

``copy_cpu=False`` leaves plain CPU tensors as they are (for a value pickled right after,
which copies anyway). This module imports nothing of the package (a leaf, layer 0): the
pool's rank side (what ``Pool.call`` and ``Pool.pull`` return) and the rank-side probes
both use it.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

CPU = torch.device("cpu")

#: What to do with a DTensor instead of taking its local shard: a tensor on any device.
DTensorHook = Callable[[DTensor], torch.Tensor]


def cpu_copy(
    value: Any,
    *,
    dtensor: DTensorHook | None = None,
    name: str = "value",
    copy_cpu: bool = True,
    cpu_modules: bool = False,
) -> Any:
    """A copy of ``value`` in which every tensor is a plain CPU tensor (module docstring).

    ``dtensor``: called with each DTensor (default: take its local shard); its result is
    copied like any tensor. ``name``: how errors refer to ``value``. ``copy_cpu=False``:
    plain CPU tensors are not copied. ``cpu_modules``: modules held wholly on the CPU are
    let through.
    """
    if dtensor is not None:
        # Before anything is copied (``dtensor`` may communicate): every rank fails alike.
        where = _dtensor_in_set(value, name, in_set=False)
        if where is not None:
            raise TypeError(
                f"{where} is a DTensor inside a set: a set's order differs between "
                "processes, so the ranks cannot gather its DTensors in step; use a list"
            )
    copier = _Copier(dtensor, copy_cpu=copy_cpu, cpu_modules=cpu_modules)
    result = copier.copy(value, name)
    if _opaque_in(result):
        _refuse_hidden_device_tensors(result, name)
    return result


def tensors_in(value: Any, name: str = "value") -> Iterator[tuple[str, torch.Tensor]]:
    """``(where, tensor)`` for every tensor :func:`cpu_copy` would copy, in its order (a
    tensor reached twice is listed twice)."""
    if isinstance(value, torch.Tensor):
        yield name, value
        return
    for where, item in _children(value, name):
        yield from tensors_in(item, where)


def _children(value: Any, name: str) -> list[tuple[str, Any]]:
    """The values ``value`` holds that :func:`cpu_copy` looks into, with where they are."""
    if isinstance(value, dict):
        out = []
        for i, (key, item) in enumerate(value.items()):
            out.append((f"{name}<key {i}>", key))
            out.append((f"{name}[{key!r}]", item))
        return out
    if isinstance(value, list | tuple):
        return [(f"{name}[{i}]", item) for i, item in enumerate(value)]
    if isinstance(value, set | frozenset):
        return [(f"{name}{{item {i}}}", item) for i, item in enumerate(value)]
    if _is_dataclass_instance(value):
        return [(f"{name}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    return []


def _dtensor_in_set(value: Any, name: str, *, in_set: bool) -> str | None:
    if isinstance(value, DTensor):
        return name if in_set else None
    inside = in_set or isinstance(value, set | frozenset)
    for where, item in _children(value, name):
        found = _dtensor_in_set(item, where, in_set=inside)
        if found is not None:
            return found
    return None


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


class _Copier:
    def __init__(self, dtensor: DTensorHook | None, *, copy_cpu: bool, cpu_modules: bool):
        self.dtensor = dtensor
        self.copy_cpu = copy_cpu
        self.cpu_modules = cpu_modules
        self.copies: dict[int, torch.Tensor] = {}
        self.keep_alive: list[torch.Tensor] = []  # ids in ``copies`` stay valid

    def copy(self, value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value, where)
        if isinstance(value, nn.Module):
            return self.module(value, where)
        if not _holds_tensor(value):
            return value
        if isinstance(value, dict):
            items = [
                (
                    self.copy(key, f"{where}<key {i}>"),
                    self.copy(item, f"{where}[{key!r}]"),
                )
                for i, (key, item) in enumerate(value.items())
            ]
            if type(value) is dict:
                return dict(items)
            rebuilt = copy.copy(value)
            rebuilt.clear()
            rebuilt.update(items)
            return rebuilt
        if isinstance(value, list):
            items = [self.copy(v, f"{where}[{i}]") for i, v in enumerate(value)]
            if type(value) is list:
                return items
            rebuilt = copy.copy(value)
            rebuilt[:] = items
            return rebuilt
        if isinstance(value, tuple):
            items = [self.copy(v, f"{where}[{i}]") for i, v in enumerate(value)]
            if type(value) is tuple:
                return tuple(items)
            if hasattr(value, "_fields"):
                return type(value)(*items)
            return type(value)(items)
        if isinstance(value, set | frozenset):
            items = [self.copy(v, f"{where}{{item {i}}}") for i, v in enumerate(value)]
            return type(value)(items)
        if _is_dataclass_instance(value):
            rebuilt = copy.copy(value)
            for field in dataclasses.fields(value):
                item = self.copy(getattr(value, field.name), f"{where}.{field.name}")
                object.__setattr__(rebuilt, field.name, item)
            return rebuilt
        return value

    def tensor(self, value: torch.Tensor, where: str) -> torch.Tensor:
        done = self.copies.get(id(value))
        if done is not None:
            return done
        source = value
        if isinstance(value, DTensor):
            value = value.detach().to_local() if self.dtensor is None else self.dtensor(value)
        if value.device.type == "meta":
            raise ValueError(f"{where} is a tensor on the meta device: it has no data to copy")
        if not self.copy_cpu and type(value) is torch.Tensor and value.device == CPU:
            self.copies[id(source)] = value
            self.keep_alive.append(source)
            return value
        with torch.no_grad():
            out = value.detach().to(CPU, copy=True)
        if type(out) is not torch.Tensor:
            out = _as_plain(out, where)
        self.copies[id(source)] = out
        self.keep_alive.append(source)
        return out

    def module(self, module: nn.Module, where: str) -> nn.Module:
        if not self.cpu_modules:
            raise TypeError(
                f"{where} is a module ({type(module).__name__}); send one of its parameters "
                "or its state_dict() instead"
            )
        for kind, items in (
            ("parameter", module.named_parameters()),
            ("buffer", module.named_buffers()),
        ):
            for name, tensor in items:
                if tensor.device != CPU:
                    raise TypeError(
                        f"{where} is a module whose {kind} {name} is on {tensor.device}: send "
                        "its state_dict() (or the tensors you need) instead of the module"
                    )
        return module


def _as_plain(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """A plain ``torch.Tensor`` for a CPU tensor of a subclass with storage of its own."""
    try:
        tensor.untyped_storage().data_ptr()
    except RuntimeError:
        raise TypeError(
            f"{where} is a {type(tensor).__name__} (a tensor subclass) whose CPU copy is "
            "still one, without storage of its own; convert it to a plain tensor first"
        ) from None
    return tensor.as_subclass(torch.Tensor)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor | nn.Module):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(k) or _holds_tensor(v) for k, v in value.items())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_holds_tensor(item) for item in value)
    if _is_dataclass_instance(value):
        return any(_holds_tensor(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False


#: Values :func:`cpu_copy` knows hold no tensor it did not look at.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, range, slice)


def _opaque_in(value: Any) -> bool:
    """Whether ``value`` holds an object :func:`cpu_copy` does not look into (one that
    might hide a tensor), after copying: tensors, modules and atoms are transparent."""
    if isinstance(value, (*_ATOMS, torch.Tensor, nn.Module, torch.dtype, torch.device)):
        return False
    if type(value).__module__.split(".")[0] == "numpy":
        return False
    children = _children(value, "")
    if children:
        return any(_opaque_in(item) for _, item in children)
    return not isinstance(value, dict | list | tuple | set | frozenset) and not (
        _is_dataclass_instance(value)
    )


class HiddenDeviceTensor(TypeError):
    """A non-CPU tensor inside an object :func:`cpu_copy` does not look into."""


def _refuse_hidden_device_tensors(value: Any, name: str) -> None:
    """Pickle ``value`` once (bytes discarded) with a pickler that refuses any non-CPU
    tensor: the check for objects :func:`cpu_copy` does not look into."""

    class _Checker(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                raise HiddenDeviceTensor(
                    f"{name} holds a tensor on {obj.device} inside an object of a class that "
                    "is not looked into (only lists, tuples, dicts, sets and dataclasses "
                    "are): move it to the CPU (t.cpu()) first"
                )
            return NotImplemented

    try:
        _Checker(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except HiddenDeviceTensor:
        raise
    except Exception:  # not picklable at all: whoever pickles it next says so
        return


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)
