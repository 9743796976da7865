"""What every view shares: a widget built on demand and text/HTML fallbacks."""

from __future__ import annotations

import html
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
