"""Locking towers (LiT, Zhai et al. 2022) and each parameter's depth from its tower's top (for layer decay).

A tower is three parts in forward order, grouped as OpenCLIP's `lock_image_tower(unlocked_groups=...)` and
`lock_text_tower(unlocked_layers=...)` group them:

- the embeddings (image: conv1, class and position embeddings, ln_pre; text: token and position embeddings),
- the transformer blocks,
- the head after them (image: ln_post, proj; text: ln_final, text_projection).

`lock_tower(tower, unlocked_blocks=k)` freezes the whole tower and gives the last k blocks and the head back to
training (OpenCLIP's unlocked_groups = k + 1; its projection-only group has no k here). A frozen parameter has
requires_grad=False: it gets no gradient, so the optimizer holds no state for it (src/optim/param_groups.py leaves
it out) and DDP and FSDP2 reduce nothing for it. A fully locked tower runs its forward under `torch.no_grad()`
(the model's `locked` flags); in a tower with unlocked blocks nothing before the first of them requires a
gradient (the images and tokens are data), so autograd records nothing there and keeps none of its activations.

`layer_depths(model)` gives every parameter its power of `optim.layer_decay`, counted as BEiT and timm's
`param_groups_layer_decay` count: in a tower of L blocks the head is at depth 0, block i (0 = the first) at L - i,
so the last block is at 1, and the embeddings at L + 1. Parameters outside the towers (the logit scale, a video
head, its temporal embedding) are at depth 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from src.config import ModelConfig
from src.models.vision import VisionTransformer

Part = nn.Module | nn.Parameter


@dataclass
class Tower:
    """One tower's parts; `name` is its config group (model.vision or model.text)."""

    name: str
    embeddings: list[Part]
    blocks: nn.ModuleList
    head: list[Part]


def image_tower(clip: nn.Module) -> Tower:
    visual = clip.visual
    return Tower("model.vision", [visual.conv1, visual.class_embedding, visual.positional_embedding, visual.ln_pre],
                 visual.transformer.resblocks, [visual.ln_post, visual.proj])


def text_tower(clip: nn.Module) -> Tower:
    return Tower("model.text", [clip.token_embedding, clip.positional_embedding], clip.transformer.resblocks,
                 [clip.ln_final, clip.text_projection])


def parameters(parts: list[Part] | nn.ModuleList) -> list[nn.Parameter]:
    return [p for part in parts for p in ([part] if isinstance(part, nn.Parameter) else part.parameters())]


def forward_order(tower: Tower) -> list[nn.Parameter]:
    """The tower's parameters in the order its forward pass uses them (the patch embedding first)."""
    return parameters([*tower.embeddings, *tower.blocks, *tower.head])


def lock_tower(tower: Tower, unlocked_blocks: int) -> bool:
    """Freeze `tower` but its last `unlocked_blocks` blocks and its head. Returns whether all of it is frozen."""
    layers = len(tower.blocks)
    if not 0 <= unlocked_blocks <= layers:
        raise ValueError(f"{tower.name}.unlocked_blocks={unlocked_blocks} must be in 0..{layers} (the tower has "
                         f"{layers} blocks)")
    for p in forward_order(tower):
        p.requires_grad_(False)
    if unlocked_blocks:
        for p in parameters([*tower.blocks[layers - unlocked_blocks :], *tower.head]):
            p.requires_grad_(True)
    return unlocked_blocks == 0


def lock_towers(clip: nn.Module, cfg: ModelConfig) -> None:
    """Lock the towers `model.vision.lock` and `model.text.lock` name, and flag those locked whole for no_grad."""
    if cfg.vision.lock:
        clip.visual.locked = lock_tower(image_tower(clip), cfg.vision.unlocked_blocks)
    if cfg.text.lock:
        clip.text_locked = lock_tower(text_tower(clip), cfg.text.unlocked_blocks)


def layer_depths(model: nn.Module) -> dict[str, int]:
    """Parameter name -> its depth from its tower's top, for every parameter of `model` (a CLIP or a model that
    holds one, such as VideoCLIP)."""
    depth_of: dict[int, int] = {}
    for module in model.modules():
        if isinstance(getattr(module, "visual", None), VisionTransformer):  # a CLIP
            for tower in (image_tower(module), text_tower(module)):
                layers = len(tower.blocks)
                depth_of.update((id(p), layers + 1) for p in parameters(tower.embeddings))
                for index, block in enumerate(tower.blocks):
                    depth_of.update((id(p), layers - index) for p in block.parameters())
    return {name: depth_of.get(id(p), 0) for name, p in model.named_parameters()}
