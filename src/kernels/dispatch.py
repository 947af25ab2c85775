"""Which kernel runs where: the one place that turns a plain model (src/models/) into the model as the trainer
runs it, as torchtitan's `parallelize` applies compile and sharding to a plain model.

`apply_kernels(model, cfg)` walks any module tree (a CLIP, a VideoCLIP) and, in every transformer tower:
- `model.linear`: swaps the blocks' linear layers for SwitchBack ones (switchback/convert.py);
- swaps Attention, Block, Transformer and the blocks' nn.GELU for their kernel classes (blocks.py, gelu.py), by
  class, so parameters and state-dict keys stay as they are, and sets what each runs: `model.attention_backend`,
  `model.residual_norm`, `model.gelu`.
Modules outside the towers (the video head) keep PyTorch's ops.
"""

from __future__ import annotations

import torch
from torch import nn

from src.config import AttentionBackend, Choice, GeluForm, ModelConfig, ResidualNorm
from src.kernels.blocks import KernelAttention, KernelBlock, KernelTransformer
from src.kernels.gelu import GELU
from src.kernels.switchback.convert import convert_to_switchback
from src.models.clip import CLIP, build_model
from src.models.transformer import Attention, Block, Transformer, keep_in_selective_checkpointing

# Our matmul and attention ops (registered by importing their modules): `selective` checkpointing keeps their
# outputs, as it keeps PyTorch's matmuls'.
keep_in_selective_checkpointing(
    torch.ops.stableclip.short_attention_forward.default,
    torch.ops.stableclip.tiled_attention_forward.default,
    torch.ops.stableclip.switchback_forward.default,
)


def apply_kernels(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """Run `model`'s transformer towers with the kernels `cfg` (model.*) picks; in place, returns `model`."""
    check_choice("attention_backend", cfg.attention_backend, AttentionBackend)
    check_choice("residual_norm", cfg.residual_norm, ResidualNorm)
    check_choice("gelu", cfg.gelu, GeluForm)
    for tower in [m for m in model.modules() if isinstance(m, Transformer)]:
        if cfg.linear != "standard":
            convert_to_switchback(tower, cfg.linear, cfg.linear_backend, cfg.fp8_fast_accum)
        set_attention_backend(tower, cfg.attention_backend)
        set_residual_norm(tower, cfg.residual_norm)
        set_gelu(tower, cfg.gelu)
    return model


def build_model_with_kernels(cfg: ModelConfig, device: torch.device | str = "cpu") -> CLIP:
    """build_model, then apply_kernels: the CLIP as the trainer runs it."""
    return apply_kernels(build_model(cfg, device), cfg)


def check_choice(key: str, value: str, choice: type[Choice]) -> None:
    if value not in choice.values():
        raise ValueError(f"model.{key}={value!r} is not one of {', '.join(choice.values())}")


def with_kernel_modules(module: nn.Module) -> nn.Module:
    """Swap, in place, every plain Attention, Block and Transformer in `module`, and each block's exact nn.GELU,
    for the kernel class that subclasses it, set as the plain module computes: PyTorch's attention kernel
    choice, the fused residual kernels where they apply (`auto`), F.gelu. Modules swapped before are left as
    they are. Returns `module`."""
    for child in module.modules():
        if type(child) is Attention:
            child.__class__ = KernelAttention
            child.backend = AttentionBackend.auto.value
        elif type(child) is Block:
            child.__class__ = KernelBlock
            child.residual_norm = ResidualNorm.auto.value
            gelu = child.mlp.gelu
            if type(gelu) is nn.GELU and gelu.approximate == "none":
                gelu.__class__ = GELU
                gelu.form = GeluForm.erf.value
        elif type(child) is Transformer:
            child.__class__ = KernelTransformer
            child.chain_blocks = True
    return module


def set_attention_backend(module: nn.Module, backend: str) -> None:
    """model.attention_backend: the attention kernel of every Attention in `module` (blocks.ATTENTION_BACKENDS)."""
    _set_on_modules(module, KernelAttention, "backend", "attention_backend", backend, AttentionBackend)


def set_residual_norm(module: nn.Module, mode: str) -> None:
    """model.residual_norm: how every Block of `module` computes x + ls_1(attention) and ln_2 (blocks.KernelBlock)."""
    _set_on_modules(module, KernelBlock, "residual_norm", "residual_norm", mode, ResidualNorm)


def set_gelu(module: nn.Module, form: str) -> None:
    """model.gelu: how every block's GELU in `module` evaluates Φ (src/kernels/gelu.py)."""
    _set_on_modules(module, GELU, "form", "gelu", form, GeluForm)


def _set_on_modules(module: nn.Module, kind: type, attribute: str, key: str, value: str, choice: type[Choice]
                    ) -> None:
    """Set `attribute` of every `kind` in `module` (its plain modules swapped first) to `value`, the config key
    `model.<key>`, one of `choice`'s values. The plain string is stored: compiled blocks guard on it."""
    check_choice(key, value, choice)
    for child in with_kernel_modules(module).modules():
        if isinstance(child, kind):
            setattr(child, attribute, str(value))
