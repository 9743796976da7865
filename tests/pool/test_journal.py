"""The journal on a real 2-rank pool: every run is an entry with its outcome, the ranks know
which call they run, and the notices they send unasked reach the kernel (also from a rank
that dies right after sending one)."""

from __future__ import annotations

import pytest

from fsdp_interactive.pool import Pool, RankDied, RankError
from fsdp_interactive.pool._journal import Journal

NOTICE = (
    "from fsdp_interactive import _notices\n"
    "if rank == 0:\n"
    "    _notices.publish({{'kind': 'snapshot', 'id': {id!r}, 'step': {step},\n"
    "                      'created': 1.0, 'call': _notices.current_call()}})\n"
)


def test_every_run_is_an_entry_with_its_cell_targets_and_outcome(pool: Pool):
    before = len(pool.journal.entries)
    pool.run("x_journal = rank", cell=41, stream=False)
    with pytest.raises(RankError):
        pool.run("raise ValueError('no')", cell=42, stream=False)
    pool.run("y_journal = 1", targets=[1], stream=False, replay=False)
    pool.run("z_journal = 1", stream=False, journal=False)
    entries = pool.journal.entries[before:]
    assert [(e.cell, e.outcome, e.replay, e.targets) for e in entries] == [
        (41, "ok", None, None),
        (42, "error", None, None),
        (None, "ok", False, [1]),
    ]
    assert entries[0].source == "x_journal = rank"
    assert all(e.seconds is not None and e.seconds >= 0 for e in entries)
    table = pool.journal.table(last=3)
    assert "In[41]" in table and "error" in table and "x_journal = rank" in table


def test_ranks_see_the_call_they_run_and_nothing_after(pool: Pool):
    code = "from fsdp_interactive import _notices\n_notices.current_call(), _notices.replaying()"
    result = pool.run(code, stream=False)
    entry = pool.journal.entries[-1]
    assert result.results == {0: f"({entry.id}, False)", 1: f"({entry.id}, False)"}
    replayed = pool.run(code, stream=False, journal=False, replaying=True)
    assert replayed.results[0] == "(None, True)"
    after = pool.call(_current_call)
    assert after == [None, None]


def _current_call():
    from fsdp_interactive import _notices

    return _notices.current_call()


def test_a_snapshot_notice_reaches_the_book_and_the_entry_that_took_it(pool: Pool):
    pool.run(NOTICE.format(id="s900001", step=7), cell=50, stream=False)
    entry = pool.journal.entries[-1]
    known = {s.id: s for s in pool.snapshots()}
    assert known["s900001"].step == 7
    assert known["s900001"].call == entry.id
    assert entry.snapshots == ["s900001"]
    assert "s900001" in pool.journal.table(last=1)


def test_a_notice_sent_just_before_a_rank_dies_is_kept(pool: Pool):
    code = NOTICE.format(id="s900002", step=8) + (
        "import os, signal\nif rank == 0:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    with pytest.raises(RankDied):
        pool.run(code, stream=False)
    assert pool.journal.entries[-1].outcome == "died"
    assert "s900002" in [s.id for s in pool.snapshots()]
    pool.restart()
    assert pool.journal.epoch.number == pool.journal.entries[-1].epoch + 1


def test_replay_for_takes_the_epoch_base_and_the_successful_entries_before():
    journal = Journal()
    journal.new_epoch()
    setup = journal.begin("model = ...", cell=1)
    journal.finish(setup, "ok")
    broken = journal.begin("oops", cell=2)
    journal.finish(broken, "error")
    loop = journal.begin("for step in ...: snapshot()", cell=3, replay=False)
    journal.finish(loop, "ok")
    taker = journal.begin("snapshot()", cell=4)
    journal.finish(taker, "ok")
    later = journal.begin("later", cell=5)
    journal.finish(later, "ok")
    # The --no-replay loop is a candidate: the slice keeps it out, saying so.
    assert journal.replay_for(taker.id) == [setup, loop]
    assert journal.replay_for(None) == [setup, loop, taker, later]
    assert not loop.replayable and setup.replayable
    # A recovery to the snapshot of cell 4 begins an epoch resting on what it replayed.
    journal.new_epoch()
    journal.set_base([setup], "s000001")
    more = journal.begin("more", cell=6)
    journal.finish(more, "ok")
    second = journal.begin("snapshot()", cell=7)
    journal.finish(second, "ok")
    assert journal.replay_for(second.id) == [setup, more]
    # A restart begins an epoch with nothing behind it.
    journal.new_epoch()
    fresh = journal.begin("fresh", cell=8)
    journal.finish(fresh, "ok")
    assert journal.replay_for(None) == [fresh]
    with pytest.raises(ValueError, match="outcome must be one of"):
        journal.finish(fresh, "maybe")
