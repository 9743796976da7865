"""The views on a torch FSDP1 model (flat parameters) and a DDP one living on the real pool:
clean names, FSDP1 units, each rank's slice, the framework's own grad norm and full tensors;
wrapped names are accepted where a name is typed."""

from __future__ import annotations

import pytest
import torch

from fsdp_interactive._text import number
from fsdp_interactive.notebook import GradNormView, LayoutView, RankModel, SummonPanel
from tests.notebook.test_widgets import rank_truth

SETUP = """
import torch as _t
from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as _Policy
from tests.models import Block as _Block, TinyLM as _TinyLM
_t.manual_seed(0)
fsdp1_model = _FSDP(_TinyLM(2), device_id=_t.device("cpu"), auto_wrap_policy=_Policy({_Block}))
ddp_model = _t.nn.parallel.DistributedDataParallel(_TinyLM(2))
_tokens = _t.randint(0, 32, (2, 5), generator=_t.Generator().manual_seed(_t.distributed.get_rank()))
for _m in (fsdp1_model, ddp_model):
    _m(_tokens).square().mean().backward()
del _t, _FSDP, _Policy, _Block, _TinyLM, _tokens, _m
"""
SUMMONED = """
with FSDP.summon_full_params(fsdp1_model, writeback=False):
    summoned = {n: p.detach().clone() for n, p in fsdp1_model.named_parameters()}
"""


@pytest.fixture(scope="module")
def models(pool_shell):
    from fsdp_interactive.notebook.magics import current_pool

    pool = current_pool()
    pool.run(SETUP, stream=False)
    try:
        yield pool
    finally:
        if pool.running:
            pool.run("del fsdp1_model, ddp_model", stream=False)


def _summoned(pool) -> dict[str, torch.Tensor]:
    pool.run(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n" + SUMMONED,
        stream=False,
    )
    return pool.pull("summoned")[0]


def test_layout_view_of_torch_fsdp1_shows_clean_names_units_and_each_ranks_run(models):
    view = LayoutView(RankModel(models, "fsdp1_model"))
    layout = view.data
    summoned = _summoned(models)
    assert sorted(p.fqn for p in layout.params) == sorted(summoned)
    assert layout.model_bytes == sum(t.numel() * t.element_size() for t in summoned.values())
    assert sum(layout.held_bytes(r) for r in range(2)) == layout.model_bytes
    qkv = layout.param("blocks.1.attn.qkv.weight")
    assert qkv.unit == "blocks.1" and qkv.placements == ("FlatShard()",)
    assert all(s.flat for s in qkv.slices) and sum(s.numel for s in qkv.slices) == qkv.numel
    text = view.text()
    assert "blocks.1.attn.qkv.weight" in text and "FlatShard()" in text
    assert "_fsdp_wrapped_module" not in text and "_flat_param" not in text
    assert [row.label for row in view.selection.rows][:1] == ["(root)"]
    assert view.widget is not None and view._image.value[:4] == b"\x89PNG"


def test_grad_norm_view_of_torch_fsdp1_is_its_own_clip_grad_norm(models):
    clip_total = rank_truth(models, "float(fsdp1_model.clip_grad_norm_(1e12))")
    view = GradNormView(RankModel(models, "fsdp1_model"))
    assert view.data.total == pytest.approx(clip_total[0], rel=1e-5)
    assert number(view.data.total) in view.text()
    assert set(view.data.units) == {"", "blocks.0", "blocks.1"}
    ddp_total = rank_truth(
        models, "float(torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), 1e12))"
    )
    ddp_view = GradNormView(RankModel(models, "ddp_model"))
    assert ddp_view.data.total == pytest.approx(ddp_total[0], rel=1e-5)
    assert "blocks.0.attn.qkv.weight" in ddp_view.text() and "module." not in ddp_view.text()


def test_summon_panel_takes_wrapped_names_and_shows_clean_ones(models):
    source = RankModel(models, "fsdp1_model")
    panel = SummonPanel(source, fqn="_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module")
    assert panel.fqn == "blocks.0"
    assert "blocks.0.mlp.0.weight" in panel.params and "_fsdp" not in " ".join(panel.params)
    summoned = _summoned(models)
    full = summoned["blocks.1.mlp.0.weight"].double()
    stats = panel.select("_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.mlp.0.weight")
    assert stats.fqn == panel.fqn == "blocks.1.mlp.0.weight"
    assert stats.mean == pytest.approx(float(full.mean()), rel=1e-9)
    assert stats.norm == pytest.approx(float(full.norm()), rel=1e-9)
    panel.apply("x * 0", confirm=True)
    assert torch.equal(_summoned(models)["blocks.1.mlp.0.weight"], torch.zeros_like(full).float())
    with pytest.raises(ValueError, match="not a parameter or module"):
        panel.select("module.nope")
    ddp_panel = SummonPanel(RankModel(models, "ddp_model"), fqn="module.head.bias")
    assert ddp_panel.fqn == "head.bias"
