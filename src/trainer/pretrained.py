"""`model.init_from`: start from pre-trained weights, ours or OpenCLIP's. Our checkpoints are verified first
(src/trainer/checkpoint.py): only their model.pt, the one file read. OpenCLIP's come as a file
(`openclip:FILE`, .bin, .pt or .safetensors) or by name (`openclip:ARCH/TAG`, any pair
`open_clip.list_pretrained()` lists), resolved through open_clip's pretrained registry and the Hugging Face cache
as `open_clip.create_model(ARCH, pretrained=TAG)` resolves them: a cached file needs no network, HF_HUB_OFFLINE is
honoured, and a file that is neither cached nor downloadable stops the run at preflight with the command that
fetches it."""

from __future__ import annotations

import logging
import os

from torch import nn

from src.config import ModelConfig
from src.models.clip import CLIP
from src.models.openclip_interop import load_openclip_checkpoint
from src.openclip_architectures import architecture
from src.trainer.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_problem,
    complete_checkpoints,
    file_problem,
    load_torch_file,
    log_unverified,
    newest_intact,
    read_manifest,
)
from src.trainer.state import MODEL_FILE

log = logging.getLogger(__name__)

OPENCLIP = "openclip:"
MODEL_PT = f"{MODEL_FILE}.pt"
FORMS = ("a checkpoints/step_N directory, its model.pt, a run directory or its checkpoints/ directory (the newest "
         "intact checkpoint is taken), openclip:FILE for an OpenCLIP checkpoint file, or openclip:ARCH/TAG for "
         "OpenCLIP's pretrained weights by name (open_clip.list_pretrained())")


def openclip_name(spec: str) -> tuple[str, str] | None:
    """(ARCH, TAG) when `spec` (after `openclip:`) names pretrained weights rather than a file that exists."""
    arch, slash, tag = spec.partition("/")
    if not slash or "/" in tag or os.path.exists(spec):
        return None
    import open_clip

    return (arch, tag) if arch in open_clip.list_models() else None


def openclip_pretrained(arch: str, tag: str) -> dict:
    """open_clip's registry entry for ARCH/TAG (its hf_hub or url, its quick_gelu)."""
    import open_clip

    entry = open_clip.get_pretrained_cfg(arch, tag)
    if not entry:
        tags = open_clip.list_pretrained_tags_by_model(arch)
        raise ValueError(f"model.init_from=openclip:{arch}/{tag}: open_clip has no weights {tag!r} for {arch}: "
                         + (f"choose one of {', '.join(tags)}" if tags else "it lists none for this architecture"))
    return entry


def fetch_command(entry: dict) -> str:
    """The command that puts ARCH/TAG's file into the Hugging Face cache (or says where the file is)."""
    import open_clip

    if entry.get("hf_hub"):
        repo, filename = os.path.split(entry["hf_hub"])  # "org/name/" names the repository's default file
        filename = filename or open_clip.pretrained.HF_WEIGHTS_NAME
        return f'python -c "from huggingface_hub import hf_hub_download; hf_hub_download({repo!r}, {filename!r})"'
    return f"curl -LO {entry['url']} (then model.init_from=openclip:FILE)"


def check_openclip_architecture(model: ModelConfig, arch: str, tag: str) -> None:
    """The model must be ARCH as open_clip builds it, with the activation the weights were trained with."""
    wanted = architecture(arch)
    ours = {key: getattr(model.vision if key.startswith("vision.") else model.text if key.startswith("text.")
                         else model, key.rpartition(".")[2]) for key in wanted}
    wanted["quick_gelu"] = wanted["quick_gelu"] or bool(openclip_pretrained(arch, tag).get("quick_gelu"))
    differ = [f"model.{key}={ours[key]} (the weights have {value})" for key, value in wanted.items()
              if ours[key] != value]
    if differ:
        hint = "model.quick_gelu=true" if differ == [d for d in differ if d.startswith("model.quick_gelu")] else (
            f"model=openclip model.name={arch}" + (" model.quick_gelu=true" if wanted["quick_gelu"] else ""))
        raise ValueError(f"model.init_from=openclip:{arch}/{tag} does not fit this model: {', '.join(differ)}. "
                         f"Use {hint}")


def openclip_weights_file(arch: str, tag: str) -> str:
    """The local file of OpenCLIP's ARCH/TAG weights: from the Hugging Face cache, downloaded into it if the
    network is allowed. Raises FileNotFoundError with the command that fetches it."""
    import open_clip

    entry = openclip_pretrained(arch, tag)
    try:
        return open_clip.pretrained.download_pretrained(entry)
    except Exception as err:  # open_clip and huggingface_hub raise many kinds (offline, no network, 404, ...)
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else ""
        raise FileNotFoundError(
            f"model.init_from=openclip:{arch}/{tag}: the weights are not in the Hugging Face cache and could not "
            f"be downloaded{offline}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
            f"Fetch them on a machine with network access (into the same HF_HOME) with: {fetch_command(entry)}"
        ) from None


def model_file(path: str) -> str:
    """The model.pt that `path` names (see FORMS), verified against its checkpoint's manifest."""
    if os.path.isfile(path):
        directory, name = os.path.split(path)
        try:
            manifest = read_manifest(directory)
        except CheckpointError as err:
            raise CheckpointError(f"model.init_from={path!r} cannot be loaded: {err}") from None
        problem = file_problem(directory, name, manifest["files"].get(name) if manifest else None, checksums=True)
    elif os.path.isfile(os.path.join(path, MODEL_PT)) or os.path.lexists(os.path.join(path, MANIFEST)):
        directory, name = path, MODEL_PT
        problem = checkpoint_problem(path, checksums=True, files=[MODEL_PT])
    else:
        for checkpoints in (path, os.path.join(path, "checkpoints")):
            if not complete_checkpoints(checkpoints):
                continue
            directory, skipped = newest_intact(checkpoints, checksums=True, files=[MODEL_PT])
            for bad, problem in skipped:
                log.warning("model.init_from: skipping %s: %s", bad, problem)
            if directory is None:
                raise CheckpointError(f"model.init_from={path!r}: no checkpoint in {checkpoints} is intact ("
                                      + "; ".join(problem for _, problem in skipped) + ")")
            name, problem = MODEL_PT, None
            break
        else:
            raise FileNotFoundError(f"model.init_from={path!r} names no checkpoint: give {FORMS}")
    if problem is not None:
        raise CheckpointError(f"model.init_from={path!r} cannot be loaded: {problem}")
    log_unverified(directory)
    return os.path.join(directory, name)


def load_pretrained(model: nn.Module, spec: str) -> str:
    """Load `spec` into `model`, a CLIP or a model holding one as `.clip` (the video model). A video model's
    own checkpoint loads whole into a video model; into a CLIP, its towers load. Returns the file read."""
    clip = model if isinstance(model, CLIP) else model.clip
    if spec.startswith(OPENCLIP):
        name = openclip_name(spec.removeprefix(OPENCLIP))
        path = openclip_weights_file(*name) if name else spec.removeprefix(OPENCLIP)
        load_openclip_checkpoint(clip, path)
        return path
    path = model_file(spec)
    state = load_torch_file(path)
    target = clip
    if any(name.startswith("clip.") for name in state):  # saved from a video model
        if model is not clip:
            target = model
        else:
            state = {name.removeprefix("clip."): v for name, v in state.items() if name.startswith("clip.")}
    try:
        target.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(f"model.init_from={spec!r} does not fit this model: use the model= preset (and "
                         f"model.video settings, and loss= for a logit_bias) it was trained with.\n{err}") from None
    return path
