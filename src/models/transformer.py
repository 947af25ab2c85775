"""Pre-norm transformer blocks with zero-initialized layer-scale.

Parameter names follow OpenCLIP (`attn.in_proj_weight`, `mlp.c_fc`, `ls_1.gamma`, ...) so that
OpenCLIP state dicts load into these modules unchanged.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class QuickGELU(nn.Module):
    """The sigmoid GELU approximation of OpenAI's original CLIP weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class LayerScale(nn.Module):
    """Per-channel gain on a residual branch. At gamma = 0 the block starts as the identity, which keeps
    feature magnitudes small early on (Wortsman et al. 2023, needed for low-precision training)."""

    def __init__(self, dim: int, init_value: float):
        super().__init__()
        self.init_value = init_value
        self.gamma = nn.Parameter(torch.full((dim,), init_value))

    def init_weights(self) -> None:
        nn.init.constant_(self.gamma, self.init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Attention(nn.Module):
    """Multi-head self-attention with a fused QKV projection, laid out like nn.MultiheadAttention."""

    # The QKV projection's linear op: convert_to_switchback swaps it (out_proj is an nn.Linear, swapped too).
    linear = staticmethod(F.linear)

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}: pick heads that divide it")
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, ls_init_value: float | None, quick_gelu: bool):
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.ln_1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ls_1 = LayerScale(width, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(width, hidden)),
            ("gelu", QuickGELU() if quick_gelu else nn.GELU()),
            ("c_proj", nn.Linear(hidden, width)),
        ]))
        self.ls_2 = LayerScale(width, ls_init_value) if ls_init_value is not None else nn.Identity()

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        x = x + self.ls_1(self.attn(self.ln_1(x), causal=causal))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class Transformer(nn.Module):
    def __init__(
        self, width: int, layers: int, heads: int, mlp_ratio: float, ls_init_value: float | None,
        quick_gelu: bool = False,
    ):
        super().__init__()
        self.width = width
        self.layers = layers
        self.grad_checkpointing = False
        self.resblocks = nn.ModuleList(
            Block(width, heads, mlp_ratio, ls_init_value, quick_gelu) for _ in range(layers)
        )

    def init_weights(self) -> None:
        """OpenCLIP's text-tower init, used for both towers: residual outputs shrink with depth."""
        attn_std = self.width ** -0.5
        proj_std = attn_std * (2 * self.layers) ** -0.5
        fc_std = (2 * self.width) ** -0.5
        for block in self.resblocks:
            for norm in (block.ln_1, block.ln_2):
                norm.reset_parameters()
            nn.init.normal_(block.attn.in_proj_weight, std=attn_std)
            nn.init.zeros_(block.attn.in_proj_bias)
            nn.init.normal_(block.attn.out_proj.weight, std=proj_std)
            nn.init.zeros_(block.attn.out_proj.bias)
            nn.init.normal_(block.mlp.c_fc.weight, std=fc_std)
            nn.init.zeros_(block.mlp.c_fc.bias)
            nn.init.normal_(block.mlp.c_proj.weight, std=proj_std)
            nn.init.zeros_(block.mlp.c_proj.bias)
            for scale in (block.ls_1, block.ls_2):
                if isinstance(scale, LayerScale):
                    scale.init_weights()

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        for block in self.resblocks:
            if self.grad_checkpointing and self.training:
                x = checkpoint(block, x, causal, use_reentrant=False)
            else:
                x = block(x, causal=causal)
        return x
