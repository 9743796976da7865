"""RNGState and ResumableDistributedSampler on their own (one process; the samplers of
several ranks are built with explicit ``num_replicas``/``rank``)."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from fsdp_interactive.checkpoint import ResumableDistributedSampler, RNGState
from fsdp_interactive.checkpoint._rng import derived_seed


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_rng_state_restores_torch_python_and_numpy_streams():
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    _draws()
    rng = RNGState()
    state = rng.state_dict()
    expected = _draws()
    torch.manual_seed(50)
    random.seed(50)
    np.random.seed(50)
    rng.load_state_dict(state)
    assert _draws() == expected
    assert "cuda" not in state  # CUDA was never initialised in this process


def test_rng_state_can_leave_out_python_and_numpy():
    torch.manual_seed(1)
    rng = RNGState(python=False, numpy=False)
    state = rng.state_dict()
    assert sorted(state) == ["torch"]
    random.seed(7)
    before = random.random()
    random.seed(7)
    rng.load_state_dict(state)
    assert random.random() == before  # untouched


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return RNGState().state_dict()


def test_rng_reshard_rules():
    rng = RNGState()
    a, b = _state(10), _state(11)
    # Every rank saved the same state: every new rank gets it.
    for rank in range(4):
        assert rng.reshard_state([a, a], rank, 4) is a
    # Ranks with a saved counterpart keep their stream (4 -> 2 and 2 -> 4).
    c, d = _state(12), _state(13)
    assert rng.reshard_state([a, b, c, d], 1, 2) is b
    assert rng.reshard_state([a, b], 0, 4) is a
    # New ranks start from a seed derived from saved rank r % N and r.
    grown = [rng.reshard_state([a, b], rank, 4) for rank in (2, 3)]
    assert grown == [{"seed": derived_seed(a, 2)}, {"seed": derived_seed(b, 3)}]
    assert len({derived_seed(a, 2), derived_seed(b, 3), derived_seed(a, 4)}) == 3
    rng.load_state_dict(grown[0])
    seed = derived_seed(a, 2)
    assert (
        torch.rand(2).tolist()
        == torch.rand(2, generator=torch.Generator().manual_seed(seed)).tolist()
    )
    assert random.random() == random.Random(seed).random()
    assert float(np.random.rand()) == float(np.random.RandomState(seed % 2**32).rand())


def test_saved_cuda_states_are_skipped_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the states would be applied")
    torch.manual_seed(4)
    state = RNGState().state_dict()
    expected = torch.rand(2).tolist()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    torch.manual_seed(9)
    RNGState().load_state_dict(state)
    assert torch.rand(2).tolist() == expected
    with pytest.raises(ValueError, match="cuda=True"):
        RNGState(cuda=True)


class FakeCuda:
    """Three CUDA devices with generator states of their own, device ``current`` current:
    ``torch.cuda``'s RNG functions as torch resolves their ``device`` argument."""

    def __init__(self, current: int = 1):
        self.current = current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(3)}
        self.set_on: list[int] = []

    def index(self, device) -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.states[self.index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.set_on.append(self.index(device))
        self.states[self.index(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        raise AssertionError("read the generators of every device")

    def patched(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for name, value in (
            ("is_available", lambda: True),
            ("is_initialized", lambda: True),
            ("device_count", lambda: 3),
            ("current_device", lambda: self.current),
            ("get_rng_state", self.get_rng_state),
            ("set_rng_state", self.set_rng_state),
            ("get_rng_state_all", self.get_rng_state_all),
        ):
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        return stack


def test_only_the_ranks_own_cuda_generator_is_saved_and_restored():
    cuda = FakeCuda(current=1)
    with cuda.patched():
        state = RNGState().state_dict()
        assert "cuda" not in state
        assert torch.equal(state["cuda_device"], cuda.states[1])  # device 1's, no other
        cuda.states[1] = torch.zeros(16, dtype=torch.uint8)
        RNGState().load_state_dict(state)
        assert cuda.set_on == [1] and torch.equal(cuda.states[1], torch.ones(16, dtype=torch.uint8))
        assert [int(cuda.states[i][0]) for i in (0, 2)] == [0, 2]  # others untouched
    # After a restart the rank sees its GPU as device 0 (CUDA_VISIBLE_DEVICES): its own
    # stream continues there.
    restarted = FakeCuda(current=0)
    with restarted.patched():
        RNGState().load_state_dict(state)
    assert restarted.set_on == [0] and int(restarted.states[0][0]) == 1


def test_states_saved_for_every_device_restore_the_current_devices_entry_only():
    cuda = FakeCuda(current=2)
    legacy = {"torch": torch.get_rng_state(), "cuda": [torch.full((16,), 10 + i) for i in range(3)]}
    with cuda.patched():
        RNGState().load_state_dict(legacy)
    assert cuda.set_on == [2] and int(cuda.states[2][0]) == 12


@pytest.mark.cuda
def test_cuda_generator_states_round_trip():
    torch.cuda.manual_seed_all(3)
    torch.rand(4, device="cuda")
    rng = RNGState(cuda=True)
    state = rng.state_dict()
    assert "cuda" not in state
    assert torch.equal(state["cuda_device"], torch.cuda.get_rng_state(torch.cuda.current_device()))
    expected = torch.rand(4, device="cuda").cpu()
    others = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    torch.cuda.manual_seed(8)  # the current device only
    rng.load_state_dict(state)
    assert torch.equal(torch.rand(4, device="cuda").cpu(), expected)
    for index in range(torch.cuda.device_count()):
        if index != torch.cuda.current_device():
            assert torch.equal(torch.cuda.get_rng_state(index), others[index])


def _samplers(n: int, world: int, **kwargs) -> list[ResumableDistributedSampler]:
    return [
        ResumableDistributedSampler(range(n), num_replicas=world, rank=r, **kwargs)
        for r in range(world)
    ]


@pytest.mark.parametrize(
    "n,world,shuffle,drop_last", [(10, 4, True, False), (10, 4, False, True), (12, 3, True, True)]
)
def test_a_fresh_epoch_serves_what_distributed_sampler_serves(n, world, shuffle, drop_last):
    for rank in range(world):
        ours = ResumableDistributedSampler(
            range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        theirs = DistributedSampler(
            range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def _take(sampler: ResumableDistributedSampler, count: int) -> list[int]:
    it = iter(sampler)
    return [next(it) for _ in range(count)]


@pytest.mark.parametrize("before,after", [(2, 4), (4, 2), (2, 2), (3, 2)])
def test_resuming_on_another_world_size_serves_each_sample_once(before, after):
    n = 24
    old = _samplers(n, before, seed=1)
    for s in old:
        s.set_epoch(3)
    served = [i for s in old for i in _take(s, 12 // before)]  # 12 samples in all
    saved = [s.state_dict() for s in old]
    new = _samplers(n, after, seed=1)
    for rank, s in enumerate(new):
        state = saved[rank] if before == after else s.reshard_state(saved, rank, after)
        s.load_state_dict(state)
        assert s.epoch == 3 and len(s) == 12 // after
    rest = [i for s in new for i in s]
    assert sorted(served + rest) == list(range(n))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1 + 3)).tolist()
    assert sorted(served) == sorted(order[:12])


def test_uneven_progress_resumes_at_the_first_sample_no_rank_took():
    old = _samplers(21, 2, shuffle=False)
    _take(old[0], 4)  # positions 0, 2, 4, 6
    _take(old[1], 2)  # positions 1, 3
    saved = [s.state_dict() for s in old]
    new = _samplers(21, 4, shuffle=False)
    states = [s.reshard_state(saved, r, 4) for r, s in enumerate(new)]
    assert [s["position"] for s in states] == [5, 6, 7, 8]
    for s, state in zip(new, states, strict=True):
        s.load_state_dict(state)
    assert sorted(i for s in new for i in s) == list(range(5, 21))  # 6 is served again


def test_passes_continue_a_finished_epoch_starts_over_a_new_epoch_starts_at_zero():
    sampler = ResumableDistributedSampler(range(8), 2, 1, shuffle=False)
    assert _take(sampler, 2) == [1, 3] and len(sampler) == 2
    assert list(sampler) == [5, 7]  # the loop stopped early; the next pass goes on
    assert sampler.state_dict()["position"] == 9
    assert list(sampler) == [1, 3, 5, 7]  # as DistributedSampler repeats an epoch
    _take(sampler, 1)
    sampler.set_epoch(1)
    assert sampler.state_dict()["position"] == 1 and len(sampler) == 4


def test_sampler_refuses_a_state_with_another_order():
    saved = ResumableDistributedSampler(range(8), 2, 0, seed=1).state_dict()
    for other in (
        ResumableDistributedSampler(range(9), 2, 0, seed=1),
        ResumableDistributedSampler(range(8), 2, 0, seed=2),
        ResumableDistributedSampler(range(8), 2, 0, seed=1, shuffle=False),
    ):
        with pytest.raises(ValueError, match="epoch order would differ"):
            other.load_state_dict(saved)
