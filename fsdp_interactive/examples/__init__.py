"""Small, dependency-free models and data used by the demo, the tutorials and the benchmarks."""

from fsdp_interactive._lazy_exports import public_names
from fsdp_interactive.examples.transformer import (
    TinyTransformer,
    TransformerBlock,
    synthetic_batch,
)

__all__ = ["TinyTransformer", "TransformerBlock", "synthetic_batch"]

__dir__ = public_names(__name__)
