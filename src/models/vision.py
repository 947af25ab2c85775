"""The ViT image tower: patchify, class token, transformer, class-token pooling, projection."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from src.models.transformer import Transformer


class PatchDropout(nn.Module):
    """Drops a random subset of patch tokens in training (Li et al. 2023, FLIP); the class token stays."""

    def __init__(self, prob: float):
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"model.vision.patch_dropout={prob} must be in [0, 1)")
        self.prob = prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.prob == 0.0:
            return x
        cls_token, patches = x[:, :1], x[:, 1:]
        keep = max(1, int(patches.shape[1] * (1 - self.prob)))
        index = torch.rand(patches.shape[:2], device=x.device).topk(keep, dim=1).indices
        patches = patches.gather(1, index.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
        return torch.cat([cls_token, patches], dim=1)


class VisionTransformer(nn.Module):
    def __init__(
        self, image_size: int, patch_size: int, width: int, layers: int, heads: int, mlp_ratio: float,
        output_dim: int, ls_init_value: float | None, patch_dropout: float = 0.0, quick_gelu: bool = False,
        ln_pre_gain: float = 1.0,
    ):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(
                f"model.vision.image_size={image_size} is not a multiple of patch_size={patch_size}"
            )
        self.image_size = image_size
        self.width = width
        grid = image_size // patch_size
        self.conv1 = nn.Conv2d(3, width, kernel_size=patch_size, stride=patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(width))
        self.positional_embedding = nn.Parameter(torch.empty(grid * grid + 1, width))
        self.patch_dropout = PatchDropout(patch_dropout)
        self.ln_pre = nn.LayerNorm(width)
        self.ln_pre_gain = ln_pre_gain  # ln_pre's weight at init (its bias starts at 0)
        self.transformer = Transformer(width, layers, heads, mlp_ratio, ls_init_value, quick_gelu)
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Parameter(torch.empty(width, output_dim))
        self.locked = False  # frozen whole (src/models/locking.py): the forward records no autograd graph

    def init_weights(self) -> None:
        scale = self.width ** -0.5
        self.conv1.reset_parameters()
        nn.init.normal_(self.class_embedding, std=scale)
        nn.init.normal_(self.positional_embedding, std=scale)
        self.ln_pre.reset_parameters()
        nn.init.constant_(self.ln_pre.weight, self.ln_pre_gain)
        self.transformer.init_weights()
        self.ln_post.reset_parameters()
        nn.init.normal_(self.proj, std=scale)

    def embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        """(B, patches, width): `conv1` applied as one matmul over unfolded patches. Non-overlapping patches
        are a reshape, and cuDNN's kernels for a stride-p convolution ran 20-40× slower than this matmul on an
        H200 (about a tenth of a ViT-B/32 step). The weight keeps the convolution's shape and state-dict key."""
        batch, channels, height, width = images.shape
        p = self.conv1.kernel_size[0]
        if height % p or width % p:
            raise ValueError(f"image size {height}x{width} is not a multiple of the patch size {p}")
        patches = images.reshape(batch, channels, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
        return F.linear(patches.reshape(batch, -1, channels * p * p), self.conv1.weight.flatten(1))

    def tokens(self, images: torch.Tensor, class_only: bool = False) -> torch.Tensor:
        """(B, 1 + patches, width): the class token then the patch tokens, after the final norm; with
        `class_only` the class token's alone (B, width), for less work (Transformer.forward's `pooled`)."""
        with torch.no_grad() if self.locked else contextlib.nullcontext():
            return self._tokens(images, class_only)

    def _tokens(self, images: torch.Tensor, class_only: bool) -> torch.Tensor:
        x = self.embed_patches(images)
        cls_token = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls_token, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.ln_pre(self.patch_dropout(x))
        cls_index = torch.zeros(x.shape[0], dtype=torch.long, device=x.device) if class_only else None
        return self.transformer(x, final_norm=self.ln_post, pooled=cls_index)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, output_dim): the class token's final state, projected."""
        return self.tokens(images, class_only=True) @ self.proj
