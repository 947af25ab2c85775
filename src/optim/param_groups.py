"""Which parameters get weight decay: the matrices of linear layers and projections, nothing else."""

from __future__ import annotations

from torch import nn

# 2-D tensors that are lookup tables or position codes, not linear maps: decay would only shrink them.
NO_DECAY_NAMES = ("token_embedding", "positional_embedding", "class_embedding", "temporal_embedding")


def decays(name: str, param: nn.Parameter) -> bool:
    """Biases, norm weights, layer-scale gammas, the logit scale and bias are 0/1-D; embeddings are named."""
    return param.ndim >= 2 and not any(part in name for part in NO_DECAY_NAMES)


def param_groups_for_weight_decay(model: nn.Module, weight_decay: float) -> list[dict]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0},
    ]
