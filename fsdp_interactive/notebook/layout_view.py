"""Shard-layout view: units, parameters, slice picture and memory per rank (notebook side)."""

from __future__ import annotations

from typing import Any

from fsdp_interactive.inspect import ModelLayout
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._groups import (
    LayoutSelection,
    check_pattern,
    check_sort,
    check_top,
    select_layout,
)
from fsdp_interactive.notebook._view import (
    Controls,
    View,
    choice_buttons,
    filter_box,
    png_image,
    refresh_button,
    top_box,
)
from fsdp_interactive.notebook.plots import layout_figure
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import render_layout

_ALL_UNITS = "(all units)"


class LayoutView(View):
    """Shows ``inspect.layout`` of a model on the ranks, grouped by FSDP unit.

    The unit table has one row per FSDP unit, with consecutive alike units (a stack of
    identical decoder layers) folded into one row such as ``layers.{0..31}`` unless
    ``fold=False``.  The parameter table lists the parameters matching ``pattern`` (a
    substring or a glob) in the unit row drilled into (``unit``: a label of the unit table;
    ``None``: the whole model), sorted by ``sort`` (``"model"`` order or ``"size"``), at
    most ``top`` rows; the unit table is cut to ``top`` rows the same way.  The picture
    draws one bar per parameter when the parameters fit, else one per unit row.

    ``refresh()`` asks the ranks again (the Refresh button does the same); ``show(...)``
    changes what is shown, as the filter box, unit list, top-k and order controls do;
    ``data`` is the merged :class:`ModelLayout`; ``figure()`` is the matplotlib picture.
    """

    def __init__(
        self,
        source: RankModel | ModelLayout,
        pattern: str | None = None,
        unit: str | None = None,
        top: int = 30,
        sort: str = "model",
        fold: bool = True,
    ):
        self.source = source if isinstance(source, RankModel) else None
        self.data: ModelLayout = source if isinstance(source, ModelLayout) else source.layout()
        self.fold = bool(fold)
        self.selection: LayoutSelection = select_layout(self.data, pattern, unit, top, sort, fold)

    @property
    def pattern(self) -> str | None:
        return self.selection.pattern

    @property
    def unit(self) -> str | None:
        return self.selection.unit

    @property
    def top(self) -> int:
        return self.selection.top

    @property
    def sort(self) -> str:
        return self.selection.sort

    def show(self, **changes: Any) -> LayoutSelection:
        """Change any of ``pattern``, ``unit``, ``top``, ``sort``, ``fold``; the others stay.

        A bad value raises (naming the argument) and leaves the view as it was.  A filter
        that leaves the drilled-into unit without parameters drops the drill-down.
        """
        unknown = set(changes) - {"pattern", "unit", "top", "sort", "fold"}
        if unknown:
            raise TypeError(f"show() got unknown arguments {sorted(unknown)}")
        pattern = check_pattern(changes.get("pattern", self.pattern))
        top = check_top(changes.get("top", self.top))
        sort = check_sort(changes.get("sort", self.sort))
        fold = bool(changes.get("fold", self.fold))
        unit = changes.get("unit", self.unit)
        if "unit" not in changes and unit is not None:
            labels = self.unit_labels(pattern, fold)
            unit = unit if unit in labels or self._unit_inside(unit, pattern, fold) else None
        self.selection = select_layout(self.data, pattern, unit, top, sort, fold)
        self.fold = fold
        self._changed()
        return self.selection

    def _unit_inside(self, unit: str, pattern: str | None, fold: bool) -> bool:
        try:
            select_layout(self.data, pattern, unit, 1, "model", fold)
        except ValueError:
            return False
        return True

    def unit_labels(self, pattern: str | None = None, fold: bool | None = None) -> list[str]:
        """The labels of the unit table's rows (what ``unit=`` accepts), in model order."""
        fold = self.fold if fold is None else fold
        selection = select_layout(self.data, pattern, None, 10**9, "model", fold)
        return [row.label for row in selection.rows]

    def refresh(self) -> ModelLayout:
        """Ask the ranks for the layout again (the Refresh button does the same) and return it; a
        view built from fixed data raises ``RuntimeError``."""
        if self.source is None:
            raise RuntimeError("this view was built from fixed data; build it from a RankModel")
        self.data = self.source.layout()
        self.show()
        return self.data

    def figure(self) -> Any:
        """The matplotlib picture of the slices as shown now: which rank holds which part of each
        parameter (or unit)."""
        return layout_figure(self.data, self.selection)

    def text(self) -> str:
        """The unit and parameter tables as shown now, as plain text."""
        return render_layout(self.data, self.selection).text()

    def html(self, figures: bool = True) -> str:
        picture = figure_html(self.figure(), "shard layout") if figures else ""
        return render_layout(self.data, self.selection).html() + picture

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._table = w.HTML()
        self._image = png_image()
        self._refresh_button = refresh_button(self)
        self._filter = filter_box(self.pattern, "filter: layers.1*  or  attn")
        self._unit_choice = w.Dropdown(
            description="unit", options=[_ALL_UNITS], layout=w.Layout(width="300px")
        )
        self._top = top_box(self.top)
        self._sort = choice_buttons([("model order", "model"), ("largest", "size")], self.sort)
        self._fold = w.Checkbox(value=self.fold, description="fold alike units", indent=False)
        self._controls = Controls(
            self,
            self._apply_controls,
            pattern=self._filter,
            unit=self._unit_choice,
            top=self._top,
            sort=self._sort,
            fold=self._fold,
        )
        controls = w.HBox(
            [
                self._refresh_button,
                self._filter,
                self._unit_choice,
                self._top,
                self._sort,
                self._fold,
            ],
            layout=w.Layout(flex_flow="row wrap"),
        )
        return w.VBox([controls, self._error_box(), self._image, self._table])

    def _apply_controls(self, unit: str, **controls: Any) -> None:
        self.show(unit=None if unit == _ALL_UNITS else unit, **controls)

    def _update_widget(self) -> None:
        with self._controls.syncing():
            self._unit_choice.options = [_ALL_UNITS, *self.unit_labels(self.pattern)]
        self._controls.show(
            unit=self.unit if self.unit is not None else _ALL_UNITS,
            pattern=self.pattern or "",
            top=self.top,
            sort=self.sort,
            fold=self.fold,
        )
        self._table.value = render_layout(self.data, self.selection).html()
        self._image.value = figure_png(self.figure())
