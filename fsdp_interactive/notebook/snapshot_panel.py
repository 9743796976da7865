"""Snapshot panel: the snapshots in the ranks' host memory, Snapshot now, and Recover
(notebook side).

The list is the kernel's (``pool.snapshots()``: what the ranks reported), so refreshing it
asks no rank; after a fault it still shows what a recovery can go back to. Each snapshot
is shown with the cell it was taken in (``In[3]``), or, for one taken between cells (this
panel, ``%fsdp snapshot`` in a cell of its own is ``In[N]`` too), the cell it follows.

Each snapshot is listed with the objects it holds (where they were). Snapshot now runs
``fsdp_interactive.snapshot`` on every rank for the panel's model and optimizer (with
``keep_last``, which counts snapshots of these objects only: one of another model is never
dropped for it; its status line names any snapshot it dropped), at the step typed in the step field or, when it is empty, at the training's own
step: the :class:`~fsdp_interactive.checkpoint.StepCounter` the newest snapshot kept, or
the one step counter the ranks hold (given as ``step=``, so its value is recorded and a
recovery restores it in place); without either, no step is recorded (never a made-up 0).

Recover runs ``pool.recover()`` (after a dead rank, a wedged collective or at any time):
while it runs the buttons are disabled, the status line follows its phases and the last
status and plan are gone; its report is shown when it ends. A plan (Plan recovery) is
dropped once the snapshot it names is gone.
"""

from __future__ import annotations

import html
import time
from typing import Any

from fsdp_interactive._text import human_bytes, text_table
from fsdp_interactive.notebook._error_note import ErrorNote
from fsdp_interactive.notebook._format import html_table
from fsdp_interactive.notebook._snapshot_taking import take_snapshot
from fsdp_interactive.notebook._view import StatusView
from fsdp_interactive.notebook.rank_model import RankModel

_HEADERS = ("snapshot", "step", "holds", "age", "taken in", "memory per host")
#: The rank-side expression listing the step counters of the namespace (rank 0's).
_COUNTERS = (
    "sorted(k for k, v in globals().items() if not k.startswith('_') "
    "and isinstance(v, _fsdp_interactive_checkpoint.StepCounter))"
)


class SnapshotPanel(StatusView):
    """The snapshots of the pool that ``source`` probes; every button is also a call:
    ``refresh()``, ``snapshot(step=None)`` and ``recover(dry_run=False)``.

    ``report`` is the last recovery's report (or plan, for a dry run); ``status`` says
    what the last click did, or, while a recovery runs (``busy``), its latest phase. A
    snapshot keeps ``source.model`` and ``source.optimizer`` (and each rank's random
    generators); ``keep_last`` is passed to every snapshot.
    """

    def __init__(self, source: RankModel, keep_last: int = 1):
        if not isinstance(source, RankModel):
            raise TypeError(f"source must be a RankModel, got {type(source).__name__}")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a number of snapshots >= 1, got {keep_last!r}")
        self.source = source
        self.keep_last = keep_last
        self.snapshots: list[Any] = []
        self.report: Any = None
        self.status = ""
        self.error: ErrorNote | None = None
        self.busy = False
        self.refresh()

    # ------------------------------------------------------------------ calls

    def refresh(self) -> list[Any]:
        """The snapshots the kernel knows, oldest first (no rank is asked); a plan whose
        snapshot is gone is dropped."""
        self.snapshots = self.source.pool.snapshots()
        planned = getattr(self.report, "snapshot", None) if _is_plan(self.report) else None
        if planned is not None and planned.id not in {s.id for s in self.snapshots}:
            self.report = None
        self._changed()
        return self.snapshots

    def step_counter(self) -> str | None:
        """The rank variable holding the training's step counter: the one the newest
        snapshot kept as ``step``, else the only ``StepCounter`` of rank 0's namespace;
        ``None`` when there is none (or several)."""
        if self.snapshots:
            kept = (self.snapshots[-1].names.get("stateful") or {}).get("step")
            if isinstance(kept, str) and kept.isidentifier():
                return kept
        found = self.source.evaluate(_COUNTERS, targets=[0])[0]
        return found[0] if len(found) == 1 else None

    def snapshot(self, step: int | str | None = None) -> Any:
        """Take a snapshot now (collective); its record. ``step``: a number, or the rank
        variable of a ``StepCounter``; ``None``: :meth:`step_counter` (no step if none)."""
        if step is None:
            step = self.step_counter()
        self.report = None  # a plan or report of the state before this snapshot
        taken = take_snapshot(
            self.source.pool,
            self.source.model,
            self.source.optimizer,
            step=step,
            keep_last=self.keep_last,
            shown="Snapshot now (snapshot panel)",
        )
        self.status = taken.taken_line() if not isinstance(taken, str) else f"took {taken}"
        self.refresh()
        return taken

    def recover(self, dry_run: bool = False) -> Any:
        """``pool.recover()`` (``dry_run``: the plan only); its report, also in ``report``.
        While it runs, ``busy`` is true and ``status`` shows its latest phase."""
        self.busy, self.report, self.error = True, None, None
        self._progress("planning the recovery" if dry_run else "recovering")
        try:
            self.report = self.source.pool.recover(dry_run=dry_run, say=self._progress)
        finally:
            self.busy = False
        self.status = str(self.report).splitlines()[0]
        self.refresh()
        return self.report

    def _progress(self, line: str) -> None:
        self.status = line.splitlines()[0] if line else line
        self._changed()

    # ------------------------------------------------------------------ display

    def _taken_in(self, call: int | None) -> str:
        """``In[3]`` for a snapshot taken in cell 3, ``after In[5]`` for one taken between
        cells (after cell 5), ``-`` when the journal does not say."""
        entries = self.source.pool.journal.entries
        entry = next((e for e in entries if e.id == call), None) if call is not None else None
        if entry is None:
            return "-"
        if entry.cell is not None:
            return entry.label
        before = [e for e in entries if e.id < entry.id and e.cell is not None]
        return f"after {before[-1].label}" if before else "-"

    def _rows(self) -> list[tuple[str, ...]]:
        now = time.time()
        rows = []
        for info in self.snapshots:
            per_host = max(info.bytes_per_host.values(), default=0)
            rows.append(
                (
                    info.id,
                    "-" if info.step is None else str(info.step),
                    info.holding,
                    info.describe(now).rsplit("(taken ", 1)[-1].removesuffix(")"),
                    self._taken_in(info.call),
                    human_bytes(per_host) if per_host else "-",
                )
            )
        return rows

    def _report_text(self) -> str:
        return "" if self.report is None else str(self.report)

    def text(self) -> str:
        """The panel as plain text: a row per snapshot in host memory, the last action's status and
        the last recovery's report."""
        head = f"snapshots in host memory: {len(self.snapshots)}"
        table = text_table(_HEADERS, self._rows()) if self.snapshots else "(none yet)"
        return "\n".join(filter(None, [head, table, self.status, self._report_text()]))

    def html(self, figures: bool = True) -> str:
        report = self._report_text()
        return (
            f"<b>snapshots in host memory: {len(self.snapshots)}</b>"
            + html_table(_HEADERS, self._rows())
            + (f"<div>{html.escape(self.status)}</div>" if self.status else "")
            + (f"<pre>{html.escape(report)}</pre>" if report else "")
        )

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._table = w.HTML()
        self._status = w.HTML()
        self._report = w.HTML()
        fixed = {"flex": "0 0 auto"}
        self._step = w.Text(
            value="",
            placeholder="the step counter",
            description="step",
            tooltip="a step number, or the rank variable of a StepCounter; empty: the "
            "training's step counter",
            layout=w.Layout(width="220px", **fixed),
        )
        self._snapshot_button = w.Button(
            description="Snapshot now", icon="camera", layout=w.Layout(width="auto", **fixed)
        )
        self._plan_button = w.Button(
            description="Plan recovery", icon="list", layout=w.Layout(width="auto", **fixed)
        )
        self._recover_button = w.Button(
            description="Recover",
            icon="undo",
            button_style="warning",
            tooltip="back to the newest snapshot: a fresh group, the setup cells replayed",
            layout=w.Layout(width="auto", **fixed),
        )
        self._refresh_button = w.Button(
            description="Refresh", icon="refresh", layout=w.Layout(width="auto", **fixed)
        )
        self._snapshot_button.on_click(
            lambda _: self._guard(lambda: self.snapshot(step=self._typed_step()))
        )
        self._plan_button.on_click(lambda _: self._guard(lambda: self.recover(dry_run=True)))
        self._recover_button.on_click(lambda _: self._guard(self.recover))
        self._refresh_button.on_click(lambda _: self._guard(self.refresh))
        self._buttons = (
            self._snapshot_button,
            self._plan_button,
            self._recover_button,
            self._refresh_button,
        )
        row = w.HBox(
            [self._step, *self._buttons],
            layout=w.Layout(flex_flow="row wrap", align_items="center"),
        )
        return w.VBox([row, self._table, self._status, self._report])

    def _typed_step(self) -> int | str | None:
        """The step field: a number, a rank variable name, or ``None`` when empty."""
        text = str(self._step.value).strip()
        if not text:
            return None
        if text.isdigit():
            return int(text)
        if text.isidentifier():
            return text
        raise ValueError(
            f"step {text!r}: type a step number or the rank variable of a StepCounter, "
            "or leave it empty for the training's step counter"
        )

    def _update_widget(self) -> None:
        self._table.value = html_table(_HEADERS, self._rows())
        self._status.value = self._status_html()
        report = self._report_text()
        self._report.value = f"<pre>{html.escape(report)}</pre>" if report else ""
        for button in self._buttons:
            button.disabled = self.busy
        self._step.disabled = self.busy
        self._recover_button.disabled = self.busy or not self.snapshots


def _is_plan(report: Any) -> bool:
    """Whether ``report`` is a recovery's plan (a dry run), not what a recovery did."""
    return report is not None and not hasattr(report, "phases")
