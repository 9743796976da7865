"""Dashboard: topology, memory, layout, gradient norms and summon in one place."""

from __future__ import annotations

import html as html_lib
from typing import Any

from fsdp_interactive.inspect import MemoryStats
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._view import View, png_image
from fsdp_interactive.notebook.grad_norm_view import GradNormView
from fsdp_interactive.notebook.layout_view import LayoutView
from fsdp_interactive.notebook.monitor import GradNormMonitor
from fsdp_interactive.notebook.plots import memory_figure
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import render_memory, render_topology
from fsdp_interactive.notebook.snapshot_panel import SnapshotPanel
from fsdp_interactive.notebook.summon_panel import SummonPanel


class Dashboard(View):
    """All views of one model on the ranks; ``refresh()`` updates every part.

    Parts: ``layout`` (LayoutView), ``grads`` (GradNormView), ``summon`` (SummonPanel),
    ``snapshots`` (SnapshotPanel: the snapshots in host memory, Recover), ``monitor``
    (GradNormMonitor, when given) and ``checkpoints`` (a CheckpointPanel, when given), plus
    the pool's topology and every rank's memory (``memory``).

    The widget opens on the "Ranks" tab and draws a part's widget the first time its tab
    is selected: every part's data is probed at construction (``text()`` and ``html()``
    show them all), but only the pictures the user looks at are drawn, each at most once
    a refresh.

    The "Ranks" tab starts with the pool's state (``health``, from ``pool.check()``): a
    rank that died, also between cells, is found by every refresh and shown there with
    its host and signal and what to type; the parts then keep what they last showed
    (their probes need every rank) until a recovery or a restart.
    """

    def __init__(
        self,
        source: RankModel,
        monitor: GradNormMonitor | None = None,
        checkpoints: Any = None,
    ):
        if not isinstance(source, RankModel):
            raise TypeError(f"source must be a RankModel, got {type(source).__name__}")
        self.source = source
        self.health = source.pool.check()
        self.memory: list[MemoryStats] = source.memory()
        self.layout = LayoutView(source)
        self.grads = GradNormView(source)
        self.summon = SummonPanel(source)
        self.snapshots = SnapshotPanel(source)
        self.monitor = monitor
        self.checkpoints = checkpoints

    def refresh(self) -> None:
        """Ask the ranks again: the pool's health, every rank's memory and each tab's view."""
        self.health = self.source.pool.check()
        if not self.source.pool.running:
            self.memory = []
            self._changed()
            return
        self.memory = self.source.memory()
        self.layout.refresh()
        self.grads.refresh()
        self.summon.select(self.summon.fqn)
        self.snapshots.refresh()
        if self.monitor is not None:
            self.monitor.poll()
        if self.checkpoints is not None:
            self.checkpoints.refresh()
        self._changed()

    def _parts(self) -> list[tuple[str, View]]:
        parts: list[tuple[str, View]] = [
            ("Layout", self.layout),
            ("Gradients", self.grads),
            ("Summon", self.summon),
            ("Snapshots", self.snapshots),
        ]
        if self.monitor is not None:
            parts.append(("Monitor", self.monitor))
        if self.checkpoints is not None:
            parts.append(("Checkpoints", self.checkpoints))
        return parts

    def _state_lines(self) -> list[str]:
        return self.health.lines(notebook=True)

    def text(self) -> str:
        """The dashboard as plain text: ranks and topology, memory, then each tab's view."""
        sections = [
            "== ranks ==\n"
            + "\n".join([*self._state_lines(), render_topology(self.source.topology()).text()]),
            "== memory ==\n" + render_memory(self.memory).text(),
        ]
        sections += [f"== {name.lower()} ==\n{part.text()}" for name, part in self._parts()]
        return "\n\n".join(sections)

    def html(self, figures: bool = True) -> str:
        sections = [
            "<h4>ranks</h4>" + self._state_html() + render_topology(self.source.topology()).html(),
            "<h4>memory</h4>"
            + render_memory(self.memory).html()
            + (figure_html(memory_figure(self.memory), "memory per rank") if figures else ""),
        ]
        sections += [
            f"<h4>{html_lib.escape(name)}</h4>{part.html(figures)}" for name, part in self._parts()
        ]
        return "".join(sections)

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._ranks = w.HTML()
        self._memory_image = png_image()
        self._refresh_button = w.Button(description="Refresh all", icon="refresh")
        self._refresh_button.on_click(self._clicked(self.refresh, "refresh"))
        overview = w.VBox([self._ranks, self._memory_image])
        parts = self._parts()
        self._tab_parts = [part for _, part in parts]
        # Filled with the part's widget when its tab is first selected (see _open_tab).
        self._tab_boxes = [w.VBox() for _ in parts]
        self._tabs = w.Tab(children=[overview, *self._tab_boxes], selected_index=0)
        for index, title in enumerate(["Ranks"] + [name for name, _ in parts]):
            self._tabs.set_title(index, title)
        self._tabs.observe(self._clicked(self._open_tab, "drawing the tab"), names="selected_index")
        return w.VBox([self._refresh_button, self._tabs, self._error_box()])

    def _open_tab(self) -> None:
        index = self._tabs.selected_index
        if not index:
            return
        box = self._tab_boxes[index - 1]
        if not box.children:
            box.children = (self._tab_parts[index - 1].widget,)

    def _state_html(self) -> str:
        broken = self.source.pool.state == "broken"
        style = ' style="color:#b00"' if broken else ""
        lines = html_lib.escape("\n".join(self._state_lines()))
        return f"<pre{style}>{lines}</pre>"

    def _update_widget(self) -> None:
        self._ranks.value = (
            self._state_html()
            + render_topology(self.source.topology()).html()
            + render_memory(self.memory).html()
        )
        self._memory_image.value = figure_png(memory_figure(self.memory))
