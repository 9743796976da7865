"""``Pool.run_script`` / ``continue_script`` on a real 2-rank pool, each script unmodified
and also run under plain ``torchrun`` in the same test as the reference: the parameters
and optimizer state after the pool's run (stopped at a step, looked at, continued) equal
torchrun's bit for bit; the script's world (torchrun's environment, the adopted group)
while it runs and nothing of it after; a failing script's frames for the debugger; the
refusals."""

from __future__ import annotations

import ast
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.pool import Pool, RankError, RankInterrupted, RankTimeout, ScriptRunError
from tests.pool.conftest import record
from tests.torchrun_reference import SCRIPTS, differences, torchrun


def values(pool: Pool, expression: str) -> dict[int, object]:
    results = pool.run(expression, stream=False, journal=False).results
    return {rank: ast.literal_eval(text) for rank, text in results.items()}


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def test_fsdp1_script_paused_inspected_continued_equals_torchrun(pool: Pool, tmp_path: Path):
    script = SCRIPTS / "plain_fsdp1.py"
    torchrun(script, 2, "--steps", "8", "--save", str(tmp_path / "torchrun"))
    engine_argv = values(pool, "import sys; sys.argv")

    status = pool.run_script(script, ["--steps", "8", "--save", str(tmp_path / "pool")], stop_at=3)
    assert status.paused and status.steps == 3 and status.paused_by == "stop-at"
    kept = dict(status.kept)
    assert kept["model"] == "FullyShardedDataParallel" and kept["optimizer"] == "AdamW"
    assert "paused after 3 optimizer steps" in str(status)
    # cells see the paused frame's locals, in the script's world
    assert values(pool, "step") == {0: 2, 1: 2}
    world = values(
        pool,
        "import os, sys; (os.environ['RANK'], os.environ['LOCAL_RANK'], "
        "os.environ['WORLD_SIZE'], os.environ['GROUP_RANK'], os.environ['ROLE_RANK'], "
        "os.environ['OMP_NUM_THREADS'], bool(os.environ['TORCHELASTIC_RUN_ID']), "
        "dist.is_torchelastic_launched(), sys.argv[1:3], torch.get_num_threads())",
    )
    assert world == {
        r: (str(r), str(r), "2", "0", str(r), "1", True, True, ["--steps", "8"], 1) for r in (0, 1)
    }
    # views of the paused model, true to torch's own clip_grad_norm_ (grads are still there)
    view = RankModel(pool, "model")
    assert {p.fqn for p in view.layout().params} == {
        "encoder.weight",
        "encoder.bias",
        "head.weight",
        "head.bias",
    }
    torch_norm = values(pool, "model.clip_grad_norm_(float('inf'), norm_type=2.0).item()")
    assert view.grad_norms().total == pytest.approx(torch_norm[0], rel=1e-6)
    # a checkpoint of the paused model and optimizer
    pool.run(
        "import fsdp_interactive.checkpoint as ckpt\n"
        f"ckpt.save({str(tmp_path / 'paused')!r}, model, optimizer)",
        stream=False,
    )
    assert (tmp_path / "paused" / "manifest.json").is_file()

    status = pool.continue_script()
    assert status.state == "ended" and status.steps == 8
    assert differences(tmp_path / "torchrun", tmp_path / "pool", 2) == []
    # nothing of the script's world is left
    after = values(
        pool,
        "import os, sys; ('TORCHELASTIC_RUN_ID' in os.environ, "
        "dist.init_process_group.__module__, dist.destroy_process_group.__module__, "
        "dist.is_initialized(), sys.argv)",
    )
    torch_functions = ("torch.distributed.distributed_c10d",) * 2
    assert after == {r: (False, *torch_functions, True, engine_argv[r]) for r in (0, 1)}
    assert values(pool, "t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}


def test_fully_shard_script_with_tqdm_equals_torchrun(pool: Pool, tmp_path: Path):
    script = SCRIPTS / "fully_shard_tqdm.py"
    torchrun(script, 2, "--steps", "6", "--save", str(tmp_path / "torchrun"))
    seen: list[tuple[int, str, str]] = []
    status = pool.run_script(
        script,
        ["--steps", "6", "--save", str(tmp_path / "pool")],
        on_output=lambda rank, stream, text: seen.append((rank, stream, text)),
    )
    assert status.state == "ended" and status.steps == 6
    assert differences(tmp_path / "torchrun", tmp_path / "pool", 2) == []
    bar = "".join(text for rank, stream, text in seen if rank == 0 and stream == "stderr")
    assert "train: 100%" in bar and "6/6" in bar


def test_init_and_destroy_adopt_the_pools_group(pool: Pool, tmp_path: Path):
    script = write(
        tmp_path,
        "asks_for_another_group.py",
        """
        import torch, torch.distributed as dist
        from torch.distributed import init_process_group
        before = dist.group.WORLD
        init_process_group("nccl", world_size=4, rank=3, device_id=torch.device("cuda", 1))
        init_process_group("nccl", world_size=4)  # said once
        same_group = dist.group.WORLD is before
        world = dist.get_world_size()
        side = dist.new_group([0, 1], backend="gloo")
        dist.destroy_process_group(side)  # a group of the script's own: destroyed
        dist.destroy_process_group()  # the pool's: stays
        alive = dist.is_initialized()
        """,
    )
    seen: list[str] = []
    pool.run_script(script, on_output=lambda rank, stream, text: seen.append(text))
    assert values(pool, "(same_group, world, alive)") == {0: (True, 2, True), 1: (True, 2, True)}
    notices = [line for line in "".join(seen).splitlines() if "[fsdp_interactive]" in line]
    assert len(notices) == 2  # once per rank
    assert "backend='nccl', world_size=4, rank=3, device_id=" in notices[0]
    assert "the pool's group is used instead (backend gloo, 2 ranks" in notices[0]


def test_failing_script_fails_the_call_keeps_its_frames_for_the_debugger(
    pool: Pool, tmp_path: Path
):
    script = write(
        tmp_path,
        "breaks.py",
        """
        import torch

        def main():
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(5):
                model(torch.ones(1, 4)).sum().backward()
                optimizer.step()
                if step == 2:
                    raise ValueError(f"diverged at step {step}")

        if __name__ == "__main__":
            main()
        """,
    )
    with pytest.raises(RankError) as raised:
        pool.run_script(script, cell=41)
    text = str(raised.value)
    assert "ValueError: diverged at step 2" in text and "breaks.py" in text
    assert "_script_run.py" not in text  # the runner's frames are hidden
    status = raised.value.script_status
    assert status.state == "failed" and status.steps == 3
    assert values(pool, "(step, type(model).__name__)") == {0: (2, "Linear"), 1: (2, "Linear")}
    assert "2" in pool.debug(0, "p step")  # the script's failing frame


def test_one_run_at_a_time_stop_and_bad_input(pool: Pool, tmp_path: Path):
    script = write(
        tmp_path,
        "loop.py",
        """
        import torch
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            for step in range(100):
                model(torch.ones(1, 2)).sum().backward()
                optimizer.step()
        finally:
            print("finally ran")
        """,
    )
    with pytest.raises(ValueError, match="stop_at must be a step number >= 1"):
        pool.run_script(script, stop_at=0)
    with pytest.raises(FileNotFoundError, match="no script at"):
        pool.run_script(tmp_path / "missing.py")
    with pytest.raises(TypeError, match="args must be a list of strings"):
        pool.run_script(script, "--steps 3")
    with pytest.raises(ValueError, match="cwd must be an existing folder"):
        pool.run_script(script, cwd=tmp_path / "nowhere")
    assert pool.run_script(script, stop_at=2).paused
    with pytest.raises(ScriptRunError, match=r"loop\.py is paused after 2 steps") as busy:
        pool.run_script(script)
    assert "pool.continue_script()" in str(busy.value)
    assert "%fsdp continue --stop" in busy.value.notebook_message()
    with pytest.raises(ValueError, match="has already taken 2 steps"):
        pool.continue_script(stop_at=2)
    assert pool.continue_script(stop_at=5).steps == 5
    seen: list[str] = []
    status = pool.continue_script(stop=True, on_output=lambda r, s, text: seen.append(text))
    assert status.state == "stopped" and "finally ran" in "".join(seen)
    with pytest.raises(ScriptRunError, match="no script run is paused"):
        pool.continue_script()


def test_ipython_run_magic_in_a_cell_fails_when_the_script_raises(pool: Pool, tmp_path: Path):
    script = write(tmp_path, "fails.py", "print('started')\nraise KeyError('missing')\n")
    with pytest.raises(RankError, match="KeyError: 'missing'"):
        pool.run(f"%run {script}", stream=False)
    quiet = write(tmp_path, "exits.py", "import sys\nsys.exit(0)\n")
    pool.run(f"%run {quiet}", stream=False)  # a clean exit is no failure


def test_a_run_on_part_of_the_ranks(pool: Pool, tmp_path: Path):
    script = write(
        tmp_path,
        "one_rank.py",
        """
        import os, torch
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
        who = os.environ["RANK"]
        """,
    )
    pool.run("who = 'a cell'", stream=False)
    status = pool.run_script(script, targets=[1], stop_at=2)
    assert status.paused and status.ranks == (1,) and status.steps == 2
    assert pool.continue_script().steps == 4  # the paused rank only
    assert values(pool, "who") == {0: "a cell", 1: "1"}


def test_cwd_and_sibling_imports(pool: Pool, tmp_path: Path):
    folder = tmp_path / "project"
    folder.mkdir()
    write(folder, "helpers.py", "ANSWER = 42\n")
    script = write(
        folder, "uses_helper.py", "import os\nfrom helpers import ANSWER\nhere = os.getcwd()\n"
    )
    pool.run_script(script, cwd=tmp_path)
    assert values(pool, "(ANSWER, here)") == {r: (42, str(tmp_path)) for r in (0, 1)}
    assert values(pool, "import os; os.getcwd() != here") == {0: True, 1: True}
    assert os.getcwd() != str(tmp_path)


# Each step waits for the test to let it go (a file go-STEP), after saying it arrived
# (at-RANK-STEP): the test then knows where every rank stands when it presses Ctrl-C.
STEPS_ON_CUE = """
import os, sys, time
import torch

folder = sys.argv[1]
model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1000):
    open(os.path.join(folder, f"at-{os.environ['RANK']}-{step}"), "w").close()
    while not os.path.exists(os.path.join(folder, f"go-{step}")):
        time.sleep(0.01)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
"""


def _waiting_call() -> object | None:
    """The :class:`PendingCall` this process's main thread waits in, if any."""
    from fsdp_interactive.pool._dispatch import PendingCall

    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None and frame.f_code is not PendingCall.wait.__code__:
        frame = frame.f_back
    return frame.f_locals.get("self") if frame is not None else None


def _in_background(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def _until(condition: Callable[[], bool], timeout: float = 120) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timing
def test_first_interrupt_pauses_at_the_next_step_second_stops(pool: Pool, tmp_path: Path):
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    script = write(tmp_path, "on_cue.py", STEPS_ON_CUE)
    (tmp_path / "go-0").touch()
    arrived = lambda step: all((tmp_path / f"at-{r}-{step}").exists() for r in (0, 1))  # noqa: E731
    called = threading.Event()

    def press_once_then_let_go() -> None:
        # both ranks wait at step 1: Ctrl-C asks for a pause; then every step may go on
        if _until(lambda: arrived(1) and _waiting_call() is not None):
            os.kill(os.getpid(), signal.SIGINT)
            step = 1
            while not called.is_set() and step < 50:
                (tmp_path / f"go-{step}").touch()
                _until(lambda s=step: arrived(s + 1) or called.is_set(), timeout=30)
                step += 1

    thread = _in_background(press_once_then_let_go)
    try:
        status = pool.run_script(script, [str(tmp_path)])
    finally:
        called.set()
        thread.join(30)
    assert status.paused and status.paused_by == "interrupt" and status.steps >= 2
    assert not any((tmp_path / f"at-{r}-{status.steps}").exists() for r in (0, 1))

    # continued, both ranks wait for a step that never comes: Ctrl-C twice stops the run
    waiting_for = status.steps + 1

    def press_twice() -> None:
        if _until(lambda: arrived(waiting_for) and _waiting_call() is not None):
            os.kill(os.getpid(), signal.SIGINT)
            _until(lambda: getattr(_waiting_call(), "_on_interrupt", None) is None)
            time.sleep(0.3)  # the ranks take the first before the second
            os.kill(os.getpid(), signal.SIGINT)

    for step in range(status.steps, waiting_for):
        (tmp_path / f"go-{step}").touch()
    thread = _in_background(press_twice)
    with pytest.raises(RankInterrupted):
        pool.continue_script()
    thread.join(30)
    after = pool.script_status()
    assert after.state == "interrupted" and after.steps == waiting_for
    assert values(pool, "type(model).__name__") == {0: "Linear", 1: "Linear"}  # kept
    assert not pool.needs_restart and not pool.busy_ranks()


@pytest.mark.world4
def test_fsdp1_script_on_four_ranks_equals_torchrun(profile_dir: str, tmp_path: Path):
    script = SCRIPTS / "plain_fsdp1.py"
    torchrun(script, 4, "--steps", "6", "--save", str(tmp_path / "torchrun"))
    four = Pool(n=4, devices="cpu", profile_dir=profile_dir, show_topology=False)
    try:
        four.start()
        record(four)
        status = four.run_script(
            script, ["--steps", "6", "--save", str(tmp_path / "pool")], stop_at=4
        )
        assert status.paused and status.steps_by_rank == {0: 4, 1: 4, 2: 4, 3: 4}
        assert values(four, "int(os.environ['WORLD_SIZE'])") == {r: 4 for r in range(4)}
        assert four.continue_script().steps == 6
    finally:
        four.stop()
        record(four)
    assert differences(tmp_path / "torchrun", tmp_path / "pool", 4) == []


@pytest.mark.timing
def test_a_hanging_script_is_reported_with_its_own_frames(pool: Pool, tmp_path: Path):
    go = tmp_path / "go"
    script = write(
        tmp_path,
        "waits.py",
        f"""
        import os, time
        import torch.distributed as dist

        def main():
            if dist.get_rank() == 1:
                while not os.path.exists({str(go)!r}):
                    time.sleep(0.05)
            dist.barrier()

        main()
        """,
    )
    try:
        with pytest.raises(RankTimeout) as hung:
            pool.run_script(script, timeout=2)
    finally:
        go.touch()
    text = str(hung.value)
    assert "rank 0: in barrier" in text and "waits.py" in text
    assert "rank 1 never issued #" in text  # the collectives, compared
    hung.value.wait()
    assert pool.script_status().state == "ended"
