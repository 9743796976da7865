"""Hugging Face models from tiny configs (random init, nothing downloaded), their data, and
the unsharded reference each parity test compares against.

Everything here is module-level so it pickles into the rank processes; ``transformers`` is
imported on the ranks only when a test first builds a model there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
SEQ = 8
LOCAL_BATCH = 2
STEPS = 3
LR = 1e-2


def build(arch: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (tied embeddings), seeded, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="eager",
            **overrides,
        )
        return LlamaForCausalLM(config)
    if arch == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
            **overrides,
        )
        return GPT2LMHeadModel(config)
    raise ValueError(f"arch must be 'llama' or 'gpt2', got {arch!r}")


def layer_class(arch: str) -> type[nn.Module]:
    """The decoder layer class a transformer wrap policy names."""
    if arch == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


def global_batch(step: int, world_size: int) -> torch.Tensor:
    """Token ids of ``step``'s global batch: ``world_size * LOCAL_BATCH`` sequences."""
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (world_size * LOCAL_BATCH, SEQ), generator=gen)


def local_batch(step: int) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    return global_batch(step, world).chunk(world)[rank]


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss Hugging Face computes (labels = inputs, shifted inside)."""
    return model(input_ids=tokens, labels=tokens).loss


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


@dataclass
class Run:
    losses: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train_sharded(model: nn.Module, steps: int = STEPS, first: int = 0) -> list[float]:
    """``steps`` AdamW steps on this rank's slice; the mean loss over ranks per step."""
    optim = optimizer(model)
    losses = []
    for step in range(first, first + steps):
        loss = loss_of(model, local_batch(step))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss))
    return losses


def train_reference(arch: str, steps: int = STEPS, seed: int = 0, **overrides: Any) -> Run:
    """One process, the unwrapped model, the whole global batch each step."""
    model = build(arch, seed, **overrides)
    world = dist.get_world_size()
    optim = optimizer(model)
    losses = []
    for step in range(steps):
        loss = loss_of(model, global_batch(step, world))
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return Run(losses, {n: p.detach().clone() for n, p in model.named_parameters()})


def unit_names(model: nn.Module) -> list[str]:
    """Clean names of the modules wrapped as FSDP units below the root (either FSDP)."""
    names = []
    for name, module in model.named_modules():
        if name and type(module).__name__ == "FullyShardedDataParallel":
            clean = name.replace("_fsdp_wrapped_module.", "").replace(
                "_checkpoint_wrapped_module.", ""
            )
            names.append(clean.removesuffix("._checkpoint_wrapped_module"))
    return names
