"""Pre-norm transformer blocks with layer-scale (near-zero or zero at init), and their activation checkpointing.

Parameter names follow OpenCLIP (`attn.in_proj_weight`, `mlp.c_fc`, `ls_1.gamma`, ...) so that
OpenCLIP state dicts load into these modules unchanged. This is the architecture in plain PyTorch;
src/kernels/dispatch.py swaps in the modules that run our fused kernels, with the same parameters.

Checkpointing policies (`model.checkpoint_policy`): `none` keeps every activation autograd wants; `full`
keeps only each block's input and re-runs the whole block in backward; `selective` keeps the outputs of the
matmuls and of attention and re-runs only the element-wise ops between them (LayerNorm, GELU, bias and
residual adds, layer-scale), which cost little time but a large share of the memory.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from src.config import CheckpointPolicy as CheckpointChoice

# Ops whose outputs `selective` keeps: the FLOPs of a block. Re-running them would cost nearly a second
# forward; everything else in a block is memory-bound and cheap to redo. Attention comes in one op per SDPA
# backend (math attention decomposes into bmm, kept through the matmuls); _scaled_mm is an fp8 matmul. Custom
# matmul and attention ops join through `keep_in_selective_checkpointing`.
_SAVED_BY_SELECTIVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def keep_in_selective_checkpointing(*ops: torch._ops.OpOverload) -> None:
    """Have `selective` keep the outputs of `ops` too: the matmul and attention ops a block may run besides
    PyTorch's own."""
    _SAVED_BY_SELECTIVE.update(ops)


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # MUST_SAVE: under torch.compile the partitioner may not trade a kept matmul back for recomputation.
    # PREFER_RECOMPUTE: it may still keep a fused element-wise result where that is cheaper than redoing it.
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


# The outputs `selective` keeps then pass through the caller's saved-tensor hooks (CPU offload, the tests'
# memory measurement) like any other saved tensor. Newer PyTorch has the switch (and warns without it); older
# PyTorch passes unknown keywords on to the checkpointed function instead.
_RESPECT_HOOKS = (
    {"respect_saved_tensors_hooks": True}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters else {}
)


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls_and_attention)


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


def sdpa_attention(
    qkv: torch.Tensor, heads: int, causal: bool = False, backends: list[SDPBackend] | None = None
) -> torch.Tensor:
    """Multi-head self-attention of a fused QKV projection's output [B, L, 3·W] -> [B, L, W], through
    `F.scaled_dot_product_attention` restricted to `backends` (None: PyTorch's choice)."""
    batch, length, three_width = qkv.shape
    q, k, v = qkv.view(batch, length, 3, heads, three_width // 3 // heads).permute(2, 0, 3, 1, 4)
    if backends is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out.transpose(1, 2).reshape(batch, length, three_width // 3)


class Attention(nn.Module):
    """Multi-head self-attention with a fused QKV projection, laid out like nn.MultiheadAttention."""

    # The QKV projection's linear op, F.linear's signature: a low-precision linear may replace it per module
    # (src/kernels/switchback/convert.py), as it replaces out_proj.
    linear: Callable[..., torch.Tensor] = staticmethod(F.linear)

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}: pick heads that divide it")
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        qkv = self.linear(x, self.in_proj_weight, self.in_proj_bias)
        return self.out_proj(sdpa_attention(qkv, self.heads, causal))

    def forward_pooled(self, x: torch.Tensor, pooled: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Attention's output [B, W] for one token per sample, x[b, pooled[b]], as `forward` computes it for
        those tokens: keys and values come from every token, the query from that token alone. Q and KV take
        their own slices of the fused projection, so no query is computed that nothing reads."""
        batch, length, width = x.shape
        head_dim = width // self.heads
        q_weight, kv_weight = self.in_proj_weight.split([width, 2 * width])
        q_bias, kv_bias = self.in_proj_bias.split([width, 2 * width])
        rows = torch.arange(batch, device=x.device)
        q = self.linear(x[rows, pooled], q_weight, q_bias).view(batch, self.heads, 1, head_dim)
        kv = self.linear(x, kv_weight, kv_bias).view(batch, length, 2, self.heads, head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4)
        # PyTorch's own choice of SDPA kernel: with one query per sample this costs next to nothing, and a
        # causal mask for one query is not SDPA's is_causal (that aligns it to key 0).
        mask = None
        if causal:
            mask = (torch.arange(length, device=x.device) <= pooled[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.reshape(batch, width))


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
        self.checkpoint_policy = "none"  # a CheckpointPolicy value; Transformer.set_checkpointing sets it

    def forward(self, x: torch.Tensor, causal: bool = False, pooled: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for input x [B, L, W]; with `pooled` (a token index per sample) only those tokens'
        outputs [B, W]."""
        # The checkpoint sits inside the block so that a compiled block (parallelize.apply_compile) traces it
        # and the selective policy marks ops of the compiled graph. Around a compiled block, selective
        # checkpointing would see TorchInductor's code as one op and recompute all of it, as `full` does.
        # `training` is read first so that evaluation never reads the policy: a compiled block then has one
        # evaluation graph, whatever the policies of the blocks sharing its code.
        if not self.training or self.checkpoint_policy == "none":
            return self._forward(x, causal, pooled)
        return self.checkpointed(self._forward, x, causal, pooled)

    def checkpointed(self, forward: Callable[..., torch.Tensor], *args) -> torch.Tensor:
        """forward(*args) under this block's checkpoint policy, `full` or `selective`."""
        if self.checkpoint_policy == "full":
            # No context_fn at all: TorchDynamo rejects torch's own noop_context_fn as one.
            return checkpoint(forward, *args, use_reentrant=False)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **_RESPECT_HOOKS)

    def _forward(self, x: torch.Tensor, causal: bool, pooled: torch.Tensor | None) -> torch.Tensor:
        if pooled is not None:
            return self._forward_pooled(x, causal, self.ln_1(x), pooled)
        x = x + self.ls_1(self.attn(self.ln_1(x), causal=causal))
        return x + self.ls_2(self.mlp(self.ln_2(x)))

    def _forward_pooled(self, x: torch.Tensor, causal: bool, normed: torch.Tensor, pooled: torch.Tensor,
                        ) -> torch.Tensor:
        # Only attention reads other tokens; from out_proj on, each token's output depends on its own row
        # alone, so the rest of the block runs on one row per sample (B rows: plain ops suffice).
        x = x[torch.arange(x.shape[0], device=x.device), pooled]
        x = x + self.ls_1(self.attn.forward_pooled(normed, pooled, causal))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class Transformer(nn.Module):
    def __init__(
        self, width: int, layers: int, heads: int, mlp_ratio: float, ls_init_value: float | None,
        quick_gelu: bool = False,
    ):
        super().__init__()
        self.width = width
        self.layers = layers
        self.resblocks = nn.ModuleList(
            Block(width, heads, mlp_ratio, ls_init_value, quick_gelu) for _ in range(layers)
        )
        self.set_checkpointing("none")
        # model.prune_last_block: where only some tokens' outputs are wanted (`pooled`), the last block computes
        # only what they need. False runs it whole and picks them after (the same numbers, for comparison).
        self.prune_last_block = True

    def set_checkpointing(self, policy: str, every: int = 1) -> None:
        """Checkpoint blocks 0, every, 2*every, ... in training with `policy` (a CheckpointPolicy value);
        the other blocks keep all their activations. every=2 halves the recomputation of every=1, and keeps
        the activations of half the blocks."""
        if policy not in CheckpointChoice.values():
            raise ValueError(
                f"model.checkpoint_policy={policy!r} is not one of {', '.join(CheckpointChoice.values())}"
            )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"model.checkpoint_every={every!r} must be an integer >= 1 (1 = every block, 2 = every second ...)"
            )
        self.checkpoint_policy = policy
        for index, block in enumerate(self.resblocks):
            block.checkpoint_policy = policy if index % every == 0 else "none"

    @property
    def grad_checkpointing(self) -> bool:
        """The older on/off switch (CLIP.set_grad_checkpointing): True sets `full` on every block; it reads
        True while any policy is on."""
        return self.checkpoint_policy != "none"

    @grad_checkpointing.setter
    def grad_checkpointing(self, enable: bool) -> None:
        self.set_checkpointing("full" if enable else "none")

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

    def forward(self, x: torch.Tensor, causal: bool = False, final_norm: nn.LayerNorm | None = None,
                pooled: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks, then `final_norm` (the tower's norm after them) where given: [B, L, W], or with `pooled`
        (one token index per sample, the class or end-of-text token) only those tokens' states [B, W]. With
        `prune_last_block` the last block then computes keys and values for every token and the rest for the
        pooled tokens alone: in a tower of n blocks that saves about 0.8 / n of its work."""
        prune = pooled is not None and self.prune_last_block and len(self.resblocks) > 0
        for block in self.resblocks[:-1] if prune else self.resblocks:
            x = block(x, causal=causal)
        if prune:
            x = self.resblocks[-1](x, causal, pooled=pooled)
            return x if final_norm is None else final_norm(x)
        if final_norm is not None:
            x = final_norm(x)
        return x if pooled is None else x[torch.arange(x.shape[0], device=x.device), pooled]
