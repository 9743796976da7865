"""CheckpointPanel against the real pool: save, async save, list, load, delete."""

from __future__ import annotations

import time

import pytest
import torch

from fsdp_interactive.notebook import CheckpointPanel, RankModel

SETUP = """
from tests.models import backward, sharded_and_reference
ckpt_model, _ = sharded_and_reference(seed=3)
ckpt_optim = torch.optim.Adam(ckpt_model.parameters(), lr=0.01)
backward(ckpt_model)
ckpt_optim.step()
"""


@pytest.fixture()
def panel(pool_shell, tmp_path):
    from fsdp_interactive.notebook.magics import current_pool

    pool = current_pool()
    pool.run(SETUP, stream=False)
    try:
        yield CheckpointPanel(
            RankModel(pool, "ckpt_model", optimizer="ckpt_optim"), str(tmp_path / "ckpts")
        )
    finally:
        if pool.running:
            pool.run("del ckpt_model, ckpt_optim", stream=False)


def weights(pool):
    pool.run("_w = ckpt_model.embed.weight.full_tensor().detach()", stream=False)
    return pool.pull("_w")[0]


def test_save_list_load_delete(panel):
    pool = panel.source.pool
    assert panel.records == [] and "(none yet)" in panel.text()
    saved = weights(pool)
    result = panel.save(step=1)
    assert result.step == 1 and result.size_bytes > 0
    assert [r.name for r in panel.records] == ["step-1"]
    assert panel.records[0].has_optimizer and panel.records[0].world_size == 2
    assert "step-1" in panel.text()

    pool.run(
        "_fsdp_interactive_edit = __import__('fsdp_interactive.inspect', fromlist=['x'])"
        ".edit_param(ckpt_model, 'embed.weight', 'x * 0')",
        stream=False,
    )
    assert not torch.equal(weights(pool), saved)
    report = panel.load("step-1")
    assert report.step == 1 and report.loaded_optimizer
    assert torch.equal(weights(pool), saved)

    with pytest.raises(ValueError, match="confirm=True"):
        panel.delete("step-1")
    with pytest.raises(ValueError, match="no checkpoint named 'nope'"):
        panel.load("nope")
    panel.delete("step-1", confirm=True)
    assert panel.records == []


def test_async_save_through_the_widget(panel):
    widget = panel.widget
    panel._name.value = "async-one"
    panel._step.value = 7
    panel._async.value = True
    panel._save_button.click()  # waits, polling, until the background save is published
    assert panel.pending is None and "saved async-one" in panel._status.value
    assert [r.name for r in panel.records] == ["async-one"]
    assert panel.records[0].step == 7
    assert list(panel._choice.options) == ["async-one"]
    panel._delete_button.click()  # not confirmed: refused, shown in the panel
    assert (
        panel._status.value
        == "tick &#x27;yes, delete it&#x27; to delete &#x27;async-one&#x27;: it cannot be undone"
    )
    assert "confirm=True" not in panel._status.value and panel.records
    panel._confirm_delete.value = True
    panel._delete_button.click()
    assert panel.records == [] and widget is panel.widget


def test_async_save_call_form(panel):
    assert panel.save("bg", step=2, asynchronous=True) is None
    assert panel.pending == "bg"
    with pytest.raises(RuntimeError, match="still running"):
        panel.save("other")
    deadline = time.monotonic() + 180
    while not panel.poll() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert panel.pending is None, "the asynchronous save 'bg' did not finish within 180 s"
    assert [r.name for r in panel.records] == ["bg"]


def set_weights(pool, expression):
    pool.run(
        "__import__('fsdp_interactive.inspect', fromlist=['x'])"
        f".edit_param(ckpt_model, 'embed.weight', {expression!r})",
        stream=False,
    )


def test_load_after_save_loads_what_was_just_saved(panel):
    pool = panel.source.pool
    widget = panel.widget
    assert panel.selected is None and panel._choice.value is None
    with pytest.raises(ValueError, match=r"no checkpoint in .* to load; save one first"):
        panel.load()
    panel.save(step=5)
    at_step_5 = weights(pool)
    assert panel.selected == "step-5"

    # Saved with a lower step, it is listed first, not last: still the one selected.
    set_weights(pool, "x + 1")
    fixed = weights(pool)
    panel._name.value = "fixed"
    panel._step.value = 2
    panel._save_button.click()
    assert [r.name for r in panel.records] == ["fixed", "step-5"]
    assert panel.selected == "fixed" and panel._choice.value == "fixed"
    set_weights(pool, "x * 0")
    panel._load_button.click()
    assert "loaded fixed (step 2)" in panel._status.value
    assert torch.equal(weights(pool), fixed)

    # The same through calls: save, then load() with no name.
    set_weights(pool, "x - 3")
    again = weights(pool)
    panel.save("again", step=1)
    assert panel.selected == "again" and panel._choice.value == "again"
    set_weights(pool, "x * 0")
    assert panel.load().step == 1 and torch.equal(weights(pool), again)

    # Picking another: by call (the dropdown follows) or in the dropdown (the panel follows).
    assert panel.select("step-5").step == 5 and panel._choice.value == "step-5"
    assert panel.load().step == 5 and torch.equal(weights(pool), at_step_5)
    panel._choice.value = "fixed"
    assert panel.selected == "fixed"
    with pytest.raises(ValueError, match="no checkpoint named 'nope'"):
        panel.select("nope")
    # Deleting the selected one selects the newest left.
    panel.delete("fixed", confirm=True)
    assert panel.selected == "step-5" and panel._choice.value == "step-5"
    assert widget is panel.widget
