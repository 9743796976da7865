"""What a demo run measured: plain data the driver fills and the report draws."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_interactive.inspect import GradNorms, ModelLayout


@dataclass
class DemoResult:
    """Everything the demo measured; ``report_png`` and ``checkpoint`` are paths."""

    world_size: int
    param_count: int
    losses: list[float] = field(default_factory=list)
    layout: ModelLayout | None = None
    grad_norms: GradNorms | None = None
    checkpoint: str = ""
    checkpoint_bytes: int = 0
    report_png: str = ""
    seconds: float = 0.0
