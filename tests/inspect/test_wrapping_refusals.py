"""A wrapping the adapter does not understand is refused by every probe, naming the class;
one that only holds the model in an attribute passes, its attribute part of the names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_interactive.inspect import (
    GradNormRecorder,
    UnsupportedWrapping,
    edit_param,
    full_param,
    grad_norms,
    layout,
    summon_stats,
)
from tests.models import Tiny, backward


class Flattening(nn.Module):
    """Flattens the model's parameters into one of its own; the model's modules keep plain
    tensor views of it (a flat-parameter scheme the adapter does not know)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        owners = [
            (m, n, p) for m in module.modules() for n, p in list(m.named_parameters(recurse=False))
        ]
        self.flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for _, _, p in owners]))
        start = 0
        for owner, name, param in owners:
            del owner._parameters[name]
            setattr(owner, name, self.flat[start : start + param.numel()].view(param.shape))
            start += param.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


class Holder(nn.Module):
    """Holds the model in an attribute and shards nothing."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.net = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Renaming(Holder):
    """Lists the model's parameters under names of its choosing."""

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        for name, param in self.net.named_parameters():
            yield f"shard_{name}", param


class ShardLike(torch.Tensor):
    """A tensor class of someone else's, holding who knows what of the parameter."""


class HandFlat(nn.Module):
    """Registers a parameter marked as a torch FSDP1 flat parameter that no FSDP1 manages."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in module.parameters()]))
        flat._is_flat_param = True
        self._flat_param = flat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _subclassed() -> nn.Module:
    model = Tiny()
    model.embed.weight = nn.Parameter(model.embed.weight.detach().as_subclass(ShardLike))
    return model


def _partitioned() -> nn.Module:
    model = Tiny()
    model.embed.weight.ds_id = 3  # how DeepSpeed ZeRO-3 marks the parameters it partitions
    return model


REFUSED = {
    "flattening": (lambda: Flattening(Tiny()), "Flattening", "viewed by the plain tensor"),
    "renaming": (lambda: Renaming(Tiny()), "Renaming", "does not name the parameters"),
    "tensor subclass": (_subclassed, "Linear", "a ShardLike, a tensor class"),
    "hand-made flat parameter": (lambda: HandFlat(Tiny()), "HandFlat", "no FSDP1 module"),
    "partitioned elsewhere": (_partitioned, "Linear", "DeepSpeed ZeRO-3"),
}
PROBES = {
    "layout": layout,
    "grad_norms": grad_norms,
    "summon_stats": lambda m: summon_stats(m, "embed.weight"),
    "edit_param": lambda m: edit_param(m, "embed.weight", "x * 2"),
    "full_param": lambda m: full_param(m, "embed.weight"),
    "GradNormRecorder": lambda m: GradNormRecorder(m).record(),
}


@pytest.mark.parametrize("wrapping", list(REFUSED))
def test_every_probe_refuses_a_wrapping_it_does_not_understand(wrapping):
    build, holder, reason = REFUSED[wrapping]
    torch.manual_seed(0)
    model = build()
    for probe_name, probe in PROBES.items():
        with pytest.raises(UnsupportedWrapping) as refusal:
            probe(model)
        message = str(refusal.value)
        assert f"the parameters {holder} holds" in message, (probe_name, message)
        assert reason in message, (probe_name, message)
        assert "DistributedDataParallel" in message  # what is understood


def test_a_wrapper_that_only_holds_the_model_passes_with_its_attribute_in_the_names():
    torch.manual_seed(0)
    model = Holder(Tiny())
    backward(model)
    names = [p.fqn for p in layout(model).params]
    assert names == [n for n, _ in model.named_parameters()] == list(model.state_dict())
    assert names[0] == "net.embed.weight"
    norms = grad_norms(model)
    truth = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e12))
    assert norms.total == pytest.approx(truth, rel=1e-6)
    weight = model.net.embed.weight.detach().double()
    stats = summon_stats(model, "net.embed")
    assert stats.names == ("net.embed.weight", "net.embed.bias")
    assert summon_stats(model, "net.embed.weight").mean == pytest.approx(float(weight.mean()))
    edit_param(model, "net.embed.bias", "x * 0")
    assert torch.equal(model.net.embed.bias, torch.zeros(3))


def _data_parallel_over_part_of_the_ranks() -> list[str]:
    """Gradients reduced over a subgroup: each rank's copy differs from the others'."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(0)
    alone, _ = dist.new_subgroups(1)
    ddp = nn.parallel.DistributedDataParallel(Tiny(), process_group=alone)
    # HYBRID_SHARD on a (2, 1) mesh: torch FSDP1 falls back to NO_SHARD over the one-rank
    # shard group and reduces no gradient between the replicas.
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    hybrid = FSDP(
        Tiny(),
        device_id=torch.device("cpu"),
        device_mesh=mesh,
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
    )
    messages = []
    for model in (ddp, hybrid):
        try:
            grad_norms(model)
        except UnsupportedWrapping as refusal:
            messages.append(str(refusal))
    return messages


def test_data_parallelism_over_part_of_the_ranks_is_refused(ranks2):
    for ddp, hybrid in ranks2.run(_data_parallel_over_part_of_the_ranks):
        assert "DistributedDataParallel holds: it replicates over 1 of the 2 ranks" in ddp
        assert "FullyShardedDataParallel holds: the torch FSDP1 unit '(root)' (NO_SHARD)" in hybrid
        assert "reduces gradients over 1 of the 2 ranks" in hybrid
        assert "HYBRID_SHARD with a one-rank shard group" in hybrid
