"""What the adapter refuses: ways of holding parameters it cannot vouch for.

A probe that reads a parameter the adapter does not understand would show a number nobody
can vouch for (a flat shard taken for a whole tensor, a local piece for the full one).
Instead the adapter raises :class:`UnsupportedWrapping`, naming the class that holds the
parameters and what was not understood:

* a parameter of a tensor class other than ``nn.Parameter``/``Tensor``, ``DTensor`` and
  torch FSDP1's ``FlatParameter`` (a ``ShardedTensor``, a quantized or float8 subclass);
* a flat parameter (or a parameter torch FSDP1 marked as flattened) that no torch FSDP1
  module of the model manages, and parameters other frameworks mark as partitioned
  (DeepSpeed ZeRO-3's ``ds_id``, fairscale's ``_is_sharded``);
* a module whose ``named_parameters()`` does not name the parameters where they are
  registered (an override that hides, adds or renames parameters);
* a plain tensor attribute of a module that views a registered parameter's storage (a
  flattened-parameter scheme the adapter does not know);
* a data-parallel wrapper over part of the ranks only (each piece's copies are counted over
  the default group).

A wrapper that only holds the model in an attribute and shards nothing passes: its
parameters are plain, registered where ``named_parameters()`` says, and its attribute is
part of the clean names, as ``state_dict()`` has it.
"""

from __future__ import annotations

from torch import nn

#: Attributes other frameworks set on the parameters they partition their own way.
FOREIGN_PARTITION_MARKS = {
    "ds_id": "DeepSpeed ZeRO-3 partitions it",
    "_is_sharded": "fairscale's FSDP shards it",
}

SUPPORTED = (
    "fully_shard, fsdp_interactive.fsdp.FullyShardedDataParallel, torch's "
    "FullyShardedDataParallel (FSDP1, any sharding strategy, use_orig_params False or True), "
    "DistributedDataParallel, torch.compile, activation-checkpoint wrappers, and Lightning "
    "Fabric's and accelerate's wrappers of these"
)


class UnsupportedWrapping(TypeError):
    """The model holds parameters in a way the adapter does not understand.

    ``holder``: the class name of the module (or tensor) in question; ``reason``: what was
    not understood. The message names both and what is understood.
    """

    def __init__(self, holder: str, reason: str):
        self.holder = holder
        self.reason = reason
        super().__init__(
            f"fsdp_interactive cannot vouch for the parameters {holder} holds: {reason}. "
            f"The probes and views read parameters of models built with {SUPPORTED}; "
            "inspect the model inside that wrapping, or without it"
        )


def owner_class(root: nn.Module, path: str) -> str:
    """The class name of the module that registers the parameter at ``path``."""
    module: object = root
    for segment in path.split(".")[:-1]:
        module = getattr(module, segment, module)
    return type(module).__name__


def overriding_class(root: nn.Module) -> str:
    """The first module class under ``root`` (pre-order), torch's and this package's aside,
    that overrides how ``nn.Module`` lists parameters; the root's class when none does."""
    listing = ("named_parameters", "parameters", "named_modules", "modules", "named_children")
    for module in root.modules():
        cls = type(module)
        if cls.__module__.startswith(("torch.", "fsdp_interactive.")):
            continue
        if any(getattr(cls, name, None) is not getattr(nn.Module, name) for name in listing):
            return cls.__name__
    return type(root).__name__
