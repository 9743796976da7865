"""StepCounter: changed in place, read as an int, saved and restored as a stateful object."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from fsdp_interactive.checkpoint import StepCounter


def test_plus_equals_changes_the_same_object_and_it_reads_as_an_int():
    step = StepCounter()
    same = step
    step += 3
    assert step is same and int(step) == 3 and step == 3 and step < 4 and step >= 3
    assert list(range(step, 5)) == [3, 4]
    assert (step * 7, step + 1, 10 - step, step % 2, step // 2, step / 2) == (21, 4, 7, 1, 1, 1.5)
    assert f"{step:03d}" == "003" and repr(step) == "StepCounter(3)"


def test_its_state_round_trips_and_bad_counts_are_refused():
    step = StepCounter(5)
    other = StepCounter()
    other.load_state_dict(step.state_dict())
    assert other == 5 and pickle.loads(pickle.dumps(other)) == 5
    with pytest.raises(ValueError, match="a step count is an int >= 0"):
        StepCounter(-1)
    with pytest.raises(ValueError, match="a step count is an int >= 0"):
        other.load_state_dict({"value": 1.5})
    with pytest.raises(TypeError):
        hash(other)  # it changes in place


def test_the_kernel_unpickles_one_without_importing_torch():
    data = pickle.dumps(StepCounter(7))
    code = (
        "import pickle, sys\n"
        f"value = pickle.loads({data!r})\n"
        "print(int(value), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "False"]
