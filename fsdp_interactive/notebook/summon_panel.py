"""Summon panel: full-parameter stats, histogram and confirmed edits (notebook side)."""

from __future__ import annotations

import contextlib
import html
from typing import Any

from fsdp_interactive._text import did_you_mean, first_few
from fsdp_interactive.inspect import TensorStats
from fsdp_interactive.notebook._error_note import ErrorNote
from fsdp_interactive.notebook._format import figure_html, figure_png
from fsdp_interactive.notebook._groups import check_pattern, matches
from fsdp_interactive.notebook._probe_input import UnknownNameError
from fsdp_interactive.notebook._view import View, filter_box, png_image
from fsdp_interactive.notebook.plots import histogram_figure
from fsdp_interactive.notebook.rank_model import RankModel
from fsdp_interactive.notebook.render import render_stats


class SummonPanel(View):
    """Pick a parameter or module, see the stats of its full tensor, edit it.

    ``select(fqn)`` gathers and summarizes (the dropdown does the same).  ``apply(expression,
    confirm=True)`` evaluates ``expression`` on the full parameter on every rank (``x`` is the
    tensor: ``"x[0] = 0"`` or ``"x * 0.5"``) and writes it back, like
    ``summon_full_params(writeback=True)``; without ``confirm=True`` it refuses and changes
    nothing.  In the widget, Apply asks for a second click on Confirm.

    A model has hundreds of parameters and more modules: the filter box (``filter(pattern)``,
    a substring or a glob) narrows the tensor list to the matches, at most
    ``max_choices`` of them; the tensor shown stays in the list.
    """

    max_choices = 200

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
        self.pattern: str | None = None
        self.data: TensorStats = source.summon(self._known(fqn) if fqn else params[0], bins)

    def choices(self, pattern: str | None = None) -> tuple[list[tuple[str, str]], int]:
        """(label, FQN) of the parameters, then the modules, matching ``pattern`` (at most
        :attr:`max_choices`; the selected tensor always among them) and how many matched."""
        pattern = check_pattern(pattern)
        everything = [(p, p) for p in self.params] + [(f"{m} (module)", m) for m in self.modules]
        matched = [(label, fqn) for label, fqn in everything if matches(fqn, pattern)]
        shown = matched[: self.max_choices]
        if all(fqn != self.fqn for _, fqn in shown):
            label = self.fqn if self.fqn in self.params else f"{self.fqn} (module)"
            shown.insert(0, (label, self.fqn))
        return shown, len(matched)

    def filter(self, pattern: str | None) -> int:
        """Narrow the tensor list to ``pattern``; returns how many tensors match."""
        self.pattern = check_pattern(pattern)
        self._changed()
        return self.choices(self.pattern)[1]

    @property
    def fqn(self) -> str:
        return self.data.fqn

    def select(self, fqn: str) -> TensorStats:
        """Summarize the parameter or module ``fqn``: its clean FQN or the name under the
        model's wrappers (shown by its clean FQN)."""
        self.data = self.source.summon(self._known(fqn), self.bins)
        self.pending = None
        self.message = ""
        self.error = None
        self._changed()
        return self.data

    def _known(self, fqn: str) -> str:
        """``fqn`` as a clean name of the model's, asking the ranks for a wrapped one;
        :class:`ProbeInputError` naming the close matches when the model has neither."""
        if fqn not in self.params and fqn not in self.modules:
            fqn = self.source.clean_name(fqn) or fqn
        if fqn not in self.params and fqn not in self.modules:
            hint = did_you_mean(fqn, [*self.params, *self.modules])
            raise UnknownNameError(
                f"fqn={fqn!r} is not a parameter or module of {self.source.model!r}; "
                + (hint or f"choose one of {first_few(self.params, 6, ', ')}")
            )
        return fqn

    def apply(self, expression: str, confirm: bool = False) -> TensorStats:
        """Set the selected parameter to ``expression`` on every rank (``confirm=True`` is
        required: an edit writes to the model) and return its new statistics."""
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
        """Drop the pending edit; nothing is written."""
        self.pending = None
        self.error = None
        self.message = "edit cancelled"
        self._changed()

    def figure(self) -> Any:
        """The matplotlib histogram of the selected parameter (or module)."""
        return histogram_figure(self.data)

    def text(self) -> str:
        """The selected parameter's statistics as plain text, with the last action's message."""
        return render_stats(self.data).text() + (f"\n{self.message}" if self.message else "")

    def html(self, figures: bool = True) -> str:
        picture = figure_html(self.figure(), f"histogram of {self.fqn}") if figures else ""
        return render_stats(self.data).html() + picture

    def _build_widget(self) -> Any:
        import ipywidgets as w

        options, _ = self.choices(self.pattern)
        self._filter = filter_box(self.pattern, "filter: layers.1*  or  q_proj")
        self._filter.observe(lambda change: self.filter(change["new"]), names="value")
        self._matches = w.HTML()
        self._choice = w.Dropdown(
            options=options, value=self.fqn, description="tensor", layout=w.Layout(width="420px")
        )
        self._choice.observe(self._on_choice, names="value")
        self._select = self._clicked(lambda: self.select(self._choice.value), "gathering")
        self._stats = w.HTML()
        self._image = png_image()
        self._expression = w.Text(placeholder="x[0] = 0   or   x * 0.5", description="edit")
        self._apply_button = w.Button(description="Apply", icon="pencil")
        # Neutral and disabled until an edit waits for confirmation, red only then: a red
        # button reads as the thing to click.
        self._confirm_button = w.Button(description="Confirm", disabled=True, button_style="")
        self._cancel_button = w.Button(description="Cancel")
        self._status = w.HTML()
        self._apply_button.on_click(lambda _: self.request(self._expression.value))
        self._confirm_button.on_click(lambda _: self._confirm_quietly())
        self._cancel_button.on_click(lambda _: self.cancel())
        return w.VBox(
            [
                w.HBox([self._filter, self._choice, self._matches]),
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
        if change["new"] is not None and change["new"] != self.fqn and not self._syncing:
            self._select()

    _syncing = False

    def _confirm_quietly(self) -> None:
        with contextlib.suppress(Exception):  # the message is already in the panel
            self.confirm()

    def _update_widget(self) -> None:
        options, matched = self.choices(self.pattern)
        self._syncing = True
        try:
            if list(self._choice.options) != options:
                self._choice.options = options
            if self._choice.value != self.fqn:
                self._choice.value = self.fqn
            if self._filter.value != (self.pattern or ""):
                self._filter.value = self.pattern or ""
        finally:
            self._syncing = False
        shown = len(options)
        self._matches.value = (
            f"<i>{min(shown, matched)} of {matched} shown: refine the filter</i>"
            if matched > self.max_choices
            else f"<i>{matched} match</i>"
            if self.pattern
            else ""
        )
        self._stats.value = render_stats(self.data).html()
        self._image.value = figure_png(self.figure())
        editable = self.fqn in self.params
        self._apply_button.disabled = not editable
        self._confirm_button.disabled = self.pending is None
        self._confirm_button.button_style = "" if self.pending is None else "danger"
        self._cancel_button.disabled = self.pending is None
        if self.error is not None:
            self._status.value = self.error.html("edit failed: ")
        else:
            self._status.value = html.escape(self.message)
