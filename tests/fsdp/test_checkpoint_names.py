"""torch's DCP state-dict helpers see the unwrapped model's names through the wrapper."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    _iterate_valid_model_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tests.fsdp import _common as C
from tests.models import DIM, VOCAB, Block


def _trained():
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import ModuleWrapPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(C.make_model(0), auto_wrap_policy=ModuleWrapPolicy({Block}))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    C.lm_loss(model, C.local_part(C.batches(0, world), rank, world)).backward()
    optim.step()
    return model, optim


def optimizer_and_model_keys_are_clean() -> None:
    model, optim = _trained()
    plain_names = [n for n, _ in C.make_model(0).named_parameters()]
    # Name traversal used by DCP's loaders and optimizer helpers.
    assert [n for n, _ in model.named_parameters()] == plain_names
    valid = [k for k, _ in _iterate_valid_model_state(model)]
    assert sorted(valid) == sorted(plain_names)
    for name in plain_names:
        assert _get_fqns(model, name) == {name}

    osd = get_optimizer_state_dict(model, optim)
    assert sorted(osd["state"]) == sorted(plain_names)
    assert sorted(n for g in osd["param_groups"] for n in g["params"]) == sorted(plain_names)
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    assert full["state"]["head.weight"]["exp_avg"].shape == (VOCAB, DIM)
    # Round trip into a fresh wrapped model's optimizer.
    fresh, fresh_optim = _trained()
    set_optimizer_state_dict(fresh, fresh_optim, osd)
    for p, q in zip(
        optim.param_groups[0]["params"], fresh_optim.param_groups[0]["params"], strict=True
    ):
        torch.testing.assert_close(
            fresh_optim.state[q]["exp_avg"].to_local(), optim.state[p]["exp_avg"].to_local()
        )

    # Model keys go through model.state_dict(); the state-dict layer's hooks drop the
    # wrapper level using _fqn_modifiers().
    from fsdp_interactive.fsdp._state_dict_utils import install_state_dict_hooks

    install_state_dict_hooks(model)
    msd = get_model_state_dict(model)
    assert sorted(msd) == sorted(C.make_model(0).state_dict())


def test_dcp_keys_match_the_unwrapped_model(ranks2):
    ranks2.run(optimizer_and_model_keys_are_clean)
