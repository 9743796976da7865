"""Any probe's answer as a view: the probe asked on the ranks, shown by its record type's
renderer (notebook side).

The views of their own (``LayoutView``, ``GradNormView``, ``SummonPanel``) add filters
and pictures to the probes they show; a probe without one is shown by this view as soon
as it is declared (``fsdp_interactive.inspect.PROBES``), through the renderer
``notebook/render.py`` registers for its record type, or as a table of the record's
fields when there is none.
"""

from __future__ import annotations

from typing import Any

from fsdp_interactive.notebook._view import View, refresh_button
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import render


class ProbeView(View):
    """Shows ``source.ask(probe, *arguments, **keywords)``: the probe's answer (``data``)
    as text, HTML or a widget with a Refresh button. ``refresh()`` asks the ranks again
    (the button does the same); input the probe cannot take raises at once, as
    :meth:`RankModel.ask` does."""

    def __init__(self, source: RankModel, probe: str, *arguments: Any, **keywords: Any):
        if not isinstance(source, RankModel):
            raise TypeError(f"source must be a RankModel, got {type(source).__name__}")
        self.source = source
        self.probe = probe
        self._arguments = arguments
        self._keywords = keywords
        self.data: Any = source.ask(probe, *arguments, **keywords)

    def refresh(self) -> Any:
        """Ask the ranks again (the Refresh button does the same) and return the answer."""
        self.data = self.source.ask(self.probe, *self._arguments, **self._keywords)
        self._changed()
        return self.data

    def text(self) -> str:
        """The answer as plain text."""
        return render(self.data).text()

    def html(self, figures: bool = True) -> str:
        return render(self.data).html()

    def _build_widget(self) -> Any:
        import ipywidgets as w

        self._refresh_button = refresh_button(self)
        self._table = w.HTML()
        return w.VBox([self._refresh_button, self._error_box(), self._table])

    def _update_widget(self) -> None:
        self._table.value = self.html()
