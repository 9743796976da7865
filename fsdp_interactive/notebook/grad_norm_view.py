"""Gradient-norm view: the global norm, a top-k table and bar chart after a backward
(notebook side)."""

from __future__ import annotations

import html
from typing import Any

from fsdp_interactive.inspect import GradNorms
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._groups import NORM_GROUPS, check_pattern, check_sort, check_top
from fsdp_interactive.notebook._view import (
    Controls,
    View,
    choice_buttons,
    filter_box,
    png_image,
    refresh_button,
    top_box,
)
from fsdp_interactive.notebook.plots import grad_norm_bars
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import global_norm_line, render_grad_norms

_SORTS = ("norm", "model")


class GradNormView(View):
    """Shows ``inspect.grad_norms`` of the model on the ranks (read-only; nothing clipped).

    One row per parameter, module or FSDP unit (``by``: ``"params"``, ``"modules"``,
    ``"units"``), those matching ``pattern`` (a substring or a glob), the ``top`` largest
    (``sort="norm"``, NaN/Inf first) or the first ``top`` in model order (``sort="model"``).
    The global norm is stated once, above the table.  ``refresh()`` recomputes (a
    collective on the ranks); ``show(...)`` / ``show_by(by)`` change what is shown, as the
    controls do.
    """

    def __init__(
        self,
        source: RankModel | GradNorms,
        by: str = "params",
        norm_type: float = 2.0,
        pattern: str | None = None,
        top: int = 30,
        sort: str = "norm",
    ):
        self.source = source if isinstance(source, RankModel) else None
        self.norm_type = norm_type
        self.by = check_sort(by, NORM_GROUPS, "by")
        self.pattern = check_pattern(pattern)
        self.top = check_top(top)
        self.sort = check_sort(sort, _SORTS)
        self.data: GradNorms = (
            source if isinstance(source, GradNorms) else source.grad_norms(norm_type)
        )

    def refresh(self) -> GradNorms:
        """Ask the ranks for the gradient norms again (the Refresh button does the same) and return
        them; a view built from fixed data raises ``RuntimeError``."""
        if self.source is None:
            raise RuntimeError("this view was built from fixed data; build it from a RankModel")
        self.data = self.source.grad_norms(self.norm_type)
        self._changed()
        return self.data

    def show(self, **changes: Any) -> None:
        """Change any of ``by``, ``pattern``, ``top``, ``sort``; a bad value raises (naming
        the argument) and changes nothing."""
        unknown = set(changes) - {"by", "pattern", "top", "sort"}
        if unknown:
            raise TypeError(f"show() got unknown arguments {sorted(unknown)}")
        by = check_sort(changes.get("by", self.by), NORM_GROUPS, "by")
        pattern = check_pattern(changes.get("pattern", self.pattern))
        top = check_top(changes.get("top", self.top))
        sort = check_sort(changes.get("sort", self.sort), _SORTS)
        self.by, self.pattern, self.top, self.sort = by, pattern, top, sort
        self._changed()

    def show_by(self, by: str) -> None:
        """Group the bars by ``by`` (as ``show(by=...)``: per parameter or per FSDP unit)."""
        self.show(by=by)

    def _choice(self) -> dict[str, Any]:
        return {"by": self.by, "pattern": self.pattern, "top": self.top, "sort": self.sort}

    def figure(self) -> Any:
        """The matplotlib bar chart of the norms as shown now."""
        return grad_norm_bars(self.data, **self._choice())

    def text(self) -> str:
        """The norms as shown now, as a plain-text table."""
        return render_grad_norms(self.data, **self._choice()).text()

    def html(self, figures: bool = True) -> str:
        picture = figure_html(self.figure(), "gradient norms") if figures else ""
        return render_grad_norms(self.data, **self._choice()).html() + picture

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._refresh_button = refresh_button(self, "Recompute", "recomputing")
        self._toggle = w.ToggleButtons(options=list(NORM_GROUPS), value=self.by)
        self._filter = filter_box(self.pattern, "filter: layers.1*  or  attn")
        self._top = top_box(self.top)
        self._sort = choice_buttons([("largest", "norm"), ("model order", "model")], self.sort)
        self._controls = Controls(
            self, self.show, by=self._toggle, pattern=self._filter, top=self._top, sort=self._sort
        )
        self._total = w.HTML()
        self._table = w.HTML()
        self._image = png_image()
        controls = w.HBox(
            [self._refresh_button, self._toggle, self._filter, self._top, self._sort],
            layout=w.Layout(flex_flow="row wrap"),
        )
        return w.VBox([controls, self._error_box(), self._total, self._image, self._table])

    def _update_widget(self) -> None:
        self._controls.show(**{**self._choice(), "pattern": self.pattern or ""})
        # The global norm is stated here only: the table and the picture leave it out.
        line = html.escape(global_norm_line(self.data)) if self.data.params else ""
        self._total.value = f"<b>{line}</b>"
        self._table.value = render_grad_norms(self.data, head=False, **self._choice()).html()
        self._image.value = figure_png(self.figure())
