"""Move weights between stableclip and OpenCLIP: same parameter names, same shapes."""

from __future__ import annotations

import os

import torch

from src.models.clip import CLIP


def load_openclip_state_dict(model: CLIP, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an OpenCLIP `CLIP.state_dict()` strictly. Layer-scale gammas absent from an OpenCLIP model
    built without layer-scale are set to 1, which makes our blocks compute exactly what theirs do. A SigLIP
    checkpoint's `logit_bias` loads into a model that has one (model.init_logit_bias set, as loss=siglip does);
    a checkpoint without one leaves a model's bias at its initial value."""
    state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
    missing_gammas = {
        name for name, _ in model.named_parameters() if name.endswith(".gamma") and name not in state_dict
    }
    own = model.state_dict()
    for name in missing_gammas:
        state_dict[name] = torch.ones_like(own[name])
    state_dict.pop("attn_mask", None)
    if "logit_bias" in state_dict and model.logit_bias is None:
        raise ValueError("this checkpoint is a SigLIP model (it has logit_bias) and the model has no bias: train it "
                         "with loss=siglip (which sets model.init_logit_bias), or set model.init_logit_bias")
    if "logit_bias" not in state_dict and model.logit_bias is not None:
        # A CLIP checkpoint fine-tuned with the sigmoid loss: its bias starts at model.init_logit_bias.
        state_dict["logit_bias"] = torch.full((), model.init_logit_bias, dtype=own["logit_bias"].dtype)
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
        for k, v in state_dict.items() if k in own and v.shape != own[k].shape
    ]
    if mismatched:
        raise ValueError(
            "OpenCLIP checkpoint does not match model config (pick the model= preset of the same "
            "architecture):\n  " + "\n  ".join(mismatched[:10])
        )
    model.load_state_dict(state_dict, strict=True)


def to_openclip_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict as a plain OpenCLIP CLIP's (built without layer-scale): each branch's layer-scale γ is folded
    into the output projection it scales (γ ⊙ (W x + b) = (diag(γ) W) x + γ ⊙ b), so the model computes the same
    embeddings with no `ls_*.gamma` left. A video model's CLIP (`clip.` keys) is taken alone."""
    if any(name.startswith("clip.") for name in state_dict):
        state_dict = {name.removeprefix("clip."): v for name, v in state_dict.items() if name.startswith("clip.")}
    plain = {name: value.float().clone() for name, value in state_dict.items() if not name.endswith(".gamma")}
    for name, gamma in state_dict.items():
        if not name.endswith((".ls_1.gamma", ".ls_2.gamma")):
            continue
        block = name.rsplit(".", 2)[0]
        output = f"{block}.attn.out_proj" if name.endswith(".ls_1.gamma") else f"{block}.mlp.c_proj"
        plain[f"{output}.weight"] *= gamma.float()[:, None]
        plain[f"{output}.bias"] *= gamma.float()
    return plain


def load_openclip_checkpoint(model: CLIP, path: str | os.PathLike) -> None:
    """Load an OpenCLIP checkpoint file into `model`: .safetensors, or a .bin/.pt state dict (bare or
    {'state_dict': ...}) read with weights_only=True, by open_clip's own reader."""
    from open_clip.factory import load_state_dict

    load_openclip_state_dict(model, load_state_dict(str(path), weights_only=True))
