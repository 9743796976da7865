"""Stand-ins for CUDA on machines without a GPU: what the CPU tests of the device logic use.

* :class:`OnDevice` -- a tensor that reports a CUDA device but keeps its data on the CPU.
  It can be detached and copied to the CPU (``.to("cpu")``, ``.cpu()``: a plain CPU
  tensor); any other operation raises, so code that does anything else with a "device"
  tensor fails the test that hands it one.
* :func:`comm_device_is_meta` -- every communication device the package asks for
  (:mod:`fsdp_interactive.fsdp._comm_device`) is ``meta`` for a while, and the groups asked
  about are recorded; with :func:`stop_at_meta_collectives` the first collective handed a
  meta tensor stops the code under test with :class:`ReachedCollective`, which says which
  collective it was. So a test sees the device a collective is given where CUDA would be.
* :func:`tensors_pickled` -- the (type, device) of every tensor in a value's whole object
  graph, as pickling it for the notebook kernel meets them.
* :class:`LiveBytes` -- counts the bytes of tensors alive at once (weak references: it
  keeps nothing alive) and the peak.

Everything here is module-level so it pickles into the rank processes.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import pickle
import weakref
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

CUDA = torch.device("cuda", 0)


class OnDevice(torch.Tensor):
    """A tensor on "cuda:0" whose data is the CPU tensor ``data`` (see the module docstring)."""

    data_on_cpu: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: torch.device = CUDA) -> OnDevice:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=device, requires_grad=False
        )

    def __init__(self, data: torch.Tensor, device: torch.device = CUDA):
        self.data_on_cpu = data

    def __repr__(self) -> str:
        return f"OnDevice({self.data_on_cpu!r}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        (this,) = [a for a in args if isinstance(a, OnDevice)]
        if func is torch.ops.aten.detach.default:
            return OnDevice(this.data_on_cpu.detach(), this.device)
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            return func(this.data_on_cpu, **kwargs)
        raise NotImplementedError(f"a stand-in device tensor was given to {func}")


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class LiveBytes:
    """Bytes of the tracked tensors alive at once; ``peak`` is the most ever."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.total = 0
        self.count = 0

    def track(self, tensor: torch.Tensor) -> None:
        size = nbytes(tensor)
        self.live += size
        self.total += size
        self.count += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size


@contextlib.contextmanager
def gathers_on_device(counter: LiveBytes) -> Iterator[None]:
    """``DTensor.full_tensor()`` returns its result as an :class:`OnDevice` tensor tracked
    by ``counter``: the gathered tensor stands for one on the GPU until it is copied to
    the CPU or dropped."""
    real = DTensor.full_tensor

    def full_tensor(self: DTensor, **kwargs: Any) -> torch.Tensor:
        result = OnDevice(real(self, **kwargs).detach().clone())
        counter.track(result)
        return result

    with mock.patch.object(DTensor, "full_tensor", full_tensor):
        yield


@contextlib.contextmanager
def broadcasts_tracked(counter: LiveBytes) -> Iterator[None]:
    """Every tensor handed to ``torch.distributed.broadcast`` is tracked by ``counter``."""
    real = dist.broadcast

    def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counter.track(tensor)
        return real(tensor, *args, **kwargs)

    with mock.patch.object(dist, "broadcast", broadcast):
        yield


class ReachedCollective(Exception):
    """The code under test handed a collective a meta tensor: ``name`` and ``devices``."""

    def __init__(self, name: str, devices: list[str]):
        super().__init__(f"{name} on {devices}")
        self.name = name
        self.devices = devices


@contextlib.contextmanager
def comm_device_is_meta(asked: list[Any] | None = None) -> Iterator[None]:
    """Every ``comm_device(...)`` answers ``meta``; the process groups it was asked about
    (``None``: the default group) are appended to ``asked``."""
    from fsdp_interactive.fsdp import _comm_device

    real = _comm_device.collective_device_type

    def collective_device_type(group: Any = None) -> str:
        if asked is not None:
            asked.append(group)
        return real(group)

    with (
        mock.patch.object(_comm_device, "collective_device_type", collective_device_type),
        mock.patch.object(_comm_device, "device_of_type", lambda _type: torch.device("meta")),
    ):
        yield


def _devices(value: Any) -> list[str]:
    if isinstance(value, DTensor):
        return [value.to_local().device.type]
    if isinstance(value, torch.Tensor):
        return [value.device.type]
    if isinstance(value, list | tuple):
        return [d for item in value for d in _devices(item)]
    return []


#: (module, name, which arguments hold the tensors) of every collective the package calls.
COLLECTIVES: tuple[tuple[Any, str, Callable[..., Any]], ...] = (
    (dist, "all_reduce", lambda *a, **k: a[:1]),
    (dist, "broadcast", lambda *a, **k: a[:1]),
    (dist, "all_gather", lambda *a, **k: a[:2]),
    (dist, "all_gather_into_tensor", lambda *a, **k: a[:2]),
    (DTensor, "full_tensor", lambda self, **k: [self]),
    (DTensor, "redistribute", lambda self, *a, **k: [self]),
)


@contextlib.contextmanager
def stop_at_meta_collectives(seen: list[tuple[str, list[str]]]) -> Iterator[None]:
    """Record ``(collective, tensor devices)`` of every collective call into ``seen``; the
    first one handed a meta tensor raises :class:`ReachedCollective` instead of running."""
    with contextlib.ExitStack() as stack:
        for owner, name, tensors_of in COLLECTIVES:
            real = getattr(owner, name)

            def recording(*args: Any, _real=real, _name=name, _of=tensors_of, **kwargs: Any):
                devices = _devices(list(_of(*args, **kwargs)))
                seen.append((_name, devices))
                if "meta" in devices:
                    raise ReachedCollective(_name, devices)
                return _real(*args, **kwargs)

            stack.enter_context(mock.patch.object(owner, name, recording))
        yield


def first_collective(run: Callable[[], Any], asked: list[Any] | None = None) -> ReachedCollective:
    """Run ``run()`` with every communication device ``meta``; the collective it reached
    first with a meta tensor. ``AssertionError`` if it reached none (it ran on CPU only)."""
    seen: list[tuple[str, list[str]]] = []
    with comm_device_is_meta(asked), stop_at_meta_collectives(seen):
        try:
            run()
        except ReachedCollective as reached:
            return reached
    raise AssertionError(f"no collective was handed a tensor on the communication device: {seen}")


class _TensorsSeen(pickle.Pickler):
    """Pickles into nothing and lists the (type, device) of every tensor on the way."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.seen: list[tuple[type, str]] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.seen.append((type(obj), obj.device.type))
            return (copyreg._reconstructor, (object, object, None))  # nothing of it pickled
        return NotImplemented


def tensors_pickled(value: Any) -> list[tuple[type, str]]:
    """(type, device type) of each tensor pickling ``value`` meets (a shared one once)."""
    pickler = _TensorsSeen()
    pickler.dump(value)
    return pickler.seen
