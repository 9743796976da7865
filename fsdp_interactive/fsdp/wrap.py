"""Auto-wrap policies: torch's own, re-exported.

Every policy FSDP1 accepts works here unchanged, because these *are* torch's objects
(``torch.distributed.fsdp.wrap``):

* :class:`ModuleWrapPolicy` / :class:`CustomPolicy` (``_Policy`` subclasses) are run through
  their own ``_run_policy`` to choose the units;
* the plain callables :func:`transformer_auto_wrap_policy`, :func:`size_based_auto_wrap_policy`,
  :func:`lambda_auto_wrap_policy`, :func:`always_wrap_policy` (usually bound with
  ``functools.partial``) and any user callable ``(module, recurse, nonwrapped_numel) -> bool``
  are evaluated exactly as FSDP1's recursive wrapper evaluates them.

:func:`enable_wrap` / :func:`wrap` are torch's manual-wrapping context; pass
``wrapper_cls=fsdp_interactive.fsdp.FullyShardedDataParallel``.
"""

from __future__ import annotations

from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

from fsdp_interactive._lazy_exports import public_names

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

__dir__ = public_names(__name__)
