#!/usr/bin/env python3
"""Print the requirements that pyproject.toml declares, one per line.

Used by the image recipes to install the project's runtime dependencies in a layer of
their own, before the package source is copied in (so that editing the source does not
reinstall the dependencies). Prints ``[project] dependencies`` followed by those of each
``--extra`` named. Does not resolve, pin or install anything; tomli on Python 3.10.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """The dependencies of ``pyproject`` plus those of each extra in ``extras``."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    declared = project.get("optional-dependencies", {})
    lines = list(project.get("dependencies", []))
    for extra in extras:
        if extra not in declared:
            raise ValueError(
                f"{extra!r} is not an optional-dependencies table of {pyproject} "
                f"(declared: {', '.join(sorted(declared)) or 'none'})"
            )
        lines += declared[extra]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path, help="path to pyproject.toml")
    parser.add_argument("--extra", action="append", default=[], help="also print this extra's")
    args = parser.parse_args(argv)
    try:
        lines = requirements(args.pyproject, args.extra)
    except ValueError as error:
        parser.error(f"--extra: {error}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
