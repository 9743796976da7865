"""Checkpoint panel: save (sync or async) with progress, list, load, delete (notebook side).

Built on :mod:`fsdp_interactive.checkpoint`: saves and loads are collectives run on every
rank; listing reads rank 0's view of the folder; deleting removes a listed checkpoint's
folder on rank 0's file system (the folder every rank writes to).
"""

from __future__ import annotations

import html
import shutil
import time
from datetime import datetime, timezone
from typing import Any

from fsdp_interactive._text import human_bytes, text_table
from fsdp_interactive.notebook._error_note import ErrorNote
from fsdp_interactive.notebook._format import html_table
from fsdp_interactive.notebook._view import StatusView
from fsdp_interactive.notebook.rank_model import RankModel

_HANDLE = "_fsdp_interactive_save_handle"
_HEADERS = ("name", "step", "saved by", "created (UTC)", "size", "optimizer")


class CheckpointPanel(StatusView):
    """Save, list, load and delete the checkpoints of a model on the ranks.

    ``root`` is the folder holding one sub-folder per checkpoint (as seen by the ranks).
    Every button is also a call: ``save(name, step, asynchronous)``, ``poll()`` /
    ``wait()`` for an async save, ``refresh()``, ``select(name)``, ``load(name)`` and
    ``delete(name, confirm=True)``.  ``selected`` is the checkpoint the dropdown shows and
    ``load()`` without a name loads: the newest at first, then the one just saved (after a
    save, Load loads what was saved, whatever its step) or the one picked.  ``keep_last``
    is passed to every save.  Not done: resuming data loaders or schedulers (put their
    state into ``extra``).
    """

    def __init__(self, source: RankModel, root: str, keep_last: int | None = None):
        if not isinstance(source, RankModel):
            raise TypeError(f"source must be a RankModel, got {type(source).__name__}")
        if not isinstance(root, str) or not root:
            raise ValueError(f"root must be a folder path as the ranks see it, got {root!r}")
        self.source = source
        self.root = root
        self.keep_last = keep_last
        self.records: list[Any] = []
        self.selected: str | None = None
        self.status = ""
        self.error: ErrorNote | None = None
        self.pending: str | None = None
        self._pending_started = 0.0
        self.refresh()

    # ------------------------------------------------------------------ calls

    def refresh(self) -> list[Any]:
        """List the published checkpoints (oldest first), as rank 0 sees the folder.

        The selection stays where it was while that checkpoint is listed, else moves to the
        newest (None when there is none).
        """
        self.records = self.source.evaluate(
            f"_fsdp_interactive_checkpoint.list_checkpoints({self.root!r})", targets=[0]
        )[0]
        names = [r.name for r in self.records]
        if self.selected not in names:
            self.selected = names[-1] if names else None
        self._changed()
        return self.records

    def select(self, name: str) -> Any:
        """Select the published checkpoint ``name`` (what ``load()`` loads); its record."""
        record = self._record(name)
        self.selected = name
        self._changed()
        return record

    def _path(self, name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"name must be a plain folder name like 'step-100', got {name!r}")
        return f"{self.root.rstrip('/')}/{name}"

    def save(
        self,
        name: str | None = None,
        step: int | None = None,
        asynchronous: bool = False,
        overwrite: bool = False,
    ) -> Any:
        """Save now; returns the SaveResult, or None for an async save (see ``poll``)."""
        if self.pending is not None:
            raise RuntimeError(
                f"an async save to {self.pending!r} is still running; call wait() first"
            )
        if name is None:
            name = (
                f"step-{step}"
                if step is not None
                else datetime.now(timezone.utc).strftime("ckpt-%Y%m%d-%H%M%S")
            )
        path = self._path(name)
        model = self.source.model
        optimizer = self.source.optimizer or "None"
        arguments = (
            f"{path!r}, {model}, {optimizer}, step={step!r}, keep_last={self.keep_last!r}, "
            f"overwrite={overwrite!r}"
        )
        if not asynchronous:
            result = self.source.evaluate(f"_fsdp_interactive_checkpoint.save({arguments})")[0]
            self.status = f"saved {name}: {human_bytes(result.size_bytes)} in {result.seconds:.2f}s"
            self.selected = name
            self.refresh()
            return result
        self.source.pool.run(
            "import fsdp_interactive.checkpoint as _fsdp_interactive_checkpoint\n"
            f"{_HANDLE} = _fsdp_interactive_checkpoint.async_save({arguments})\n"
            "del _fsdp_interactive_checkpoint\n",
            stream=False,
            journal=False,
        )
        self.pending = name
        self._pending_started = time.monotonic()
        self.status = f"saving {name} in the background (training can go on)"
        self._changed()
        return None

    def poll(self) -> bool:
        """True when no async save is running (the last one finished); updates the status."""
        if self.pending is None:
            return True
        done = self.source.evaluate(f"{_HANDLE}.done()")
        if all(done):
            self.wait()
            return True
        elapsed = time.monotonic() - self._pending_started
        self.status = (
            f"saving {self.pending}: {sum(done)}/{len(done)} ranks done after {elapsed:.1f}s"
        )
        self._changed()
        return False

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the running async save; its SaveResult (None if none was running)."""
        if self.pending is None:
            return None
        name = self.pending
        try:
            result = self.source.evaluate(f"{_HANDLE}.wait({timeout!r})")[0]
        except Exception as error:
            self.status = f"saving {name} failed: {error}"
            self.pending = None
            self._changed()
            raise
        self.source.pool.run(f"del {_HANDLE}", stream=False, journal=False)
        self.pending = None
        self.status = f"saved {name}: {human_bytes(result.size_bytes)} in {result.seconds:.2f}s"
        self.selected = name
        self.refresh()
        return result

    def load(self, name: str | None = None, strict: bool = True) -> Any:
        """Load checkpoint ``name`` (default: the selected one) into the model (and
        optimizer) on every rank."""
        if name is None:
            name = self.selected
            if name is None:
                raise ValueError(
                    f"no checkpoint in {self.root} to load; save one first: save(step=N)"
                )
        self._record(name)
        model = self.source.model
        optimizer = self.source.optimizer or "None"
        report = self.source.evaluate(
            f"_fsdp_interactive_checkpoint.load({self._path(name)!r}, {model}, {optimizer}, "
            f"strict={strict!r})"
        )[0]
        self.source.pool.journal.note_outside(f"checkpoint {name} loaded into {model}")
        self.status = f"loaded {name} (step {report.step}) in {report.seconds:.2f}s"
        self._changed()
        return report

    def delete(self, name: str, confirm: bool = False) -> None:
        """Delete the published checkpoint ``name``; refuses without ``confirm=True``."""
        record = self._record(name)
        if not confirm:
            raise ValueError(
                f"deleting {name!r} cannot be undone; call delete({name!r}, confirm=True)"
            )
        self.source.pool.call(shutil.rmtree, record.path, targets=[0])
        self.status = f"deleted {name}"
        self.refresh()

    def _record(self, name: str) -> Any:
        for record in self.records:
            if record.name == name:
                return record
        self.refresh()
        for record in self.records:
            if record.name == name:
                return record
        known = ", ".join(r.name for r in self.records) or "none"
        raise ValueError(f"no checkpoint named {name!r} in {self.root}; published: {known}")

    # ------------------------------------------------------------------ display

    def _rows(self) -> list[tuple[str, ...]]:
        return [
            (
                r.name,
                "-" if r.step is None else str(r.step),
                f"{r.world_size} ranks",
                r.created_utc,
                human_bytes(r.size_bytes),
                "yes" if r.has_optimizer else "no",
            )
            for r in self.records
        ]

    def text(self) -> str:
        """The panel as plain text: the checkpoint folder, a row per checkpoint, the last action's
        status."""
        head = f"checkpoints in {self.root}: {len(self.records)}"
        table = text_table(_HEADERS, self._rows()) if self.records else "(none yet)"
        return "\n".join(filter(None, [head, table, self.status]))

    def html(self, figures: bool = True) -> str:
        return (
            f"<b>checkpoints in {self.root}: {len(self.records)}</b>"
            + html_table(_HEADERS, self._rows())
            + (f"<div>{html.escape(self.status)}</div>" if self.status else "")
        )

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._table = w.HTML()
        self._status = w.HTML()
        # Rows wrap rather than squeeze: a squeezed flex row cuts buttons to "S..." and the
        # progress bar to a dot (inside the Dashboard's tabs above all).
        fixed = {"flex": "0 0 auto"}
        self._name = w.Text(
            placeholder="name (default: step-N or time)",
            description="name",
            layout=w.Layout(width="300px", **fixed),
        )
        self._step = w.IntText(value=0, description="step", layout=w.Layout(width="160px", **fixed))
        self._async = w.Checkbox(
            value=False,
            description="async (train on while saving)",
            indent=False,
            layout=w.Layout(width="auto", **fixed),
        )
        self._save_button = w.Button(
            description="Save now", icon="save", layout=w.Layout(width="auto", **fixed)
        )
        self._progress = w.IntProgress(
            value=0,
            min=0,
            max=1,
            description="save",
            layout=w.Layout(width="240px", height="24px", **fixed),
        )
        self._choice = w.Dropdown(
            options=[], description="checkpoint", layout=w.Layout(width="320px", **fixed)
        )
        self._load_button = w.Button(
            description="Load", icon="upload", layout=w.Layout(width="auto", **fixed)
        )
        self._delete_button = w.Button(
            description="Delete", button_style="danger", layout=w.Layout(width="auto", **fixed)
        )
        self._confirm_delete = w.Checkbox(
            value=False,
            description="yes, delete it",
            indent=False,
            layout=w.Layout(width="auto", **fixed),
        )
        self._refresh_button = w.Button(
            description="Refresh", icon="refresh", layout=w.Layout(width="auto", **fixed)
        )
        self._choice.observe(self._on_choice, names="value")
        self._save_button.on_click(lambda _: self._guard(self._click_save))
        self._load_button.on_click(lambda _: self._guard(self._click_load))
        self._delete_button.on_click(lambda _: self._guard(self._click_delete))
        self._refresh_button.on_click(lambda _: self._guard(self.refresh))
        return w.VBox(
            [
                w.HBox(
                    [self._name, self._step, self._async, self._save_button, self._progress],
                    layout=w.Layout(flex_flow="row wrap", align_items="center"),
                ),
                w.HBox(
                    [
                        self._choice,
                        self._load_button,
                        self._delete_button,
                        self._confirm_delete,
                        self._refresh_button,
                    ],
                    layout=w.Layout(flex_flow="row wrap", align_items="center"),
                ),
                self._table,
                self._status,
            ]
        )

    def _click_save(self) -> None:
        if self.pending is not None:
            self._refuse(f"the background save of {self.pending!r} is still running; wait for it")
            return
        name = self._name.value.strip() or None
        self.save(name=name, step=self._step.value, asynchronous=self._async.value)
        if self._async.value:
            while not self.poll():
                time.sleep(0.2)

    def _on_choice(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] is not None and change["new"] != self.selected:
            self._guard(lambda: self.select(change["new"]))

    _syncing = False

    def _click_load(self) -> None:
        if self.selected is None:
            self._refuse("no checkpoint is selected")
            return
        self.load(self.selected)

    def _click_delete(self) -> None:
        name = self.selected
        if name is None:
            self._refuse("no checkpoint is selected")
            return
        if not self._confirm_delete.value:
            self._refuse(f"tick 'yes, delete it' to delete {name!r}: it cannot be undone")
            return
        self.delete(name, confirm=True)
        self._confirm_delete.value = False

    def _refuse(self, reason: str) -> None:
        """Say in the panel why a click did nothing (in the panel's own words)."""
        self.error = None
        self.status = reason
        self._changed()

    def _update_widget(self) -> None:
        self._table.value = html_table(_HEADERS, self._rows())
        self._status.value = self._status_html()
        names = [r.name for r in self.records]
        self._syncing = True  # the dropdown follows ``selected``; it does not set it here
        try:
            if list(self._choice.options) != names:
                self._choice.options = names
            if self._choice.value != self.selected:
                self._choice.value = self.selected
        finally:
            self._syncing = False
        finished = self.pending is None and self.status.startswith("saved")
        self._progress.value = 1 if finished else 0
        self._progress.bar_style = "success" if finished else "info"
