"""Live gradient-norm monitor: plots a ``GradNormRecorder``'s history (notebook side)."""

from __future__ import annotations

import html
import os
import threading
from typing import Any

from fsdp_interactive.inspect import GradNormRecord, find_spikes, record_from_json
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._view import View, png_image
from fsdp_interactive.notebook.plots import grad_norm_history_figure
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import render_history


def _summary_html(records: list[GradNormRecord]) -> str:
    """The first three lines of :func:`render_history` (counts, NaN/Inf steps, spikes)."""
    return "<br/>".join(
        html.escape(line) for line in render_history(records).text().split("\n")[:3]
    )


class GradNormMonitor(View):
    """Plots the global gradient norm per step, marking NaN/Inf steps and spikes.

    Two sources, usable together:

    * ``log_path``: the file a ``GradNormRecorder(..., log_path=...)`` on rank 0 appends
      to.  ``follow()`` starts a background thread that reads new lines every
      ``interval`` seconds and redraws, so the plot moves while a training cell runs on
      the ranks (the kernel is busy waiting for that cell; the thread is not).  The file
      must be readable from the kernel (same host or a shared file system).
    * ``source``: a ``RankModel`` with ``recorder=`` set; ``poll()`` asks the ranks for the
      records it does not have yet (only between cells: the ranks answer when idle).

    ``poll()`` is the plain-call form of the Refresh button; ``spikes`` and
    ``nonfinite_steps`` are what the plot marks.
    """

    def __init__(
        self,
        source: RankModel | None = None,
        log_path: str | os.PathLike[str] | None = None,
        spike_factor: float = 3.0,
        window: int = 20,
    ):
        if source is None and log_path is None:
            raise ValueError(
                "give source=RankModel(pool, recorder='recorder') or log_path= (the file the "
                "recorder writes), or both"
            )
        if source is not None and source.recorder is None and log_path is None:
            raise ValueError("source has no recorder: RankModel(pool, recorder='recorder')")
        self.source = source
        self.log_path = os.fspath(log_path) if log_path is not None else None
        self.spike_factor = spike_factor
        self.window = window
        self.records: list[GradNormRecord] = []
        self._offset = 0
        self._partial = ""
        self._lock = threading.Lock()
        # The follow thread and the kernel's thread both redraw: one redraw at a time, each
        # from one snapshot, so the summary and the plot always count the same records.
        self._draw_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ data

    def _read_log(self) -> list[GradNormRecord]:
        if self.log_path is None or not os.path.exists(self.log_path):
            return []
        with open(self.log_path, encoding="utf-8") as log:
            log.seek(self._offset)
            chunk = log.read()
            self._offset = log.tell()
        text = self._partial + chunk
        *lines, self._partial = text.split("\n")
        return [record_from_json(line) for line in lines if line.strip()]

    def poll(self) -> list[GradNormRecord]:
        """Fetch records not seen yet (log file first, else the ranks); redraw; return them."""
        with self._lock:
            if self.log_path is not None:
                new = self._read_log()
            else:
                assert self.source is not None
                new = self.source.history(since=len(self.records))
            self.records.extend(new)
        if new:
            self._changed()
        return new

    @property
    def totals(self) -> list[float]:
        return [r.total for r in self.records]

    @property
    def spikes(self) -> list[int]:
        """Steps whose norm exceeds ``spike_factor`` times the recent median."""
        indices = find_spikes(self.totals, factor=self.spike_factor, window=self.window)
        return [self.records[i].step for i in indices]

    @property
    def nonfinite_steps(self) -> list[int]:
        return [r.step for r in self.records if r.nonfinite]

    # ------------------------------------------------------------------ live following

    def follow(self, interval: float = 0.5) -> None:
        """Poll the log file in a background thread until ``stop()``."""
        if self.log_path is None:
            raise ValueError(
                "follow() reads the recorder's log file: create the monitor with log_path="
            )
        if interval <= 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        if self.following:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval):
                self.poll()
            self.poll()

        self._thread = threading.Thread(target=loop, name="grad-norm-monitor", daemon=True)
        self._thread.start()
        self._changed()

    def stop(self) -> None:
        """Stop following (reads what is left once more)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
        self._changed()

    @property
    def following(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ display

    def snapshot(self) -> list[GradNormRecord]:
        """The records now (a copy: the follow thread may append while a view draws)."""
        with self._lock:
            return list(self.records)

    def figure(self, records: list[GradNormRecord] | None = None) -> Any:
        """The matplotlib picture of the global norm per step of ``records`` (default: every record
        polled so far), NaN/Inf steps and spikes marked."""
        records = self.snapshot() if records is None else records
        return grad_norm_history_figure(records, self.spike_factor, self.window)

    def text(self) -> str:
        """The recorded steps as plain text: each step's global norm, NaN/Inf steps and spikes
        named."""
        return render_history(self.snapshot()).text()

    def html(self, figures: bool = True) -> str:
        records = self.snapshot()
        summary = _summary_html(records)
        picture = figure_html(self.figure(records), "gradient norm history") if figures else ""
        return summary + picture

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._summary = w.HTML()
        self._image = png_image()
        self._refresh_button = w.Button(description="Refresh", icon="refresh")
        self._follow_button = w.ToggleButton(
            description="Follow", value=False, disabled=self.log_path is None
        )
        self._refresh_button.on_click(self._clicked(self.poll, "refresh"))
        self._follow_button.observe(self._on_follow, names="value")
        return w.VBox(
            [
                w.HBox([self._refresh_button, self._follow_button]),
                self._error_box(),
                self._summary,
                self._image,
            ]
        )

    def _on_follow(self, change: dict[str, Any]) -> None:
        if change["new"] and not self.following:
            self.follow()
        elif not change["new"] and self.following:
            self.stop()

    def _update_widget(self) -> None:
        with self._draw_lock:
            records = self.snapshot()
            self._summary.value = _summary_html(records)
            self._image.value = figure_png(self.figure(records))
        if self._follow_button.value != self.following:
            self._follow_button.value = self.following
