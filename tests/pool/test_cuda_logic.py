"""The pool's CUDA/NCCL logic on CPU: which flight recorder a backend records into, when a
rank counts as blocked behind an NCCL collective, the NCCL watchdog hold, placement from
the engines' reports, CUDA_VISIBLE_DEVICES and local ranks, what reaches the kernel.

Only CUDA and NCCL themselves are stood in for (:mod:`tests.pool.cuda_standins`); the
GPU half of each is in ``tests/pool/test_cuda.py`` (marked ``cuda``) and ``make gpu-check``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import subprocess
import sys
import time
from typing import NamedTuple

import pytest
import torch

from fsdp_interactive import _torch_compat
from fsdp_interactive.pool._placement import Placement, Request, plan, settle
from fsdp_interactive.pool._rendezvous import host_reports
from fsdp_interactive.pool.common._collectives import blocked_where, unfinished_on_device
from fsdp_interactive.pool.common._stacks import Frame
from fsdp_interactive.pool.common._topology import RankRecord, RankSlot, format_table
from fsdp_interactive.pool.processes._devices import cuda_handles
from fsdp_interactive.pool.rank import _bootstrap, _results, _torch_recorder, _watchdog_hold
from tests.pool.cuda_standins import FakeCudaTensor, nccl_dump, nccl_entry

# ---------------------------------------------------------------------------- recorders


def test_each_backend_is_read_from_the_recorder_it_records_into():
    assert _torch_recorder.recorders_for("nccl") == ["nccl"]
    assert _torch_recorder.recorders_for("gloo") == ["generic"]
    assert _torch_recorder.recorders_for("cpu:gloo,cuda:nccl") == ["nccl", "generic"]


def _generic(entries=()):
    return pickle.dumps({"version": "2.7", "entries": list(entries), "pg_status": {}})


def test_an_nccl_group_is_checked_and_dumped_from_ncclS_recorder(monkeypatch):
    nccl = nccl_dump(
        nccl_entry(1, completed=True), nccl_entry(2, "broadcast", completed=False, age_s=42)
    )
    monkeypatch.setattr(_torch_compat, "nccl_flight_recorder_dump", lambda: lambda *a: nccl)
    monkeypatch.setattr(_torch_compat, "flight_recorder_dump", lambda: lambda *a: _generic())
    monkeypatch.setattr(_torch_recorder, "_note", "not checked")
    # The generic recorder alone is empty: reading it would say NCCL is not recorded.
    assert _torch_recorder.check("nccl") is None
    dump = _torch_recorder.dump()
    assert [(r.backend, r.op, r.seq, r.completed) for r in dump.records] == [
        ("nccl", "all_reduce", 1, True),
        ("nccl", "broadcast", 2, False),
    ]
    pending = unfinished_on_device(dump)
    assert [r.seq for r in pending] == [2] and 41 < pending[0].pending_s < 60


def test_a_torch_without_ncclS_recorder_says_so_for_an_nccl_group(monkeypatch):
    monkeypatch.setattr(_torch_compat, "nccl_flight_recorder_dump", lambda: None)
    monkeypatch.setattr(_torch_recorder, "_note", "not checked")
    note = _torch_recorder.check("nccl")
    assert note == f"torch {torch.__version__} has no flight recorder dump for nccl"
    assert _torch_recorder.dump().note == note


def test_a_group_in_both_recorders_keeps_each_backends_numbers_apart():
    nccl = pickle.loads(nccl_dump(nccl_entry(7, completed=True, group="1")))
    gloo_entry = {**nccl_entry(3, completed=True, group="1"), "profiling_name": "gloo:barrier"}
    generic = {"entries": [gloo_entry], "pg_status": {"1": {"last_enqueued_collective": 3}}}
    merged = _torch_recorder.merged([("nccl", nccl), ("generic", generic)])
    groups = [(e["process_group"][0], e["collective_seq_id"]) for e in merged["entries"]]
    assert groups == [("1", 7), ("1/gloo", 3)]
    assert set(merged["pg_status"]) == {"1", "1/gloo"}


# ---------------------------------------------------------------------------- blocked


CELL = [Frame("/tmp/ipykernel_1/5.py", 2, "<module>", "loss.item()", "Cell In[5]")]
IN_BARRIER = [
    Frame("/x/torch/distributed/distributed_c10d.py", 4800, "barrier"),
    Frame("/tmp/ipykernel_1/5.py", 1, "<module>", "dist.barrier()", "Cell In[5]"),
]


def _records(*entries):
    raw = pickle.loads(nccl_dump(*entries))
    return _torch_recorder.records_of(raw)


def test_a_rank_waiting_for_its_gpu_behind_an_unfinished_nccl_collective_is_blocked():
    dump = _records(nccl_entry(11, completed=True), nccl_entry(12, completed=False, age_s=34))
    where = blocked_where(CELL, dump)
    assert where == (
        "in <module> (Cell In[5], line 2): loss.item(), behind nccl all_reduce #12, "
        "unfinished on the GPU for 34 s"
    )


def test_blocked_needs_a_stack_in_torch_distributed_or_unfinished_nccl_work():
    finished = _records(nccl_entry(11, completed=True))
    assert blocked_where(CELL, finished) is None  # running elsewhere, nothing queued
    assert blocked_where(IN_BARRIER, finished).startswith("in barrier (distributed_c10d.py:4800)")
    assert blocked_where([], _records(nccl_entry(1, completed=False))) is None  # idle
    gloo = _torch_recorder.records_of(
        {
            "entries": [{**nccl_entry(3, completed=False), "profiling_name": "gloo:all_reduce"}],
            "pg_status": {},
        }
    )
    # A gloo collective blocks inside torch.distributed, which the stack shows.
    assert unfinished_on_device(gloo) == [] and blocked_where(CELL, gloo) is None


# ---------------------------------------------------------------------------- watchdog hold


def test_a_hold_extends_nccl_timeouts_by_the_time_it_lasts(monkeypatch):
    asked: list[float] = []
    monkeypatch.setattr(_torch_compat, "extend_nccl_timeouts", asked.append)
    _watchdog_hold.hold("test")
    assert _watchdog_hold.active() == ["test"]
    time.sleep(2.5)
    _watchdog_hold.release("test")
    time.sleep(_watchdog_hold.STEP_S * 1.5)
    settled = sum(asked)
    time.sleep(_watchdog_hold.STEP_S * 1.5)
    assert sum(asked) == settled  # nothing more once released
    # The time held (2.5 s) plus the margin kept ahead of the watchdog, in small steps.
    assert 2.5 <= settled <= 2.5 + 2 * _watchdog_hold.STEP_S + 1.0
    assert max(asked) <= 2 * _watchdog_hold.STEP_S + 0.5
    assert _watchdog_hold.active() == []


def test_a_timed_hold_lapses_by_itself(monkeypatch):
    monkeypatch.setattr(_torch_compat, "extend_nccl_timeouts", lambda seconds: None)
    _watchdog_hold.hold("short", 0.3)
    assert _watchdog_hold.active() == ["short"]
    time.sleep(0.5)
    assert _watchdog_hold.active() == []
    _watchdog_hold.hold("gone", 0)
    assert _watchdog_hold.active() == []


# ---------------------------------------------------------------------------- placement


def test_engines_elsewhere_leave_devices_to_their_reports():
    for connecting in (True, False):
        placement = plan(
            Request(None, None, None),
            local_engines=False,
            connecting=connecting,
            visible_devices=lambda: pytest.fail("the kernel's host was asked for devices"),
        )
        assert placement.devices == "reported" and placement.backend is None
        assert placement.n == (None if connecting else 2)
    nccl = plan(Request(None, None, "nccl"), local_engines=False, connecting=False)
    assert (nccl.n, nccl.devices) == (2, "reported")  # not n=1 any more


def test_reports_decide_cuda_or_cpu_ranks():
    undecided = Placement(None, "reported", None)
    gpus = settle(undecided, {"a": (4, 8), "b": (4, 4)})
    assert (gpus.devices, gpus.backend) == ("local_rank", "nccl")
    assert [gpus.device_for(r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    cpu = settle(undecided, {"a": (2, 0), "b": (2, 0)})
    assert (cpu.devices, cpu.backend) == (None, "gloo") and cpu.device_for(1) == "cpu"
    with pytest.raises(ValueError, match="b runs 2 ranks and has 0 CUDA device"):
        settle(undecided, {"a": (2, 2), "b": (2, 0)})
    with pytest.raises(ValueError, match="a runs 4 ranks and has 2 CUDA device"):
        settle(undecided, {"a": (4, 2)})
    with pytest.raises(ValueError, match=r"needs CUDA devices.*a: 0"):
        settle(Placement(2, "reported", "nccl"), {"a": (2, 0)})
    chosen = Placement(2, (1, 3), "nccl")
    assert settle(chosen, {"a": (2, 4)}) is chosen
    with pytest.raises(ValueError, match=r"devices \[3\] not present on a: 2 CUDA"):
        settle(chosen, {"a": (2, 2)})
    with pytest.raises(ValueError, match=r"a runs 3 ranks but devices=\[1, 3\] names 2"):
        settle(chosen, {"a": (3, 4)})


def test_host_reports_count_ranks_and_the_smallest_count_per_host():
    slots = [RankSlot(e, e, e % 2, 2, "ab"[e // 2], "x", 100 + e) for e in range(4)]
    described = {0: {"cuda_devices": 4}, 1: {"cuda_devices": 3}, 2: {}, 3: {}}
    assert host_reports(slots, described) == {"a": (2, 3), "b": (2, None)}


def test_chosen_devices_make_local_rank_the_index_each_rank_sees():
    placement = plan(
        Request(None, (1, 3), None), local_engines=True, connecting=False, visible_devices=lambda: 4
    )
    assert placement.visible_for(2) == (1, 3)
    assert [placement.device_for(local) for local in (0, 1)] == ["cuda:0", "cuda:1"]
    everything = plan(
        Request(None, None, None), local_engines=True, connecting=False, visible_devices=lambda: 2
    )
    assert everything.visible_for(2) == (0, 1) and everything.device_for(1) == "cuda:1"
    record = RankRecord(1, 1, 2, "h", 9, "cuda:1", "nccl", 1, "x", visible_devices="1,3")
    assert "cuda:1 (of 1,3)" in format_table([record])


def test_visible_devices_are_narrowed_from_what_the_engine_inherited(monkeypatch):
    monkeypatch.setattr(_bootstrap, "_STATE", _bootstrap._RankState())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _bootstrap.narrow_visible_devices([1, 3]) == "1,3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
    # A second group on the same engine picks from the inherited (unset) value again.
    assert _bootstrap.narrow_visible_devices([0]) == "0"

    monkeypatch.setattr(_bootstrap, "_STATE", _bootstrap._RankState())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d")
    assert _bootstrap.narrow_visible_devices([1, 3]) == "GPU-b,GPU-d"
    assert _bootstrap.narrow_visible_devices([2]) == "GPU-c"
    with pytest.raises(ValueError, match=r"device 4 is not present.*shows 4 device"):
        _bootstrap.narrow_visible_devices([4])

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"CUDA already runs in this engine.*restart"):
        _bootstrap.narrow_visible_devices([0])
    assert _bootstrap.narrow_visible_devices([2]) == "GPU-c"  # what it runs under already


def test_a_cpu_build_engine_reports_no_cuda_devices_without_a_probe(monkeypatch):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch counts through NVML (test_cuda.py)")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probe started"))
    assert _bootstrap.describe_engine(count_cuda=True)["cuda_devices"] == 0
    assert _bootstrap.describe_engine()["cuda_devices"] is None


def test_the_forker_imports_initialise_no_cuda():
    """Engines forked from the forker can still choose their devices: the forker's imports
    never reach the CUDA driver (stand-ins for torch's two ways in record any call)."""
    script = (
        "import torch\n"
        "calls = []\n"
        "torch._C._cuda_getDeviceCount = lambda: calls.append('getDeviceCount') or 1\n"
        "torch._C._cuda_init = lambda: calls.append('cuda_init')\n"
        "from fsdp_interactive.pool.processes import _engine_forker\n"
        "_engine_forker.preload()\n"
        "during_preload = list(calls)\n"
        "assert torch.cuda.is_available() and calls[-1] == 'getDeviceCount'  # seen when made\n"
        "print(during_preload)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_cuda_handles_are_the_nvidia_device_files_a_process_holds(tmp_path):
    fd = tmp_path / "123" / "fd"
    fd.mkdir(parents=True)
    for number, target in enumerate(["/dev/nvidiactl", "/dev/nvidia0", "/dev/null", "pipe:[9]"]):
        os.symlink(target, fd / str(number))
    os.symlink("/dev/nvidia0", fd / "7")
    assert cuda_handles(123, proc=str(tmp_path)) == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert cuda_handles(456, proc=str(tmp_path)) == []
    assert cuda_handles() == []  # this CPU test process never touched a GPU driver


# ---------------------------------------------------------------------------- to the kernel


class Pair(NamedTuple):
    first: object
    second: object


@dataclasses.dataclass(frozen=True)
class Box:
    tensor: object
    label: str = "box"


class Opaque:
    def __init__(self, tensor):
        self.tensor = tensor


def _plain_cpu(tensor) -> bool:
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu"


def test_every_container_comes_back_with_plain_cpu_tensors():
    cuda = FakeCudaTensor(torch.arange(4.0))
    assert cuda.is_cuda and cuda.device.type == "cuda"
    value = {
        "pair": Pair(cuda, [cuda, 1]),
        "box": Box(cuda),
        "set": frozenset({("a", 1)}),
        "ordered": collections.OrderedDict(x=cuda),
        "parameter": torch.nn.Parameter(torch.ones(2)),
    }
    out = _results.to_kernel(value)
    assert type(out["pair"]) is Pair and _plain_cpu(out["pair"].first)
    assert out["pair"].first is out["pair"].second[0]  # one tensor reached twice: one copy
    assert torch.equal(out["pair"].first, torch.arange(4.0))
    assert type(out["box"]) is Box and _plain_cpu(out["box"].tensor) and out["box"].label == "box"
    assert out["set"] is value["set"]  # nothing to move: the same object
    assert type(out["ordered"]) is collections.OrderedDict and _plain_cpu(out["ordered"]["x"])
    assert _plain_cpu(out["parameter"])
    assert value["box"].tensor is cuda  # the rank's own value is left alone
    plain = torch.ones(3)
    assert _results.to_kernel(plain) is plain


def test_what_cannot_go_to_the_kernel_is_refused_naming_where():
    with pytest.raises(ValueError, match=r"x\['w'\]\[1\] is a tensor on the meta device"):
        _results.to_kernel({"w": [1, torch.empty(2, device="meta")]}, "x")
    with pytest.raises(ValueError, match=r"value\.tensor is a tensor on the meta"):
        _results.to_kernel(Box(torch.empty(2, device="meta")))
    with pytest.raises(TypeError, match="holds a tensor on cuda:0 inside an object"):
        _results.to_kernel([Opaque(FakeCudaTensor(torch.ones(1)))])
    on_meta = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(TypeError, match=r"parameter weight is on meta.*state_dict"):
        _results.to_kernel(on_meta)
    opaque = Opaque(torch.ones(1))
    assert _results.to_kernel([opaque])[0] is opaque  # CPU inside: passes as it is


def test_call_and_pull_run_their_value_through_to_kernel():
    out = _results.call(lambda x, fn=None: {"fn": fn, "x": FakeCudaTensor(x)}, torch.ones(2), fn=3)
    assert out["fn"] == 3 and _plain_cpu(out["x"])
    assert _plain_cpu(_results.pull_from({"t": FakeCudaTensor(torch.ones(1))}, "t"))
    with pytest.raises(NameError, match="name 'missing' is not defined"):
        _results.pull_from({}, "missing")
