"""The optimizer's parameter groups: which parameters get weight decay (the matrices of linear layers and
projections, nothing else) and each one's learning-rate scale: layer decay, and the layer-scale gammas' own factor.
Frozen parameters (a locked tower, src/models/locking.py) are in no group, so the optimizer keeps no state for
them."""

from __future__ import annotations

from torch import nn

# 2-D tensors that are lookup tables or position codes, not linear maps: decay would only shrink them.
NO_DECAY_NAMES = ("token_embedding", "positional_embedding", "class_embedding", "temporal_embedding")


def decays(name: str, param: nn.Parameter) -> bool:
    """Biases, norm weights, layer-scale gammas, the logit scale and bias are 0/1-D; embeddings are named."""
    return param.ndim >= 2 and not any(part in name for part in NO_DECAY_NAMES)


def is_layer_scale_gamma(name: str) -> bool:
    """src/models/transformer.py's LayerScale holds its gain as `gamma` (OpenCLIP's `ls_1.gamma`, `ls_2.gamma`);
    nothing else in the models has that name."""
    return name.rpartition(".")[2] == "gamma"


def param_groups(model: nn.Module, weight_decay: float, lr: float, layer_decay: float = 1.0,
                 depths: dict[str, int] | None = None, layer_scale_lr_scale: float = 1.0) -> list[dict]:
    """One group per (layer-decay scale, weight decay, gamma or not) of the trainable parameters, each with its
    `lr` (lr x `lr_scale`, where lr_scale = layer_decay ** depth, times `layer_scale_lr_scale` for the layer-scale
    gammas; `depths` gives each parameter name its depth from its tower's top, src/models/locking.py's
    layer_depths). The schedule (LambdaLR) multiplies each group's own lr, so every group follows the same schedule
    at its scale. Groups run from the deepest (smallest scale) to the top; within a depth decayed, then gammas,
    then the rest not decayed, so the last is at scale 1 (it holds the logit scale). With layer_scale_lr_scale = 1
    the gammas share their depth's no-decay group, and with layer_decay = 1 too the groups are the two weight-decay
    groups, in the order checkpoints from before layer decay saved them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    depth = (lambda name: depths[name]) if depths is not None and layer_decay != 1.0 else (lambda name: 0)
    own_gamma_groups = layer_scale_lr_scale != 1.0
    groups: dict[tuple[int, bool, bool], list[nn.Parameter]] = {}
    for name, p in named:
        gamma = own_gamma_groups and is_layer_scale_gamma(name)
        groups.setdefault((depth(name), decays(name, p), gamma), []).append(p)
    ordered = sorted(groups.items(), key=lambda item: (-item[0][0], not item[0][1], not item[0][2]))
    return [
        {"params": params, "weight_decay": weight_decay if decayed else 0.0, "lr": lr * scale, "lr_scale": scale}
        for (d, decayed, gamma), params in ordered
        for scale in [layer_decay ** d * (layer_scale_lr_scale if gamma else 1.0)]
    ]
