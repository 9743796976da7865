"""Gradient-norm view: table and bar chart after a backward (notebook side)."""

from __future__ import annotations

from typing import Any

from fsdp_interactive.inspect import GradNorms
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._view import View, png_image
from fsdp_interactive.notebook.plots import grad_norm_bars
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import grad_norms_html, grad_norms_text


class GradNormView(View):
    """Shows ``inspect.grad_norms`` of the model on the ranks (read-only; nothing clipped).

    ``refresh()`` recomputes (a collective on the ranks); ``show_by("modules")`` switches
    between per-parameter and per-module bars, as the toggle does.
    """

    def __init__(self, source: RankModel | GradNorms, by: str = "params", norm_type: float = 2.0):
        self.source = source if isinstance(source, RankModel) else None
        self.norm_type = norm_type
        self.by = self._check_by(by)
        self.data: GradNorms = (
            source if isinstance(source, GradNorms) else source.grad_norms(norm_type)
        )

    @staticmethod
    def _check_by(by: str) -> str:
        if by not in ("params", "modules"):
            raise ValueError(f"by must be 'params' or 'modules', got {by!r}")
        return by

    def refresh(self) -> GradNorms:
        if self.source is None:
            raise RuntimeError("this view was built from fixed data; build it from a RankModel")
        self.data = self.source.grad_norms(self.norm_type)
        self._changed()
        return self.data

    def show_by(self, by: str) -> None:
        self.by = self._check_by(by)
        if self._widget is not None and self._toggle.value != by:
            self._toggle.value = by  # the observer updates the view
        else:
            self._changed()

    def figure(self) -> Any:
        return grad_norm_bars(self.data, by=self.by)

    def text(self) -> str:
        return grad_norms_text(self.data, self.by)

    def html(self, figures: bool = True) -> str:
        picture = figure_html(self.figure(), "gradient norms") if figures else ""
        return grad_norms_html(self.data, self.by) + picture

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._refresh_button = w.Button(
            description="Recompute", icon="refresh", disabled=self.source is None
        )
        self._refresh_button.on_click(self._clicked(self.refresh, "recomputing"))
        self._toggle = w.ToggleButtons(options=["params", "modules"], value=self.by)
        self._toggle.observe(lambda change: self.show_by(change["new"]), names="value")
        self._total = w.HTML()
        self._table = w.HTML()
        self._image = png_image()
        return w.VBox(
            [
                w.HBox([self._refresh_button, self._toggle]),
                self._error_box(),
                self._total,
                self._image,
                self._table,
            ]
        )

    def _update_widget(self) -> None:
        self._total.value = f"<b>global norm: {self.data.total:.8g}</b>"
        self._table.value = grad_norms_html(self.data, self.by)
        self._image.value = figure_png(self.figure())
