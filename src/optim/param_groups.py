"""The optimizer's parameter groups: which parameters get weight decay (the matrices of linear layers and
projections, nothing else) and each one's layer-decay learning-rate scale. Frozen parameters (a locked tower,
src/models/locking.py) are in no group, so the optimizer keeps no state for them."""

from __future__ import annotations

from torch import nn

# 2-D tensors that are lookup tables or position codes, not linear maps: decay would only shrink them.
NO_DECAY_NAMES = ("token_embedding", "positional_embedding", "class_embedding", "temporal_embedding")


def decays(name: str, param: nn.Parameter) -> bool:
    """Biases, norm weights, layer-scale gammas, the logit scale and bias are 0/1-D; embeddings are named."""
    return param.ndim >= 2 and not any(part in name for part in NO_DECAY_NAMES)


def param_groups(model: nn.Module, weight_decay: float, lr: float, layer_decay: float = 1.0,
                 depths: dict[str, int] | None = None) -> list[dict]:
    """One group per (layer-decay scale, weight decay) of the trainable parameters, each with its `lr` (lr x
    `lr_scale`, where lr_scale = layer_decay ** depth and `depths` gives each parameter name its depth from its
    tower's top, src/models/locking.py's layer_depths). The schedule (LambdaLR) multiplies each group's own lr,
    so every group follows the same schedule at its scale. Groups run from the deepest (smallest scale) to the
    top, decayed before not decayed, so the last is at scale 1 (it holds the logit scale); with layer_decay = 1
    they are the two weight-decay groups, in the order checkpoints from before layer decay saved them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    depth = (lambda name: depths[name]) if depths is not None and layer_decay != 1.0 else (lambda name: 0)
    groups: dict[tuple[int, bool], list[nn.Parameter]] = {}
    for name, p in named:
        groups.setdefault((depth(name), decays(name, p)), []).append(p)
    return [
        {"params": params, "weight_decay": weight_decay if decayed else 0.0, "lr": lr * layer_decay ** d,
         "lr_scale": layer_decay ** d}
        for (d, decayed), params in sorted(groups.items(), key=lambda item: (-item[0][0], not item[0][1]))
    ]
