"""Summon panel: full-parameter stats, histogram and confirmed edits (notebook side)."""

from __future__ import annotations

import contextlib
import html
from typing import Any

from fsdp_interactive.inspect import TensorStats
from fsdp_interactive.notebook._error_note import ErrorNote
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._view import View, png_image
from fsdp_interactive.notebook.plots import histogram_figure
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import stats_html, stats_text


class SummonPanel(View):
    """Pick a parameter or module, see the stats of its full tensor, edit it.

    ``select(fqn)`` gathers and summarizes (the dropdown does the same).  ``apply(expression,
    confirm=True)`` evaluates ``expression`` on the full parameter on every rank (``x`` is the
    tensor: ``"x[0] = 0"`` or ``"x * 0.5"``) and writes it back, like
    ``summon_full_params(writeback=True)``; without ``confirm=True`` it refuses and changes
    nothing.  In the widget, Apply asks for a second click on Confirm.
    """

    def __init__(self, source: RankModel, fqn: str | None = None, bins: int = 40):
        if not isinstance(source, RankModel):
            raise TypeError(f"source must be a RankModel, got {type(source).__name__}")
        self.source = source
        self.bins = bins
        params, modules = source.names()
        if not params:
            raise ValueError(f"the model {source.model!r} on the ranks has no parameters")
        self.params = params
        self.modules = modules
        self.pending: str | None = None
        self.message = ""
        self.error: ErrorNote | None = None
        self.data: TensorStats = source.summon(fqn or params[0], bins)

    @property
    def fqn(self) -> str:
        return self.data.fqn

    def select(self, fqn: str) -> TensorStats:
        if fqn not in self.params and fqn not in self.modules:
            raise ValueError(
                f"fqn={fqn!r} is not a parameter or module of {self.source.model!r}; choose one of "
                f"{', '.join(self.params[:6])}{', ...' if len(self.params) > 6 else ''}"
            )
        self.data = self.source.summon(fqn, self.bins)
        self.pending = None
        self.message = ""
        self.error = None
        self._changed()
        return self.data

    def apply(self, expression: str, confirm: bool = False) -> TensorStats:
        if self.fqn not in self.params:
            raise ValueError(f"{self.fqn!r} is a module; select one parameter to edit it")
        if not confirm:
            raise ValueError(
                f"editing {self.fqn!r} writes to every rank; call apply({expression!r}, "
                "confirm=True) to do it"
            )
        self.data = self.source.edit(self.fqn, expression, self.bins)
        self.pending = None
        self.error = None
        self.message = f"applied {expression!r} to {self.fqn} on every rank"
        self._changed()
        return self.data

    def request(self, expression: str) -> None:
        """First step of the widget's two-click edit: remember ``expression``, ask to confirm."""
        self.error = None
        if not expression.strip():
            self.message = "type an expression first, e.g. x[0] = 0"
        else:
            self.pending = expression
            self.message = f"write {expression!r} back to {self.fqn} on every rank? click Confirm"
        self._changed()

    def confirm(self) -> TensorStats | None:
        """Second step: apply the pending expression (nothing pending: no-op)."""
        if self.pending is None:
            return None
        try:
            return self.apply(self.pending, confirm=True)
        except Exception as error:  # shown in the panel; the parameter stays unchanged
            self.pending = None
            self.error = ErrorNote.of(error)
            self.message = self.error.text("edit failed: ")
            self._changed()
            raise

    def cancel(self) -> None:
        self.pending = None
        self.error = None
        self.message = "edit cancelled"
        self._changed()

    def figure(self) -> Any:
        return histogram_figure(self.data)

    def text(self) -> str:
        return stats_text(self.data) + (f"\n{self.message}" if self.message else "")

    def html(self, figures: bool = True) -> str:
        picture = figure_html(self.figure(), f"histogram of {self.fqn}") if figures else ""
        return stats_html(self.data) + picture

    def _build_widget(self) -> Any:
        import ipywidgets as w

        options = [(p, p) for p in self.params] + [(f"{m} (module)", m) for m in self.modules]
        self._choice = w.Dropdown(options=options, value=self.fqn, description="tensor")
        self._choice.observe(self._on_choice, names="value")
        self._select = self._clicked(lambda: self.select(self._choice.value), "gathering")
        self._stats = w.HTML()
        self._image = png_image()
        self._expression = w.Text(placeholder="x[0] = 0   or   x * 0.5", description="edit")
        self._apply_button = w.Button(description="Apply", icon="pencil")
        self._confirm_button = w.Button(description="Confirm", button_style="danger")
        self._cancel_button = w.Button(description="Cancel")
        self._status = w.HTML()
        self._apply_button.on_click(lambda _: self.request(self._expression.value))
        self._confirm_button.on_click(lambda _: self._confirm_quietly())
        self._cancel_button.on_click(lambda _: self.cancel())
        return w.VBox(
            [
                self._choice,
                w.HBox([self._stats, self._image]),
                w.HBox(
                    [
                        self._expression,
                        self._apply_button,
                        self._confirm_button,
                        self._cancel_button,
                    ]
                ),
                self._status,
                self._error_box(),
            ]
        )

    def _on_choice(self, change: dict[str, Any]) -> None:
        if change["new"] != self.fqn:
            self._select()

    def _confirm_quietly(self) -> None:
        with contextlib.suppress(Exception):  # the message is already in the panel
            self.confirm()

    def _update_widget(self) -> None:
        if self._choice.value != self.fqn:
            self._choice.value = self.fqn
        self._stats.value = stats_html(self.data)
        self._image.value = figure_png(self.figure())
        editable = self.fqn in self.params
        self._apply_button.disabled = not editable
        self._confirm_button.disabled = self.pending is None
        self._cancel_button.disabled = self.pending is None
        if self.error is not None:
            self._status.value = self.error.html("edit failed: ")
        else:
            self._status.value = html.escape(self.message)
