"""Snapshot panel: the snapshots in the ranks' host memory, Snapshot now, and Recover
(notebook side).

The list is the kernel's (``pool.snapshots()``: what the ranks reported), so refreshing it
asks no rank; after a fault it still shows what a recovery can go back to. Snapshot now
runs ``fsdp_interactive.snapshot`` on every rank for the panel's model and optimizer;
Recover runs ``pool.recover()`` (after a dead rank, a wedged collective or at any time)
and shows its report.
"""

from __future__ import annotations

import html
import time
from typing import Any

from fsdp_interactive._text import human_bytes, text_table
from fsdp_interactive.notebook._error_note import ErrorNote
from fsdp_interactive.notebook._format import html_table
from fsdp_interactive.notebook._snapshot_calls import take_snapshot
from fsdp_interactive.notebook._view import StatusView
from fsdp_interactive.notebook.rank_model import RankModel

_HEADERS = ("snapshot", "step", "age", "taken in", "memory per host")


class SnapshotPanel(StatusView):
    """The snapshots of the pool that ``source`` probes; every button is also a call:
    ``refresh()``, ``snapshot(step=None)`` and ``recover(dry_run=False)``.

    ``report`` is the last recovery's report (or plan, for a dry run); ``status`` says
    what the last click did. A snapshot keeps ``source.model`` and ``source.optimizer``
    (and each rank's random generators); ``keep_last`` is passed to every snapshot.
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
        self.refresh()

    # ------------------------------------------------------------------ calls

    def refresh(self) -> list[Any]:
        """The snapshots the kernel knows, oldest first (no rank is asked)."""
        self.snapshots = self.source.pool.snapshots()
        self._changed()
        return self.snapshots

    def snapshot(self, step: int | str | None = None) -> Any:
        """Take a snapshot now (collective); its record. ``step``: a number, or the rank
        variable of a ``StepCounter``."""
        taken = take_snapshot(
            self.source.pool,
            self.source.model,
            self.source.optimizer,
            step=step,
            keep_last=self.keep_last,
        )
        self.status = f"took {taken if isinstance(taken, str) else taken.describe()}"
        self.refresh()
        return taken

    def recover(self, dry_run: bool = False) -> Any:
        """``pool.recover()`` (``dry_run``: the plan only); its report, also in ``report``."""
        self.report = self.source.pool.recover(dry_run=dry_run)
        self.status = str(self.report).splitlines()[0]
        self.refresh()
        return self.report

    # ------------------------------------------------------------------ display

    def _rows(self) -> list[tuple[str, ...]]:
        now = time.time()
        journal = self.source.pool.journal
        rows = []
        for info in self.snapshots:
            entry = journal.entry(info.call) if info.call is not None else None
            per_host = max(info.bytes_per_host.values(), default=0)
            rows.append(
                (
                    info.id,
                    "-" if info.step is None else str(info.step),
                    info.describe(now).rsplit("(taken ", 1)[-1].removesuffix(")"),
                    entry.label if entry is not None else "-",
                    human_bytes(per_host) if per_host else "-",
                )
            )
        return rows

    def _report_text(self) -> str:
        return "" if self.report is None else str(self.report)

    def text(self) -> str:
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
        self._step = w.IntText(value=0, description="step", layout=w.Layout(width="160px", **fixed))
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
            lambda _: self._guard(lambda: self.snapshot(step=self._step.value))
        )
        self._plan_button.on_click(lambda _: self._guard(lambda: self.recover(dry_run=True)))
        self._recover_button.on_click(lambda _: self._guard(self.recover))
        self._refresh_button.on_click(lambda _: self._guard(self.refresh))
        row = w.HBox(
            [
                self._step,
                self._snapshot_button,
                self._plan_button,
                self._recover_button,
                self._refresh_button,
            ],
            layout=w.Layout(flex_flow="row wrap", align_items="center"),
        )
        return w.VBox([row, self._table, self._status, self._report])

    def _update_widget(self) -> None:
        self._table.value = html_table(_HEADERS, self._rows())
        self._status.value = self._status_html()
        report = self._report_text()
        self._report.value = f"<pre>{html.escape(report)}</pre>" if report else ""
        self._recover_button.disabled = not self.snapshots
