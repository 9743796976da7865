"""Argument types shared by the subcommands: argparse turns their errors into exit 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_in_range(low: int, high: int | None, what: str) -> Callable[[str], int]:
    """An argparse ``type`` accepting whole numbers in ``low..high`` (no upper bound if None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive_int = int_in_range(1, None, "a positive integer")
tcp_port = int_in_range(1, 65535, "a TCP port number in 1..65535")
