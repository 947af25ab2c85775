"""OpenCLIP's model configs as ours: `model=openclip model.name=ViT-bigG-14` reads the JSON that open_clip_torch
ships for that architecture (open_clip.get_model_config) and fills the model keys from it, through the
`${openclip:NAME,KEY}` resolver in configs/model/openclip.yaml. Nothing is copied: a new open_clip release brings
its new architectures. An architecture whose config asks for anything our ViT towers do not build (a ResNet or
timm image tower, a Hugging Face text tower, attentional pooling, ...) is refused with the list of those we build.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

# The config keys our towers build. Any other key of an open_clip config changes the architecture.
VISION_KEYS = {"image_size", "layers", "width", "patch_size", "head_width", "mlp_ratio"}
TEXT_KEYS = {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"}
TOP_KEYS = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu"}
# The model keys (configs/model/base.yaml) an architecture sets, per tower.
MODEL_KEYS = {"vision": ("image_size", "patch_size", "width", "layers", "heads", "mlp_ratio"),
              "text": ("context_length", "vocab_size", "width", "layers", "heads", "mlp_ratio")}


def unbuildable_keys(config: dict) -> list[str]:
    """The keys of an open_clip model config that our CLIP cannot build, as `vision_cfg.timm_model_name`."""
    found = [key for key in config if key not in TOP_KEYS]
    found += [f"vision_cfg.{key}" for key in config.get("vision_cfg", {}) if key not in VISION_KEYS]
    found += [f"text_cfg.{key}" for key in config.get("text_cfg", {}) if key not in TEXT_KEYS]
    if not isinstance(config.get("vision_cfg", {}).get("layers", 0), int):
        found.append("vision_cfg.layers (a list: a ResNet)")
    return found


@functools.cache
def buildable_architectures() -> tuple[str, ...]:
    import open_clip

    return tuple(name for name in open_clip.list_models() if not unbuildable_keys(open_clip.get_model_config(name)))


def architecture(name: str) -> dict[str, Any]:
    """Our model keys for the open_clip architecture `name`, with open_clip's own defaults (CLIPVisionCfg,
    CLIPTextCfg) for the keys its JSON leaves out. A new dict each call: the caller may change it."""
    return dict(read_architecture(name))


@functools.cache
def read_architecture(name: str) -> dict[str, Any]:
    import open_clip
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    config = open_clip.get_model_config(name)
    choose = "choose one of: " + ", ".join(buildable_architectures())
    if config is None:
        raise ValueError(f"model.name={name!r} is not an architecture open_clip ships: {choose}")
    unbuildable = unbuildable_keys(config)
    if unbuildable:
        raise ValueError(f"model.name={name!r}: stableclip builds ViT towers with OpenCLIP's CLIP layout, and this "
                         f"architecture needs {', '.join(unbuildable)}; {choose}")
    vision = {**dataclasses.asdict(CLIPVisionCfg()), **config["vision_cfg"]}
    text = {**dataclasses.asdict(CLIPTextCfg()), **config["text_cfg"]}
    return {
        "embed_dim": config["embed_dim"],
        "quick_gelu": bool(config.get("quick_gelu", False)),
        "vision.image_size": vision["image_size"], "vision.patch_size": vision["patch_size"],
        "vision.width": vision["width"], "vision.layers": vision["layers"],
        "vision.heads": vision["width"] // vision["head_width"], "vision.mlp_ratio": float(vision["mlp_ratio"]),
        "text.context_length": text["context_length"], "text.vocab_size": text["vocab_size"],
        "text.width": text["width"], "text.layers": text["layers"], "text.heads": text["heads"],
        "text.mlp_ratio": float(text["mlp_ratio"]),
    }


def openclip_value(name: str, key: str) -> Any:
    """The `${openclip:NAME,KEY}` resolver: one model key of an open_clip architecture."""
    return architecture(name)[key]


def openclip_model_config(model: dict) -> dict:
    """The open_clip model JSON of our model keys (`model` as config.yaml holds them): what
    `open_clip.add_model_config` registers for an architecture open_clip does not ship."""
    vision, text = model["vision"], model["text"]
    config = {
        "embed_dim": model["embed_dim"], "quick_gelu": bool(model["quick_gelu"]),
        "vision_cfg": {"image_size": vision["image_size"], "layers": vision["layers"], "width": vision["width"],
                       "patch_size": vision["patch_size"], "head_width": vision["width"] // vision["heads"],
                       "mlp_ratio": vision["mlp_ratio"]},
        "text_cfg": {key: text[key] for key in MODEL_KEYS["text"]},
    }
    if model.get("init_logit_bias") is not None:
        config["init_logit_bias"] = model["init_logit_bias"]
    return config


def matching_architecture(model: dict) -> str | None:
    """The open_clip architecture name whose config builds exactly our model, if open_clip ships one."""
    if model.get("init_logit_bias") is not None:
        return None  # open_clip's ViTs with a logit bias have timm towers, which we do not build
    ours = {"embed_dim": model["embed_dim"], "quick_gelu": bool(model["quick_gelu"]),
            **{f"{tower}.{key}": float(model[tower][key]) if key == "mlp_ratio" else model[tower][key]
               for tower, keys in MODEL_KEYS.items() for key in keys}}
    return next((name for name in buildable_architectures() if architecture(name) == ours), None)
