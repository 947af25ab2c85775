"""How a built model runs on the hardware, kept apart from what it computes (as torchtitan splits model and
parallelize): regional compilation of the transformer blocks."""

from __future__ import annotations

from torch import nn

from src.models.transformer import Block


def apply_compile(model: nn.Module) -> int:
    """Compile each transformer block in place and return how many. Blocks of one tower share code and shapes,
    so TorchInductor compiles each kind once (parameters are graph inputs, not constants) instead of tracing
    the whole model; the fusions that pay (LayerNorm, bias, GELU, layer-scale and residual adds) all live
    inside a block."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        block.compile()
    return len(blocks)

