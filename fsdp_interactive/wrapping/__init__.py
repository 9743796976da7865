"""How a model is wrapped: every original parameter, wherever this rank holds it (rank side).

The one place that understands wrappings. Every probe and view reads parameters through
:func:`model_params`, which returns, for a model however it is wrapped, each original
parameter (:class:`OriginalParam`) with

* its clean FQN, as ``torch.distributed.checkpoint.state_dict`` names it (``fqn``), and the
  name under the wrappers (``wrapped_name``); :meth:`ModelParams.resolve` and
  :meth:`ModelParams.select` accept either, and raise :class:`UnknownName` (a
  ``KeyError``) naming close matches for a name that is neither;
* its global ``shape``, ``dtype`` and the clean name of its FSDP ``unit``;
* what this rank holds of it (:meth:`OriginalParam.piece`: the elements and where they lie
  in the full tensor) and of its gradient (:meth:`OriginalParam.grad_piece`), with the
  groups that split it and how many ranks hold each piece (``split_groups``, ``copies``);
* the full tensor (:meth:`OriginalParam.full_tensor`, a collective over ``split_groups``).

Understood: ``fully_shard`` and :class:`fsdp_interactive.fsdp.FullyShardedDataParallel`
(DTensor parameters), torch's ``FullyShardedDataParallel`` (FSDP1) with
``use_orig_params`` False or True under every sharding strategy (each original
parameter's run of elements from the ``FlatParameter``'s own bookkeeping; its units are the
FSDP1 modules), ``DistributedDataParallel``, ``torch.compile``, activation-checkpoint
wrappers, Lightning Fabric's ``_FabricModule`` and the Lightning Trainer's wrapper (what
accelerate and the Hugging Face ``Trainer`` build is one of these), nested in any order,
and plain modules. Anything else that holds parameters its own way is refused with
:class:`UnsupportedWrapping`, naming the class: no probe shows a number the adapter cannot
vouch for.

Nothing here communicates except ``full_tensor``; nothing modifies the model.
"""

from fsdp_interactive._lazy_exports import public_names
from fsdp_interactive.wrapping._model_params import ModelParams, UnknownName, model_params
from fsdp_interactive.wrapping._param import OriginalParam, Piece
from fsdp_interactive.wrapping._refusal import UnsupportedWrapping

__all__ = [
    "ModelParams",
    "OriginalParam",
    "Piece",
    "UnknownName",
    "UnsupportedWrapping",
    "model_params",
]

__dir__ = public_names(__name__)
