"""The transformer modules of src/models/transformer.py as they run with our kernels: same parameters, same
state-dict keys, so src/kernels/dispatch.py swaps them in by class (`module.__class__`) on a built model.

- KernelAttention: `model.attention_backend` picks our Triton attention (src/kernels/attention/) or restricts
  PyTorch's SDPA to some of its kernels.
- KernelBlock: `model.residual_norm` computes x + ls_1(attention) and ln_2 in one fused kernel
  (src/kernels/residual_norm.py), with out_proj's bias folded in; in a chain it also fuses the closing residual
  with the next block's ln_1.
- KernelTransformer: runs its blocks as that chain where every block takes the fused kernels.
- GELU (src/kernels/gelu.py) replaces the blocks' nn.GELU where `model.gelu` says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from src.config import AttentionBackend
from src.kernels import residual_norm
from src.kernels.attention import short as short_attention
from src.kernels.attention import tiled as tiled_attention
from src.kernels.autocast import autocast_dtype
from src.kernels.switchback.convert import SwitchBackLinear
from src.kernels.switchback.functions import switchback_linear
from src.models.transformer import Attention, Block, LayerScale, Transformer, sdpa_attention

# model.attention_backend -> the SDPA kernels allowed (None: PyTorch's own choice, which on an H200 is cuDNN).
# auto also takes our kernels where they apply (CUDA, 16 bits): attention/short.py up to its AUTO_MAX_LENGTH (128
# tokens), attention/tiled.py above that up to its own AUTO_MAX_LENGTH. triton_short takes the first for every
# sequence of at most 128 tokens, triton_tiled the second for every sequence; both fail where they cannot run.
# Keyed by the plain strings the modules store (dispatch._set_on_modules), as compiled blocks look them up.
ATTENTION_BACKENDS: dict[str, list[SDPBackend] | None] = {
    AttentionBackend.auto.value: None,
    AttentionBackend.triton_short.value: None,
    AttentionBackend.triton_tiled.value: None,
    AttentionBackend.flash.value: [SDPBackend.FLASH_ATTENTION],
    AttentionBackend.cudnn.value: [SDPBackend.CUDNN_ATTENTION],
    AttentionBackend.efficient.value: [SDPBackend.EFFICIENT_ATTENTION],
    AttentionBackend.math.value: [SDPBackend.MATH],
}


def linear_without_bias(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x Wᵀ of a linear layer, its bias left out, in the layer's own arithmetic (plain or SwitchBack)."""
    if isinstance(linear, SwitchBackLinear):
        return switchback_linear(x, linear.weight, None, linear.variant, linear.backend, linear.fp8_fast_accum)
    return F.linear(x, linear.weight)


class KernelAttention(Attention):
    """Attention through the kernel `backend` (an AttentionBackend value) picks."""

    backend: str  # an AttentionBackend value; dispatch.set_attention_backend sets it

    def forward(self, x: torch.Tensor, causal: bool = False, out_bias: bool = True) -> torch.Tensor:
        """Attention of x; without out_proj's bias where `out_bias` is False (the caller adds it)."""
        qkv = self.linear(x, self.in_proj_weight, self.in_proj_bias)
        kernel = self._our_kernel(qkv)
        if kernel is not None:
            out = kernel(qkv, self.heads, causal)
        else:
            out = sdpa_attention(qkv, self.heads, causal, ATTENTION_BACKENDS[self.backend])
        return self.out_proj(out) if out_bias else linear_without_bias(self.out_proj, out)

    def _our_kernel(self, qkv: torch.Tensor):
        """Which of our Triton attention functions the backend takes for qkv, or None for SDPA."""
        short = qkv.shape[1] <= short_attention.MAX_LENGTH
        if self.backend == "triton_short":
            return short_attention.short_attention if short else None
        if self.backend == "triton_tiled":
            return tiled_attention.tiled_attention
        if self.backend == "auto":
            if short_attention.applies(qkv, self.heads):
                return short_attention.short_attention
            if tiled_attention.applies(qkv, self.heads):  # the sequences short_attention's `auto` leaves
                return tiled_attention.tiled_attention
        return None


class KernelBlock(Block):
    """A Block whose residual adds and LayerNorms run as `residual_norm` (a ResidualNorm value) says: with
    residual_norm.py's fused kernels (`fused`: CUDA only, a clear error at the first step elsewhere), with
    PyTorch's ops (`unfused`), or `auto`: fused where residual_norm.applies."""

    residual_norm: str  # a ResidualNorm value; dispatch.set_residual_norm sets it

    def forward(self, x: torch.Tensor, causal: bool = False, pooled: torch.Tensor | None = None,
                normed: torch.Tensor | None = None,
                next_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Block.forward; in a chain of blocks (KernelTransformer.forward), `normed` is this block's ln_1(x),
        computed by the block before, and `next_norm` the (weight, bias, eps) of the norm after this block: the
        block then returns (output, that norm of it), its closing residual and the next norm in one kernel."""
        # As in Block.forward: `training` first, and the checkpoint inside the (compiled) block.
        if not self.training or self.checkpoint_policy == "none":
            return self._fused_forward(x, causal, pooled, normed, next_norm)
        return self.checkpointed(self._fused_forward, x, causal, pooled, normed, next_norm)

    def _fused_forward(self, x: torch.Tensor, causal: bool, pooled: torch.Tensor | None, normed: torch.Tensor | None,
                       next_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
                       ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if pooled is not None:
            return self._forward_pooled(x, causal, self.ln_1(x) if normed is None else normed, pooled)
        # Where the fused kernels run, out_proj's and c_proj's biases go into them (residual_norm's a_bias).
        fused = self.residual_norm == "fused" or (self.residual_norm == "auto" and residual_norm.applies(x, x))
        branch = self.attn(self.ln_1(x) if normed is None else normed, causal=causal, out_bias=not fused)
        if fused:
            x, normed = residual_norm.residual_norm(x, branch, self._gamma(self.ls_1), self.ln_2.weight,
                                                    self.ln_2.bias, self.ln_2.eps, a_bias=self.attn.out_proj.bias)
        else:
            x = x + self.ls_1(branch)
            normed = self.ln_2(x)
        if next_norm is None:
            return x + self.ls_2(self.mlp(normed))
        branch = linear_without_bias(self.mlp.c_proj, self.mlp.gelu(self.mlp.c_fc(normed)))
        # The sum is this block's output, the next block's input, which that block's backward keeps anyway.
        return residual_norm.residual_norm(x, branch, self._gamma(self.ls_2), *next_norm, save_sum=True,
                                           a_bias=self.mlp.c_proj.bias)

    def _gamma(self, scale: nn.Module) -> torch.Tensor:
        """A residual branch's layer-scale gain for the fused kernels (ones where the model has none)."""
        return scale.gamma if isinstance(scale, LayerScale) else torch.ones_like(self.ln_2.weight)


class KernelTransformer(Transformer):
    """A Transformer whose blocks run as a chain where the fused residual kernels run in every block."""

    # Blocks may chain only where each block's parameters are whole tensors throughout the forward pass:
    # dispatch turns it on, parallelize.apply_fsdp off, since FSDP2 gathers one block's at a time.
    chain_blocks: bool

    def forward(self, x: torch.Tensor, causal: bool = False, final_norm: nn.LayerNorm | None = None,
                pooled: torch.Tensor | None = None) -> torch.Tensor:
        """Transformer.forward. Where the fused residual kernels run in every block (`model.residual_norm`) and
        no block is checkpointed, the blocks run as a chain: each block's closing residual and the norm after it
        (the next block's ln_1, or `final_norm`) are one kernel. Its output has the 16-bit precision of the
        autocast dtype, which the matmul after it would round to anyway; the tower's output keeps the input's
        dtype, as LayerNorm's under autocast."""
        prune = pooled is not None and self.prune_last_block and len(self.resblocks) > 0
        chained = self.resblocks[:-1] if prune else self.resblocks
        normed = None
        if self._chains(x, final_norm):
            normed = self.resblocks[0].ln_1(x)
            dtype = autocast_dtype(x.device)
            if dtype is not None:
                # Autocast leaves LayerNorm's output in float32, the fused kernels' in 16 bits: one dtype for
                # every block's `normed` keeps one compiled graph for all of them (the QKV matmul casts anyway).
                normed = normed.to(dtype)
            for block, norm in zip(chained, [*(b.ln_1 for b in self.resblocks[1:]), final_norm]):
                x, normed = block(x, causal, normed=normed, next_norm=(norm.weight, norm.bias, norm.eps))
        else:
            for block in chained:
                x = block(x, causal=causal)
        if prune:
            x = self.resblocks[-1](x, causal, pooled=pooled, normed=normed)
            return x if final_norm is None else final_norm(x)
        if normed is not None:  # the chain ended in final_norm
            x = normed.to(x.dtype)
        elif final_norm is not None:
            x = final_norm(x)
        return x if pooled is None else x[torch.arange(x.shape[0], device=x.device), pooled]

    def _chains(self, x: torch.Tensor, final_norm: nn.LayerNorm | None) -> bool:
        modes = {block.residual_norm for block in self.resblocks}
        fused = modes == {"fused"} or (modes == {"auto"} and residual_norm.applies(x, x))
        checkpointed = self.training and any(block.checkpoint_policy != "none" for block in self.resblocks)
        return self.chain_blocks and final_norm is not None and len(self.resblocks) > 0 and fused and not checkpointed
