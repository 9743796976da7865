"""``clean_name(model, name)``: a parameter's or module's clean FQN (rank side)."""

from __future__ import annotations

from torch import nn

from fsdp_interactive.wrapping import model_params


def clean_name(model: nn.Module, name: str) -> str | None:
    """The clean FQN (as ``torch.distributed.checkpoint.state_dict`` names it) of the
    parameter or module of ``model`` called ``name``, clean or wrapped (``"module.fc"``,
    ``"_fsdp_wrapped_module.fc._flat_param"``'s module, ``"_orig_mod.fc.weight"``); ``None``
    when ``model`` has neither. No communication.
    """
    try:
        return model_params(model).clean_name(name)
    except KeyError:
        return None
