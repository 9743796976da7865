"""Records of a Llama-shaped model, made without ranks, for the views at real sizes.

``llama_layout(layers, world)``: an embedding and a head in the root unit and ``layers``
decoder layers of 9 parameters each, one FSDP unit per layer, sharded on dim 0 over
``world`` ranks (3 + 9 * layers parameters: 33 layers make 300).
"""

from __future__ import annotations

import math

from fsdp_interactive.inspect import GradNorms, ModelLayout, ParamLayout, RankTotals, ShardSlice

DIM = 64
LAYER = (
    ("input_layernorm.weight", (DIM,)),
    ("self_attn.q_proj.weight", (DIM, DIM)),
    ("self_attn.k_proj.weight", (DIM // 2, DIM)),
    ("self_attn.v_proj.weight", (DIM // 2, DIM)),
    ("self_attn.o_proj.weight", (DIM, DIM)),
    ("post_attention_layernorm.weight", (DIM,)),
    ("mlp.gate_proj.weight", (3 * DIM, DIM)),
    ("mlp.up_proj.weight", (3 * DIM, DIM)),
    ("mlp.down_proj.weight", (DIM, 3 * DIM)),
)


def _param(fqn: str, shape: tuple[int, ...], unit: str, world: int) -> ParamLayout:
    rows, rest = shape[0], math.prod(shape[1:])
    chunk = -(-rows // world)
    slices = []
    for rank in range(world):
        start = min(rows, rank * chunk)
        held = max(0, min(rows, start + chunk) - start)
        local = (held, *shape[1:])
        slices.append(
            ShardSlice(rank, local, (start,) + (0,) * (len(shape) - 1), held * rest, chunk * rest)
        )
    return ParamLayout(
        fqn=fqn,
        global_shape=shape,
        dtype="float32",
        element_size=4,
        is_dtensor=True,
        placements=("Shard(dim=0)",),
        mesh_shape=(world,),
        mesh_dim_names=None,
        requires_grad=True,
        slices=tuple(slices),
        unit=unit,
    )


def llama_params(layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(FQN, shape, unit) of every parameter, in model order."""
    params = [("model.embed_tokens.weight", (256, DIM), "")]
    for i in range(layers):
        unit = f"model.layers.{i}"
        params += [(f"{unit}.{name}", shape, unit) for name, shape in LAYER]
    params += [("model.norm.weight", (DIM,), ""), ("lm_head.weight", (256, DIM), "")]
    return params


def llama_layout(layers: int, world: int) -> ModelLayout:
    params = tuple(_param(f, s, u, world) for f, s, u in llama_params(layers))
    totals = []
    for rank in range(world):
        stored = sum(p.slice_of(rank).padded_numel * 4 for p in params)
        totals.append(RankTotals(rank, stored, stored, 2 * stored, 1024, host="node0"))
    return ModelLayout(world_size=world, params=params, ranks=tuple(totals))


def llama_norms(layers: int) -> GradNorms:
    """Norms that grow with the layer index (the last layer's are the largest)."""
    from fsdp_interactive.inspect import combine_norms

    params, unit_of, members = {}, {}, {}
    for index, (fqn, _, unit) in enumerate(llama_params(layers)):
        params[fqn] = 0.01 * (index + 1)
        unit_of[fqn] = unit
        members.setdefault(unit, []).append(params[fqn])
    modules: dict[str, list[float]] = {}
    for fqn, value in params.items():
        parts = fqn.split(".")
        for depth in range(len(parts)):
            modules.setdefault(".".join(parts[:depth]), []).append(value)
    return GradNorms(
        norm_type=2.0,
        total=combine_norms(list(params.values()), 2.0),
        params=params,
        modules={k: combine_norms(v, 2.0) for k, v in modules.items()},
        units={k: combine_norms(v, 2.0) for k, v in members.items()},
        unit_of=unit_of,
    )
