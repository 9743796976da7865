"""Shard-layout view: table, slice picture and memory per rank (notebook side)."""

from __future__ import annotations

from typing import Any

from fsdp_interactive.inspect import ModelLayout
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._view import View, png_image
from fsdp_interactive.notebook.plots import layout_figure
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import layout_html, layout_text


class LayoutView(View):
    """Shows ``inspect.layout`` of a model on the ranks.

    ``refresh()`` asks the ranks again (the Refresh button does the same); ``data`` is the
    merged :class:`ModelLayout`; ``figure()`` is the matplotlib picture.
    """

    def __init__(self, source: RankModel | ModelLayout):
        self.source = source if isinstance(source, RankModel) else None
        self.data: ModelLayout = source if isinstance(source, ModelLayout) else source.layout()

    def refresh(self) -> ModelLayout:
        if self.source is None:
            raise RuntimeError("this view was built from fixed data; build it from a RankModel")
        self.data = self.source.layout()
        self._changed()
        return self.data

    def figure(self) -> Any:
        return layout_figure(self.data)

    def text(self) -> str:
        return layout_text(self.data)

    def html(self, figures: bool = True) -> str:
        picture = figure_html(self.figure(), "shard layout") if figures else ""
        return layout_html(self.data) + picture

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._table = w.HTML()
        self._image = png_image()
        self._refresh_button = w.Button(
            description="Refresh", icon="refresh", disabled=self.source is None
        )
        self._refresh_button.on_click(self._clicked(self.refresh, "refresh"))
        return w.VBox([self._refresh_button, self._error_box(), self._table, self._image])

    def _update_widget(self) -> None:
        self._table.value = layout_html(self.data)
        self._image.value = figure_png(self.figure())
