"""Export a checkpoint's model as an OpenCLIP model file, for open_clip and the tools built on it (clip_benchmark).

    python scripts/export_openclip.py RUN_DIR/checkpoints/step_N -o model.safetensors [--ema]

The checkpoint is verified against its manifest; the model's settings come from the run's config.yaml. Layer-scale
is folded into the weights it scales, so the file holds a plain OpenCLIP CLIP (`open_clip.create_model_and_transforms
(NAME, pretrained="model.safetensors")` loads it strictly and computes the same embeddings). The script prints NAME:
the open_clip architecture of the model, or, for one open_clip does not ship, the name of a model config JSON it
writes beside the file (register it with `open_clip.add_model_config(PATH)` first). `--ema` exports the weights'
EMA (`ema.pt`, of a run with trainer.ema_decay set) instead of the weights. A .bin or .pt output is a torch state
dict instead of safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import yaml
from safetensors.torch import save_file

from src.models.openclip_interop import to_openclip_state_dict
from src.openclip_architectures import matching_architecture, openclip_model_config
from src.trainer.checkpoint import CheckpointError, load_torch_file
from src.trainer.ema import EMA_FILE
from src.trainer.pretrained import model_file


def run_config(weights: str) -> dict:
    """The model settings of the run whose RUN_DIR/checkpoints/step_N/model.pt `weights` is."""
    run_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(weights))))
    path = os.path.join(run_dir, "config.yaml")
    try:
        with open(path) as f:
            return yaml.safe_load(f)["model"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: cannot read the run's model settings ({err}); give a checkpoint inside its run "
                         "directory (RUN_DIR/checkpoints/step_N)") from err


def export(checkpoint: str, output: str, ema: bool = False) -> str:
    """Write the checkpoint's model (or its EMA) to `output` and return its open_clip architecture name."""
    weights = model_file(checkpoint)  # verified against the checkpoint's manifest
    if ema:
        averaged = os.path.join(os.path.dirname(weights), f"{EMA_FILE}.pt")
        if not os.path.isfile(averaged):
            raise FileNotFoundError(f"{os.path.dirname(weights)} holds no {EMA_FILE}.pt: its run had "
                                    "trainer.ema_decay=null (drop --ema, or give a checkpoint of a run with an EMA)")
        weights = model_file(averaged)
    model = run_config(weights)
    state = to_openclip_state_dict(load_torch_file(weights))
    name = matching_architecture(model)
    if name is None:  # open_clip names a model config by its file's stem
        name = os.path.splitext(os.path.basename(output))[0]
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(os.path.join(os.path.dirname(os.path.abspath(output)), f"{name}.json"), "w") as f:
            json.dump(openclip_model_config(model), f, indent=1)
    # Written beside the output, then renamed: an interrupted export leaves no partial file under its name.
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    partial = output + ".tmp"
    if output.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, partial)
        # safetensors 0.8 writes its files 0600 whatever the umask (safetensors issue #782): give the model the
        # mode of the json beside it, so whoever may read the directory may load it.
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)
    else:
        torch.save(state, partial)
    os.replace(partial, output)
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="RUN_DIR/checkpoints/step_N (or a run directory: its newest checkpoint)")
    parser.add_argument("-o", "--output", required=True, help="the model file: .safetensors (or .bin/.pt)")
    parser.add_argument("--ema", action="store_true", help="export the weights' EMA (trainer.ema_decay) instead")
    args = parser.parse_args(argv)
    try:
        name = export(args.checkpoint, args.output, args.ema)
    except (CheckpointError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: open_clip architecture {name}")
    config = os.path.join(os.path.dirname(os.path.abspath(args.output)), f"{name}.json")
    if os.path.isfile(config):
        print(f"register it first: open_clip.add_model_config({config!r})")
    print(f"load it: open_clip.create_model_and_transforms({name!r}, pretrained={args.output!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
