"""``cpu_copy``: nothing that reaches the notebook kernel holds a non-CPU tensor.

CUDA tensors are stood in for by :class:`tests.device_standins.OnDevice` (reports
``cuda:0``, keeps its data on the CPU) and, for a tensor without data, by ``meta``
tensors. Every result is checked by pickling it, the way it travels to the kernel, with a
pickler that sees every tensor in the whole object graph, including where ``cpu_copy``
does not look.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn

from fsdp_interactive._plain import cpu_copy, tensors_in
from tests.device_standins import OnDevice, tensors_pickled

Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass(frozen=True)
class Record:
    name: str
    values: torch.Tensor
    extra: dict = dataclasses.field(default_factory=dict)


def device(values: list[float]) -> OnDevice:
    return OnDevice(torch.tensor(values))


def nested_value() -> dict:
    shared = device([9.0])
    return {
        "list": [device([1.0]), 2],
        "tuple": (device([3.0]), "x"),
        "namedtuple": Pair(device([4.0]), shared),
        "dataclass": Record("r", device([5.0]), {"deep": [shared]}),
        "set": {device([6.0]), 7},
        "frozenset": frozenset({device([8.0])}),
        "parameter": nn.Parameter(torch.tensor([10.0])),
        "plain": torch.tensor([11.0]),
        "no tensors": {"a": [1, (2, 3)]},
        device([12.0]): "a tensor key",
    }


def test_every_tensor_of_a_nested_value_becomes_a_plain_cpu_tensor():
    value = nested_value()
    assert ("cuda" in {d for _, d in tensors_pickled(value)}) and OnDevice in {
        t for t, _ in tensors_pickled(value)
    }  # the stand-ins are seen as device tensors
    copy = cpu_copy(value)
    assert set(tensors_pickled(copy)) == {(torch.Tensor, "cpu")}
    assert len(tensors_pickled(copy)) == len(tensors_pickled(value))
    # Containers keep their types, values their data.
    assert isinstance(copy["namedtuple"], Pair) and copy["namedtuple"].first.tolist() == [4.0]
    assert isinstance(copy["dataclass"], Record) and copy["dataclass"].values.tolist() == [5.0]
    assert isinstance(copy["set"], set) and isinstance(copy["frozenset"], frozenset)
    assert sorted(t.item() for t in copy["set"] if isinstance(t, torch.Tensor)) == [6.0]
    assert type(copy["parameter"]) is torch.Tensor and copy["parameter"].tolist() == [10.0]
    assert copy["no tensors"] is value["no tensors"]  # nothing to move: not rebuilt
    # A tensor reached twice is copied once: tied stays tied.
    assert copy["namedtuple"].second is copy["dataclass"].extra["deep"][0]


def test_cpu_tensors_are_copied_not_shared():
    plain = torch.tensor([1.0, 2.0])
    copy = cpu_copy({"t": plain})["t"]
    copy.add_(1)
    assert plain.tolist() == [1.0, 2.0]


def dtensor_copies() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    value = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    out: dict = {}
    if dist.get_rank() == 0:  # rank 1 does not take part: no collective may be issued
        local = cpu_copy({"w": value})["w"]
        out["local"] = (type(local) is torch.Tensor, local.tolist())
    dist.barrier()
    gathered = cpu_copy([value], dtensor=lambda t: t.full_tensor() * 2)[0]
    out["gathered"] = gathered.tolist()
    calls: list = []
    try:
        cpu_copy({"first": [value], "s": {value}}, dtensor=calls.append)
    except TypeError as error:
        out["set"] = (str(error), calls)
    return out


def test_a_dtensor_becomes_its_local_shard_or_what_the_hook_makes_of_it(ranks2):
    first, second = ranks2.run(dtensor_copies)
    assert first["local"] == (True, [0.0, 1.0])
    assert "local" not in second
    for result in (first, second):
        assert result["gathered"] == [0.0, 2.0, 4.0, 6.0]
        error, calls = result["set"]
        assert "value['s']{item 0} is a DTensor inside a set" in error
        assert calls == []  # refused before the first DTensor was handed over


def test_what_cannot_be_made_plain_is_refused_naming_where():
    with pytest.raises(ValueError, match=r"value\['w'\]\[0\] is a tensor on the meta device"):
        cpu_copy({"w": [torch.ones(2, device="meta")]})
    with pytest.raises(TypeError, match=r"value\[1\] is a module \(Linear\)"):
        cpu_copy([1, nn.Linear(2, 2)])
    with pytest.raises(TypeError, match=r"out\.values is a Stubborn \(a tensor subclass\)"):
        cpu_copy(Record("r", Stubborn(torch.ones(1))), name="out")


class Stubborn(torch.Tensor):
    """A wrapper subclass without storage whose CPU copy is still one of its kind."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype)

    def __init__(self, data: torch.Tensor):
        self.inner = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        (this,) = [a for a in args if isinstance(a, Stubborn)]
        return Stubborn(this.inner)


def test_tensors_in_lists_every_tensor_where_cpu_copy_finds_it():
    found = dict(tensors_in(nested_value()))
    assert "value['list'][0]" in found and "value['dataclass'].values" in found
    assert "value['namedtuple'][1]" in found and "value['dataclass'].extra['deep'][0]" in found
    # The pickle holds the shared tensor once; tensors_in lists both places.
    assert len(found) == len(tensors_pickled(nested_value())) + 1
