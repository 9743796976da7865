"""Inference and export of a sharded Hugging Face model.

* ``model.generate()`` through the wrapper gives the tokens the unsharded model gives;
* a FULL_STATE_DICT taken on rank 0 (``rank0_only``, ``offload_to_cpu``) saved with
  ``save_pretrained`` loads back with ``from_pretrained`` into a plain model whose logits are
  the sharded model's.

Logits are compared at 1e-5: the sharded forward runs the same kernels on the same
(all-gathered) weights, only batched per rank; measured differences are 0 to 1e-6.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp._common import full_params
from tests.hf import _common as H

LOGIT_TOL = 1e-5
NEW_TOKENS = 6


def _wrap(model: nn.Module, arch: str) -> nn.Module:
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_interactive.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={H.layer_class(arch)}
    )
    return FSDP(model, auto_wrap_policy=policy, use_orig_params=True)


def _prompt() -> torch.Tensor:
    return torch.randint(0, H.VOCAB, (2, 4), generator=torch.Generator().manual_seed(7))


def generate_both(arch: str) -> dict:
    model = _wrap(H.build(arch), arch)
    H.train_sharded(model, steps=1)  # not the initial weights
    model.eval()
    # Every rank generates the same prompt; a fixed length keeps every rank's number of
    # forwards (and so of collectives) equal.
    kwargs = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False}
    with torch.no_grad():
        sharded = model.generate(_prompt(), **kwargs)
    plain = H.build(arch)
    plain.load_state_dict(full_params(model), strict=False)
    plain.eval()
    with torch.no_grad():
        expected = plain.generate(_prompt(), **kwargs)
    return {"sharded": sharded.tolist(), "plain": expected.tolist()}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_through_the_wrapper_equals_the_unsharded_model(ranks2, arch):
    for r in ranks2.run(generate_both, arch):
        assert r["sharded"] == r["plain"]
        assert len(r["sharded"][0]) == 4 + NEW_TOKENS


@pytest.mark.world4
def test_generate_on_4_ranks(ranks4):
    for r in ranks4.run(generate_both, "llama"):
        assert r["sharded"] == r["plain"]


def export_round_trip(path: str, arch: str) -> dict:
    from transformers import AutoModelForCausalLM

    from fsdp_interactive.fsdp import FullStateDictConfig, StateDictType
    from fsdp_interactive.fsdp import FullyShardedDataParallel as FSDP

    warnings.simplefilter("ignore", FutureWarning)
    model = _wrap(H.build(arch), arch)
    H.train_sharded(model, steps=2)
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    model.eval()
    probe = H.global_batch(99, 1)
    with torch.no_grad():
        sharded_logits = model(input_ids=probe).logits
    out = {"entries": len(state)}
    if dist.get_rank() == 0:
        plain = H.build(arch, seed=5)
        out["same_keys"] = sorted(state) == sorted(plain.state_dict())
        plain.save_pretrained(path, state_dict=state)
        loaded = AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            loaded_logits = loaded(input_ids=probe).logits
        out["logit_diff"] = (loaded_logits - sharded_logits).abs().max().item()
        if arch == "gpt2":
            out["tied"] = loaded.lm_head.weight is loaded.transformer.wte.weight
    dist.barrier()
    return out


def _check_export(results: list[dict], arch: str) -> None:
    first, *others = results
    assert first["same_keys"]
    assert first["logit_diff"] < LOGIT_TOL
    if arch == "gpt2":
        assert first["tied"]
    assert all(r["entries"] == 0 for r in others), "rank0_only leaves other ranks empty"


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_full_rank0_state_dict_exports_with_save_pretrained(ranks2, tmp_path, arch):
    _check_export(ranks2.run(export_round_trip, str(tmp_path / arch), arch), arch)


@pytest.mark.world4
def test_full_rank0_state_dict_export_on_4_ranks(ranks4, tmp_path):
    _check_export(ranks4.run(export_round_trip, str(tmp_path / "gpt2"), "gpt2"), "gpt2")
