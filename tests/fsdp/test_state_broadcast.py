"""``broadcast_from_rank0``: rank 0's nested state on every rank, one tensor at a time, on
two gloo ranks (the devices it talks on are checked in ``test_comm_device.py``, the bytes
in flight in ``test_full_state_streaming.py``)."""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

Pair = collections.namedtuple("Pair", "tensor note")


def broadcast_nested_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_interactive.fsdp._state_broadcast import broadcast_from_rank0

    rank = dist.get_rank()
    state = {
        "transposed": torch.arange(6.0).reshape(2, 3).t(),  # not contiguous on rank 0
        "pair": Pair(torch.tensor([1, 2]), "note"),
        "nested": [3, (torch.zeros(0), {"half": torch.ones(2, dtype=torch.float16)})],
    }
    paths: list = []

    def receive(path, tensor):
        paths.append(path)
        return tensor.to("cpu", copy=True) * 2

    got = broadcast_from_rank0(state if rank == 0 else None, receive=receive)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    try:
        broadcast_from_rank0({"w": [sharded]} if rank == 0 else {})
        refused = None
    except TypeError as error:
        refused = str(error)
    return {
        "transposed": got["transposed"].tolist(),
        "pair": (type(got["pair"]).__name__, got["pair"].tensor.tolist(), got["pair"].note),
        "nested": (got["nested"][0], tuple(got["nested"][1][0].shape)),
        "half": (got["nested"][1][1]["half"].dtype, got["nested"][1][1]["half"].tolist()),
        "paths": paths,
        "refused": refused,
    }


def test_rank0_state_arrives_everywhere_through_receive(ranks2):
    for result in ranks2.run(broadcast_nested_state):
        assert result["transposed"] == [[0.0, 6.0], [2.0, 8.0], [4.0, 10.0]]
        assert result["pair"] == ("Pair", [2, 4], "note")
        assert result["nested"] == (3, (0,))
        assert result["half"] == (torch.float16, [2.0, 2.0])
        assert result["paths"] == [
            ("transposed",),
            ("pair", 0),
            ("nested", 1, 0),
            ("nested", 1, 1, "half"),
        ]
        assert (
            "the state['w'][0] is a DTensor; gather it to a full tensor first"
            in (result["refused"])
        )
