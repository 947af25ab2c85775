"""CLIP: a ViT image tower, a causal transformer text tower, a learnable temperature and, for SigLIP's sigmoid loss,
an optional learnable bias of the logits.

The text tower's modules sit at the top level (`token_embedding`, `transformer`, `ln_final`, ...) as in
OpenCLIP's `CLIP`, so both models share one state-dict layout.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from src.config import ModelConfig
from src.models.locking import lock_towers
from src.models.transformer import Transformer
from src.models.vision import VisionTransformer

TOKEN_EMBEDDING_STD, TEXT_POSITIONAL_STD = 0.02, 0.01  # OpenCLIP's initialisation of the text tower's inputs
# The text residual stream's RMS at init: a block's branch, scaled by γ, is added to a stream this size.
TEXT_STREAM_RMS = math.hypot(TOKEN_EMBEDDING_STD, TEXT_POSITIONAL_STD)


def ln_pre_gain(cfg: ModelConfig) -> float:
    """`model.vision.ln_pre_gain`, or by default the image stream's start at the text stream's scale when
    layer-scale is on. `ln_pre` normalises the class and patch tokens to RMS 1 (times this gain), so with gain 1 a
    block's γ-scaled branch weighs about 45x less against the image stream than against the text stream, and the
    image tower, which reaches its pooled class token only through its blocks, joins late (docs/stability.md)."""
    if cfg.vision.ln_pre_gain is not None:
        return cfg.vision.ln_pre_gain
    return TEXT_STREAM_RMS if cfg.ls_init_value is not None else 1.0


class CLIP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        vision, text = cfg.vision, cfg.text
        self.init_logit_scale = cfg.init_logit_scale
        self.init_logit_bias = cfg.init_logit_bias
        self.max_logit_scale = cfg.max_logit_scale
        self.visual = VisionTransformer(
            vision.image_size, vision.patch_size, vision.width, vision.layers, vision.heads,
            vision.mlp_ratio, cfg.embed_dim, cfg.ls_init_value, vision.patch_dropout, cfg.quick_gelu,
            ln_pre_gain=ln_pre_gain(cfg),
        )
        self.context_length = text.context_length
        self.token_embedding = nn.Embedding(text.vocab_size, text.width)
        self.positional_embedding = nn.Parameter(torch.empty(text.context_length, text.width))
        self.transformer = Transformer(
            text.width, text.layers, text.heads, text.mlp_ratio, cfg.ls_init_value, cfg.quick_gelu
        )
        self.ln_final = nn.LayerNorm(text.width)
        self.text_projection = nn.Parameter(torch.empty(text.width, cfg.embed_dim))
        self.logit_scale = nn.Parameter(torch.empty(()))
        # OpenCLIP's name and state-dict key; a model without one has no such parameter, as in OpenCLIP.
        self.logit_bias = nn.Parameter(torch.empty(())) if cfg.init_logit_bias is not None else None
        self.text_locked = False  # the text tower frozen whole (src/models/locking.py): no autograd graph for it
        for tower in (self.visual.transformer, self.transformer):
            tower.prune_last_block = cfg.prune_last_block

    def init_weights(self) -> None:
        """Initialise every parameter; called after `to_empty()` when the model was built on `meta`."""
        self.visual.init_weights()
        nn.init.normal_(self.token_embedding.weight, std=TOKEN_EMBEDDING_STD)
        nn.init.normal_(self.positional_embedding, std=TEXT_POSITIONAL_STD)
        self.transformer.init_weights()
        self.ln_final.reset_parameters()
        nn.init.normal_(self.text_projection, std=self.transformer.width ** -0.5)
        nn.init.constant_(self.logit_scale, self.init_logit_scale)
        if self.logit_bias is not None:
            nn.init.constant_(self.logit_bias, self.init_logit_bias)

    def set_checkpointing(self, policy: str, every: int = 1) -> None:
        """Activation checkpointing of both towers' blocks in training (Transformer.set_checkpointing)."""
        self.visual.transformer.set_checkpointing(policy, every)
        self.transformer.set_checkpointing(policy, every)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.set_checkpointing("full" if enable else "none")

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        features = self.visual(images)
        return F.normalize(features, dim=-1) if normalize else features

    def text_tokens(self, tokens: torch.Tensor, pooled: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, text width): every token's final hidden state; with `pooled` (a token index per caption)
        only those tokens' (B, text width)."""
        with torch.no_grad() if self.text_locked else contextlib.nullcontext():
            x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[1]]
            return self.transformer(x, causal=True, final_norm=self.ln_final, pooled=pooled)

    def pool_text(self, x: torch.Tensor, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """The caption embedding from `text_tokens`' output: the end-of-text token's state, projected."""
        pooled = x[torch.arange(x.shape[0], device=x.device), end_of_text(tokens)]
        return self.project_text(pooled, normalize)

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        return self.project_text(self.text_tokens(tokens, pooled=end_of_text(tokens)), normalize)

    def project_text(self, pooled: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """The caption embedding from the end-of-text token's final state (B, text width)."""
        features = pooled @ self.text_projection
        return F.normalize(features, dim=-1) if normalize else features

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(image features, text features, logit scale), and the logit bias after them when the model has one, as
        OpenCLIP's CLIP returns them."""
        outputs = self.encode_image(images), self.encode_text(tokens), self.logit_scale.exp()
        return outputs if self.logit_bias is None else (*outputs, self.logit_bias)

    @torch.no_grad()
    def clamp_logit_scale(self) -> None:
        """Cap the temperature at 100 as CLIP does; in place on the device, so no host sync."""
        self.logit_scale.clamp_(0, self.max_logit_scale)


def end_of_text(tokens: torch.Tensor) -> torch.Tensor:
    """Each caption's end-of-text position: that token has the largest id in CLIP's vocabulary."""
    return tokens.argmax(dim=-1)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> CLIP:
    """The CLIP of `cfg` in plain PyTorch, checkpointed as `model.checkpoint_policy` says and its towers locked as
    `model.vision.lock` and `model.text.lock` say: built on the meta device first so a large model never
    materialises twice, then initialised (left on meta for `device="meta"`). src/kernels/dispatch.py's
    apply_kernels then picks the kernels it runs."""
    with torch.device("meta"):
        model = CLIP(cfg)
    # model.grad_checkpointing=true is the older spelling of checkpoint_policy=full; a policy set explicitly wins.
    legacy = cfg.grad_checkpointing and cfg.checkpoint_policy == "none"
    model.set_checkpointing("full" if legacy else cfg.checkpoint_policy, cfg.checkpoint_every)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    lock_towers(model, cfg)
    return model


def count_parameters(model: CLIP) -> dict[str, int]:
    """Parameter counts per tower, in all and those trained (not locked); works on meta-device models."""
    visual = sum(p.numel() for p in model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())
    logits = sum(p.numel() for p in (model.logit_scale, model.logit_bias) if p is not None)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"visual": visual, "text": total - visual - logits, "total": total, "trainable": trainable}
