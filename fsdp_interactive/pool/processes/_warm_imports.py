"""Warm imports: an engine forker imports what the notebook's cells import, so that the
engines it forks later (a recovery's, a restart's) find those modules already loaded.

A recovery replays the cells that built the model; on CPU ranks their imports
(``transformers`` and what its model classes pull in: seconds a process) are a large
part of that replay, paid again by every new rank. The pool asks each forker, after a
cell that will be replayed finished, to import the modules that cell imports; the
forker does it between requests, off any recovery's path.

An *import spec* is ``"package.module"`` (``import package.module``) or
``"package.module:name"`` (``from package.module import name``: the name is looked up
too, which loads what lazy packages such as ``transformers`` load only then).

What may be imported into a forker, whose children must stay safe to fork:

* only modules of installed packages: the top-level package's files lie in a
  site-packages folder or the standard library. The notebook's own modules, and editable
  installs of a project under work, are never warmed: a forker that kept an old copy
  would hand it to every engine started after the user edited the file (a restart is how
  users pick up their edits);
* only imports that start no thread and leave CUDA uninitialized, which a throwaway fork
  (the *probe*) tries first; the forker imports the specs the probe found safe. When the
  probe of several specs saw a thread started or CUDA initialized, each of them is probed
  alone, so that the others are still imported; a spec refused once is not tried again.

A warmed module binds what it imports as the forker has it, so the forker first makes
``tqdm.auto`` give the rank bar, as engines do (:func:`prepare_forker`). Other
import-time checks of a library see a process with ``ipykernel`` loaded but no shell
running: ``transformers`` picks its text progress callback (whose bar is the rank bar)
rather than its notebook one when ``transformers.trainer`` was warmed.

A package upgraded on disk after it was warmed reaches engines after the pool is stopped
and started again (the forkers start afresh then), as in any long-lived Python process.
This module runs in the forker and the probe only: it never starts a thread itself.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The longest list of specs one request may carry, and the longest spec.
MAX_SPECS = 256
_MAX_SPEC_CHARS = 300


def check_specs(specs: Any) -> list[str]:
    """``specs`` as a list of import specs; ``ValueError`` naming what is wrong."""
    if not isinstance(specs, list) or len(specs) > MAX_SPECS:
        raise ValueError(f"warm must be a list of at most {MAX_SPECS} import specs")
    for spec in specs:
        module, colon, name = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        if (
            not isinstance(spec, str)
            or len(spec) > _MAX_SPEC_CHARS
            or not all(part.isidentifier() for part in module.split("."))
            or (colon and not name.isidentifier())
        ):
            raise ValueError(
                f"an import spec is 'package.module' or 'package.module:name', got {spec!r}"
            )
    return list(specs)


def _installed_roots() -> list[Path]:
    roots = [*site.getsitepackages(), site.getusersitepackages()]
    paths = sysconfig.get_paths()
    roots += [paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]]
    return [Path(root).resolve() for root in dict.fromkeys(roots) if root]


def installed(top_level: str) -> bool:
    """Whether the top-level package or module ``top_level`` is installed: its files lie
    under a site-packages folder or the standard library (finding it imports nothing)."""
    if top_level in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(top_level)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = list(spec.submodule_search_locations or []) or [spec.origin or ""]
    roots = _installed_roots()
    return all(
        place and any(Path(place).resolve().is_relative_to(root) for root in roots)
        for place in places
    )


def prepare_forker() -> None:
    """Before any warm import, once the forker's preloads are done: make what warm imports
    load here what an engine would load, ``tqdm.auto`` giving the rank bar and the
    initialization functions wrapped
    (:func:`~fsdp_interactive.pool.rank._engine_shell.prepare_process`)."""
    shell = sys.modules.get("fsdp_interactive.pool.rank._engine_shell")
    if shell is not None:  # its preload failed: the engines report why
        shell.prepare_process()


def import_spec(spec: str) -> None:
    """Import what ``spec`` names (see the module's docstring); raises what importing raises."""
    module_name, _, name = spec.partition(":")
    module = importlib.import_module(module_name)
    if name and not hasattr(module, name):  # a submodule not imported by its package
        importlib.import_module(f"{module_name}.{name}")


def _thread_count() -> int:
    """Threads of this process, native ones included (OpenMP, OpenBLAS)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def probe(specs: list[str]) -> dict[str, Any]:
    """In a throwaway fork: import ``specs``; what the forker may import.

    ``{"ok": [...], "failed": {spec: reason}, "unsafe": reason or None}``: ``unsafe`` when
    the imports started a thread or initialized CUDA (then nothing is to be imported).
    """
    threads = _thread_count()
    ok, failed = [], {}
    for spec in specs:
        top_level = spec.partition(":")[0].split(".")[0]
        if not installed(top_level):
            failed[spec] = f"{top_level} is not an installed package"
            continue
        try:
            import_spec(spec)
        except (Exception, SystemExit) as exc:  # a module may even call sys.exit
            failed[spec] = f"{type(exc).__name__}: {exc}"
            continue
        ok.append(spec)
    unsafe = None
    if _thread_count() > threads:
        unsafe = f"importing them started {_thread_count() - threads} thread(s)"
    elif _cuda_initialized():
        unsafe = "importing them initialized CUDA"
    return {"ok": ok, "failed": failed, "unsafe": unsafe}


def run_probe(specs: list[str], report_path: str) -> int:
    """The probe's body: :func:`probe`, its result written as JSON to ``report_path``."""
    result = probe(specs)
    Path(report_path).write_text(json.dumps(result), encoding="utf-8")
    return 0


@dataclass(frozen=True)
class Settled:
    """What the forker does once a probe ended: import ``to_import``, report ``skipped``
    (spec -> reason), and probe each of ``alone`` by itself, to find which of them made
    the probe of them together unsafe."""

    to_import: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    alone: list[str] = field(default_factory=list)


def settle(specs: list[str], report_path: str, exit_code: int) -> Settled:
    """In the forker, once the probe of ``specs`` ended with ``exit_code``: what to do."""
    result = read_probe(report_path)
    if result is None or exit_code != 0:
        return Settled(skipped=dict.fromkeys(specs, f"the import probe ended with {exit_code}"))
    skipped = {str(k): str(v) for k, v in dict(result.get("failed", {})).items()}
    ok = [s for s in result.get("ok", []) if s in specs]
    if not result.get("unsafe"):
        return Settled(to_import=ok, skipped=skipped)
    if len(ok) > 1:
        return Settled(skipped=skipped, alone=ok)
    return Settled(skipped={**skipped, **dict.fromkeys(ok, str(result["unsafe"]))})


def read_probe(report_path: str) -> dict[str, Any] | None:
    """What a probe wrote to ``report_path`` (``None`` if it wrote nothing usable); the
    file is removed."""
    try:
        with open(report_path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        result = None
    finally:
        with contextlib.suppress(OSError):
            os.remove(report_path)
    return result if isinstance(result, dict) else None


def import_here(specs: list[str]) -> tuple[list[str], dict[str, str]]:
    """In the forker: import ``specs`` (each one the probe imported safely); the imported
    ones, and the reason for each that failed. Like the forker's own preloads, with the
    cyclic collector off meanwhile and what was made frozen afterwards. What the imports
    print goes to stderr: the forker's stdout carries its protocol."""
    import gc

    done, failed = [], {}
    gc.disable()
    try:
        with contextlib.redirect_stdout(sys.stderr):
            for spec in specs:
                try:
                    import_spec(spec)
                except (Exception, SystemExit) as exc:
                    failed[spec] = f"{type(exc).__name__}: {exc}"
                else:
                    done.append(spec)
    finally:
        gc.freeze()
        gc.enable()
    return done, failed
