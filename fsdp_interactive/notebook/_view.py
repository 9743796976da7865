"""What every view shares: a widget built on demand and text/HTML fallbacks, and the
controls its widget shows (Refresh, a filter box, top-k, a choice of buttons) tied to the
view's settings.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def live_kernel() -> bool:
    """True inside a Jupyter kernel, where widget views can be displayed."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def png_image() -> Any:
    """An ipywidgets Image for PNG figures, shown at its own size (not stretched)."""
    import ipywidgets as w

    return w.Image(format="png", layout=w.Layout(align_self="flex-start"))


def refresh_button(view: Any, description: str = "Refresh", what: str = "refresh") -> Any:
    """The button that calls ``view.refresh()``; disabled for a view built from fixed data
    (its ``source`` is ``None``); an error shows in the view's error box as ``"<what>
    failed: ..."``."""
    import ipywidgets as w

    button = w.Button(description=description, icon="refresh", disabled=view.source is None)
    button.on_click(view._clicked(view.refresh, what))
    return button


def filter_box(pattern: str | None, placeholder: str) -> Any:
    """The filter box: a substring or a glob, applied when the user presses Enter."""
    import ipywidgets as w

    return w.Text(
        value=pattern or "",
        placeholder=placeholder,
        description="filter",
        continuous_update=False,
        layout=w.Layout(width="260px"),
    )


def top_box(top: int) -> Any:
    """How many rows a table shows at most."""
    import ipywidgets as w

    return w.BoundedIntText(
        value=top, min=1, max=10**6, description="top", layout=w.Layout(width="150px")
    )


def choice_buttons(options: Sequence[Any], value: Any) -> Any:
    """One of a few choices (``options``: values, or (label, value) pairs) as buttons."""
    import ipywidgets as w

    return w.ToggleButtons(options=list(options), value=value, style={"button_width": "auto"})


class Controls:
    """A view's controls by the setting each shows (``name -> widget``).

    A value the user changes calls ``apply(**every control's value)`` (an error shows in
    the view's error box, as for a click); values the view writes back with :meth:`show`
    (after ``show(...)`` or ``refresh()`` changed them) call nothing.
    """

    def __init__(self, view: View, apply: Callable[..., Any], **widgets: Any):
        self.widgets = widgets
        self._syncing = False
        callback = view._clicked(lambda: self._values_to(apply), "filter")
        for widget in widgets.values():
            widget.observe(lambda _change: callback(), names="value")

    def _values_to(self, apply: Callable[..., Any]) -> None:
        if not self._syncing:
            apply(**{name: widget.value for name, widget in self.widgets.items()})

    @contextlib.contextmanager
    def syncing(self) -> Iterator[None]:
        """While inside, changed values call nothing (for a change beyond :meth:`show`,
        such as a dropdown's options)."""
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False

    def show(self, **values: Any) -> None:
        """Set the controls to the view's settings, calling nothing."""
        with self.syncing():
            for name, value in values.items():
                self.widgets[name].value = value


class View:
    """Base of the views: ``text()``, ``html()`` and ``widget`` show the same data.

    Displaying a view gives a bundle with ``text/plain`` and ``text/html`` always, plus the
    widget's view inside a live kernel; so nbval and nbconvert see plain text and HTML, and
    JupyterLab shows the interactive widget.  Outside a kernel the HTML embeds the figures
    as PNG; inside one it holds the tables only (the widget has the pictures).
    """

    _widget: Any = None
    _error: Any = None  # an ErrorNote while the last click failed

    def text(self) -> str:
        raise NotImplementedError

    def html(self, figures: bool = True) -> str:
        """HTML of the view; ``figures=False`` leaves the (PNG) pictures out."""
        raise NotImplementedError

    def _build_widget(self) -> Any:
        raise NotImplementedError

    def _update_widget(self) -> None:
        """Push the current data into the widget (only called once it exists)."""

    @property
    def widget(self) -> Any:
        if self._widget is None:
            self._widget = self._build_widget()
            self._update_widget()
        return self._widget

    def _changed(self) -> None:
        if self._widget is not None:
            self._update_widget()

    def _error_box(self) -> Any:
        """The widget that shows the last failed click's error (empty otherwise)."""
        import ipywidgets as w

        if getattr(self, "_error_html", None) is None:
            self._error_html = w.HTML()
        return self._error_html

    def _clicked(self, action: Any, what: str = "") -> Any:
        """A button callback running ``action()``; an error shows in :meth:`_error_box`,
        exception line first, as a click has no caller to raise to."""
        from fsdp_interactive.notebook._error_note import ErrorNote

        def callback(*_: Any) -> None:
            box = self._error_box()
            try:
                action()
            except Exception as error:
                self._error = ErrorNote.of(error)
                box.value = self._error.html(f"{what} failed: " if what else "")
            else:
                self._error = None
                box.value = ""

        return callback

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        live = live_kernel()
        # In a live kernel the widget shows the pictures; the HTML fallback stays
        # text-only there so that saved notebooks compare stably (nbval compares HTML).
        bundle: dict[str, Any] = {"text/plain": self.text(), "text/html": self.html(not live)}
        if live:
            widget_bundle = self.widget._repr_mimebundle_() or {}
            for key, value in widget_bundle.items():
                if key != "text/plain":
                    bundle[key] = value
        return bundle

    def __repr__(self) -> str:
        return self.text()


class StatusView(View):
    """A panel with one status line: what its last action did, or the error it raised.

    ``status`` is plain text (set by the actions); ``error`` the last failed action's
    :class:`~._error_note.ErrorNote`, shown exception line first instead of ``status``.
    """

    status: str = ""
    error: Any = None

    def _guard(self, action: Any) -> None:
        """Run ``action()``; an exception shows in the status line, as a click has no
        caller to raise to."""
        from fsdp_interactive.notebook._error_note import ErrorNote

        self.error = None
        try:
            action()
        except Exception as error:
            self.error = ErrorNote.of(error)
            self.status = self.error.text("error: ")
            self._changed()

    def _status_html(self) -> str:
        """The status line as HTML: the error while the last action failed."""
        if self.error is not None:
            return self.error.html("error: ")
        return html.escape(self.status)
