"""Rank side: what ``Pool.pull`` and ``Pool.call`` send back to the kernel, with every
tensor on the CPU.

The notebook kernel never creates a CUDA context, and its host may have no GPU: a CUDA
tensor unpickled there would create one (or fail). ``Pool.call`` and ``Pool.pull`` run
on the ranks through :func:`call` and :func:`pull_from`, which pass the value through
:func:`to_kernel` before ipyparallel pickles it: :func:`fsdp_interactive._plain.cpu_copy`
with plain CPU tensors left uncopied (pickling copies them) and modules held wholly on the
CPU let through. A ``DTensor`` becomes this rank's local shard, without communication (the
call may reach only some of its ranks): to have the whole tensor, return
``t.full_tensor()`` from the call, on every rank of its mesh. What is refused, with an
error naming where in the value: a ``meta`` tensor, a module with a parameter or buffer
off the CPU, and a non-CPU tensor hidden in an object of another class.

Free of IPython: the engine's namespace is handed to :func:`pull_from` by
:mod:`._engine_shell`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def call(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, its result made fit for the kernel (:func:`to_kernel`)."""
    return to_kernel(function(*args, **kwargs), "the call's result")


def pull_from(namespace: Mapping[str, Any], name: str) -> Any:
    """The value of ``name`` in ``namespace``, made fit for the kernel (:func:`to_kernel`);
    ``NameError`` when it is not defined there."""
    try:
        value = namespace[name]
    except KeyError:
        raise NameError(f"name {name!r} is not defined") from None
    return to_kernel(value, name)


def to_kernel(value: Any, name: str = "value") -> Any:
    """``value`` with every tensor a plain CPU tensor (module docstring); ``name``: how
    errors refer to ``value``."""
    # Imported here: the kernel imports this module (to name ``call`` for ipyparallel),
    # and the kernel never imports torch.
    from fsdp_interactive._plain import cpu_copy

    return cpu_copy(value, name=name, copy_cpu=False, cpu_modules=True)
