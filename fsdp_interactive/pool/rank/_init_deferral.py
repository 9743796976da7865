"""Rank side: parameter initialization deferred while a recovery replays the cells that build
the model, and dropped for every tensor the snapshot then overwrites.

Building GPT-2 small on a CPU rank spends seconds drawing initial weights that the
snapshot replaces a moment later. While an :class:`InitDeferral` is started, the
``torch.nn.init`` functions (``normal_``, ``uniform_``, ``kaiming_uniform_``, ... as
transformers' ``no_init_weights`` lists them: in ``torch.nn.init``, in the
``torch.nn.modules`` that bound them by name, and the table transformers' own
initialization calls) record the call and return the tensor as it is, like torch's meta
device and transformers' ``no_init_weights``. :meth:`InitDeferral.finish`, after the
replay, then runs the recorded calls whose tensor is still alive and is not a parameter or
buffer of an object the snapshot restores; the others are dropped.

What this changes, and what it does not:

* the restored objects end as the snapshot has them, bit for bit (their initial values are
  overwritten by the restore);
* a tensor that is not restored (a second model, a probe head) is initialized, at the end
  of the replay instead of during it, with the generators as they are then: its values
  are not the original's;
* a tensor freed before the end of the replay is taken as copied into the restored
  objects (``fully_shard`` replaces every parameter by its shard): a value derived from
  its initial weights inside the replayed cell (a forward pass in the build cell, a copy
  into an object the snapshot does not hold) is derived from uninitialized memory;
* random numbers the replayed cell draws after the skipped initialization are not the
  original's (the generators did not advance over the skipped draws); the cells after it
  draw the original's numbers again, since the replay sets the generators to what the
  original cell left (:mod:`._cell_watch`);
* views (a slice of a tensor) and calls made on other threads while deferring are run at
  once, as usual.

Faults: the functions are put back by :meth:`stop` (called after the cell, also when it
raised); a rank that dies while deferring takes the change with it.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

#: The initialization functions deferred (as transformers' ``TORCH_INIT_FUNCTIONS``).
INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
#: Where transformers keeps the functions its own initialization calls.
_TRANSFORMERS_TABLE = ("transformers.initialization", "TORCH_INIT_FUNCTIONS")


def _whole(tensor: Any) -> bool:
    """A tensor that owns its storage from the start (not a view into another)."""
    try:
        return (
            tensor.storage_offset() == 0
            and tensor.is_contiguous()
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        )
    except (RuntimeError, NotImplementedError):  # meta tensors, tensor subclasses
        return False


class InitDeferral:
    """Defers ``torch.nn.init`` calls between :meth:`start` and :meth:`stop` (on the thread
    that started it); :meth:`finish` settles them."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, Callable[..., Any], tuple, dict]] = []
        self._undo: list[Callable[[], None]] = []
        self._thread: int | None = None

    def start(self) -> None:
        if self._undo:
            return
        import torch

        self._thread = threading.get_ident()
        originals = {name: getattr(torch.nn.init, name) for name in INIT_FUNCTIONS}
        wrappers = {name: self._wrap(fn) for name, fn in originals.items()}
        for module_name, module in list(sys.modules.items()):
            if module is None or not (
                module_name == "torch.nn.init" or module_name.startswith("torch.nn.modules.")
            ):
                continue
            for name, fn in originals.items():
                if vars(module).get(name) is fn:
                    setattr(module, name, wrappers[name])
                    self._undo.append(lambda m=module, n=name, f=fn: setattr(m, n, f))
        table_module = sys.modules.get(_TRANSFORMERS_TABLE[0])
        table = getattr(table_module, _TRANSFORMERS_TABLE[1], None)
        if isinstance(table, dict):
            for name, fn in list(table.items()):
                if callable(fn) and name in originals:
                    table[name] = self._wrap(fn)
                    self._undo.append(lambda t=table, n=name, f=fn: t.__setitem__(n, f))

    def stop(self) -> None:
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            step()

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def deferred(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self._thread or not _whole(tensor):
                return fn(tensor, *args, **kwargs)
            self._pending.append((weakref.ref(tensor), fn, args, kwargs))
            return tensor

        deferred.__wrapped__ = fn  # type: ignore[attr-defined]
        return deferred

    def finish(self, restored: Sequence[Any]) -> dict[str, int]:
        """Run the deferred calls whose tensor is alive and not held by ``restored`` (the
        objects the snapshot restores: modules' parameters and buffers count); drop the
        rest. Returns ``{"skipped": n, "initialized": m}``."""
        self.stop()
        import torch

        held_ids: set[int] = set()
        held_storage: set[int] = set()
        for obj in restored:
            if not isinstance(obj, torch.nn.Module):
                continue
            for tensor in [*obj.parameters(), *obj.buffers()]:
                held_ids.add(id(tensor))
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                held_storage.add(local.untyped_storage().data_ptr())
        skipped = initialized = 0
        pending, self._pending = self._pending, []
        for ref, fn, args, kwargs in pending:
            tensor = ref()
            if (
                tensor is None
                or id(tensor) in held_ids
                or (tensor.untyped_storage().data_ptr() in held_storage)
            ):
                skipped += 1
                continue
            with torch.no_grad():
                fn(tensor, *args, **kwargs)
            initialized += 1
        log.info(
            "replay: %d parameter initializations skipped (restored by the snapshot), %d run",
            skipped,
            initialized,
        )
        return {"skipped": skipped, "initialized": initialized}
